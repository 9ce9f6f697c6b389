package stackbench

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync/atomic"
)

// Kind is the shape of a key distribution.
type Kind uint8

// Kinds.
const (
	// Hot: every check on one key.
	Hot Kind = iota
	// Uniform: every key equally often, walked in a seeded random order that every caller shares,
	// so each key is checked once every N checks: at X checks/s, every N/X seconds. Independent
	// draws would find a key checked less than a lease lifetime τ before in a share
	// 1 - exp(-τX/N) of the checks — one in eight at 10,000 keys, 5,000 checks/s and τ = 250 ms —
	// while the walk keeps every key colder than its lease as long as N/X exceeds τ.
	Uniform
	// Zipf: key k (k = 0..N-1) with probability proportional to (k+1)^-S (math/rand/v2's exact
	// rejection sampler, one seeded source per caller).
	Zipf
)

func (k Kind) String() string {
	switch k {
	case Hot:
		return "hot"
	case Uniform:
		return "uniform"
	case Zipf:
		return "zipf"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// Dist is a distribution of checks over the N tenants "t0" … "t<N-1>".
type Dist struct {
	Kind Kind
	N    int
	S    float64 // Zipf's exponent, > 1
}

// Keys draws from a Dist for the load of one stack. The uniform walk is shared by every sampler
// and survives from one run to the next, so a key's interval stays N checks across runs.
type Keys struct {
	dist    Dist
	seed    uint64
	tenants []string
	perm    []int32 // Uniform: the walk's order
	cursor  atomic.Uint64
}

// New returns the keys of d, seeded by seed.
func (d Dist) New(seed uint64) *Keys {
	if d.N < 1 || (d.Kind == Hot && d.N != 1) || (d.Kind == Zipf && d.S <= 1) {
		panic(fmt.Sprintf("stackbench: invalid distribution %+v", d))
	}
	k := &Keys{dist: d, seed: seed, tenants: make([]string, d.N)}
	for i := range k.tenants {
		k.tenants[i] = "t" + strconv.Itoa(i)
	}
	if d.Kind == Uniform {
		r := rand.New(rand.NewPCG(seed, 0))
		k.perm = make([]int32, d.N)
		for i, j := range r.Perm(d.N) {
			k.perm[i] = int32(j)
		}
	}
	return k
}

// Dist is the distribution drawn from.
func (k *Keys) Dist() Dist { return k.dist }

// Tenant is key i's tenant, "t<i>".
func (k *Keys) Tenant(i int) string { return k.tenants[i] }

// Sampler returns caller's draw function: the next key to check. A sampler is not safe for
// concurrent use; give each caller its own.
func (k *Keys) Sampler(caller int) func() int {
	switch k.dist.Kind {
	case Uniform:
		n := uint64(k.dist.N)
		return func() int { return int(k.perm[(k.cursor.Add(1)-1)%n]) }
	case Zipf:
		z := rand.NewZipf(rand.New(rand.NewPCG(k.seed, uint64(caller)+1)), k.dist.S, 1, uint64(k.dist.N-1))
		return func() int { return int(z.Uint64()) }
	}
	return func() int { return 0 }
}

// Pass is the j-th key (j = 0..N-1) of one pass over every key, in the order the uniform walk
// checks them. It does not move the walk.
func (k *Keys) Pass(j int) int {
	if k.perm != nil {
		return int(k.perm[j])
	}
	return j
}
