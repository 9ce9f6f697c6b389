// Package bucket is the token-bucket arithmetic of leasebucket, in integer microtokens.
//
// One global bucket per identity holds Tokens (at most Capacity) and refills continuously at
// num/den microtokens per millisecond. The same arithmetic runs in three places: the Redis Lua
// script (as IEEE doubles), the in-memory store and the agent's local emergency buckets. It is
// therefore written so that every intermediate value is an integer below 2^53, where a double is
// exact: a Limit that could break that bound is rejected by NewLimit.
//
// Time is always a parameter (milliseconds on the store's clock); nothing here reads a clock,
// allocates or locks. State is not safe for concurrent use; callers synchronize.
package bucket

import (
	"errors"
	"fmt"
)

// Micro is an amount of microtokens: 1 token = PerToken microtokens.
type Micro int64

// Millis is a time or a duration in milliseconds.
type Millis int64

const (
	// PerToken is the number of microtokens in one token. Policies speak in tokens; buckets count
	// microtokens so that slow rates (one token a day) refill smoothly with integer arithmetic.
	PerToken Micro = 1_000_000

	// MaxExact is the largest integer an IEEE double represents exactly (2^53 - 1). Redis Lua numbers
	// are doubles, so every product and sum the script forms must stay at or below it.
	MaxExact = 1<<53 - 1

	// MaxFill bounds the time an empty bucket takes to fill (2^45 ms, about 1115 years). It keeps
	// now + fill time below 2^53 for any wall-clock millisecond of this millennium, and rejects
	// policies that are a typo rather than a limit.
	MaxFill Millis = 1 << 45

	// Never is the RetryAfter of a request that no amount of waiting can satisfy: its minimum is
	// above the capacity, or the bucket does not refill.
	Never Millis = -1
)

// ErrUnrepresentable is wrapped by NewLimit when a limit cannot be computed exactly.
var ErrUnrepresentable = errors.New("bucket: limit cannot be represented exactly")

// Limit is a validated, immutable bucket shape: Capacity microtokens, refilled at num/den
// microtokens per millisecond, the fraction reduced by its gcd.
//
// Invariants (checked by NewLimit): 1 <= capacity; 2*capacity + num <= MaxExact;
// (num+1)*den <= MaxExact; fill <= MaxFill. Under them every intermediate of Refill, Take and Return
// stays within MaxExact (the bound is noted beside each multiplication).
type Limit struct {
	capacity Micro
	num, den int64  // refill rate: num microtokens per den milliseconds; num == 0 never refills
	fill     Millis // time to fill from empty, rounded up; 0 when num == 0 (never)
}

// NewLimit returns the limit of a bucket holding at most capacity microtokens and refilling amount
// microtokens every period milliseconds. amount == 0 is a bucket that never refills (a one-off
// allowance); then period is ignored.
func NewLimit(capacity, amount Micro, period Millis) (Limit, error) {
	switch {
	case capacity < 1:
		return Limit{}, fmt.Errorf("bucket: capacity %d µ must be at least 1", capacity)
	case amount < 0:
		return Limit{}, fmt.Errorf("bucket: refill amount %d µ must not be negative", amount)
	case amount > 0 && period < 1:
		return Limit{}, fmt.Errorf("bucket: refill period %d ms must be at least 1 ms", period)
	case capacity > MaxExact/2:
		return Limit{}, fmt.Errorf("%w: capacity %d µ exceeds 2^52 µ", ErrUnrepresentable, capacity)
	}
	l := Limit{capacity: capacity, num: 0, den: 1}
	if amount == 0 {
		return l, nil
	}
	g := gcd(int64(amount), int64(period))
	l.num, l.den = int64(amount)/g, int64(period)/g
	if l.num > MaxExact/l.den-1 { // (num+1)*den <= MaxExact: the refill's remainder adds up to den
		return Limit{}, fmt.Errorf("%w: rate %d µ per %d ms reduces to %d/%d, whose product exceeds 2^53",
			ErrUnrepresentable, amount, period, l.num, l.den)
	}
	if 2*int64(capacity) > MaxExact-l.num {
		return Limit{}, fmt.Errorf("%w: capacity %d µ plus a %d µ refill step exceeds 2^53",
			ErrUnrepresentable, capacity, l.num)
	}
	// fillTime's quotient is at most capacity*den/num; bound it before forming it.
	if int64(capacity)/l.num > int64(MaxFill)/l.den {
		return Limit{}, fmt.Errorf("%w: filling %d µ at %d µ per %d ms takes longer than 2^45 ms",
			ErrUnrepresentable, capacity, l.num, l.den)
	}
	l.fill = l.timeFor(capacity)
	if l.fill > MaxFill {
		return Limit{}, fmt.Errorf("%w: filling %d µ at %d µ per %d ms takes longer than 2^45 ms",
			ErrUnrepresentable, capacity, l.num, l.den)
	}
	return l, nil
}

