package storetest

import (
	"errors"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

// multi is an exact take of want from key and every bucket of also, all or nothing.
func multi(key string, l bucket.Limit, want bucket.Micro, also ...coordinator.Bucket) coordinator.TakeRequest {
	return coordinator.TakeRequest{Key: key, Limit: l, Want: want, Min: want, Also: also}
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
}
