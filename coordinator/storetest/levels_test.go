package storetest_test

import (
	"context"
	"testing"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

// TestLevels follows a key through takes, a replay, a stale take, a return and a failed item: the
// level is what the bucket held after the last operation that reached it.
func TestLevels(t *testing.T) {
	const tok = bucket.PerToken
	l, err := bucket.NewLimit(10*tok, tok, 1000)
	if err != nil {
		t.Fatal(err)
	}
	now := bucket.Millis(1_000_000)
	levels := storetest.NewLevels(memstore.New(memstore.WithClock(func() bucket.Millis { return now })))
	ctx := context.Background()
	take := func(want bucket.Micro, seq uint64) coordinator.TakeResult {
		t.Helper()
		req := coordinator.TakeRequest{Key: "k", Limit: l, Want: want, Min: tok}
		if seq > 0 {
			req.Op = coordinator.OpID{Agent: "a", Seq: seq}
		}
		res, err := levels.Take(ctx, []coordinator.TakeRequest{req})
		if err != nil || res[0].Err != nil {
			t.Fatalf("Take = %+v, %v", res, err)
		}
		return res[0]
	}
	level := func(want bucket.Micro) {
		t.Helper()
		if got, ok := levels.Level("k"); !ok || got != want {
			t.Fatalf("Level(k) = %d, %v, want %d, true", got, ok, want)
		}
	}

	if _, ok := levels.Level("k"); ok {
		t.Fatal("Level(k) before any operation: held")
	}
	first := take(3*tok, 2)
	level(7 * tok)
	take(tok, 0)
	level(6 * tok)
	if r := take(3*tok, 2); !r.Replayed || r.Remaining != 7*tok {
		t.Fatalf("retried take = %+v, want a replay of the first", r)
	}
	level(6 * tok) // the replay's Remaining is the record's, not the bucket's
	now += 1000    // one token refills, seen by the next operation that changes the bucket
	if r := take(tok, 1); !r.Stale {
		t.Fatalf("older take = %+v, want stale", r)
	}
	level(6 * tok)
	res, err := levels.Return(ctx, []coordinator.ReturnRequest{
		{Key: "k", Limit: l, Amount: 2 * tok, GrantedAt: first.Now},
		{Key: "k", Limit: l, Amount: -1, GrantedAt: first.Now}, // invalid: not noted
	})
	if err != nil || res[0].Err != nil || res[1].Err == nil {
		t.Fatalf("Return = %+v, %v, want the first credited and the second refused", res, err)
	}
	level(8 * tok) // 6, one refilled, and the two returned less the one refilled since their grant
}