// Capacity is the most the bucket holds, in microtokens.
func (l Limit) Capacity() Micro { return l.capacity }

// Rate is the reduced refill rate: num microtokens every den milliseconds.
func (l Limit) Rate() (num, den int64) { return l.num, l.den }

// FillTime is the time an empty bucket takes to fill, rounded up; 0 if it never refills.
func (l Limit) FillTime() Millis { return l.fill }

// Refilled is what the bucket refills in elapsed ms from empty, rounded down and capped at the
// capacity.
func (l Limit) Refilled(elapsed Millis) Micro {
	switch {
	case elapsed <= 0 || l.num == 0:
		return 0
	case elapsed >= l.fill:
		return l.capacity
	}
	add, _ := l.added(elapsed, 0)
	return add
}

// TimeFor is how long amount takes to refill at the bucket's rate from empty, rounded up, for
// 0 <= amount <= capacity; 0 for a bucket that never refills.
func (l Limit) TimeFor(amount Micro) Millis {
	if l.num == 0 || amount <= 0 {
		return 0
	}
	return l.timeFor(min(amount, l.capacity))
}

// Permille is x·p/1000 rounded down, for 0 <= x < 2^53 and 0 <= p <= 1000, without forming x·p
// (which could pass 2^53): x/1000·p + (x%1000)·p/1000.
func Permille(x Micro, p int64) Micro {
	return Micro(int64(x)/WholeShare*p + int64(x)%WholeShare*p/WholeShare)
}

// Refills reports whether the bucket refills at all.
func (l Limit) Refills() bool { return l.num > 0 }

// String shows the limit in the units of the arithmetic.
func (l Limit) String() string {
	return fmt.Sprintf("capacity=%dµ rate=%dµ/%dms", l.capacity, l.num, l.den)
}

// added refills elapsed ms (0 <= elapsed <= fill) on top of a remainder frac (0 <= frac < den, in
// units of 1/den µ): it returns the whole microtokens and the new remainder of
// elapsed*num + frac over den. Split as q*num + (r*num + frac)/den so that no product exceeds 2^53:
// q*num <= elapsed*num/den <= fill*num/den < capacity + num, and r*num + frac < den*num + den <= MaxExact.
func (l Limit) added(elapsed Millis, frac int64) (Micro, int64) {
	q, r := int64(elapsed)/l.den, int64(elapsed)%l.den
	t := r*l.num + frac
	return Micro(q*l.num + t/l.den), t % l.den
}

// timeFor is ceil(amount * den / num) for 0 <= amount <= 2*capacity: the milliseconds the bucket
// needs to refill amount. Split as q*den + ceil(r*den/num): r*den < num*den <= MaxExact, and
// q*den <= amount*den/num, which NewLimit bounded by MaxFill for amount <= capacity (2*MaxFill
// for 2*capacity: a take or a fill from a debt of at most the capacity).
func (l Limit) timeFor(amount Micro) Millis {
	return l.timeForFrac(amount, 0)
}

// timeForFrac is timeFor when a remainder frac (units of 1/den µ) is already there:
// ceil((amount*den - frac) / num), split the same way; r*den - frac is in (-den, num*den).
func (l Limit) timeForFrac(amount Micro, frac int64) Millis {
	q, r := int64(amount)/l.num, int64(amount)%l.num
	x := r*l.den - frac
	if x >= 0 {
		return Millis(q*l.den + ceilDiv(x, l.num))
	}
	return Millis(q*l.den - (-x)/l.num) // ceil of a negative quotient
}

