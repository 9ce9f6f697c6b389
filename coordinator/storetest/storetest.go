// Package storetest is the conformance suite of coordinator.Store: the behaviours every store must
// show, run against memstore and against redisstore on a real Redis.
package storetest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"testing"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

// NewStore returns an empty store (no keys) whose clock is clock.
type NewStore func(t *testing.T, clock func() bucket.Millis) coordinator.Store

// Run runs every behaviour as a subtest, each on a new store.
func Run(t *testing.T, newStore NewStore) {
	for _, tc := range slices.Concat(cases, counterCases, multiCases) {
		t.Run(tc.name, func(t *testing.T) {
			f := &fixture{t: t, now: start}
			f.store = newStore(t, func() bucket.Millis { return f.now })
			tc.run(f)
		})
	}
}

// start is the clock at the beginning of each case: a wall-clock-like millisecond.
const start bucket.Millis = 1_700_000_000_000

const (
	tok    = bucket.PerToken
	second = bucket.Millis(1000)
	day    = 24 * 3600 * second
	year   = 365 * day
)

// limit is bucket.NewLimit that fails the test on error.
func limit(t *testing.T, capacity, amount bucket.Micro, period bucket.Millis) bucket.Limit {
	t.Helper()
	l, err := bucket.NewLimit(capacity, amount, period)
	if err != nil {
		t.Fatalf("NewLimit(%d, %d, %d): %v", capacity, amount, period, err)
	}
	return l
}

// fixture is one case's store and manual clock.
type fixture struct {
	t     *testing.T
	store coordinator.Store
	now   bucket.Millis
}

func (f *fixture) advance(d bucket.Millis) { f.now += d }

// want is an expected result; a nil Err field in results means success.
type want struct {
	granted, remaining bucket.Micro
	retry              bucket.Millis
	now                bucket.Millis
	replayed, stale    bool
	credited           bucket.Micro  // Take: what its handed-back lease was credited
	pace               bucket.Millis // Take: the pace of a contended take
	debited            bucket.Micro  // Take: what was charged of its debt
}

func (w want) String() string {
	s := fmt.Sprintf("{granted=%d remaining=%d retry=%d now=%d", w.granted, w.remaining, w.retry, w.now)
	if w.credited != 0 {
		s += fmt.Sprintf(" credited=%d", w.credited)
	}
	if w.pace != 0 {
		s += fmt.Sprintf(" pace=%d", w.pace)
	}
	if w.debited != 0 {
		s += fmt.Sprintf(" debited=%d", w.debited)
	}
	if w.replayed {
		s += " replayed"
	}
	if w.stale {
		s += " stale"
	}
	return s + "}"
}

// TakeString formats a request for failure messages.
func TakeString(r coordinator.TakeRequest) string {
	s := fmt.Sprintf("Take(%q, %v, want=%d, min=%d", r.Key, r.Limit, r.Want, r.Min)
	if r.AmpleWant != 0 {
		s += fmt.Sprintf(", ample=%d", r.AmpleWant)
	}
	if r.Demand != 0 || r.TTL != 0 {
		s += fmt.Sprintf(", demand=%d ttl=%d", r.Demand, r.TTL)
	}
	if r.Share != 0 {
		s += fmt.Sprintf(", share=%d‰", r.Share)
	}
	if r.Unit != 0 {
		s += fmt.Sprintf(", unit=%d", r.Unit)
	}
	if r.Credit.Amount != 0 {
		s += fmt.Sprintf(", credit=%d granted at %d", r.Credit.Amount, r.Credit.GrantedAt)
	}
	if r.Debt != 0 || r.MaxDebt != 0 {
		s += fmt.Sprintf(", debt=%d max_debt=%d", r.Debt, r.MaxDebt)
	}
	if !r.Period.IsZero() {
		s += fmt.Sprintf(", window=%d..%d..%d", r.Period.Start, r.Period.End, r.Period.Next)
	}
	if r.Op.Agent != "" {
		s += fmt.Sprintf(", op=%s/%d", r.Op.Agent, r.Op.Seq)
	}
	for _, b := range r.Also {
		s += fmt.Sprintf(", also %q %v", b.Key, b.Limit)
	}
	return s + ")"
}

// ReturnString formats a request for failure messages.
func ReturnString(r coordinator.ReturnRequest) string {
	s := fmt.Sprintf("Return(%q, %v, amount=%d, grantedAt=%d", r.Key, r.Limit, r.Amount, r.GrantedAt)
	if !r.Period.IsZero() {
		s += fmt.Sprintf(", window=%d..%d..%d", r.Period.Start, r.Period.End, r.Period.Next)
	}
	if r.Op.Agent != "" {
		s += fmt.Sprintf(", op=%s/%d", r.Op.Agent, r.Op.Seq)
	}
	for _, b := range r.Also {
		s += fmt.Sprintf(", also %q %v", b.Key, b.Limit)
	}
	return s + ")"
}

// TakeResultString formats a result for failure messages.
func TakeResultString(r coordinator.TakeResult) string {
	if r.Err != nil {
		return "error " + r.Err.Error()
	}
	return takeWant(r).String()
}

func takeWant(r coordinator.TakeResult) want {
	return want{r.Granted, r.Remaining, r.RetryAfter, r.Now, r.Replayed, r.Stale, r.Credited, r.Pace, r.Debited}
}

// ReturnResultString formats a result for failure messages.
func ReturnResultString(r coordinator.ReturnResult) string {
	if r.Err != nil {
		return "error " + r.Err.Error()
	}
	return want{r.Granted, r.Remaining, r.RetryAfter, r.Now, r.Replayed, r.Stale, 0, 0, 0}.String()
}

