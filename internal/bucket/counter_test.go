package bucket

import (
	"encoding/binary"
	"errors"
	"testing"
)

func TestCounter(t *testing.T) {
	const q = 10 * PerToken
	w := Window{Start: 1000, End: 2000, Next: 3000}
	c := FreshCounter(q, 1500)
	take := func(now Millis, want, least Micro, wantRes Result) {
		t.Helper()
		got, err := c.Take(q, w, now, want, least, WholeShare, 1)
		if err != nil || got != wantRes {
			t.Fatalf("Take(now=%d, want=%d, least=%d) = %+v, %v; want %+v", now, want, least, got, err, wantRes)
		}
	}
	take(1500, 4*PerToken, PerToken, Result{Granted: 4 * PerToken, Remaining: 6 * PerToken})
	if c.Period != 1000 || c.Last != 1500 {
		t.Fatalf("counter %+v, want period 1000, last 1500", c)
	}
	take(1600, 10*PerToken, PerToken, Result{Granted: 6 * PerToken})
	// Denied until the period ends: no refill within it.
	take(1700, PerToken, PerToken, Result{RetryAfter: 300})
	// Above the quota: never.
	take(1700, 11*PerToken, 11*PerToken, Result{RetryAfter: Never})
	// A lease of this period comes back in full.
	if got, err := c.Return(q, w, 1800, 3*PerToken, 1600); err != nil || got != (Result{Granted: 3 * PerToken, Remaining: 3 * PerToken}) {
		t.Fatalf("Return = %+v, %v; want 3 tokens credited", got, err)
	}
	// A clock that goes back stays in the period and keeps its clock.
	take(1200, PerToken, PerToken, Result{Granted: PerToken, Remaining: 2 * PerToken})
	if c.Last != 1800 {
		t.Fatalf("Last = %d after a clock going back, want 1800", c.Last)
	}
	// The next period starts full; a lease of the previous one is credited nothing.
	take(2000, 2*PerToken, 2*PerToken, Result{Granted: 2 * PerToken, Remaining: 8 * PerToken})
	if got, err := c.Return(q, w, 2001, 5*PerToken, 1600); err != nil || got != (Result{Remaining: 8 * PerToken}) {
		t.Fatalf("Return of an earlier period's lease = %+v, %v; want nothing credited", got, err)
	}
	// Credits never exceed what the period spent.
	if got, err := c.Return(q, w, 2001, 5*PerToken, 2000); err != nil || got != (Result{Granted: 2 * PerToken, Remaining: q}) {
		t.Fatalf("Return = %+v, %v; want the 2 tokens spent", got, err)
	}
	if e := c.Expiry(w, 5); e != 3005 {
		t.Fatalf("Expiry = %d, want the end of the period plus the margin", e)
	}
	// Outside the window, or a window of an earlier period: an error, and nothing changes.
	before := c
	for _, bad := range []struct {
		w   Window
		now Millis
	}{
		{w, 3000},                      // past the window
		{Window{0, 500, 1000}, 900},    // the key's clock is past it
		{Window{5000, 6000, 7000}, 10}, // the key's clock is before it
	} {
		if _, err := c.Take(q, bad.w, bad.now, 1, 1, WholeShare, 1); !errors.Is(err, ErrOutsideWindow) {
			t.Fatalf("Take(window %+v, now %d): %v, want ErrOutsideWindow", bad.w, bad.now, err)
		}
		if _, err := c.Return(q, bad.w, bad.now, 1, 1); !errors.Is(err, ErrOutsideWindow) {
			t.Fatalf("Return(window %+v, now %d): %v, want ErrOutsideWindow", bad.w, bad.now, err)
		}
		if c != before {
			t.Fatalf("counter changed by a failed operation: %+v, was %+v", c, before)
		}
	}
	// A later window: the period from 3000 starts with the whole quota.
	w = Window{Start: 3000, End: 4000, Next: 5000}
	take(3500, q, q, Result{Granted: q})
}

func TestCounterLaterWindow(t *testing.T) {
	const q = 5
	c := FreshCounter(q, 100)
	if _, err := c.Take(q, Window{0, 1000, 2000}, 100, 5, 5, WholeShare, 1); err != nil {
		t.Fatal(err)
	}
	// A coordinator whose window starts at the next period, while the key's clock is there too.
	got, err := c.Take(q, Window{1000, 2000, 3000}, 1000, 5, 5, WholeShare, 1)
	if err != nil || got.Granted != 5 || c.Period != 1000 {
		t.Fatalf("Take in the next window = %+v, %v, counter %+v; want the whole quota of period 1000", got, err, c)
	}
}

