package calendar

import (
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

func mustLoad(t testing.TB, name string) *time.Location {
	t.Helper()
	loc, err := time.LoadLocation(name)
	if err != nil {
		t.Fatal(err)
	}
	return loc
}

func TestWindow(t *testing.T) {
	ny := mustLoad(t, "America/New_York")
	ms := func(s string, loc *time.Location) bucket.Millis {
		t.Helper()
		tm, err := time.ParseInLocation("2006-01-02 15:04", s, loc)
		if err != nil {
			t.Fatal(err)
		}
		return bucket.Millis(tm.UnixMilli())
	}
	for _, tc := range []struct {
		p                Period
		at               string
		start, end, next string
	}{
		{Period{Day, nil}, "2026-12-03 13:10", "2026-12-03 00:00", "2026-12-04 00:00", "2026-12-05 00:00"},
		{Period{Month, nil}, "2026-12-31 23:59", "2026-12-01 00:00", "2027-01-01 00:00", "2027-02-01 00:00"},
		{Period{Month, nil}, "2028-02-29 12:00", "2028-02-01 00:00", "2028-03-01 00:00", "2028-04-01 00:00"},
		// A spring-forward day in New York is 23 hours long, the day after 24.
		{Period{Day, ny}, "2026-03-08 12:00", "2026-03-08 00:00", "2026-03-09 00:00", "2026-03-10 00:00"},
		{Period{Month, ny}, "2026-11-30 23:30", "2026-11-01 00:00", "2026-12-01 00:00", "2027-01-01 00:00"},
	} {
		loc := tc.p.loc()
		got := tc.p.Window(time.UnixMilli(int64(ms(tc.at, loc))))
		want := bucket.Window{Start: ms(tc.start, loc), End: ms(tc.end, loc), Next: ms(tc.next, loc)}
		if got != want {
			t.Errorf("%v.Window(%s) = %+v, want %+v", tc.p, tc.at, got, want)
		}
	}
	p := Period{Day, ny}
	w := p.Window(time.UnixMilli(int64(ms("2026-03-08 12:00", ny))))
	if d := time.Duration(w.End-w.Start) * time.Millisecond; d != 23*time.Hour {
		t.Errorf("the spring-forward day lasts %v, want 23h", d)
	}
}

// FuzzWindow: for any instant and zone, the window's first period contains the instant, the
// periods are adjacent and non-empty, each starts at a local midnight (of the first day for a
// month), and the window of a period's start is that period.
func FuzzWindow(f *testing.F) {
	zones := []string{"UTC", "America/New_York", "Europe/Berlin", "Australia/Lord_Howe", "Asia/Kathmandu", "America/Sao_Paulo", "Pacific/Apia"}
	locs := make([]*time.Location, len(zones))
	for i, z := range zones {
		locs[i] = mustLoad(f, z)
	}
	f.Add(int64(1_764_767_400_000), uint8(0), false)
	f.Add(int64(1_772_953_200_000), uint8(1), true)
	f.Add(int64(0), uint8(6), false)
	f.Fuzz(func(t *testing.T, at int64, zone uint8, month bool) {
		at %= 1 << 42 // until about 2109
		if at < 0 {
			at = -at
		}
		p := Period{Unit: Day, Loc: locs[int(zone)%len(locs)]}
		if month {
			p.Unit = Month
		}
		w := p.Window(time.UnixMilli(at))
		if err := w.Validate(); err != nil && w.Start >= 0 {
			t.Fatalf("%v at %d: %v", p, at, err)
		}
		if !(w.Start <= bucket.Millis(at) && bucket.Millis(at) < w.End && w.End < w.Next) {
			t.Fatalf("%v at %d: window %+v does not hold it", p, at, w)
		}
		for _, b := range []bucket.Millis{w.Start, w.End, w.Next} {
			lt := time.UnixMilli(int64(b)).In(p.loc())
			if p.Unit == Month && lt.Day() != 1 {
				t.Fatalf("%v at %d: boundary %v is not a first of the month", p, at, lt)
			}
			if d := time.Duration(int64(b)-p.Start(time.UnixMilli(int64(b))).UnixMilli()) * time.Millisecond; d != 0 {
				t.Fatalf("%v at %d: boundary %v is not the start of its own period", p, at, lt)
			}
		}
		if d := time.Duration(w.Next-w.End) * time.Millisecond; d > p.Unit.Longest() || d < 20*time.Hour {
			t.Fatalf("%v at %d: a period of %v", p, at, d)
		}
		if n := p.Window(time.UnixMilli(int64(w.End))); n.Start != w.End || n.End != w.Next {
			t.Fatalf("%v at %d: the next period's window %+v does not follow %+v", p, at, n, w)
		}
	})
}