func (f *fixture) takes(reqs ...coordinator.TakeRequest) []coordinator.TakeResult {
	f.t.Helper()
	res, err := f.store.Take(context.Background(), reqs)
	if err != nil {
		f.t.Fatalf("Take batch of %d: %v", len(reqs), err)
	}
	if len(res) != len(reqs) {
		f.t.Fatalf("Take batch of %d: %d results", len(reqs), len(res))
	}
	return res
}

func (f *fixture) returns(reqs ...coordinator.ReturnRequest) []coordinator.ReturnResult {
	f.t.Helper()
	res, err := f.store.Return(context.Background(), reqs)
	if err != nil {
		f.t.Fatalf("Return batch of %d: %v", len(reqs), err)
	}
	if len(res) != len(reqs) {
		f.t.Fatalf("Return batch of %d: %d results", len(reqs), len(res))
	}
	return res
}

// take runs one Take and checks its result.
func (f *fixture) take(r coordinator.TakeRequest, w want) coordinator.TakeResult {
	f.t.Helper()
	got := f.takes(r)[0]
	if got.Err != nil || takeWant(got) != w {
		f.t.Fatalf("at %d: %s = %s, want %s", f.now, TakeString(r), TakeResultString(got), w)
	}
	return got
}

// ret runs one Return and checks its result.
func (f *fixture) ret(r coordinator.ReturnRequest, w want) coordinator.ReturnResult {
	f.t.Helper()
	got := f.returns(r)[0]
	if got.Err != nil || (want{got.Granted, got.Remaining, got.RetryAfter, got.Now, got.Replayed, got.Stale, 0, 0, 0}) != w {
		f.t.Fatalf("at %d: %s = %s, want %s", f.now, ReturnString(r), ReturnResultString(got), w)
	}
	return got
}

// ProbeRequest is a Take of key that asks for more than l's capacity: it never grants, and its
// result's Remaining is the bucket's tokens after a refill to the store's now.
func ProbeRequest(key string, l bucket.Limit) coordinator.TakeRequest {
	return coordinator.TakeRequest{Key: key, Limit: l, Want: l.Capacity() + 1, Min: l.Capacity() + 1}
}

// Probe returns the tokens of key's bucket in store after a refill to the store's now, by a
// ProbeRequest.
func Probe(ctx context.Context, store coordinator.Store, key string, l bucket.Limit) (bucket.Micro, error) {
	res, err := store.Take(ctx, []coordinator.TakeRequest{ProbeRequest(key, l)})
	switch {
	case err != nil:
		return 0, err
	case res[0].Err != nil:
		return 0, res[0].Err
	}
	return res[0].Remaining, nil
}

// tokens returns the bucket's tokens after a refill to now, with a ProbeRequest.
func (f *fixture) tokens(key string, l bucket.Limit) bucket.Micro {
	f.t.Helper()
	r := ProbeRequest(key, l)
	got := f.takes(r)[0]
	if got.Err != nil || got.Granted != 0 || got.RetryAfter != bucket.Never {
		f.t.Fatalf("at %d: probe %s = %s, want a denial", f.now, TakeString(r), TakeResultString(got))
	}
	return got.Remaining
}

type testCase struct {
	name string
	run  func(f *fixture)
}

