package stackbench

// Turns is the order in which modes measure round r of n when a run's slices take turns: modes
// rotated by one place each round, so that over len(modes) rounds each mode takes each place once
// (none always runs first, or after the same one), and the last round (r = n-1) in the modes' own
// order. With n a multiple of len(modes), each mode takes each place equally often.
func Turns(modes []Mode, r, n int) []Mode {
	k := len(modes)
	out := make([]Mode, k)
	if k == 0 {
		return out
	}
	shift := (r - (n - 1)) % k
	if shift < 0 {
		shift += k
	}
	for j := range modes {
		out[j] = modes[(j+shift)%k]
	}
	return out
}
