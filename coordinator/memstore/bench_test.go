package memstore_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

// benchLimit never runs dry at benchmark rates: 10^9 tokens refilled every millisecond.
func benchLimit(b *testing.B) bucket.Limit {
	return mustLimit(b, 1_000_000_000*tok, 1_000_000_000*tok, 1)
}

func BenchmarkTake(b *testing.B) {
	var now bucket.Millis
	s := memstore.New(memstore.WithClock(func() bucket.Millis { return now }))
	reqs := []coordinator.TakeRequest{{Key: "tenant-1/GET /orders/{id}/read/v3", Limit: benchLimit(b), Want: tok, Min: tok}}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		now++
		if _, err := s.Take(ctx, reqs); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkTakeIdempotent(b *testing.B) {
	var now bucket.Millis
	s := memstore.New(memstore.WithClock(func() bucket.Millis { return now }))
	reqs := []coordinator.TakeRequest{{Key: "tenant-1/GET /orders/{id}/read/v3", Limit: benchLimit(b), Want: tok, Min: tok,
		Op: coordinator.OpID{Agent: "node-17.eu-west-1"}}}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		now++
		reqs[0].Op.Seq++
		if _, err := s.Take(ctx, reqs); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkTakeBatch100(b *testing.B) {
	var now bucket.Millis
	s := memstore.New(memstore.WithClock(func() bucket.Millis { return now }))
	l := benchLimit(b)
	reqs := make([]coordinator.TakeRequest, 100)
	for i := range reqs {
		reqs[i] = coordinator.TakeRequest{Key: "tenant-" + strconv.Itoa(i), Limit: l, Want: tok, Min: tok}
	}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		now++
		if _, err := s.Take(ctx, reqs); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)*100/b.Elapsed().Seconds(), "grants/s")
}

// BenchmarkTakeParallel spreads goroutines over 1024 keys: the sharded locks should scale.
func BenchmarkTakeParallel(b *testing.B) {
	var now atomic.Int64
	s := memstore.New(memstore.WithClock(func() bucket.Millis { return bucket.Millis(now.Load()) }))
	l := benchLimit(b)
	keys := make([]string, 1024)
	for i := range keys {
		keys[i] = "tenant-" + strconv.Itoa(i)
	}
	var next atomic.Int64
	ctx := context.Background()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		reqs := []coordinator.TakeRequest{{Limit: l, Want: tok, Min: tok}}
		i := next.Add(1) * 7919
		for pb.Next() {
			i++
			reqs[0].Key = keys[i%1024]
			if _, err := s.Take(ctx, reqs); err != nil {
				b.Error(err)
				return
			}
		}
	})
}