// State is one bucket: Tokens microtokens plus Frac/den of one more, as of Last, the store's clock
// in milliseconds at the last refill. A missing state is a full bucket (Full), so an idle key can
// expire.
//
// Tokens goes below zero only by Charge, a cost settled after the fact (debt), and at most by the
// maxDebt it is given, itself at most the capacity; a take finds no tokens until refills (or
// returns) have repaid the debt.
//
// Invariants: -Capacity <= -maxDebt <= Tokens <= Capacity; 0 <= Frac < den, and Frac == 0 when
// Tokens == Capacity.
// Last never moves backwards: a clock that jumps back credits nothing and leaves Last where it
// was, so no interval is credited twice. Frac carries the part of a microtoken a refill could not
// credit yet, so refills lose nothing however often the bucket is touched (a bucket touched every
// millisecond at one token a day still refills at exactly one token a day).
type State struct {
	Tokens Micro
	Last   Millis
	Frac   int64
}

// Full is the state of a bucket nobody has used, or whose key expired: full as of now.
func Full(l Limit, now Millis) State { return State{Tokens: l.capacity, Last: now} }

// Refill credits the time since Last, capped at capacity, and moves Last to now if now is later.
// Nothing is created or lost except what the cap discards. From a level below zero (a debt) it
// first refills the time to reach zero, then the rest from there: the cap's shortcut (a whole
// fill time fills the bucket) holds only from a level of at least zero.
func (s *State) Refill(l Limit, now Millis) {
	elapsed := now - s.Last
	if elapsed <= 0 {
		return // the clock went backwards (or did not move): credit nothing, keep Last
	}
	s.Last = now
	if s.Tokens < 0 && l.num > 0 {
		// -Tokens <= maxDebt <= capacity, so zero <= fill ms away (timeForFrac bounds its
		// products), and added's bound holds for up to fill ms.
		zero := l.timeForFrac(-s.Tokens, s.Frac)
		if elapsed < zero {
			add, frac := l.added(elapsed, s.Frac)
			s.Tokens, s.Frac = s.Tokens+add, frac // still below zero: add < -Tokens
			return
		}
		add, frac := l.added(zero, s.Frac)
		s.Tokens, s.Frac = s.Tokens+add, frac // 0 <= Tokens <= add + Tokens < num + 1
		elapsed -= zero
		if s.Tokens >= l.capacity {
			s.Tokens, s.Frac = l.capacity, 0
		}
	}
	switch {
	case s.Tokens >= l.capacity || l.num == 0:
		s.Frac = 0
	case elapsed >= l.fill: // clamp elapsed to the time to fill before multiplying
		s.Tokens, s.Frac = l.capacity, 0
	default:
		add, frac := l.added(elapsed, s.Frac)
		s.Tokens, s.Frac = s.Tokens+add, frac // <= 2*capacity + num <= MaxExact
		if s.Tokens >= l.capacity {
			s.Tokens, s.Frac = l.capacity, 0
		}
	}
}

// Result is the outcome of Take or Return.
type Result struct {
	Granted    Micro  // microtokens taken by Take, or credited by Return
	Remaining  Micro  // microtokens left in the bucket afterwards
	RetryAfter Millis // Take only: 0 if granted, else when min becomes available, or Never
}

// Charge refills the bucket up to now, then debits a cost settled after the fact: amount, even
// below zero, but never below -maxDebt; the rest is forgiven. Granted is what was debited,
// min(amount, Tokens+maxDebt) and never negative (a bucket already deeper in debt than maxDebt,
// after a policy lowered it, is charged nothing). Charge(0) changes nothing but the refill.
// Preconditions: amount >= 0; 0 <= maxDebt <= capacity.
func (s *State) Charge(l Limit, now Millis, amount, maxDebt Micro) Result {
	s.Refill(l, now)
	d := max(0, min(amount, s.Tokens+maxDebt)) // Tokens + maxDebt <= 2*capacity
	s.Tokens -= d
	return Result{Granted: d, Remaining: s.Tokens}
}

// Take refills the bucket up to now, then grants min(want, Tokens) if at least least microtokens
// are available; otherwise it grants nothing and says when least will be available. One call
// serves a single request (want == least == cost) and a lease (least = one request's cost).
// Preconditions: 1 <= least <= want.
func (s *State) Take(l Limit, now Millis, want, least Micro) Result {
	return s.TakeShare(l, now, want, least, WholeShare, 1)
}

// WholeShare is the share (in permille) that does not cap a grant.
const WholeShare = 1000

