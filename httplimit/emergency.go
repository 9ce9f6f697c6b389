package httplimit

import (
	"sync"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

// sweepEvery bounds how often a full table is swept for buckets that have refilled: a sweep
// walks every key, and while the table stays full of buckets in use, sweeping on every request
// would cost that walk per request.
const sweepEvery = time.Second

// emergencyBuckets are the Filter's own emergency buckets, one per bucket key, spent only while
// the agent is unreachable: the same arithmetic as the agent's (internal/bucket), on the
// process's monotonic clock in milliseconds.
//
// Invariant: at most max keys. A full bucket is the same as no bucket (a missing key starts
// full), so buckets that refilled are dropped when room is needed and nothing is forgotten that
// would allow more than the emergency limit. A key that finds no room is refused (the caller
// answers 503), never given a fresh bucket in place of one in use.
type emergencyBuckets struct {
	now    func() time.Time
	origin time.Time
	max    int

	mu        sync.Mutex
	m         map[string]*emergencyBucket
	lastSweep time.Time
}

type emergencyBucket struct {
	lim   bucket.Limit
	state bucket.State
}

func newEmergencyBuckets(maxKeys int, now func() time.Time) *emergencyBuckets {
	return &emergencyBuckets{now: now, origin: now(), max: maxKeys, m: make(map[string]*emergencyBucket)}
}

// take spends cost from key's bucket of limit lim. allowed reports whether it was spent; if not,
// retry is when it could be (negative: never, the cost exceeds the capacity). ok is false when
// the key has no bucket and there is no room for one.
func (e *emergencyBuckets) take(key string, lim bucket.Limit, cost bucket.Micro) (allowed bool, retry time.Duration, ok bool) {
	t := e.now()
	now := bucket.Millis(t.Sub(e.origin).Milliseconds())
	e.mu.Lock()
	defer e.mu.Unlock()
	b := e.m[key]
	if b == nil {
		if len(e.m) >= e.max && !e.sweep(t, now) {
			return false, 0, false
		}
		b = &emergencyBucket{lim: lim, state: bucket.Full(lim, now)}
		e.m[key] = b
	} else if b.lim != lim {
		// The emergency limit changed (a tenant override's emergency, with the main limit and
		// so the key unchanged): start the new limit full, as the agent does after a reload.
		b.lim, b.state = lim, bucket.Full(lim, now)
	}
	res := b.state.Take(lim, now, cost, cost)
	if res.Granted > 0 {
		return true, 0, true
	}
	if res.RetryAfter == bucket.Never {
		return false, -1, true
	}
	return false, time.Duration(res.RetryAfter) * time.Millisecond, true
}

// sweep drops the buckets that are full by now and reports whether there is room. Called with
// mu held.
func (e *emergencyBuckets) sweep(t time.Time, now bucket.Millis) bool {
	if t.Sub(e.lastSweep) < sweepEvery {
		return false
	}
	e.lastSweep = t
	for k, b := range e.m {
		b.state.Refill(b.lim, now)
		if b.state.Tokens >= b.lim.Capacity() {
			delete(e.m, k)
		}
	}
	return len(e.m) < e.max
}
