package redisstore_test

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/internal/testkit/stackbench"
)

// scriptCalls is how many scripts the server has run (INFO commandstats), the probe's own
// commands aside.
func scriptCalls(t *testing.T, probe *stackbench.RedisProbe) int {
	t.Helper()
	st, err := probe.Stats(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	return int(st.Scripts)
}

// TestBatchScript: on a standalone Redis the bucket calls of a batch run in batch.lua invocations
// of up to MaxBatchKeys keys, in the batch's order, each answered as its own script would be, and
// an error on one key fails that item only. (That every answer and every key's state equal the
// in-memory store's, batches included, is memstore's TestDifferential.)
func TestBatchScript(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	s := redisstore.New(rdb)
	if err := s.Load(ctx(t)); err != nil {
		t.Fatal(err)
	}
	probe, _, err := stackbench.NewRedisProbe(ctx(t), srv.Options())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = probe.Close() })
	// A token an hour: the takes of one test see no refill between scripts a millisecond apart.
	l := mustLimit(t, 10*tok, tok, 3_600_000)

	t.Run("Chunks", func(t *testing.T) {
		n := 2*redisstore.MaxBatchKeys + 22
		reqs := make([]coordinator.TakeRequest, n)
		for i := range reqs {
			reqs[i] = coordinator.TakeRequest{Key: "chunk/" + strconv.Itoa(i), Limit: l, Want: 3 * tok, Min: tok}
		}
		before := scriptCalls(t, probe)
		res, err := s.Take(ctx(t), reqs)
		if err != nil {
			t.Fatal(err)
		}
		if got := scriptCalls(t, probe) - before; got != 3 {
			t.Errorf("%d takes on distinct keys ran %d scripts, want 3 (%d keys each at most)", n, got, redisstore.MaxBatchKeys)
		}
		for i, r := range res {
			if r.Err != nil || r.Granted != 3*tok || r.Remaining != 7*tok {
				t.Fatalf("take %d: %+v, want 3 tokens granted and 7 left", i, r)
			}
			if got, err := rdb.HGet(ctx(t), reqs[i].Key, "t").Int64(); err != nil || got != int64(7*tok) {
				t.Fatalf("%s holds %d µ (%v), want %d", reqs[i].Key, got, err, 7*tok)
			}
		}
	})

	t.Run("WithBatchKeys", func(t *testing.T) {
		// The same takes through stores of other batch sizes: as many scripts as the size asks
		// for, the same answers.
		for _, tc := range []struct{ keys, scripts int }{{10, 3}, {1, 25}, {0, 25}, {25, 1}} {
			s := redisstore.New(rdb, redisstore.WithBatchKeys(tc.keys))
			reqs := make([]coordinator.TakeRequest, 25)
			for i := range reqs {
				reqs[i] = coordinator.TakeRequest{Key: fmt.Sprintf("size%d/%d", tc.keys, i), Limit: l, Want: 3 * tok, Min: tok}
			}
			before := scriptCalls(t, probe)
			res, err := s.Take(ctx(t), reqs)
			if err != nil {
				t.Fatal(err)
			}
			if got := scriptCalls(t, probe) - before; got != tc.scripts {
				t.Errorf("WithBatchKeys(%d): 25 takes ran %d scripts, want %d", tc.keys, got, tc.scripts)
			}
			for i, r := range res {
				if r.Err != nil || r.Granted != 3*tok || r.Remaining != 7*tok {
					t.Fatalf("WithBatchKeys(%d), take %d: %+v, want 3 tokens granted and 7 left", tc.keys, i, r)
				}
			}
		}
	})

	t.Run("Order", func(t *testing.T) {
		// A take of two buckets between bucket calls on the same key splits the run: the calls
		// are applied in the batch's order, the third bucket take after the take of both.
		take := coordinator.TakeRequest{Key: "order/a", Limit: l, Want: tok, Min: tok}
		both := take
		both.Also = []coordinator.Bucket{{Key: "order/b", Limit: l}}
		before := scriptCalls(t, probe)
		res, err := s.Take(ctx(t), []coordinator.TakeRequest{take, take, both, take})
		if err != nil {
			t.Fatal(err)
		}
		if got := scriptCalls(t, probe) - before; got != 3 {
			t.Errorf("ran %d scripts, want 3: a batch of two, the take of both, the last take alone", got)
		}
		for i, want := range map[int]bucket.Micro{0: 9, 1: 8, 3: 6} {
			if r := res[i]; r.Err != nil || r.Granted != tok || r.Remaining != want*tok {
				t.Errorf("take %d: %+v, want a token granted and %d left", i, r, want)
			}
		}
		if res[2].Err != nil || res[2].Granted != tok {
			t.Errorf("take of both: %+v, want a token granted", res[2])
		}
	})

	t.Run("ErrorIsItsItem", func(t *testing.T) {
		if err := rdb.Set(ctx(t), "wrong/type", "x", 0).Err(); err != nil {
			t.Fatal(err)
		}
		reqs := []coordinator.TakeRequest{
			{Key: "wrong/0", Limit: l, Want: tok, Min: tok},
			{Key: "wrong/type", Limit: l, Want: tok, Min: tok},
			{Key: "wrong/1", Limit: l, Want: tok, Min: tok},
		}
		before := scriptCalls(t, probe)
		res, err := s.Take(ctx(t), reqs)
		if err != nil {
			t.Fatal(err)
		}
		if got := scriptCalls(t, probe) - before; got != 1 {
			t.Errorf("ran %d scripts, want 1", got)
		}
		if res[1].Err == nil || !strings.Contains(res[1].Err.Error(), "WRONGTYPE") || !strings.Contains(res[1].Err.Error(), `"wrong/type"`) {
			t.Errorf("take on a string: %v, want WRONGTYPE naming the key", res[1].Err)
		}
		for _, i := range []int{0, 2} {
			if res[i].Err != nil || res[i].Granted != tok {
				t.Errorf("take %d beside the failed one: %+v, want a token granted", i, res[i])
			}
			if got, err := rdb.HGet(ctx(t), reqs[i].Key, "t").Int64(); err != nil || got != int64(9*tok) {
				t.Errorf("%s holds %d µ (%v), want %d", reqs[i].Key, got, err, 9*tok)
			}
		}
		// Returns batch the same way.
		rets := []coordinator.ReturnRequest{
			{Key: "wrong/0", Limit: l, Amount: tok, GrantedAt: res[0].Now},
			{Key: "wrong/1", Limit: l, Amount: tok, GrantedAt: res[2].Now},
		}
		before = scriptCalls(t, probe)
		back, err := s.Return(ctx(t), rets)
		if err != nil {
			t.Fatal(err)
		}
		if got := scriptCalls(t, probe) - before; got != 1 {
			t.Errorf("two returns ran %d scripts, want 1", got)
		}
		for i, r := range back {
			if r.Err != nil || r.Granted == 0 {
				t.Errorf("return %d: %+v, want credited", i, r)
			}
		}
	})
}
