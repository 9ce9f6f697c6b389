package stackbench

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// TestHistBuckets: every value falls in the bucket whose bounds hold it, buckets are contiguous,
// and none is wider than 1/64 of its values.
func TestHistBuckets(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	values := []uint64{0, 1, 63, 64, 65, 127, 128, 129, 1000, 1 << 40, math.MaxInt64}
	for range 10000 {
		values = append(values, r.Uint64N(math.MaxInt64), r.Uint64N(1<<20))
	}
	for _, v := range values {
		i := index(v)
		if lo, hi := lower(i), lower(i+1); v < lo || v >= hi {
			t.Fatalf("index(%d) = %d, whose bucket is [%d, %d)", v, i, lo, hi)
		}
	}
	for i := 1<<subBits + 1; i < numBuckets; i++ {
		lo, hi := lower(i), lower(i+1)
		if lo <= lower(i-1) || float64(hi-lo) > float64(lo)/(1<<subBits) {
			t.Fatalf("bucket %d: [%d, %d)", i, lo, hi)
		}
	}
}

// TestHistQuantile: quantiles of merged histograms are within the bucket width of the exact
// quantiles of the same samples.
func TestHistQuantile(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	var a, b Hist
	var all []time.Duration
	for i := range 100_000 {
		d := time.Duration(r.ExpFloat64() * float64(2*time.Millisecond))
		all = append(all, d)
		if i%2 == 0 {
			a.Record(d)
		} else {
			b.Record(d)
		}
	}
	a.Merge(&b)
	slices.Sort(all)
	if a.Count() != uint64(len(all)) {
		t.Fatalf("Count = %d, want %d", a.Count(), len(all))
	}
	for _, q := range []float64{0.01, 0.5, 0.99, 1} {
		want := all[int(math.Ceil(q*float64(len(all))))-1]
		if got := a.Quantile(q); math.Abs(float64(got-want)) > float64(want)/100 {
			t.Errorf("Quantile(%v) = %v, want %v within 1 %%", q, got, want)
		}
	}
	var empty Hist
	if got := empty.Quantile(0.5); got != 0 {
		t.Errorf("empty Quantile = %v", got)
	}
}
