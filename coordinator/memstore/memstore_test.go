package memstore_test

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

var _ coordinator.Store = (*memstore.Store)(nil)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const tok = bucket.PerToken

func mustLimit(t testing.TB, capacity, amount bucket.Micro, period bucket.Millis) bucket.Limit {
	t.Helper()
	l, err := bucket.NewLimit(capacity, amount, period)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T, clock func() bucket.Millis) coordinator.Store {
		return memstore.New(memstore.WithClock(clock))
	})
}

func TestWallClockByDefault(t *testing.T) {
	s := memstore.New()
	l := mustLimit(t, 10*tok, tok, 100)
	before := bucket.Millis(time.Now().UnixMilli())
	res, err := s.Take(context.Background(), []coordinator.TakeRequest{{Key: "k", Limit: l, Want: tok, Min: tok}})
	after := bucket.Millis(time.Now().UnixMilli())
	if err != nil || res[0].Err != nil {
		t.Fatal(err, res)
	}
	if res[0].Now < before || res[0].Now > after {
		t.Fatalf("Now = %d, want the wall clock in [%d, %d]", res[0].Now, before, after)
	}
}

// TestSweep drops exactly the keys whose logical expiry has come, and requests drop an expired key
// they touch.
func TestSweep(t *testing.T) {
	now := bucket.Millis(1_000_000)
	s := memstore.New(memstore.WithClock(func() bucket.Millis { return now }))
	fast := mustLimit(t, 10*tok, tok, 100) // full 100 ms after a one-token take
	slow := mustLimit(t, 10*tok, tok, 1000)
	never := mustLimit(t, 10*tok, 0, 0)
	var reqs []coordinator.TakeRequest
	for i := range 100 {
		reqs = append(reqs,
			coordinator.TakeRequest{Key: "fast-" + strconv.Itoa(i), Limit: fast, Want: tok, Min: tok},
			coordinator.TakeRequest{Key: "slow-" + strconv.Itoa(i), Limit: slow, Want: tok, Min: tok},
			coordinator.TakeRequest{Key: "never-" + strconv.Itoa(i), Limit: never, Want: tok, Min: tok})
	}
	if _, err := s.Take(context.Background(), reqs); err != nil {
		t.Fatal(err)
	}
	if n := s.Len(); n != 300 {
		t.Fatalf("Len() = %d, want 300", n)
	}
	fastExpiry := now + 100 + coordinator.ExpiryMargin
	if n := s.Sweep(fastExpiry - 1); n != 0 {
		t.Fatalf("Sweep before any expiry dropped %d keys", n)
	}
	if n := s.Sweep(fastExpiry); n != 100 {
		t.Fatalf("Sweep at the fast keys' expiry dropped %d keys, want 100", n)
	}
	if _, ok := s.Lookup("fast-0"); ok {
		t.Fatal("fast-0 held after its sweep")
	}
	// A request drops the expired key it touches and starts from a full bucket.
	now = now + 1000 + coordinator.ExpiryMargin
	res, err := s.Take(context.Background(), []coordinator.TakeRequest{{Key: "slow-0", Limit: slow, Want: 10 * tok, Min: 1}})
	if err != nil || res[0].Granted != 10*tok {
		t.Fatalf("Take on an expired key: %v %v, want a full bucket", err, res)
	}
	if n := s.Sweep(now + 100*365*24*3600*1000); n != 100 {
		t.Fatalf("Sweep a century later dropped %d keys, want the 100 slow keys", n)
	}
	// Keys of buckets that never refill and are not full never expire.
	if n := s.Len(); n != 100 {
		t.Fatalf("Len() = %d, want the 100 never-refilling keys", n)
	}
}

// TestConcurrentKeys races many goroutines over a few keys: no bucket grants more than it holds,
// and the race detector watches the sharded locking.
func TestConcurrentKeys(t *testing.T) {
	var clock atomic.Int64
	s := memstore.New(memstore.WithClock(func() bucket.Millis { return bucket.Millis(clock.Load()) }))
	l := mustLimit(t, 1000*tok, 0, 0)
	const keys = 16
	var granted [keys]atomic.Int64
	var wg sync.WaitGroup
	for g := range 32 {
		wg.Go(func() {
			for i := 0; ; i++ {
				k := (g + i) % keys
				reqs := []coordinator.TakeRequest{{
					Key: "k" + strconv.Itoa(k), Limit: l, Want: 3 * tok, Min: tok,
					Op: coordinator.OpID{Agent: "g" + strconv.Itoa(g), Seq: uint64(i + 1)},
				}}
				if i%7 == 0 {
					clock.Add(1)
					s.Sweep(bucket.Millis(clock.Load()))
				}
				res, err := s.Take(context.Background(), reqs)
				if err != nil || res[0].Err != nil || res[0].Remaining < 0 {
					t.Errorf("Take: %v %v", err, res)
					return
				}
				granted[k].Add(int64(res[0].Granted))
				if i > 2000 {
					return
				}
			}
		})
	}
	wg.Wait()
	for k := range keys {
		e, ok := s.Lookup("k" + strconv.Itoa(k))
		if !ok {
			t.Fatalf("key k%d missing", k)
		}
		if got := bucket.Micro(granted[k].Load()) + e.State.Tokens; got != 1000*tok {
			t.Errorf("key k%d: granted + left = %d µ, want the capacity %d", k, got, 1000*tok)
		}
	}
}