// grantOf is what a take grants from tokens >= least (TakeShare's rule, for buckets and counters
// alike; common.lua's take_share in the stores): want, capped at share‰ of tokens but never below
// least, at most tokens, and when cut below want rounded down to a multiple of unit, never below
// least.
func grantOf(tokens, want, least Micro, share int64, unit Micro) Micro {
	capped := want
	if share < WholeShare {
		capped = min(want, max(least, Permille(tokens, share)))
	}
	g := min(capped, tokens)
	if g < want && unit > 1 {
		g = max(least, g-g%unit)
	}
	return g
}

// TakeShare is Take with the grant also capped at share‰ of the tokens available, but never below
// least: one lease cannot drain a bucket that other agents need, and when the bucket runs low the
// grant shrinks to least (one request's cost). A grant cut below want — by the share or by what
// the bucket holds — is rounded down to a multiple of unit (one request's cost), never below
// least, so a lease holds whole requests and is spent to zero.
// A bucket in debt (Tokens < 0) grants nothing until least is there: RetryAfter counts the time
// to repay the debt too (least - Tokens <= 2*capacity, which timeForFrac allows).
// Preconditions: 1 <= least <= want; 1 <= share <= 1000; unit >= 1.
func (s *State) TakeShare(l Limit, now Millis, want, least Micro, share int64, unit Micro) Result {
	s.Refill(l, now)
	switch {
	case s.Tokens >= least:
		g := grantOf(s.Tokens, want, least, share, unit)
		s.Tokens -= g
		return Result{Granted: g, Remaining: s.Tokens}
	case least > l.capacity || l.num == 0:
		return Result{Remaining: s.Tokens, RetryAfter: Never}
	default:
		return Result{Remaining: s.Tokens, RetryAfter: l.timeForFrac(least-s.Tokens, s.Frac)}
	}
}

// Return credits back amount unspent microtokens of a lease granted at grantedAt (the store's clock
// when the lease was taken), and reports how much was credited.
//
// The credit is amount less the refill the bucket could have received since grantedAt (rounded
// up), capped at capacity: a returned token counts as if it had sat in the bucket all along, where
// the cap would have stopped the refill. Without that decay, tokens held in leases while the bucket
// refilled could be returned into a full bucket again and again, and the admission bound
// C + r·(w + τ) would not hold (docs/leases.md proves it does with the decay).
// No lease exceeds the capacity, so a larger amount is treated as the capacity. On a bucket in
// debt the credit repays it (Tokens + credit <= capacity as ever).
// Preconditions: amount >= 0.
func (s *State) Return(l Limit, now Millis, amount Micro, grantedAt Millis) Result {
	s.Refill(l, now)
	credit := min(amount, l.capacity)
	if age := s.Last - grantedAt; age > 0 && l.num > 0 {
		if age >= l.fill {
			credit = 0 // a full bucket's worth of refill has passed: nothing left to credit
		} else {
			credit -= l.timeDecay(age)
		}
	}
	credit = max(0, min(credit, l.capacity-s.Tokens))
	s.Tokens += credit
	if s.Tokens == l.capacity {
		s.Frac = 0
	}
	return Result{Granted: credit, Remaining: s.Tokens}
}

// timeDecay is ceil(age * num / den) for 0 < age < fill: the refill in age, rounded up.
func (l Limit) timeDecay(age Millis) Micro {
	q, r := int64(age)/l.den, int64(age)%l.den
	return Micro(q*l.num + ceilDiv(r*l.num, l.den)) // r*num < den*num <= MaxExact
}

// TimeToFull is how long the bucket, as of Last, takes to fill; ok is false if it never will
// (it is not full and does not refill). From a debt it is the time to repay it and then fill:
// capacity - Tokens <= 2*capacity, at most twice the fill time.
func (s State) TimeToFull(l Limit) (d Millis, ok bool) {
	switch {
	case s.Tokens >= l.capacity:
		return 0, true
	case l.num == 0:
		return 0, false
	default:
		return l.timeForFrac(l.capacity-s.Tokens, s.Frac), true
	}
}

// ceilDiv is ceil(a/b) for a >= 0, b > 0, without forming a+b-1 (which could pass 2^53).
func ceilDiv(a, b int64) int64 {
	q := a / b
	if q*b != a {
		q++
	}
	return q
}

func gcd(a, b int64) int64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}
