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

func TestRefilled(t *testing.T) {
	l, err := NewLimit(20*PerToken, 100*PerToken, 60_000) // 5000 µ per 3 ms, full in 12 s
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		elapsed Millis
		want    Micro
	}{{-5, 0}, {0, 0}, {1, 1666}, {3, 5000}, {600, PerToken}, {11_999, 19_998_333}, {12_000, 20 * PerToken}, {1 << 40, 20 * PerToken}} {
		if got := l.Refilled(tc.elapsed); got != tc.want {
			t.Errorf("Refilled(%d ms) = %d µ, want %d", tc.elapsed, got, tc.want)
		}
	}
	never, _ := NewLimit(PerToken, 0, 0)
	if got := never.Refilled(1 << 40); got != 0 {
		t.Errorf("a bucket that never refills: Refilled = %d, want 0", got)
	}
}
