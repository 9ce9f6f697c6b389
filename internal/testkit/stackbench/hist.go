package stackbench

import (
	"math"
	"math/bits"
	"time"
)

// subBits sets the histogram's resolution: 2^subBits buckets per power of two, so a bucket is at
// most 1/64 (1.6 %) of its values wide.
const subBits = 6

// numBuckets covers every non-negative int64 of nanoseconds.
const numBuckets = (64 - subBits) << subBits

// Hist is a log-linear histogram of latencies in nanoseconds: exact below 64 ns, then 64
// buckets per power of two. Recording is a few instructions and never allocates. The zero value
// is empty; a Hist is not safe for concurrent use (each caller keeps its own, merged at the end).
type Hist struct {
	counts [numBuckets]uint64
	n      uint64
}

// index is v's bucket.
func index(v uint64) int {
	if v < 1<<subBits {
		return int(v)
	}
	shift := bits.Len64(v) - subBits - 1 // v>>shift is in [2^subBits, 2^(subBits+1))
	return (shift+1)<<subBits + int(v>>shift) - 1<<subBits
}

// lower is the smallest value of bucket i; the bucket holds [lower(i), lower(i+1)).
func lower(i int) uint64 {
	if i < 1<<subBits {
		return uint64(i)
	}
	shift := i>>subBits - 1
	return (uint64(i&(1<<subBits-1)) + 1<<subBits) << shift
}

// Record adds one latency.
func (h *Hist) Record(d time.Duration) {
	h.counts[index(uint64(max(d, 0)))]++
	h.n++
}

// Merge adds o's latencies to h.
func (h *Hist) Merge(o *Hist) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
}

// Count is the number of latencies recorded.
func (h *Hist) Count() uint64 { return h.n }

// Quantile is the q-quantile (0 < q <= 1): the midpoint of the bucket holding the ⌈q·n⌉-th
// smallest latency, within 0.8 % of it. It is 0 for an empty histogram.
func (h *Hist) Quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(math.Ceil(q * float64(h.n)))
	rank = min(max(rank, 1), h.n)
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			lo, hi := lower(i), lower(i+1)
			return time.Duration(lo + (hi-lo)/2)
		}
	}
	return 0 // not reached: the counts sum to n
}
