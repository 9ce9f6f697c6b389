// Package calendar computes the boundaries of calendar periods (days and months in a time zone)
// as the windows of internal/bucket's counters: a quota per billing period resets at the calendar
// boundary, not a fixed length after the first request.
//
// Boundaries come from Go's time zone database, so a day of a daylight-saving change is 23 or 25
// hours long and a month is 28 to 31 days. Redis has no time zone database: the coordinator sends
// each counter its window (the period of a moment and the period after it), and the store's
// script picks the one its own clock is in.
package calendar

import (
	"fmt"
	"time"
	_ "time/tzdata" // zones on hosts and images without a zoneinfo database: a quota must reset the same everywhere

	"github.com/leasebucket/leasebucket/internal/bucket"
)

// Unit is the length of a calendar period.
type Unit uint8

const (
	// Day is a calendar day: from midnight to midnight in the period's time zone.
	Day Unit = iota + 1
	// Month is a calendar month: from midnight of its first day to midnight of the next month's.
	Month
)

func (u Unit) String() string {
	switch u {
	case Day:
		return "day"
	case Month:
		return "month"
	}
	return fmt.Sprintf("Unit(%d)", uint8(u))
}

// Period is a kind of calendar period in a time zone. The zero Period is not valid.
type Period struct {
	Unit Unit
	Loc  *time.Location
}

// String is "day" or "month", followed by the zone's name unless it is UTC.
func (p Period) String() string {
	if p.Loc == nil || p.Loc == time.UTC {
		return p.Unit.String()
	}
	return p.Unit.String() + " " + p.Loc.String()
}

// Start is the beginning of the period that contains t.
func (p Period) Start(t time.Time) time.Time {
	t = t.In(p.loc())
	y, m, d := t.Date()
	if p.Unit == Month {
		d = 1
	}
	return midnight(y, m, d, p.loc())
}

// add returns the start of the period n periods after the one starting at s.
func (p Period) add(s time.Time, n int) time.Time {
	y, m, d := s.In(p.loc()).Date()
	if p.Unit == Month {
		return midnight(y, m+time.Month(n), 1, p.loc())
	}
	return midnight(y, m, d+n, p.loc())
}

// Window is the period containing t and the period after it, in milliseconds since the Unix
// epoch. The caller passes its clock less the most another clock may lag it (the slack), so that
// the store's clock lies in the window.
func (p Period) Window(t time.Time) bucket.Window {
	s := p.Start(t)
	e := p.add(s, 1)
	n := p.add(e, 1)
	return bucket.Window{Start: bucket.Millis(s.UnixMilli()), End: bucket.Millis(e.UnixMilli()), Next: bucket.Millis(n.UnixMilli())}
}

// Longest is the longest a period of the unit can last: 31 days and an hour for a month (a
// daylight-saving change), 25 hours for a day (some zones once moved by more; the bound is
// used for sizing, never for correctness).
func (u Unit) Longest() time.Duration {
	if u == Month {
		return 31*24*time.Hour + time.Hour
	}
	return 25 * time.Hour
}

func (p Period) loc() *time.Location {
	if p.Loc == nil {
		return time.UTC
	}
	return p.Loc
}

// midnight is 00:00 of the given date in loc (normalized: a day 0 or 32 rolls the month over).
func midnight(y int, m time.Month, d int, loc *time.Location) time.Time {
	return time.Date(y, m, d, 0, 0, 0, 0, loc)
}
