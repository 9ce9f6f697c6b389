package stackbench_test

import (
	"slices"
	"testing"

	sb "github.com/leasebucket/leasebucket/internal/testkit/stackbench"
)

// TestTurns: the last round runs in the modes' order; over as many rounds as there are modes,
// each mode takes each place once; over a multiple of that, equally often; each round holds every
// mode once.
func TestTurns(t *testing.T) {
	for _, modes := range [][]sb.Mode{
		{sb.Direct, sb.Lease},
		{sb.Empty, sb.Direct, sb.Lease},
		{sb.Empty, sb.Direct, sb.Lease, sb.Control},
	} {
		k := len(modes)
		for _, n := range []int{1, k, 2 * k, k + 1} {
			places := map[sb.Mode][]int{} // times in each place
			for r := range n {
				got := sb.Turns(modes, r, n)
				if !sameSet(got, modes) {
					t.Fatalf("%v, round %d of %d: %v, want each mode once", modes, r, n, got)
				}
				if r == n-1 && !slices.Equal(got, modes) {
					t.Errorf("%v, last round of %d: %v, want the modes' order", modes, n, got)
				}
				for j, m := range got {
					if places[m] == nil {
						places[m] = make([]int, k)
					}
					places[m][j]++
				}
			}
			if n%k != 0 {
				continue
			}
			for m, p := range places {
				for j, c := range p {
					if c != n/k {
						t.Errorf("%v over %d rounds: %s in place %d %d times, want %d", modes, n, m, j, c, n/k)
					}
				}
			}
		}
	}
	if got := sb.Turns([]sb.Mode{sb.Direct, sb.Lease}, 0, 3); !slices.Equal(got, []sb.Mode{sb.Direct, sb.Lease}) {
		t.Errorf("first of three rounds of two modes: %v", got)
	}
}

func sameSet(a, b []sb.Mode) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}
