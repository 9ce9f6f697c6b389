package policy

import (
	"os"
	"testing"
)

func BenchmarkMatch(b *testing.B) {
	s := loadExample(b)
	for _, bc := range []struct{ name, path, op string }{
		{"clean-3seg", "/orders/7/cancel", "POST"},
		{"clean-2seg", "/orders/7", "GET"},
		{"wildcard", "/users/1/orders/2/items", "GET"},
		{"default", "/not/a/route", "GET"},
		{"percent", "/orders/%37", "GET"},
		{"dots-slashes", "//orders/./x/../7/", "GET"},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := s.Match(bc.path, bc.op); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkLimits(b *testing.B) {
	s := loadExample(b)
	r, _ := s.Match("/orders/7", "GET")
	b.ReportAllocs()
	for b.Loop() {
		if _, err := s.Limits(r, "bigcorp", ""); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkKey(b *testing.B) {
	s := loadExample(b)
	r, _ := s.Match("/orders/7", "GET")
	b.ReportAllocs()
	for b.Loop() {
		if _, err := s.Key(r, "acme", ""); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkParseExample(b *testing.B) {
	data, err := os.ReadFile(examplePath)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Parse(examplePath, data); err != nil {
			b.Fatal(err)
		}
	}
}
