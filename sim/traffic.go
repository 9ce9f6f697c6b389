package sim

import (
	"math"
	"math/rand/v2"
)

// stream is one traffic entry's arrivals on one agent: a Poisson process (or evenly spaced
// arrivals) whose rate follows the entry's shape. Poisson arrivals under a shape are drawn by
// thinning: candidates at the shape's peak rate, each kept with probability rate(t)/peak, which
// is exact for any shape.
type stream struct {
	pos      float64 // ns of the next arrival
	base     float64 // arrivals per ns without the shape
	peak     float64 // the most the shape reaches, per ns
	shape    *Shape
	constant bool
	pick     *picker
}

// never is a time no arrival reaches.
const never = math.MaxInt64

func newStream(t *Traffic, perAgent float64, p *picker, r *rand.Rand) *stream {
	s := &stream{base: perAgent / 1e9, shape: &t.Shape, constant: t.Arrivals == "constant", pick: p}
	s.peak = s.base * s.shape.peakFactor()
	switch {
	case s.base <= 0:
		s.pos = never
	case s.constant:
		s.pos = r.Float64() / (s.base * max(s.shape.factor(0), 1e-3)) // a random phase
	default:
		s.pos = 0
		s.advance(r)
	}
	return s
}

// next is the time of the next arrival.
func (s *stream) next() int64 {
	if s.pos >= never {
		return never
	}
	return int64(s.pos)
}

// advance draws the arrival after the current one.
func (s *stream) advance(r *rand.Rand) {
	if s.constant {
		// A shape that reaches zero (a diurnal amplitude of 1) would stop the stream: 1/1000 of
		// the rate is the slowest it goes.
		s.pos += 1 / (s.base * max(s.shape.factor(int64(s.pos)), 1e-3))
		return
	}
	for {
		s.pos += r.ExpFloat64() / s.peak
		if s.shape.Kind == "none" || s.pos >= never || r.Float64()*s.peak < s.base*s.shape.factor(int64(s.pos)) {
			return
		}
	}
}

// factor is the shape's multiplier of the rate at t (ns).
func (sh *Shape) factor(t int64) float64 {
	switch sh.Kind {
	case "diurnal":
		phase := float64(t-int64(sh.PeakAt)) / float64(sh.Period)
		return 1 + sh.Amplitude*math.Cos(2*math.Pi*phase)
	case "bursts":
		if t%int64(sh.Every) < int64(sh.Length) {
			return sh.Factor
		}
	}
	return 1
}

// peakFactor is the largest factor the shape reaches.
func (sh *Shape) peakFactor() float64 {
	switch sh.Kind {
	case "diurnal":
		return 1 + sh.Amplitude
	case "bursts":
		return sh.Factor
	}
	return 1
}

// picker chooses a request (one tenant of a group) for each arrival: uniformly, by Zipf weights
// (Vose's alias table, O(1) a draw), with one hot key taking a share, or in a cycle.
type picker struct {
	reqs  []int32 // request indices; the first is the hottest
	hot   uint64  // the hot key's share of 2^64, 0 if none
	alias []aliasCell
	// cycle: every arrival of the traffic, on any agent, takes the next request of order (a
	// seeded random permutation of reqs, drawn at the first pick), so each is picked exactly once
	// every len(reqs) arrivals.
	cycle bool
	order []int32
	next  int
}

type aliasCell struct {
	keep  uint32 // keep this column if the draw's high half is below keep
	other int32
}

func newPicker(reqs []int32, k Skew) *picker {
	p := &picker{reqs: reqs}
	switch {
	case k.Cycle:
		p.cycle = true
	case k.Hot > 0 && len(reqs) > 1:
		p.hot = uint64(k.Hot * (1 << 63) * 2)
		if k.Hot >= 1 {
			p.hot = math.MaxUint64
		}
	case k.Zipf > 0 && len(reqs) > 1:
		w := make([]float64, len(reqs))
		for i := range w {
			w[i] = math.Pow(float64(i+1), -k.Zipf)
		}
		p.alias = newAlias(w)
	}
	return p
}

func (p *picker) pick(r *rand.Rand) int32 {
	n := uint64(len(p.reqs))
	if n == 1 {
		return p.reqs[0]
	}
	if p.cycle {
		if p.order == nil {
			p.order = make([]int32, n)
			for i, j := range r.Perm(int(n)) {
				p.order[i] = p.reqs[j]
			}
		}
		q := p.order[p.next]
		p.next = (p.next + 1) % int(n)
		return q
	}
	u := r.Uint64()
	switch {
	case p.alias != nil:
		col := (u & 0xffffffff) * n >> 32
		c := p.alias[col]
		if uint32(u>>32) < c.keep {
			return p.reqs[col]
		}
		return p.reqs[c.other]
	case p.hot != 0:
		if u < p.hot {
			return p.reqs[0]
		}
		return p.reqs[1+(r.Uint64()&0xffffffff)*(n-1)>>32]
	}
	return p.reqs[(u&0xffffffff)*n>>32]
}

// newAlias builds Vose's alias table for weights w.
func newAlias(w []float64) []aliasCell {
	n := len(w)
	var sum float64
	for _, x := range w {
		sum += x
	}
	prob := make([]float64, n)
	var small, large []int
	for i, x := range w {
		prob[i] = x * float64(n) / sum
		if prob[i] < 1 {
			small = append(small, i)
		} else {
			large = append(large, i)
		}
	}
	cells := make([]aliasCell, n)
	for len(small) > 0 && len(large) > 0 {
		s, l := small[len(small)-1], large[len(large)-1]
		small = small[:len(small)-1]
		cells[s] = aliasCell{keep: uint32(prob[s] * (1 << 32)), other: int32(l)}
		prob[l] += prob[s] - 1
		if prob[l] < 1 {
			large = large[:len(large)-1]
			small = append(small, l)
		}
	}
	for _, i := range append(small, large...) {
		cells[i] = aliasCell{keep: math.MaxUint32, other: int32(i)}
	}
	return cells
}
