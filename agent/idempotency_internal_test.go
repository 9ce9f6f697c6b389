package agent

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/clock"
)

// TestIdempotencyWindowAndBound: a record lives for the window from its first check, then a
// repeat leads again; a deny or an error is forgotten at once; beyond the size bound the oldest
// records go first.
func TestIdempotencyWindowAndBound(t *testing.T) {
	const window = time.Minute
	m := newIdempotency(window, idemShards) // one record per shard
	k := idemKey{bucket: "lb1:acme|/orders/{}|read|x", key: "k"}
	now := clock.Nanos(1000)
	rec, leader := m.begin(now, k)
	if !leader {
		t.Fatal("the first check of a key does not lead")
	}
	if again, leader := m.begin(now, k); leader || again != rec {
		t.Fatal("a repeat while the first is decided does not follow it")
	}
	m.finish(k, rec, Verdict{Outcome: Allow, Remaining: 7}, nil)
	for _, at := range []clock.Nanos{now, now + clock.Of(window) - 1} {
		got, leader := m.begin(at, k)
		if leader || got != rec || !got.ok || got.v.Remaining != 7 {
			t.Fatalf("repeat at +%v: leader %v, %+v; want the remembered allow", (at - now).Duration(), leader, got)
		}
	}
	if _, leader := m.begin(now+clock.Of(window), k); !leader {
		t.Fatal("a repeat after the window does not lead again")
	}

	for _, tc := range []struct {
		v   Verdict
		err error
	}{{Verdict{Outcome: Deny}, nil}, {Verdict{Outcome: Unavailable}, nil}, {Verdict{}, errors.New("boom")}} {
		k := idemKey{bucket: "b", key: fmt.Sprint(tc)}
		rec, _ := m.begin(now, k)
		m.finish(k, rec, tc.v, tc.err)
		if _, leader := m.begin(now, k); !leader {
			t.Fatalf("after %v, %v the key is remembered", tc.v.Outcome, tc.err)
		}
	}

	// The bound: many more keys than records; the table never holds more than its size.
	small := newIdempotency(window, 2*idemShards)
	for i := range 10_000 {
		k := idemKey{bucket: "b", key: fmt.Sprint(i)}
		rec, _ := small.begin(now, k)
		small.finish(k, rec, Verdict{Outcome: Allow}, nil)
	}
	if n := small.len(); n > 2*idemShards {
		t.Fatalf("%d records held, bound %d", n, 2*idemShards)
	}
	// Expired records leave when the shard is next written, not when it overflows.
	later := now + clock.Of(window)
	for i := range 1000 { // every shard gets some (a shard missed by all has odds of 1e-28)
		small.begin(later, idemKey{bucket: "c", key: fmt.Sprint(i)})
	}
	for i := range small.shards {
		s := &small.shards[i]
		_, old, ok := s.lru.GetOldest()
		if ok && later >= old.expires {
			t.Fatalf("shard %d still holds an expired record", i)
		}
	}
}
