package stackbench

import (
	"math"
	"testing"
)

// TestUniformWalk: the callers' draws, together, check every key once every N draws, and the warm
// pass goes through the keys in the walk's order.
func TestUniformWalk(t *testing.T) {
	const n = 1000
	k := Dist{Kind: Uniform, N: n}.New(7)
	draws := []func() int{k.Sampler(0), k.Sampler(1), k.Sampler(2)}
	for round := range 3 {
		seen := make([]int, n)
		for j := range n {
			key := draws[j%len(draws)]()
			seen[key]++
			if round == 0 && key != k.Pass(j) {
				t.Fatalf("draw %d is key %d, the warm pass's is %d", j, key, k.Pass(j))
			}
		}
		for key, c := range seen {
			if c != 1 {
				t.Fatalf("round %d: key %d drawn %d times", round, key, c)
			}
		}
	}
	if k.Pass(0) == 0 && k.Pass(1) == 1 && k.Pass(2) == 2 {
		t.Error("the walk is not shuffled")
	}
	if got := k.Tenant(42); got != "t42" {
		t.Errorf("Tenant(42) = %q", got)
	}
}

// TestZipf: key k is drawn with probability proportional to (k+1)^-s; the samplers are seeded
// (the same caller draws the same keys) and differ between callers.
func TestZipf(t *testing.T) {
	const n, draws, s = 100_000, 400_000, 1.1
	k := Dist{Kind: Zipf, N: n, S: s}.New(7)
	next := k.Sampler(0)
	counts := make([]float64, n)
	for range draws {
		counts[next()]++
	}
	var h float64 // the normalisation, H(n, s)
	for i := 1; i <= n; i++ {
		h += math.Pow(float64(i), -s)
	}
	for _, key := range []int{0, 1, 9, 99} {
		want := draws * math.Pow(float64(key+1), -s) / h
		if got := counts[key]; math.Abs(got-want) > 5*math.Sqrt(want) {
			t.Errorf("key %d drawn %v times, want %.0f", key, got, want)
		}
	}
	a, b, c := k.Sampler(3), Dist{Kind: Zipf, N: n, S: s}.New(7).Sampler(3), k.Sampler(4)
	same, other := true, false
	for range 100 {
		x := a()
		same = same && x == b()
		other = other || x != c()
	}
	if !same || !other {
		t.Errorf("seeded samplers: same caller same keys %t, other caller other keys %t", same, other)
	}
}

// TestHot: every draw is key 0.
func TestHot(t *testing.T) {
	next := Dist{Kind: Hot, N: 1}.New(7).Sampler(5)
	for range 100 {
		if got := next(); got != 0 {
			t.Fatalf("hot draw %d", got)
		}
	}
}
