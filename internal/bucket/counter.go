package bucket

import (
	"errors"
	"fmt"
)

// Window is a calendar period [Start, End) and the period after it [End, Next), in milliseconds
// on the store's clock. Periods are computed from a calendar and a time zone outside this package
// (internal/calendar); here they are only boundaries. The zero Window is no window: a token
// bucket, not a counter.
type Window struct {
	Start, End, Next Millis
}

// IsZero reports whether w is the zero Window.
func (w Window) IsZero() bool { return w == Window{} }

// Validate checks 0 <= Start < End < Next <= MaxExact/2: every period is non-empty and every
// boundary plus a margin stays below 2^53.
func (w Window) Validate() error {
	if w.Start < 0 || w.Start >= w.End || w.End >= w.Next || w.Next > MaxExact/2 {
		return fmt.Errorf("bucket: window %d..%d..%d: need 0 <= start < end < next <= 2^52", w.Start, w.End, w.Next)
	}
	return nil
}

// ErrOutsideWindow is returned when the counter's clock or period lies outside the window a
// request carries: the clock of whoever computed the window is more than the window's slack away
// from the store's, or the window belongs to another calendar.
var ErrOutsideWindow = errors.New("bucket: the key clock is outside the request's calendar window")

// Counter is the exact counter of a calendar quota: Tokens left of the quota in the period that
// starts at Period, as of Last (the key clock). It does not refill: at the first touch in a later
// period it holds the whole quota again. Amounts are microtokens; the quota is a Limit that never
// refills (its Capacity).
//
// Tokens goes below zero only by Charge (a cost settled after the fact), at most by the maxDebt
// it is given (at most the quota): the period then grants nothing more, and the next one starts
// from the whole quota again, the debt forgotten with the period it was charged to.
//
// Invariants: -quota <= -maxDebt <= Tokens <= quota. Last and Period never move backwards: a clock that jumps
// back neither starts a period twice nor returns to an earlier one. A token of a period is
// credited back only to that period (Return), so what a period grants net of credits is at most
// the quota, exactly.
type Counter struct {
	Tokens Micro
	Last   Millis
	Period Millis
}

// FreshCounter is the counter of a key nobody has used, or whose key expired: the whole quota,
// as of now, in no period yet (the first operation places it in its window's period).
func FreshCounter(quota Micro, now Millis) Counter { return Counter{Tokens: quota, Last: now} }

// advance moves the clock to now (if later) and the counter to the period of its clock in w,
// resetting it to the quota when that period is later than its own. It returns the end of the
// counter's period. Nothing changes on error.
func (c *Counter) advance(quota Micro, w Window, now Millis) (end Millis, err error) {
	last := max(c.Last, now)
	var p Millis
	switch {
	case last < w.Start || last >= w.Next:
		return 0, fmt.Errorf("%w: clock %d ms, window %d..%d", ErrOutsideWindow, last, w.Start, w.Next)
	case last < w.End:
		p, end = w.Start, w.End
	default:
		p, end = w.End, w.Next
	}
	if p < c.Period {
		return 0, fmt.Errorf("%w: the key is in the period from %d ms, the window's is from %d ms", ErrOutsideWindow, c.Period, p)
	}
	c.Last = last
	if p > c.Period {
		c.Period, c.Tokens = p, quota
	}
	return end, nil
}

// Take grants as State.TakeShare does, from the counter of the period of now in w (quota is the
// counter's Limit: l.Capacity(), never refilling). A denied take's RetryAfter is the time until
// the period ends, when the whole quota is there again (a debt too is gone then); Never if least
// is above the quota.
// Preconditions: 1 <= least <= want; 1 <= share <= 1000; unit >= 1; w valid.
func (c *Counter) Take(quota Micro, w Window, now Millis, want, least Micro, share int64, unit Micro) (Result, error) {
	end, err := c.advance(quota, w, now)
	if err != nil {
		return Result{}, err
	}
	switch {
	case c.Tokens >= least:
		g := grantOf(c.Tokens, want, least, share, unit)
		c.Tokens -= g
		return Result{Granted: g, Remaining: c.Tokens}, nil
	case least > quota:
		return Result{Remaining: c.Tokens, RetryAfter: Never}, nil
	default:
		return Result{Remaining: c.Tokens, RetryAfter: end - c.Last}, nil // Last < end
	}
}

// Charge debits a cost settled after the fact from the counter of the period of now in w: amount,
// even below zero, but never below -maxDebt; the rest is forgiven. Granted is what was debited
// (State.Charge).
// Preconditions: amount >= 0; 0 <= maxDebt <= quota; w valid.
func (c *Counter) Charge(quota Micro, w Window, now Millis, amount, maxDebt Micro) (Result, error) {
	if _, err := c.advance(quota, w, now); err != nil {
		return Result{}, err
	}
	d := max(0, min(amount, c.Tokens+maxDebt)) // Tokens + maxDebt <= 2*quota
	c.Tokens -= d
	return Result{Granted: d, Remaining: c.Tokens}, nil
}

// Return credits back amount unspent microtokens of a lease granted at grantedAt (the key clock
// of its grant). Only a lease of the counter's current period is credited, in full (at most what
// the period spent): its tokens were charged to this period and never used. A lease of an earlier
// period is credited nothing, since that period's quota is gone with it. A credit to a counter in
// debt repays it.
// Preconditions: amount >= 0; w valid.
func (c *Counter) Return(quota Micro, w Window, now Millis, amount Micro, grantedAt Millis) (Result, error) {
	if _, err := c.advance(quota, w, now); err != nil {
		return Result{}, err
	}
	var credit Micro
	if grantedAt >= c.Period {
		credit = max(0, min(amount, quota-c.Tokens))
	}
	c.Tokens += credit
	return Result{Granted: credit, Remaining: c.Tokens}, nil
}

// Expiry is when the counter's key may be dropped, on the key clock: at the end of its period
// (the next period starts from a fresh counter) plus margin. w is the window of its last
// operation.
func (c Counter) Expiry(w Window, margin Millis) Millis {
	if c.Period == w.Start {
		return w.End + margin
	}
	return w.Next + margin
}