var cases = []testCase{
	{"FirstUseIsFull", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100) // 10 tokens, 1 token per 100 ms
		f.take(take("k", l, 3*tok, tok), want{granted: 3 * tok, remaining: 7 * tok, now: f.now})
		// An unused key of another limit is full too.
		big := limit(f.t, 1_000_000_000*tok, 1_000_000_000*tok, day)
		f.take(take("other", big, 2*tok, 2*tok), want{granted: 2 * tok, remaining: (1_000_000_000 - 2) * tok, now: f.now})
	}},
	{"GrantPartialDeny", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		f.take(take("k", l, 4*tok, 4*tok), want{granted: 4 * tok, remaining: 6 * tok, now: f.now})
		// Up to want, at least min: a partial grant empties the bucket.
		f.take(take("k", l, 10*tok, tok), want{granted: 6 * tok, remaining: 0, now: f.now})
		// Denied: 2 tokens take 200 ms to refill.
		f.take(take("k", l, 2*tok, 2*tok), want{remaining: 0, retry: 200, now: f.now})
		f.advance(150)
		f.take(take("k", l, 2*tok, 2*tok), want{remaining: tok + tok/2, retry: 50, now: f.now})
		// retry_after rounds up: 1 µ short is 1 ms.
		f.advance(49)
		f.take(take("k", l, 2*tok, 2*tok), want{remaining: 2*tok - 10_000, retry: 1, now: f.now})
		f.advance(1)
		f.take(take("k", l, 5*tok, 2*tok), want{granted: 2 * tok, remaining: 0, now: f.now})
	}},
	{"Never", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		// More than the capacity: no wait helps, even from a full bucket.
		f.take(take("k", l, 11*tok, 11*tok), want{remaining: 10 * tok, retry: bucket.Never, now: f.now})
		// A bucket that never refills: once empty, never again.
		once := limit(f.t, 3*tok, 0, 0)
		f.take(take("once", once, 3*tok, 3*tok), want{granted: 3 * tok, now: f.now})
		f.take(take("once", once, tok, tok), want{retry: bucket.Never, now: f.now})
		f.advance(10 * year)
		f.take(take("once", once, tok, 1), want{retry: bucket.Never, now: f.now})
	}},
	{"ShareCap", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		r := take("k", l, 10*tok, tok)
		r.Share = 250 // at most a quarter of what is there
		f.take(r, want{granted: 2*tok + tok/2, remaining: 7*tok + tok/2, now: f.now})
		f.take(r, want{granted: 1_875_000, remaining: 5_625_000, now: f.now})
		// Never below min: a low bucket grants one request's cost.
		r.Min = 3 * tok
		f.take(r, want{granted: 3 * tok, remaining: 2_625_000, now: f.now})
		// Share 0 and 1000 do not cap.
		r.Share, r.Min = 0, 1
		f.take(r, want{granted: 2_625_000, remaining: 0, now: f.now})
		f.advance(1000)
		r.Share = bucket.WholeShare
		f.take(r, want{granted: 10 * tok, remaining: 0, now: f.now})
	}},
	{"UnitRounding", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		r := take("k", l, 9*tok, 3*tok)
		r.Unit, r.Share = 3*tok, 500
		// Half of 10 tokens is 5: cut below want, rounded down to one request of 3 tokens.
		f.take(r, want{granted: 3 * tok, remaining: 7 * tok, now: f.now})
		// Uncapped, 7 tokens held, want 9: two whole requests.
		r.Share = 0
		f.take(r, want{granted: 6 * tok, remaining: tok, now: f.now})
		// Want itself is never rounded, and rounding never goes below min: 2 tokens held, less
		// than a request of 3, grant min.
		f.advance(300)
		r.Want, r.Min = 4*tok, 4*tok
		f.take(r, want{granted: 4 * tok, remaining: 0, now: f.now})
		f.advance(200)
		r.Want, r.Min = 5*tok, tok
		f.take(r, want{granted: tok, remaining: tok, now: f.now})
	}},
	{"CreditBeforeTake", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		g := f.take(take("k", l, 8*tok, 8*tok), want{granted: 8 * tok, remaining: 2 * tok, now: f.now})
		f.advance(100) // 1 token refilled: the 5 tokens handed back decay by 1
		r := take("k", l, 6*tok, 6*tok)
		r.Credit = coordinator.Credit{Amount: 5 * tok, GrantedAt: g.Now}
		// 2 + 1 refilled + 4 credited = 7: the take of 6 sees the credit.
		r.Op = coordinator.OpID{Agent: "a", Seq: 1}
		f.take(r, want{granted: 6 * tok, remaining: tok, now: f.now, credited: 4 * tok})
		// A repeat is answered from the record, credit included; nothing is charged or credited.
		f.take(r, want{granted: 6 * tok, remaining: tok, now: f.now, credited: 4 * tok, replayed: true})
		// A credit that decayed away adds nothing, and a denied take keeps what was credited.
		f.advance(1000)
		r = take("k", l, 11*tok, 11*tok)
		r.Credit = coordinator.Credit{Amount: 3 * tok, GrantedAt: f.now - 1000}
		f.take(r, want{remaining: 10 * tok, retry: bucket.Never, now: f.now})
		f.take(take("k", l, 2*tok, 2*tok), want{granted: 8 * tok / 4, remaining: 8 * tok, now: f.now})
		r = take("k", l, 10*tok, 10*tok)
		r.Credit = coordinator.Credit{Amount: tok, GrantedAt: f.now}
		f.take(r, want{remaining: 9 * tok, retry: 100, now: f.now, credited: tok})
		// The credit is capped at what the bucket can hold.
		f.advance(1000)
		r = take("k", l, tok, tok)
		r.Credit = coordinator.Credit{Amount: 5 * tok, GrantedAt: f.now}
		f.take(r, want{granted: tok, remaining: 9 * tok, now: f.now})
		// A take that only hands a lease back (want and min 0) credits and takes nothing.
		r = take("k", l, 0, 0)
		r.Credit = coordinator.Credit{Amount: 3 * tok, GrantedAt: f.now}
		f.take(r, want{remaining: 10 * tok, now: f.now, credited: tok})
		f.take(take("k", l, 4*tok, 4*tok), want{granted: 4 * tok, remaining: 6 * tok, now: f.now})
		r.Op = coordinator.OpID{Agent: "b", Seq: 7}
		f.take(r, want{remaining: 9 * tok, now: f.now, credited: 3 * tok})
		f.take(r, want{remaining: 9 * tok, now: f.now, credited: 3 * tok, replayed: true})
		// Without a credit, want and min 0 is malformed.
		if got := f.takes(take("k", l, 0, 0))[0]; !errors.Is(got.Err, coordinator.ErrInvalidRequest) {
			f.t.Fatalf("take of 0 with no credit = %s, want ErrInvalidRequest", TakeResultString(got))
		}
	}},
	{"DebtBelowZero", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		f.take(take("k", l, 8*tok, 8*tok), want{granted: 8 * tok, remaining: 2 * tok, now: f.now})
		// A cost settled after the fact, alone (want and min 0): 2 tokens are there, 3 go into
		// debt, within max_debt 4. Nothing is taken.
		r := take("k", l, 0, 0)
		r.Debt, r.MaxDebt, r.Op = 5*tok, 4*tok, coordinator.OpID{Agent: "a", Seq: 1}
		f.take(r, want{remaining: -3 * tok, now: f.now, debited: 5 * tok})
		// A repeat is answered from the record: charged once.
		f.take(r, want{remaining: -3 * tok, now: f.now, debited: 5 * tok, replayed: true})
		// A take waits for the debt and its own cost: 4 tokens, 400 ms.
		f.take(take("k", l, tok, tok), want{remaining: -3 * tok, retry: 400, now: f.now})
		// Beyond max_debt the rest is forgiven; the debt is charged before the take.
		r = take("k", l, tok, tok)
		r.Debt, r.MaxDebt = 3*tok, 4*tok
		f.take(r, want{remaining: -4 * tok, retry: 500, now: f.now, debited: tok})
		r = take("k", l, 0, 0)
		r.Debt, r.MaxDebt = tok, 4*tok
		f.take(r, want{remaining: -4 * tok, now: f.now})
		// Refills repay the debt, fractions of a token included.
		f.advance(250)
		if got := f.tokens("k", l); got != -tok-tok/2 {
			f.t.Fatalf("250 ms after a debt of 4 tokens the bucket holds %d µ, want -1.5 tokens", got)
		}
		// A lease handed back repays it too, before the debt and the take of the same request.
		r = take("k", l, tok, tok)
		r.Credit = coordinator.Credit{Amount: 2 * tok, GrantedAt: f.now}
		f.take(r, want{remaining: tok / 2, retry: 50, now: f.now, credited: 2 * tok})
		f.advance(50)
		f.take(take("k", l, tok, tok), want{granted: tok, remaining: 0, now: f.now})
		// From the deepest debt a whole fill time repays it, and another fills the bucket.
		r = take("k", l, 0, 0)
		r.Debt, r.MaxDebt = 20*tok, 10*tok
		f.take(r, want{remaining: -10 * tok, now: f.now, debited: 10 * tok})
		f.advance(1000)
		f.take(take("k", l, tok, tok), want{remaining: 0, retry: 100, now: f.now})
		f.advance(1000)
		f.take(take("k", l, tok, tok), want{granted: tok, remaining: 9 * tok, now: f.now})
		// max_debt 0: a debt is charged while tokens are there, never below zero.
		r = take("k", l, 0, 0)
		r.Debt = 12 * tok
		f.take(r, want{remaining: 0, now: f.now, debited: 9 * tok})
		// A debt with a lease handed back and no take.
		f.advance(200)
		r = take("k", l, 0, 0)
		r.Debt, r.MaxDebt, r.Credit = 5*tok, 3*tok, coordinator.Credit{Amount: tok, GrantedAt: f.now}
		f.take(r, want{remaining: -2 * tok, now: f.now, credited: tok, debited: 5 * tok})
		for _, bad := range []coordinator.TakeRequest{
			{Key: "k", Limit: l, Debt: -1},
			{Key: "k", Limit: l, Want: tok, Min: tok, Debt: -1},
			{Key: "k", Limit: l, Debt: bucket.MaxExact/2 + 1},
			{Key: "k", Limit: l, Debt: tok, MaxDebt: 10*tok + 1},
			{Key: "k", Limit: l, Debt: tok, MaxDebt: -1},
		} {
			if got := f.takes(bad)[0]; !errors.Is(got.Err, coordinator.ErrInvalidRequest) {
				f.t.Fatalf("%s = %s, want ErrInvalidRequest", TakeString(bad), TakeResultString(got))
			}
		}
	}},
	{"Contention", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100) // 10 tokens a second: 10 refill over a lifetime of 1 s
		const ttl = 1000
		take := func(agent string, seq uint64, want, least, demand bucket.Micro) coordinator.TakeRequest {
			return coordinator.TakeRequest{Key: "k", Limit: l, Want: want, Min: least, Unit: tok, Demand: demand, TTL: ttl,
				Op: coordinator.OpID{Agent: agent, Seq: seq}}
		}
		// b takes 6 of 10, the bucket covers it and keeps a quarter: no contention.
		f.take(take("b", 1, 6*tok, tok, 6*tok), want{granted: 6 * tok, remaining: 4 * tok, now: f.now})
		// a wants 8 of 4: contended. a's demand is 18 of the key's 24 tokens/s (overloaded: more
		// than the 10 it refills over a lifetime and the 4 it holds): 750‰ of the 10 the bucket
		// refills over a lifetime plus the 4 it holds (at most the capacity, 10), counted as the
		// share cap's 500‰ as b took too: 5, cut to the 4 held; a waits until 750‰ of the refill
		// covers 4 tokens: 400 ms at the full rate, 534 at its share (more than its floor, the
		// others' 250‰ of a lifetime).
		r := take("a", 1, 8*tok, tok, 18*tok)
		f.take(r, want{granted: 4 * tok, remaining: 0, now: f.now, pace: 534})
		f.take(r, want{granted: 4 * tok, remaining: 0, now: f.now, pace: 534, replayed: true})
		// b, denied: its 250‰ share needs 400 ms for a token, but on an overloaded key it waits at
		// least the others' share of a lifetime, 750 ms (also the longest pace). b is thin (6
		// requests a lifetime, below lease.ThinRequests), and a denial paces a thin agent too.
		f.take(take("b", 2, 5*tok, tok, 6*tok), want{retry: 100, now: f.now, pace: 750})
		// A second later the bucket is full again and a asks for 3: not low, but the key's agents
		// compete and it is still overloaded (24 tokens over a lifetime against the 10 it refills
		// and the 10 it holds), so a stays under the rule: its lease is its share of what refilled
		// since it last took and what the bucket holds (the capacity, 10), its 750‰ counted as the
		// share cap's 500‰ as b took too: 5 tokens, whatever it asked for, paced 667 ms (500 ms of
		// refill at its 750‰).
		f.advance(1000)
		f.take(take("a", 2, 3*tok, tok, 18*tok), want{granted: 5 * tok, remaining: 5 * tok, now: f.now, pace: 667})
		// A key whose agents compete leaves the rule once the bucket holds more than their demand
		// over a lifetime, less its refill: b, 400 ms later, asks for 2 with a demand of 0.6
		// tokens/s (the key's is 18.6: 18.6 over a lifetime against 10 refilled and 9 held) and gets
		// them without a pace.
		f.advance(400)
		f.take(take("b", 3, 2*tok, tok, 600_000), want{granted: 2 * tok, remaining: 7 * tok, now: f.now})
		// Two lifetimes later a's demand is stale: b alone asks for 3 tokens/s, less than the
		// bucket refills: it is refilling, nothing is cut or paced.
		f.advance(2*ttl + 1)
		f.take(take("b", 4, 12*tok, tok, 3*tok), want{granted: 10 * tok, remaining: 0, now: f.now})
		// b alone over the rate: its share is the whole refill (10 tokens), paced until the refill
		// covers what it got (no others, no floor).
		f.advance(500)
		f.take(take("b", 5, 12*tok, tok, 30*tok), want{granted: 5 * tok, remaining: 0, now: f.now, pace: 500})
		// Asked 100 ms later, it gets the token that refilled, and is paced half a lifetime rather
		// than the 100 ms that token took: alone, it asks no more often than twice a lifetime.
		f.advance(100)
		f.take(take("b", 6, 12*tok, tok, 30*tok), want{granted: tok, remaining: 0, now: f.now, pace: 500})
		// Direct mode (no lifetime) and a take without demand are never paced.
		f.advance(1000)
		r = take("c", 1, 12*tok, tok, tok)
		r.TTL = 0
		f.take(r, want{granted: 10 * tok, remaining: 0, now: f.now})
		f.advance(1000)
		f.take(take("d", 1, 12*tok, tok, 0), want{granted: 10 * tok, remaining: 0, now: f.now})
	}},
	{"ContentionPerCheck", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100) // 10 tokens a second: 10 refill over a lifetime of 1 s
		const ttl = 1000
		take := func(agent string, seq uint64, want bucket.Micro) coordinator.TakeRequest {
			return coordinator.TakeRequest{Key: "k", Limit: l, Want: want, Min: tok, Unit: tok, Demand: 6 * tok, TTL: ttl,
				Op: coordinator.OpID{Agent: agent, Seq: seq}}
		}
		// b, 6 tokens a second alone, is not overloading the key: 8 of 10, uncontended.
		f.take(take("b", 1, 8*tok), want{granted: 8 * tok, remaining: 2 * tok, now: f.now})
		// a, 6 a second too: the key's 12 a lifetime overload it (10 refilled, 2 held). a's share,
		// half of the 10 it may share out, is cut to its demand over three quarters of a lifetime,
		// 4 tokens, and its 6 requests a lifetime would exceed that by less than √6: it takes per
		// check, its least, unpaced.
		f.take(take("a", 1, 3*tok), want{granted: tok, remaining: tok, now: f.now})
		f.take(take("a", 2, 3*tok), want{granted: tok, remaining: 0, now: f.now})
		// Denied, it is paced as any agent: its half of the refill covers a token in 200 ms, at
		// least the others' half of a lifetime, 500 ms.
		f.take(take("a", 3, 3*tok), want{retry: 100, now: f.now, pace: 500})
	}},
	{"ContentionOthersUnmeasured", func(f *fixture) {
		// A day's budget: 100 tokens, one a day, leases of 30 s (lease.MaxTTL).
		l := limit(f.t, 100*tok, tok, 86_400_000)
		const ttl = 30_000
		take := func(agent string, want, demand bucket.Micro) coordinator.TakeRequest {
			return coordinator.TakeRequest{Key: "day", Limit: l, Want: want, Min: tok, Unit: tok, Demand: demand, TTL: ttl,
				Op: coordinator.OpID{Agent: agent, Seq: 1}}
		}
		// b takes 2 before its first demand sample closed (demand 0): nothing to compare, no rule.
		f.take(take("b", 2*tok, 0), want{granted: 2 * tok, remaining: 98 * tok, now: f.now})
		// a's first sample read as 19 tokens/s: it asks for the capacity, the bucket would be left
		// low and a day's refill is far below that demand (contended). Its share reads as the
		// whole key, but b took too: half of what the bucket holds and refilled over a lifetime
		// (49 whole tokens), paced for the longest pace (a lifetime's refill covers less than a
		// token).
		r := take("a", 100*tok, 19*tok)
		f.take(r, want{granted: 49 * tok, remaining: 49 * tok, now: f.now, pace: 22_500})
		// b's next check finds the other half.
		r = take("b", tok, 0)
		r.Op.Seq = 2
		f.take(r, want{granted: tok, remaining: 48 * tok, now: f.now})
	}},
	{"Ample", func(f *fixture) {
		l := limit(f.t, 20*tok, tok, 100) // 10 tokens a second: full in 2 s
		take := func(key, agent string, seq uint64, want, ample, demand bucket.Micro, ttl bucket.Millis) coordinator.TakeRequest {
			return coordinator.TakeRequest{Key: key, Limit: l, Want: want, AmpleWant: ample, Min: tok, Unit: tok, Demand: demand,
				TTL: ttl, Op: coordinator.OpID{Agent: agent, Seq: seq}}
		}
		// A full bucket keeps three quarters of its capacity after 5 tokens: the ample want.
		f.take(take("k", "a", 1, 3*tok, 5*tok, 8*tok, 500), want{granted: 5 * tok, remaining: 15 * tok, now: f.now})
		// 15 left: another 5 would leave 10, below three quarters: the want.
		f.take(take("k", "b", 1, 3*tok, 5*tok, 8*tok, 500), want{granted: 3 * tok, remaining: 12 * tok, now: f.now})
		// An ample want equal to the want changes nothing.
		f.take(take("k", "b", 2, 2*tok, 2*tok, 8*tok, 500), want{granted: 2 * tok, remaining: 10 * tok, now: f.now})
		// The contention rule still cuts an ample want. a's demand of 40 tokens/s overloads c (80
		// tokens over a lifetime of 2 s against 20 refilled): its take is contended (alone on the
		// key, its share is the whole pool), and the key's agents compete for two lifetimes.
		f.take(take("c", "a", 1, 20*tok, 20*tok, 40*tok, 2000), want{granted: 20 * tok, remaining: 0, now: f.now, pace: 1500})
		// 2 s later c is full again, but its agents still compete: b's ample want of 5 tokens leaves
		// 15, yet b gets its share (8 of 48 tokens/s: 166‰ of 20 tokens, 3 whole ones), paced for
		// the longest pace (its share of the refill covers 3 tokens in 1.8 s).
		f.advance(2000)
		f.take(take("c", "b", 1, tok, 5*tok, 8*tok, 2000), want{granted: 3 * tok, remaining: 17 * tok, now: f.now, pace: 1500})
		// d asks for a token a second (2 requests a lifetime) and its share is 20‰ of 20 tokens:
		// its demand exceeds its share by more than √2, so it keeps a lease (its least) and is paced.
		f.take(take("c", "d", 1, tok, 3*tok, tok, 2000), want{granted: tok, remaining: 16 * tok, now: f.now, pace: 1500})
		for _, bad := range []coordinator.TakeRequest{
			{Key: "k", Limit: l, Want: 2 * tok, Min: tok, AmpleWant: tok, TTL: 500},             // below want
			{Key: "k", Limit: l, Want: 2 * tok, Min: tok, AmpleWant: 3 * tok},                   // no lifetime
			{Key: "k", Limit: l, Want: 2 * tok, Min: tok, AmpleWant: bucket.MaxExact, TTL: 500}, // above 2^52
			{Key: "k", Limit: l, Debt: tok, AmpleWant: tok, TTL: 500},                           // takes nothing
		} {
			if got := f.takes(bad)[0]; !errors.Is(got.Err, coordinator.ErrInvalidRequest) {
				f.t.Fatalf("%s = %s, want ErrInvalidRequest", TakeString(bad), TakeResultString(got))
			}
		}
	}},
	{"ReturnDecayAndCap", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		g := f.take(take("k", l, 4*tok, 4*tok), want{granted: 4 * tok, remaining: 6 * tok, now: f.now})
		f.advance(100) // refills 1 token: a returned token decays by the same
		f.ret(ret("k", l, 3*tok, g.Now), want{granted: 2 * tok, remaining: 9 * tok, now: f.now})
		// The credit is capped at what the bucket can hold.
		f.ret(ret("k", l, 5*tok, f.now), want{granted: tok, remaining: 10 * tok, now: f.now})
		// Decay rounds up: 1 ms at 10,000 µ/ms.
		f.take(take("k", l, 10*tok, 10*tok), want{granted: 10 * tok, now: f.now})
		grant := f.now
		f.advance(1)
		f.ret(ret("k", l, 5*tok, grant), want{granted: 5*tok - 10_000, remaining: 5 * tok, now: f.now})
		// A lease older than the fill time returns nothing; an amount below its decay neither.
		f.advance(1000)
		f.take(take("k", l, 10*tok, 10*tok), want{granted: 10 * tok, now: f.now})
		f.advance(1000)
		f.ret(ret("k", l, 10*tok, f.now-1000), want{remaining: 10 * tok, now: f.now})
		f.take(take("k", l, 10*tok, 10*tok), want{granted: 10 * tok, now: f.now})
		f.advance(10)
		f.ret(ret("k", l, 50_000, f.now-10), want{granted: 0, remaining: 100_000, now: f.now})
		// A bucket that never refills takes back everything unspent.
		once := limit(f.t, 3*tok, 0, 0)
		g = f.take(take("once", once, 3*tok, tok), want{granted: 3 * tok, now: f.now})
		f.advance(year)
		f.ret(ret("once", once, 2*tok, g.Now), want{granted: 2 * tok, remaining: 2 * tok, now: f.now})
	}},
	{"ClockBackwardsCreditsNothing", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		f.take(take("k", l, 10*tok, 10*tok), want{granted: 10 * tok, now: f.now})
		last := f.now
		f.advance(-5 * second)
		// No refill, and the key clock stays where it was.
		f.take(take("k", l, tok, tok), want{retry: 100, now: last})
		f.ret(ret("k", l, 0, last), want{now: last})
		// Back at last + 100 ms: exactly 100 ms are credited, once.
		f.now = last + 100
		f.take(take("k", l, 2*tok, tok), want{granted: tok, now: last + 100})
		// A Return of a lease granted "in the future" (the clock went back) decays nothing.
		f.ret(ret("k", l, tok, last+5000), want{granted: tok, remaining: tok, now: last + 100})
	}},
	{"IdleForYearsRefillsToCapacity", func(f *fixture) {
		for _, l := range []bucket.Limit{
			limit(f.t, 1_000_000_000*tok, 1_000_000_000*tok, day), // 10^9 tokens a day
			limit(f.t, tok, 1, 1),                  // one token, 1 µ per ms
			limit(f.t, 7*tok, 5, 432),              // a rate that does not divide
			limit(f.t, 1<<51+12345, 1<<40+1, 4095), // num*den and 2*capacity near 2^52
		} {
			key := l.String()
			f.take(take(key, l, l.Capacity(), 1), want{granted: l.Capacity(), now: f.now})
			f.advance(1000 * year)
			if got := f.tokens(key, l); got != l.Capacity() {
				f.t.Fatalf("%v: after 1000 years idle: %d µ, want exactly the capacity %d µ", l, got, l.Capacity())
			}
			f.advance(-1000 * year)
		}
	}},
	{"SlowRateKeepsFraction", func(f *fixture) {
		l := limit(f.t, tok, tok, day) // reduces to 5 µ per 432 ms
		f.take(take("k", l, tok, tok), want{granted: tok, now: f.now})
		f.advance(431)
		// 431*5/432 = 4 µ and 427/432 of one: the fifth µ needs ceil((432-427)/5) = 1 ms more.
		f.take(take("k", l, 5, 5), want{remaining: 4, retry: 1, now: f.now})
		// 86 ms later the fraction carried over completes it: 86*5 + 427 = 857 = 1 µ + 425/432.
		f.advance(86)
		f.take(take("k", l, 5, 5), want{granted: 5, now: f.now})
		// Idle for the fill time: exactly full.
		f.advance(day)
		f.take(take("k", l, tok, tok), want{granted: tok, now: f.now})
		// 99 refills of 864,001 ms each add exactly what one refill of the whole time would:
		// floor(99*864,001*5/432) = 990,001 µ. Refills lose nothing however often they happen.
		for range 99 {
			f.advance(864_001)
			f.tokens("k", l)
		}
		if got := f.tokens("k", l); got != 990_001 {
			f.t.Fatalf("after 99 refills of 864,001 ms: %d µ, want 990,001", got)
		}
	}},
	{"TakeReplayAndStale", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		r := take("k", l, 4*tok, tok)
		r.Op = coordinator.OpID{Agent: "agent-a", Seq: 7}
		first := want{granted: 4 * tok, remaining: 6 * tok, now: f.now}
		f.take(r, first)
		f.advance(50)
		// A retry is answered from the record: nothing charged, the original answer.
		first.replayed = true
		f.take(r, first)
		f.take(r, first)
		if got := f.tokens("k", l); got != 6*tok+tok/2 {
			f.t.Fatalf("after replays: %d µ, want %d", got, 6*tok+tok/2)
		}
		// A new sequence number is a new operation; the old one is then stale.
		r.Op.Seq = 8
		f.take(r, want{granted: 4 * tok, remaining: 2*tok + tok/2, now: f.now})
		f.advance(100)
		r.Op.Seq = 7
		f.take(r, want{remaining: 2*tok + tok/2, now: f.now - 100, stale: true}) // stored state, no refill
		// Another agent's numbering is its own; a denial is replayed with its retry_after.
		b := take("k", l, 5*tok, 5*tok)
		b.Op = coordinator.OpID{Agent: "agent-b", Seq: 1}
		f.take(b, want{remaining: 3*tok + tok/2, retry: 150, now: f.now})
		f.advance(200)
		f.take(b, want{remaining: 3*tok + tok/2, retry: 150, now: f.now - 200, replayed: true})
		// Takes without an OpID are never replayed.
		p := take("k", l, tok, tok)
		f.take(p, want{granted: tok, remaining: 4*tok + tok/2, now: f.now})
		f.take(p, want{granted: tok, remaining: 3*tok + tok/2, now: f.now})
	}},
	{"ReturnReplayAndStale", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		g := f.take(take("k", l, 8*tok, 8*tok), want{granted: 8 * tok, remaining: 2 * tok, now: f.now})
		r := ret("k", l, 3*tok, g.Now)
		r.Op = coordinator.OpID{Agent: "agent-a", Seq: 3}
		f.ret(r, want{granted: 3 * tok, remaining: 5 * tok, now: f.now})
		f.advance(10)
		f.ret(r, want{granted: 3 * tok, remaining: 5 * tok, now: f.now - 10, replayed: true})
		if got := f.tokens("k", l); got != 5*tok+tok/10 {
			f.t.Fatalf("after a replayed Return: %d µ, want %d", got, 5*tok+tok/10)
		}
		r.Op.Seq = 2
		f.ret(r, want{remaining: 5*tok + tok/10, now: f.now, stale: true})
		// Take and Return records are separate: a Take with seq 1 is new.
		tk := take("k", l, tok, tok)
		tk.Op = coordinator.OpID{Agent: "agent-a", Seq: 1}
		f.take(tk, want{granted: tok, remaining: 4*tok + tok/10, now: f.now})
		r.Op.Seq = 4
		r.Amount = 0
		f.ret(r, want{remaining: 4*tok + tok/10, now: f.now})
	}},
	{"RecordSweepBound", func(f *fixture) {
		// Buckets that never refill and are not full never expire: only the sweep removes records.
		l := limit(f.t, 1000*tok, 0, 0)
		op := func(key, agent string) coordinator.TakeRequest {
			r := take(key, l, 1, 1)
			r.Op = coordinator.OpID{Agent: agent, Seq: 1}
			return r
		}
		old := func(key string, n int) {
			reqs := make([]coordinator.TakeRequest, n)
			for i := range reqs {
				reqs[i] = op(key, "old-"+strconv.Itoa(i))
			}
			f.takes(reqs...)
		}
		const full = 1000 * tok
		// "under": MaxRecords-1 old records and one new are not more than MaxRecords: no sweep.
		// "over": MaxRecords old and one new are: the records older than RecordKeep go.
		// "edge": the same, but the old records are exactly RecordKeep old, and stay.
		old("under", coordinator.MaxRecords-1)
		old("over", coordinator.MaxRecords)
		f.advance(coordinator.RecordKeep)
		old("edge", coordinator.MaxRecords)
		f.advance(1)
		newAt := f.now
		f.takes(op("under", "new"), op("over", "new"))
		f.advance(coordinator.RecordKeep - 1)
		f.takes(op("edge", "new"))

		f.take(op("under", "old-0"), want{granted: 1, remaining: full - 1, now: start, replayed: true})
		f.take(op("edge", "old-0"), want{granted: 1, remaining: full - 1, now: newAt - 1, replayed: true})
		// Swept: the old operation is new again and charges.
		f.take(op("over", "old-0"), want{granted: 1, remaining: full - coordinator.MaxRecords - 2, now: f.now})
		// The record within RecordKeep survived the sweep.
		f.take(op("over", "new"), want{granted: 1, remaining: full - coordinator.MaxRecords - 1, now: newAt,
			replayed: true})
	}},
	{"RecordSweepOnAdd", func(f *fixture) {
		// Records are swept when one is added, never when an agent rewrites its own: a key that
		// holds more than MaxRecords old records keeps them through old-0's next take, and the
		// first record added after it sweeps them.
		l := limit(f.t, 1000*tok, 0, 0)
		op := func(agent string, seq uint64) coordinator.TakeRequest {
			r := take("k", l, 1, 1)
			r.Op = coordinator.OpID{Agent: agent, Seq: seq}
			return r
		}
		const full = 1000 * tok
		reqs := make([]coordinator.TakeRequest, coordinator.MaxRecords+1)
		for i := range reqs {
			reqs[i] = op("old-"+strconv.Itoa(i), 1)
		}
		f.takes(reqs...)
		f.advance(coordinator.RecordKeep + 1)
		n := bucket.Micro(len(reqs))
		f.take(op("old-0", 2), want{granted: 1, remaining: full - n - 1, now: f.now})
		f.take(op("old-1", 1), want{granted: 1, remaining: full - 2, now: start, replayed: true})
		f.take(op("new", 1), want{granted: 1, remaining: full - n - 2, now: f.now})
		// Swept: old-1's take is new again and charges; old-0's rewritten record stays.
		f.take(op("old-1", 1), want{granted: 1, remaining: full - n - 3, now: f.now})
		f.take(op("old-0", 2), want{granted: 1, remaining: full - n - 1, now: f.now, replayed: true})
	}},
	{"LogicalExpiry", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		r := take("k", l, tok, tok)
		r.Op = coordinator.OpID{Agent: "agent-a", Seq: 1}
		f.take(r, want{granted: tok, remaining: 9 * tok, now: f.now})
		// The key expires when full (100 ms) plus ExpiryMargin; until then records answer.
		expiry := f.now + 100 + coordinator.ExpiryMargin
		f.now = expiry - 1
		f.take(r, want{granted: tok, remaining: 9 * tok, now: start, replayed: true})
		// At expiry the key is a full bucket without records: the same operation is new.
		f.now = expiry
		f.take(r, want{granted: tok, remaining: 9 * tok, now: expiry})

		// A full bucket that never refills expires after the margin.
		once := limit(f.t, 3*tok, 0, 0)
		d := take("once", once, 4*tok, 4*tok)
		d.Op = coordinator.OpID{Agent: "agent-a", Seq: 1}
		f.take(d, want{remaining: 3 * tok, retry: bucket.Never, now: f.now})
		f.advance(coordinator.ExpiryMargin - 1)
		f.take(d, want{remaining: 3 * tok, retry: bucket.Never, now: f.now - coordinator.ExpiryMargin + 1, replayed: true})
		f.advance(1)
		f.take(d, want{remaining: 3 * tok, retry: bucket.Never, now: f.now})
		// Once not full it never expires: a century later its records still answer.
		d.Min, d.Want, d.Op.Seq = tok, tok, 2
		f.take(d, want{granted: tok, remaining: 2 * tok, now: f.now})
		granted := f.now
		f.advance(100 * year)
		f.take(d, want{granted: tok, remaining: 2 * tok, now: granted, replayed: true})
	}},
	{"InvalidRequestsFailAlone", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		takes := []coordinator.TakeRequest{
			take("k", l, tok, tok),
			take("k", l, tok, 0),            // min < 1
			take("", l, tok, tok),           // no key
			take("k", bucket.Limit{}, 1, 1), // no limit
			take("k", l, tok, 2*tok),        // want < min
			{Key: "k", Limit: l, Want: 1, Min: 1, Share: 1001},
			{Key: "k", Limit: l, Want: 1, Min: 1, Op: coordinator.OpID{Agent: "a", Seq: 0}},
			take("k", l, 2*tok, tok),
		}
		res := f.takes(takes...)
		for i, r := range res {
			valid := i == 0 || i == len(res)-1
			if valid && r.Err != nil || !valid && !errors.Is(r.Err, coordinator.ErrInvalidRequest) {
				f.t.Errorf("item %d: %s = %s, want valid=%v", i, TakeString(takes[i]), TakeResultString(r), valid)
			}
		}
		if res[len(res)-1].Remaining != 7*tok {
			f.t.Errorf("valid items around invalid ones: remaining %d, want %d", res[len(res)-1].Remaining, 7*tok)
		}
		rets := []coordinator.ReturnRequest{
			ret("k", l, -1, f.now),
			ret("k", l, tok, -1),
			ret("k", l, tok, f.now),
		}
		rres := f.returns(rets...)
		for i, r := range rres {
			valid := i == 2
			if valid && r.Err != nil || !valid && !errors.Is(r.Err, coordinator.ErrInvalidRequest) {
				f.t.Errorf("item %d: %s = %s, want valid=%v", i, ReturnString(rets[i]), ReturnResultString(r), valid)
			}
		}
	}},
	{"BatchIsInOrder", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		m := limit(f.t, 5*tok, tok, 100)
		res := f.takes(take("k", l, 4*tok, tok), take("j", m, 4*tok, tok), take("k", l, 4*tok, tok), take("k", l, 4*tok, tok))
		got := []bucket.Micro{res[0].Granted, res[1].Granted, res[2].Granted, res[3].Granted}
		if fmt.Sprint(got) != fmt.Sprint([]bucket.Micro{4 * tok, 4 * tok, 4 * tok, 2 * tok}) {
			f.t.Fatalf("granted %v, want [4 4 4 2] tokens in batch order", got)
		}
	}},
	{"CancelledContext", func(f *fixture) {
		l := limit(f.t, 10*tok, tok, 100)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := f.store.Take(ctx, []coordinator.TakeRequest{take("k", l, tok, tok)}); !errors.Is(err, context.Canceled) {
			f.t.Fatalf("Take with a cancelled context: %v, want context.Canceled", err)
		}
		if _, err := f.store.Return(ctx, []coordinator.ReturnRequest{ret("k", l, tok, f.now)}); !errors.Is(err, context.Canceled) {
			f.t.Fatalf("Return with a cancelled context: %v, want context.Canceled", err)
		}
		if got := f.tokens("k", l); got != 10*tok {
			f.t.Fatalf("after cancelled batches: %d µ, want a full bucket", got)
		}
	}},
}

func take(key string, l bucket.Limit, want, least bucket.Micro) coordinator.TakeRequest {
	return coordinator.TakeRequest{Key: key, Limit: l, Want: want, Min: least}
}

func ret(key string, l bucket.Limit, amount bucket.Micro, grantedAt bucket.Millis) coordinator.ReturnRequest {
	return coordinator.ReturnRequest{Key: key, Limit: l, Amount: amount, GrantedAt: grantedAt}
}