func TestWindowValidate(t *testing.T) {
	for _, tc := range []struct {
		w  Window
		ok bool
	}{
		{Window{0, 1, 2}, true},
		{Window{1, 1, 2}, false},
		{Window{1, 2, 2}, false},
		{Window{-1, 2, 3}, false},
		{Window{0, 1, MaxExact/2 + 1}, false},
		{Window{}, false},
	} {
		if err := tc.w.Validate(); (err == nil) != tc.ok {
			t.Errorf("%+v.Validate() = %v, want ok=%v", tc.w, err, tc.ok)
		}
	}
}

// FuzzCounter drives a counter through random takes and returns over random windows of a
// calendar of equal periods, and checks the invariants: 0 <= Tokens <= quota; the clock and the
// period never move back; within each period, granted minus credited never exceeds the quota;
// a lease is credited only in its own period and never more than it holds.
func FuzzCounter(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16})
	f.Add([]byte("a counter of a calendar quota, taken and returned"))
	f.Fuzz(func(t *testing.T, data []byte) { fuzzCounter(t, data, false) })
}

// fuzzCounter is FuzzCounter, and with debts FuzzCounterDebt: settled costs (Charge) too, down to
// a max debt drawn from data, the bounds then -maxDebt <= Tokens and quota + maxDebt debited net
// per period.
func fuzzCounter(t *testing.T, data []byte, debts bool) {
	next := func(n uint64) uint64 {
		var b [8]byte
		k := copy(b[:2], data)
		data = data[k:]
		return binary.LittleEndian.Uint64(b[:]) % n
	}
	quota := Micro(1 + next(1000))
	var maxDebt Micro
	if debts {
		maxDebt = Micro(next(uint64(quota) + 1))
	}
	period := Millis(1 + next(500))
	now := Millis(next(10_000))
	c := FreshCounter(quota, now)
	net := map[Millis]Micro{} // per period: debited - credited
	type grantT struct {
		at     Millis
		amount Micro
	}
	var grants []grantT
	ops := uint64(3) // take, take, return
	if debts {
		ops = 4 // take, take, charge, return
	}
	for len(data) > 0 {
		now += Millis(next(uint64(period))) - period/4 // sometimes back
		now = max(now, 0)
		// The window of a clock up to a period away from the key's.
		around := max(0, c.Last+Millis(next(uint64(2*period)))-period)
		start := around - around%period
		w := Window{Start: start, End: start + period, Next: start + 2*period}
		before := c
		switch op := next(ops); {
		case op < 2:
			want := Micro(1 + next(uint64(quota)+5))
			least := Micro(1 + next(uint64(want)))
			res, err := c.Take(quota, w, now, want, least, int64(1+next(WholeShare)), Micro(1+next(4)))
			if err != nil {
				if c != before {
					t.Fatalf("failed take changed the counter")
				}
				continue
			}
			if res.Granted > 0 {
				if res.Granted < least || res.Granted > want {
					t.Fatalf("granted %d outside least %d..want %d", res.Granted, least, want)
				}
				net[c.Period] += res.Granted
				grants = append(grants, grantT{c.Last, res.Granted})
			} else if res.RetryAfter != Never && (res.RetryAfter < 1 || c.Last+res.RetryAfter != c.Expiry(w, 0)) {
				t.Fatalf("denied with retry %d at %d, period ends at %d", res.RetryAfter, c.Last, c.Expiry(w, 0))
			}
		case op == 2 && debts:
			amount := Micro(next(uint64(2*quota) + 1))
			res, err := c.Charge(quota, w, now, amount, maxDebt)
			if err != nil {
				if c != before {
					t.Fatalf("failed charge changed the counter")
				}
				continue
			}
			if res.Granted < 0 || res.Granted > amount {
				t.Fatalf("charged %d of %d", res.Granted, amount)
			}
			net[c.Period] += res.Granted
		case len(grants) > 0:
			g := grants[next(uint64(len(grants)))]
			res, err := c.Return(quota, w, now, g.amount, g.at)
			if err != nil {
				continue
			}
			if res.Granted > g.amount || res.Granted > 0 && g.at < c.Period {
				t.Fatalf("credited %d of a lease of %d granted at %d in the period from %d", res.Granted, g.amount, g.at, c.Period)
			}
			net[c.Period] -= res.Granted
		}
		if c.Tokens < -maxDebt || c.Tokens > quota || c.Last < before.Last || c.Period < before.Period {
			t.Fatalf("counter %+v after %+v breaks an invariant (quota %d, max debt %d)", c, before, quota, maxDebt)
		}
		if net[c.Period] > quota+maxDebt {
			t.Fatalf("period from %d debited %d net, above quota %d + max debt %d", c.Period, net[c.Period], quota, maxDebt)
		}
		if net[c.Period] >= 0 && c.Tokens != quota-net[c.Period] {
			t.Fatalf("counter holds %d, the period debited %d net of a quota of %d", c.Tokens, net[c.Period], quota)
		}
	}
}
