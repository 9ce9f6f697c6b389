package sim

import (
	"cmp"
	"slices"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

// A false deny is a 429 that the global limit did not require: while it was answered, tokens of
// its key sat unused and were wasted — in a lease that ended unspent (handed back and decayed,
// given up, or stranded by a crash) or in a full bucket whose refill its cap discarded. The
// tokens of a denial that only sat elsewhere for a while (another agent's lease, spent later; a
// bucket that paced agents take from at their turn) moved an admission rather than lost it: the
// report counts those apart (HeldElsewhere), and under-use says what was lost.
//
// Wasted tokens are known only when their lease ends, so denials are matched at the end of the
// run: each waste interval (the lease's life, from its grant to its end) accounts for as many
// denials of its key within it as its tokens cover, earliest first — the greedy matching that
// counts the most denials an interval could have served, interval by interval in order of end.

// denial is one 429 of a key, with where it was counted.
type denial struct {
	at       int64 // ns
	cost     int64 // µ
	ident    int32
	region   int32
	wasteful bool
}

// waste is what a lease of a key left unspent and unused: amount µ over [from, to] (ns).
type waste struct {
	from, to int64
	amount   int64
}

// denied records a 429 of rq on key k (in region g) at t; full says the key's bucket was full
// then (its refill being discarded): that denial is false at once.
func (k *key) denied(t int64, rq *request, g int, full bool) {
	k.denials = append(k.denials, denial{at: t, cost: rq.micro, ident: rq.ident, region: int32(g), wasteful: full})
}

// wasted records amount µ of k that sat unused from from to to (ns) and will never be spent.
func (k *key) wasted(from, to, amount int64) {
	if amount > 0 {
		k.wastes = append(k.wastes, waste{from: from, to: to, amount: amount})
	}
}

// grantNs is the virtual time of a grant the store stamped at ms.
func grantNs(ms int64) int64 { return ms * int64(1e6) }

// matchFalseDenies marks k's denials that wasted tokens could have served and counts them into
// the identities' and the seconds' tallies.
func (w *world) matchFalseDenies(k *key) {
	d := k.denials
	if len(d) == 0 {
		return
	}
	slices.SortStableFunc(d, func(a, b denial) int { return cmp.Compare(a.at, b.at) })
	slices.SortFunc(k.wastes, func(a, b waste) int { return cmp.Compare(a.to, b.to) })
	// next[i] is the first denial at or after i not yet false (union-find with path halving).
	next := make([]int32, len(d)+1)
	for i := range next {
		next[i] = int32(i)
	}
	find := func(i int32) int32 {
		for next[i] != i {
			next[i] = next[next[i]]
			i = next[i]
		}
		return i
	}
	for i := range d {
		if d[i].wasteful {
			next[i] = int32(i + 1)
		}
	}
	for _, ws := range k.wastes {
		left := ws.amount
		i := find(int32(firstAtOrAfter(d, ws.from)))
		for int(i) < len(d) && d[i].at <= ws.to && left > 0 {
			if d[i].cost <= left {
				left -= d[i].cost
				d[i].wasteful = true
				next[i] = i + 1
			}
			i = find(i + 1)
		}
	}
	for i := range d {
		if !d[i].wasteful {
			continue
		}
		id := &w.idents[d[i].ident]
		id.counts[d[i].region].FalseDenied++
		w.second(d[i].at).FalseDenied++
	}
	k.denials, k.wastes = nil, nil
}

func firstAtOrAfter(d []denial, t int64) int {
	i, _ := slices.BinarySearchFunc(d, t, func(x denial, t int64) int { return cmp.Compare(x.at, t) })
	return i
}

// bucketFull reports whether k's bucket, as the store last answered and refilled to ms, is full.
func (k *key) bucketFull(ms bucket.Millis) bool {
	s := k.level
	s.Refill(k.limit, ms)
	return s.Tokens >= k.limit.Capacity()
}
