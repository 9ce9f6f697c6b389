package storetest

import (
	"errors"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

// count is a take on a calendar counter of quota in window w.
func count(key string, quota bucket.Limit, w bucket.Window, want, least bucket.Micro) coordinator.TakeRequest {
	return coordinator.TakeRequest{Key: key, Limit: quota, Want: want, Min: least, Period: w}
}

// uncount hands a counter's lease back.
func uncount(key string, quota bucket.Limit, w bucket.Window, amount bucket.Micro, grantedAt bucket.Millis) coordinator.ReturnRequest {
	return coordinator.ReturnRequest{Key: key, Limit: quota, Amount: amount, GrantedAt: grantedAt, Period: w}
}

// window is a calendar window whose first period began ago ms before now and lasts period ms.
func window(now, ago, period bucket.Millis) bucket.Window {
	return bucket.Window{Start: now - ago, End: now - ago + period, Next: now - ago + 2*period}
}

var counterCases = []testCase{
	{"CounterResetsAtTheBoundary", func(f *fixture) {
		q := limit(f.t, 10*tok, 0, 0)
		w := window(f.now, 1000, day)
		g := f.take(count("c", q, w, 4*tok, tok), want{granted: 4 * tok, remaining: 6 * tok, now: f.now})
		// No refill inside the period: denied until it ends.
		f.advance(day / 2)
		f.take(count("c", q, w, 7*tok, 7*tok), want{remaining: 6 * tok, retry: w.End - f.now, now: f.now})
		f.take(count("c", q, w, 11*tok, 11*tok), want{remaining: 6 * tok, retry: bucket.Never, now: f.now})
		// A lease of the period comes back whole.
		f.ret(uncount("c", q, w, 3*tok, g.Now), want{granted: 3 * tok, remaining: 9 * tok, now: f.now})
		f.take(count("c", q, w, 9*tok, 9*tok), want{granted: 9 * tok, now: f.now})
		// At the boundary the whole quota is there again, and the old period's lease is not
		// credited to the new one.
		f.now = w.End
		f.take(count("c", q, w, 10*tok, 2*tok), want{granted: 10 * tok, now: f.now})
		f.ret(uncount("c", q, w, 5*tok, g.Now), want{now: f.now})
		// A coordinator whose window has moved on agrees.
		w2 := bucket.Window{Start: w.End, End: w.Next, Next: w.Next + day}
		f.advance(1)
		f.take(count("c", q, w2, tok, tok), want{retry: w2.End - f.now, now: f.now})
	}},
	{"CounterDebt", func(f *fixture) {
		q := limit(f.t, 10*tok, 0, 0)
		w := window(f.now, 1000, day)
		g := f.take(count("c", q, w, 8*tok, tok), want{granted: 8 * tok, remaining: 2 * tok, now: f.now})
		// A cost settled after the fact: used goes past the quota by at most max_debt.
		r := count("c", q, w, 0, 0)
		r.Debt, r.MaxDebt, r.Op = 6*tok, 3*tok, coordinator.OpID{Agent: "a", Seq: 1}
		f.take(r, want{remaining: -3 * tok, now: f.now, debited: 5 * tok})
		f.take(r, want{remaining: -3 * tok, now: f.now, debited: 5 * tok, replayed: true})
		// Takes are refused until the period ends.
		f.advance(day / 2)
		f.take(count("c", q, w, tok, tok), want{remaining: -3 * tok, retry: w.End - f.now, now: f.now})
		// A lease of the period handed back repays the debt.
		f.ret(uncount("c", q, w, 4*tok, g.Now), want{granted: 4 * tok, remaining: tok, now: f.now})
		f.take(count("c", q, w, tok, tok), want{granted: tok, remaining: 0, now: f.now})
		// The next period starts from the whole quota, the debt gone with its period.
		r = count("c", q, w, 0, 0)
		r.Debt, r.MaxDebt = 10*tok, 10*tok
		f.take(r, want{remaining: -10 * tok, now: f.now, debited: 10 * tok})
		f.now = w.End
		f.take(count("c", q, w, 10*tok, tok), want{granted: 10 * tok, now: f.now})
	}},
	{"CounterShareUnitCredit", func(f *fixture) {
		q := limit(f.t, 10*tok, 0, 0)
		w := window(f.now, 0, 1000)
		r := count("c", q, w, 9*tok, 3*tok)
		r.Unit, r.Share = 3*tok, 500
		// Half of 10 tokens is 5, rounded down to one request of 3.
		f.take(r, want{granted: 3 * tok, remaining: 7 * tok, now: f.now})
		r.Share = 0
		f.take(r, want{granted: 6 * tok, remaining: tok, now: f.now})
		// A credit riding a take is credited first, with the take's idempotency.
		r = count("c", q, w, 4*tok, 4*tok)
		r.Credit = coordinator.Credit{Amount: 3 * tok, GrantedAt: f.now}
		r.Op = coordinator.OpID{Agent: "a", Seq: 1}
		f.take(r, want{granted: 4 * tok, remaining: 0, now: f.now, credited: 3 * tok})
		f.take(r, want{granted: 4 * tok, remaining: 0, now: f.now, credited: 3 * tok, replayed: true})
		r.Op = coordinator.OpID{Agent: "b", Seq: 5}
		r.Want, r.Min, r.Credit = 0, 0, coordinator.Credit{Amount: 2 * tok, GrantedAt: f.now}
		f.take(r, want{remaining: 2 * tok, now: f.now, credited: 2 * tok})
		// Stale: an older operation of the agent does nothing.
		r.Op.Seq = 4
		f.take(r, want{remaining: 2 * tok, now: f.now, stale: true})
		ret := uncount("c", q, w, tok, f.now)
		ret.Op = coordinator.OpID{Agent: "b", Seq: 6}
		f.ret(ret, want{granted: tok, remaining: 3 * tok, now: f.now})
		f.ret(ret, want{granted: tok, remaining: 3 * tok, now: f.now, replayed: true})
	}},
	{"CounterClockBack", func(f *fixture) {
		q := limit(f.t, 5*tok, 0, 0)
		w := window(f.now, 100, 1000)
		f.advance(800) // 100 ms before the period ends
		t0 := f.now
		f.take(count("c", q, w, 5*tok, 5*tok), want{granted: 5 * tok, now: t0})
		// The key's clock is in the next period; a clock that goes back into the first one
		// neither returns to it nor starts the next period twice.
		f.now = w.End
		f.take(count("c", q, w, 5*tok, 5*tok), want{granted: 5 * tok, now: f.now})
		back := f.now
		f.now -= 50
		f.take(count("c", q, w, tok, tok), want{retry: w.Next - back, now: back})
	}},
	{"CounterOutsideWindow", func(f *fixture) {
		q := limit(f.t, 5*tok, 0, 0)
		for _, w := range []bucket.Window{
			window(f.now, -10, 1000),   // starts after the clock
			window(f.now, 2000, 1000),  // ended before it
			window(f.now, 10_000, 100), // long gone
		} {
			if got := f.takes(count("c", q, w, tok, tok))[0]; !errors.Is(got.Err, bucket.ErrOutsideWindow) {
				f.t.Fatalf("take in window %+v at %d = %s, want ErrOutsideWindow", w, f.now, TakeResultString(got))
			}
			if got := f.returns(uncount("c", q, w, tok, f.now))[0]; !errors.Is(got.Err, bucket.ErrOutsideWindow) {
				f.t.Fatalf("return in window %+v at %d = %s, want ErrOutsideWindow", w, f.now, ReturnResultString(got))
			}
		}
		// Nothing was created or charged: a good window sees the whole quota.
		w := window(f.now, 0, 1000)
		f.take(count("c", q, w, 5*tok, 5*tok), want{granted: 5 * tok, now: f.now})
		// The key now counts the period from f.now; a window whose periods began 1500 and 500 ms
		// ago puts the clock in a period before the key's: an error.
		if got := f.takes(count("c", q, window(f.now, 1500, 1000), tok, tok))[0]; !errors.Is(got.Err, bucket.ErrOutsideWindow) {
			f.t.Fatalf("take with an earlier window = %s, want an error", TakeResultString(got))
		}
	}},
	{"CounterExpires", func(f *fixture) {
		q := limit(f.t, 5*tok, 0, 0)
		w := window(f.now, 0, 1000)
		g := f.take(count("c", q, w, 2*tok, 2*tok), want{granted: 2 * tok, remaining: 3 * tok, now: f.now})
		// Past the end of the period plus the margin the key is gone: a fresh counter in the
		// window of that time, and the old lease is not credited.
		f.now = w.End + coordinator.ExpiryMargin
		w2 := window(f.now, 0, 1000)
		f.ret(uncount("c", q, w2, 2*tok, g.Now), want{remaining: 5 * tok, now: f.now})
	}},
	{"CounterInvalid", func(f *fixture) {
		refills := limit(f.t, 10*tok, tok, 100)
		q := limit(f.t, 10*tok, 0, 0)
		w := window(f.now, 0, 1000)
		takes := []coordinator.TakeRequest{
			count("c", refills, w, tok, tok), // a counter does not refill
			count("c", q, bucket.Window{Start: f.now, End: f.now, Next: f.now + 1}, tok, tok), // an empty period
			count("c", q, bucket.Window{Start: -1, End: f.now + 1, Next: f.now + 2}, tok, tok),
			count("c", q, w, tok, tok),
		}
		for i, r := range f.takes(takes...) {
			valid := i == 3
			if valid && r.Err != nil || !valid && !errors.Is(r.Err, coordinator.ErrInvalidRequest) {
				f.t.Errorf("item %d: %s = %s, want valid=%v", i, TakeString(takes[i]), TakeResultString(r), valid)
			}
		}
		rets := []coordinator.ReturnRequest{uncount("c", refills, w, tok, f.now), uncount("c", q, w, tok, f.now)}
		for i, r := range f.returns(rets...) {
			valid := i == 1
			if valid && r.Err != nil || !valid && !errors.Is(r.Err, coordinator.ErrInvalidRequest) {
				f.t.Errorf("item %d: %s = %s, want valid=%v", i, ReturnString(rets[i]), ReturnResultString(r), valid)
			}
		}
	}},
}
