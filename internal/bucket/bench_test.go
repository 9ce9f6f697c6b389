package bucket

import "testing"

func BenchmarkTake(b *testing.B) {
	l, err := NewLimit(20*PerToken, 100*PerToken, 60_000)
	if err != nil {
		b.Fatal(err)
	}
	s := Full(l, 0)
	now := Millis(0)
	b.ReportAllocs()
	for b.Loop() {
		now++
		s.Take(l, now, PerToken, PerToken)
	}
}

func BenchmarkReturn(b *testing.B) {
	l, err := NewLimit(20*PerToken, 100*PerToken, 60_000)
	if err != nil {
		b.Fatal(err)
	}
	s := Full(l, 0)
	now := Millis(0)
	b.ReportAllocs()
	for b.Loop() {
		now++
		s.Return(l, now, PerToken, now-500)
	}
}

func BenchmarkNewLimit(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		if _, err := NewLimit(20*PerToken, 100*PerToken, 60_000); err != nil {
			b.Fatal(err)
		}
	}
}
