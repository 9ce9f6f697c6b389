package storetest

import (
	"errors"
	"strconv"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

// multi is an exact take of want from key and every bucket of also, all or nothing.
func multi(key string, l bucket.Limit, want bucket.Micro, also ...coordinator.Bucket) coordinator.TakeRequest {
	return coordinator.TakeRequest{Key: key, Limit: l, Want: want, Min: want, Also: also}
}

// giveBack hands amount, the unspent grant at grantedAt of a take of key and every bucket of also,
// back to each of them.
func giveBack(key string, l bucket.Limit, amount bucket.Micro, grantedAt bucket.Millis, also ...coordinator.Bucket) coordinator.ReturnRequest {
	return coordinator.ReturnRequest{Key: key, Limit: l, Amount: amount, GrantedAt: grantedAt, Also: also}
}

// takeAll runs one take of several buckets and checks its result and the bucket that refused.
func (f *fixture) takeAll(r coordinator.TakeRequest, w want, refused int) coordinator.TakeResult {
	f.t.Helper()
	got := f.take(r, w)
	if got.Granted == 0 && !got.Stale && got.Refused != refused {
		f.t.Fatalf("at %d: %s refused by bucket %d, want %d", f.now, TakeString(r), got.Refused, refused)
	}
	return got
}

// lv is a bucket's expected level.
type lv struct {
	key string
	l   bucket.Limit
	w   bucket.Micro
}

// levels checks the tokens of each bucket after a refill to now.
func (f *fixture) levels(want ...lv) {
	f.t.Helper()
	for _, w := range want {
		if got := f.tokens(w.key, w.l); got != w.w {
			f.t.Fatalf("at %d: %q holds %d µ, want %d", f.now, w.key, got, w.w)
		}
	}
}

var multiCases = []testCase{
	{"MultiAllOrNothing", func(f *fixture) {
		a := limit(f.t, 10*tok, tok, 100) // 10 tokens, 1 per 100 ms
		b := limit(f.t, 3*tok, tok, 1000) // 3 tokens, 1 per second
		r := multi("a", a, 2*tok, coordinator.Bucket{Key: "b", Limit: b})
		// Granted from both; remaining is the least either holds.
		f.takeAll(r, want{granted: 2 * tok, remaining: tok, now: f.now}, 0)
		// b holds 1 token: nothing is taken from a either; b's refill names the wait.
		f.takeAll(r, want{remaining: tok, retry: 1000, now: f.now}, 1)
		f.levels(lv{"a", a, 8 * tok}, lv{"b", b, tok})
		f.advance(1000)
		f.takeAll(r, want{granted: 2 * tok, remaining: 0, now: f.now}, 0)
		f.levels(lv{"a", a, 8 * tok}, lv{"b", b, 0})
		// A missing key is a full bucket; the order of the keys does not matter.
		r = multi("c", b, 3*tok, coordinator.Bucket{Key: "a", Limit: a})
		f.takeAll(r, want{granted: 3 * tok, remaining: 0, now: f.now}, 0)
		f.levels(lv{"a", a, 5 * tok}, lv{"c", b, 0})
	}},
	{"MultiLongestRetry", func(f *fixture) {
		a := limit(f.t, 10*tok, tok, 100)
		b := limit(f.t, 10*tok, tok, 1000)
		c := limit(f.t, 10*tok, tok, 10)
		r := multi("a", a, 10*tok, coordinator.Bucket{Key: "b", Limit: b}, coordinator.Bucket{Key: "c", Limit: c})
		f.takeAll(r, want{granted: 10 * tok, remaining: 0, now: f.now}, 0)
		// Each refills at its own rate: after 50 ms a holds 0.5, b 0.05, c 5 tokens; b waits longest.
		f.advance(50)
		r.Want, r.Min = 5*tok, 5*tok
		f.takeAll(r, want{remaining: 50_000, retry: 4950, now: f.now}, 1)
		f.levels(lv{"a", a, tok / 2}, lv{"b", b, 50_000}, lv{"c", c, 5 * tok})
		// A bucket that can never cover the take is the longest wait of all.
		once := limit(f.t, 4*tok, 0, 0)
		r = multi("a", a, 5*tok, coordinator.Bucket{Key: "b", Limit: b}, coordinator.Bucket{Key: "once", Limit: once})
		f.takeAll(r, want{remaining: 50_000, retry: bucket.Never, now: f.now}, 2)
		f.levels(lv{"a", a, tok / 2}, lv{"b", b, 50_000}, lv{"once", once, 4 * tok})
	}},
	{"MultiIdempotent", func(f *fixture) {
		a := limit(f.t, 10*tok, tok, 100)
		b := limit(f.t, 3*tok, tok, 1000)
		r := multi("a", a, 2*tok, coordinator.Bucket{Key: "b", Limit: b})
		r.Op = coordinator.OpID{Agent: "ag", Seq: 5}
		f.takeAll(r, want{granted: 2 * tok, remaining: tok, now: f.now}, 0)
		// A retry is answered from the record in the first key: nothing is charged again.
		f.advance(10)
		f.takeAll(r, want{granted: 2 * tok, remaining: tok, now: f.now - 10, replayed: true}, 0)
		f.levels(lv{"a", a, 8*tok + tok/10}, lv{"b", b, tok + tok/100})
		// A denial is recorded too, with the bucket that refused.
		r.Op.Seq = 6
		f.takeAll(r, want{remaining: tok + tok/100, retry: 990, now: f.now}, 1)
		f.advance(1000)
		f.takeAll(r, want{remaining: tok + tok/100, retry: 990, now: f.now - 1000, replayed: true}, 1)
		// An older seq is stale and does nothing.
		r.Op.Seq = 4
		f.take(r, want{remaining: 8*tok + tok/10, now: f.now - 1000, stale: true}) // the first bucket as stored
		f.levels(lv{"a", a, 10 * tok}, lv{"b", b, 2*tok + tok/100})
		// The record of a take of several buckets is its own: the agent's lease takes of the same
		// keys, with later seqs, are not stale, and do not answer it.
		lt := take("b", b, tok, tok)
		lt.Op = coordinator.OpID{Agent: "ag", Seq: 7}
		f.take(lt, want{granted: tok, remaining: tok + tok/100, now: f.now})
		r.Op.Seq = 8
		f.takeAll(r, want{remaining: tok + tok/100, retry: 990, now: f.now}, 1)
	}},
	{"MultiInvalid", func(f *fixture) {
		a := limit(f.t, 10*tok, tok, 100)
		ok := coordinator.Bucket{Key: "b", Limit: a}
		for _, r := range []coordinator.TakeRequest{
			{Key: "a", Limit: a, Also: []coordinator.Bucket{ok}},
			{Key: "a", Limit: a, Want: tok, Min: tok, Share: 500, Also: []coordinator.Bucket{ok}},
			{Key: "a", Limit: a, Want: tok, Min: tok, Credit: coordinator.Credit{Amount: tok}, Also: []coordinator.Bucket{ok}},
			{Key: "a", Limit: a, Want: tok, Min: tok, TTL: 1000, Also: []coordinator.Bucket{ok}},
			{Key: "a", Limit: a, Want: tok, Min: tok, Debt: tok, MaxDebt: tok, Also: []coordinator.Bucket{ok}},
			{Key: "a", Limit: a, Want: tok, Min: tok, Also: []coordinator.Bucket{{Key: "a", Limit: a}}},
			{Key: "a", Limit: a, Want: tok, Min: tok, Also: []coordinator.Bucket{ok, ok}},
			{Key: "a", Limit: a, Want: tok, Min: tok, Also: []coordinator.Bucket{{Key: "", Limit: a}}},
			{Key: "a", Limit: a, Want: tok, Min: tok, Also: []coordinator.Bucket{{Key: "c"}}},
			{Key: "a", Limit: a, Want: tok, Min: tok, Also: make([]coordinator.Bucket, coordinator.MaxAlso+1)},
		} {
			if got := f.takes(r)[0]; !errors.Is(got.Err, coordinator.ErrInvalidRequest) {
				f.t.Errorf("%s: %s, want ErrInvalidRequest", TakeString(r), TakeResultString(got))
			}
		}
		f.levels(lv{"a", a, 10 * tok}, lv{"b", a, 10 * tok})
	}},
	{"MultiPartial", func(f *fixture) {
		// Up to want, at least min, in whole units when cut: decided on the least any bucket
		// holds, debited from each.
		a := limit(f.t, 10*tok, tok, 1000)
		b := limit(f.t, 5*tok, tok, 1000)
		r := coordinator.TakeRequest{Key: "a", Limit: a, Want: 4 * tok, Min: 2 * tok, Unit: 2 * tok, Also: []coordinator.Bucket{{Key: "b", Limit: b}}}
		f.takeAll(r, want{granted: 4 * tok, remaining: tok, now: f.now}, 0)
		// b holds 1: below min, refused by b; min's wait, not want's.
		f.takeAll(r, want{remaining: tok, retry: 1000, now: f.now}, 1)
		f.advance(2500) // b holds 3.5: cut to one unit of 2
		f.takeAll(r, want{granted: 2 * tok, remaining: tok + tok/2, now: f.now}, 0)
		f.levels(lv{"a", a, 6*tok + tok/2}, lv{"b", b, tok + tok/2})
	}},
	{"MultiBatch", func(f *fixture) {
		// Takes of several buckets ride in a batch with single takes; each is atomic on its own.
		a := limit(f.t, 4*tok, tok, 1000)
		res := f.takes(
			take("a", a, 3*tok, 3*tok),
			multi("x", a, 2*tok, coordinator.Bucket{Key: "a", Limit: a}),
			multi("y", a, tok, coordinator.Bucket{Key: "a", Limit: a}),
		)
		if res[0].Granted != 3*tok || res[1].Granted != 0 || res[1].Refused != 1 || res[2].Granted != tok {
			f.t.Fatalf("batch: %s, %s, %s", TakeResultString(res[0]), TakeResultString(res[1]), TakeResultString(res[2]))
		}
		f.levels(lv{"a", a, 0}, lv{"x", a, 4 * tok}, lv{"y", a, 3 * tok})
	}},
	{"ReturnAllCreditsEach", func(f *fixture) {
		// Each bucket is credited what a return to it alone would credit: its own decay and cap.
		a := limit(f.t, 10*tok, tok, 100)  // 1 token per 100 ms
		b := limit(f.t, 10*tok, tok, 1000) // 1 token per second
		c := limit(f.t, 4*tok, tok, 10)    // 1 token per 10 ms: full 40 ms after it empties
		also := []coordinator.Bucket{{Key: "b", Limit: b}, {Key: "c", Limit: c}}
		g := f.takeAll(multi("a", a, 4*tok, also...), want{granted: 4 * tok, remaining: 0, now: f.now}, 0)
		// 30 ms later a holds 6.3 tokens, b 6.03, c 3: the 4 tokens handed back decay by as much in
		// each, 3.7, 3.97 and 1 are credited, and every bucket is full again. Granted is their sum,
		// Remaining the least any bucket holds (c's 4).
		f.advance(30)
		f.ret(giveBack("a", a, 4*tok, g.Now, also...), want{granted: 3_700_000 + 3_970_000 + tok, remaining: 4 * tok, now: f.now})
		f.levels(lv{"a", a, 10 * tok}, lv{"b", b, 10 * tok}, lv{"c", c, 4 * tok})
		// Another lease holds 3 of b's tokens. A take of a token from each leaves a 9, b 6, c 3;
		// 5 ms later (a 9.05, b 6.005, c 3.5) 3 tokens handed back decay by 0.05, 0.005 and 0.5:
		// b takes its 2.995, a and c only the room they have, 0.95 and 0.5.
		f.take(take("b", b, 3*tok, 3*tok), want{granted: 3 * tok, remaining: 7 * tok, now: f.now})
		g = f.takeAll(multi("a", a, tok, also...), want{granted: tok, remaining: 3 * tok, now: f.now}, 0)
		f.advance(5)
		f.ret(giveBack("a", a, 3*tok, g.Now, also...), want{granted: 950_000 + 2_995_000 + 500_000, remaining: 4 * tok, now: f.now})
		f.levels(lv{"a", a, 10 * tok}, lv{"b", b, 9 * tok}, lv{"c", c, 4 * tok})
		// 100 ms later c is full again (the lease is older than its fill time), and so is a bucket
		// the take never touched (a missing key): they credit nothing, a and b their decayed share.
		g = f.takeAll(multi("a", a, 2*tok, also...), want{granted: 2 * tok, remaining: 2 * tok, now: f.now}, 0)
		f.advance(100) // a 8 + 1 = 9, b 7 + 0.1 = 7.1, c full again
		d := coordinator.Bucket{Key: "d", Limit: c}
		f.ret(giveBack("a", a, 2*tok, g.Now, also[0], also[1], d), want{granted: tok + 1_900_000, remaining: 4 * tok, now: f.now})
		f.levels(lv{"a", a, 10 * tok}, lv{"b", b, 9 * tok}, lv{"c", c, 4 * tok}, lv{"d", c, 4 * tok})
	}},
	{"ReturnAllIdempotent", func(f *fixture) {
		a := limit(f.t, 10*tok, tok, 100)
		b := limit(f.t, 10*tok, tok, 1000)
		also := coordinator.Bucket{Key: "b", Limit: b}
		tk := multi("a", a, 4*tok, also)
		tk.Op = coordinator.OpID{Agent: "ag", Seq: 5}
		g := f.takeAll(tk, want{granted: 4 * tok, remaining: 6 * tok, now: f.now}, 0)
		// The take's record (m:) is not a return's: a return with a lower seq is new. 10 ms later
		// a holds 6.1 and b 6.01; 3 tokens credited less their decay, 2.9 and 2.99.
		f.advance(10)
		r := giveBack("a", a, 3*tok, g.Now, also)
		r.Op = coordinator.OpID{Agent: "ag", Seq: 3}
		first := want{granted: 2_900_000 + 2_990_000, remaining: 9 * tok, now: f.now}
		f.ret(r, first)
		// A retry is answered from the record in a: nothing is credited again.
		f.advance(10)
		first.replayed = true
		f.ret(r, first)
		// An older seq than the agent's last return on a is stale: a as stored, no bucket changes.
		r.Op.Seq = 2
		f.ret(r, want{remaining: 9 * tok, now: f.now - 10, stale: true})
		f.levels(lv{"a", a, 9*tok + tok/10}, lv{"b", b, 9*tok + tok/100})
		// The record is the agent's ordinary return record on a, and on a only: a return to a
		// alone with the same seq is its repeat, one with an older seq is stale; a return to b
		// alone with an older seq is new.
		one := ret("a", a, tok, f.now)
		one.Op = coordinator.OpID{Agent: "ag", Seq: 3}
		f.ret(one, first)
		one.Op.Seq = 1
		f.ret(one, want{remaining: 9*tok + tok/10, now: f.now, stale: true}) // a as the probe stored it
		lb := ret("b", b, tok/2, f.now)
		lb.Op = coordinator.OpID{Agent: "ag", Seq: 1}
		f.ret(lb, want{granted: tok / 2, remaining: 9*tok + tok/100 + tok/2, now: f.now})
		// A later return to a alone makes the return to both stale, though b never saw it.
		one.Op.Seq = 7
		f.ret(one, want{granted: 9 * tok / 10, remaining: 10 * tok, now: f.now})
		r.Op.Seq = 6
		f.ret(r, want{remaining: 10 * tok, now: f.now, stale: true})
		f.levels(lv{"a", a, 10 * tok}, lv{"b", b, 9*tok + tok/100 + tok/2})
		// Without an OpID a return to both is never replayed.
		p := giveBack("a", a, tok, f.now, also)
		f.ret(p, want{granted: tok/2 - tok/100, remaining: 10 * tok, now: f.now}) // a full, b 0.49 short of it
	}},
	{"ReturnAllInvalid", func(f *fixture) {
		a := limit(f.t, 10*tok, tok, 100)
		q := limit(f.t, 10*tok, 0, 0) // a calendar quota: it never refills
		ok := coordinator.Bucket{Key: "b", Limit: a}
		f.takeAll(multi("a", a, 2*tok, ok), want{granted: 2 * tok, remaining: 8 * tok, now: f.now}, 0)
		many := make([]coordinator.Bucket, coordinator.MaxAlso+1)
		for i := range many {
			many[i] = coordinator.Bucket{Key: "m" + strconv.Itoa(i), Limit: a}
		}
		window := window(f.now, 1000, day)
		rets := []coordinator.ReturnRequest{
			giveBack("a", a, tok, f.now, ok),
			{Key: "q", Limit: q, Amount: tok, GrantedAt: f.now, Period: window, Also: []coordinator.Bucket{{Key: "r", Limit: q}}},
			giveBack("a", a, tok, f.now, coordinator.Bucket{Key: "a", Limit: a}),
			giveBack("a", a, tok, f.now, ok, ok),
			giveBack("a", a, tok, f.now, coordinator.Bucket{Key: "", Limit: a}),
			giveBack("a", a, tok, f.now, coordinator.Bucket{Key: "c"}),
			giveBack("a", a, tok, f.now, many...),
			giveBack("a", a, -1, f.now, ok),
			giveBack("a", a, tok, f.now, ok),
		}
		res := f.returns(rets...)
		for i, r := range res {
			valid := i == 0 || i == len(res)-1
			if valid && r.Err != nil || !valid && !errors.Is(r.Err, coordinator.ErrInvalidRequest) {
				f.t.Errorf("item %d: %s = %s, want valid=%v", i, ReturnString(rets[i]), ReturnResultString(r), valid)
			}
		}
		// The valid items around the invalid ones credit a and b a token each.
		if res[0].Granted != 2*tok || res[0].Remaining != 9*tok || res[len(res)-1].Granted != 2*tok || res[len(res)-1].Remaining != 10*tok {
			f.t.Errorf("valid items: %s and %s, want 2 tokens credited each, 9 and 10 left", ReturnResultString(res[0]), ReturnResultString(res[len(res)-1]))
		}
		f.levels(lv{"a", a, 10 * tok}, lv{"b", a, 10 * tok}, lv{"c", a, 10 * tok}, lv{"m0", a, 10 * tok}, lv{"q", q, 10 * tok}, lv{"r", q, 10 * tok})
	}},
	{"ReturnAllBatch", func(f *fixture) {
		// Returns to several buckets ride in a batch with single returns, applied in order: the
		// first return refills a to 2, the return to both fills x and a, the last finds a full.
		a := limit(f.t, 4*tok, tok, 1000)
		g := f.takeAll(multi("x", a, 3*tok, coordinator.Bucket{Key: "a", Limit: a}), want{granted: 3 * tok, remaining: tok, now: f.now}, 0)
		res := f.returns(
			ret("a", a, tok, g.Now),
			giveBack("x", a, 3*tok, g.Now, coordinator.Bucket{Key: "a", Limit: a}),
			ret("a", a, tok, g.Now),
		)
		if res[0].Granted != tok || res[1].Granted != 5*tok || res[1].Remaining != 4*tok || res[2].Granted != 0 || res[2].Remaining != 4*tok {
			f.t.Fatalf("batch: %s, %s, %s", ReturnResultString(res[0]), ReturnResultString(res[1]), ReturnResultString(res[2]))
		}
		f.levels(lv{"a", a, 4 * tok}, lv{"x", a, 4 * tok})
	}},
	{"ReturnAllSumStopsAtMaxExact", func(f *fixture) {
		// Three buckets of 2^52 - 1 µ credited whole: the sum would pass 2^53, where the Lua
		// script's doubles stop being exact, so both stores answer 2^53 - 1.
		big := limit(f.t, bucket.MaxExact/2, 0, 0)
		also := []coordinator.Bucket{{Key: "b", Limit: big}, {Key: "c", Limit: big}}
		g := f.takeAll(multi("a", big, big.Capacity(), also...), want{granted: big.Capacity(), remaining: 0, now: f.now}, 0)
		r := giveBack("a", big, big.Capacity(), g.Now, also...)
		r.Op = coordinator.OpID{Agent: "ag", Seq: 1}
		f.ret(r, want{granted: bucket.MaxExact, remaining: big.Capacity(), now: f.now})
		f.ret(r, want{granted: bucket.MaxExact, remaining: big.Capacity(), now: f.now, replayed: true})
		// Every bucket is full (the probe's take of more than the capacity is not valid here).
		f.takeAll(multi("a", big, big.Capacity(), also...), want{granted: big.Capacity(), remaining: 0, now: f.now}, 0)
	}},
}
