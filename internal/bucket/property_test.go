package bucket

import (
	"encoding/binary"
	"fmt"
	"math/big"
	"math/rand/v2"
	"slices"
	"testing"
)

// ref is the bucket arithmetic written the obvious way, in arbitrary precision: the split
// multiplications of the real code must agree with it exactly.
type ref struct {
	cap, num, den      *big.Int
	tokens, last, frac *big.Int
}

func newRef(l Limit, s State) *ref {
	return &ref{
		cap: big.NewInt(int64(l.capacity)), num: big.NewInt(l.num), den: big.NewInt(l.den),
		tokens: big.NewInt(int64(s.Tokens)), last: big.NewInt(int64(s.Last)), frac: big.NewInt(s.Frac),
	}
}

func (r *ref) refill(now int64) {
	n := big.NewInt(now)
	if n.Cmp(r.last) <= 0 {
		return
	}
	e := new(big.Int).Sub(n, r.last)
	r.last = n
	total := new(big.Int).Mul(e, r.num)
	total.Add(total, r.frac)
	add, frac := new(big.Int).QuoRem(total, r.den, new(big.Int))
	r.tokens.Add(r.tokens, add)
	r.frac = frac
	if r.tokens.Cmp(r.cap) >= 0 {
		r.tokens.Set(r.cap)
		r.frac.SetInt64(0)
	}
}

// ceilQuo is ceil(a/b) for b > 0 (QuoRem truncates toward zero, which is the ceiling when a < 0).
func ceilQuo(a, b *big.Int) *big.Int {
	q, m := new(big.Int).QuoRem(a, b, new(big.Int))
	if m.Sign() > 0 {
		q.Add(q, big.NewInt(1))
	}
	return q
}

func (r *ref) take(now, want, least, share, unit int64) Result {
	r.refill(now)
	w := big.NewInt(want)
	if share < WholeShare {
		part := new(big.Int).Mul(r.tokens, big.NewInt(share))
		part.Quo(part, big.NewInt(WholeShare))
		if part.Cmp(big.NewInt(least)) < 0 {
			part.SetInt64(least)
		}
		if part.Cmp(w) < 0 {
			w = part
		}
	}
	if r.tokens.Cmp(big.NewInt(least)) >= 0 {
		g := new(big.Int).Set(w)
		if r.tokens.Cmp(g) < 0 {
			g.Set(r.tokens)
		}
		if g.Cmp(big.NewInt(want)) < 0 {
			g.Sub(g, new(big.Int).Mod(g, big.NewInt(unit)))
			if g.Cmp(big.NewInt(least)) < 0 {
				g.SetInt64(least)
			}
		}
		r.tokens.Sub(r.tokens, g)
		return Result{Granted: Micro(g.Int64()), Remaining: Micro(r.tokens.Int64())}
	}
	if big.NewInt(least).Cmp(r.cap) > 0 || r.num.Sign() == 0 {
		return Result{Remaining: Micro(r.tokens.Int64()), RetryAfter: Never}
	}
	d := new(big.Int).Sub(big.NewInt(least), r.tokens)
	d.Mul(d, r.den).Sub(d, r.frac)
	return Result{Remaining: Micro(r.tokens.Int64()), RetryAfter: Millis(ceilQuo(d, r.num).Int64())}
}

func (r *ref) ret(now, amount, grantedAt int64) Result {
	r.refill(now)
	credit := big.NewInt(amount)
	if credit.Cmp(r.cap) > 0 {
		credit.Set(r.cap)
	}
	if age := new(big.Int).Sub(r.last, big.NewInt(grantedAt)); age.Sign() > 0 && r.num.Sign() > 0 {
		credit.Sub(credit, ceilQuo(age.Mul(age, r.num), r.den))
	}
	room := new(big.Int).Sub(r.cap, r.tokens)
	if credit.Cmp(room) > 0 {
		credit = room
	}
	if credit.Sign() < 0 {
		credit.SetInt64(0)
	}
	r.tokens.Add(r.tokens, credit)
	if r.tokens.Cmp(r.cap) == 0 {
		r.frac.SetInt64(0)
	}
	return Result{Granted: Micro(credit.Int64()), Remaining: Micro(r.tokens.Int64())}
}

// FuzzArithmetic drives a bucket with operations decoded from the input and checks every result
// against the arbitrary-precision reference, plus the invariants: 0 <= tokens <= capacity,
// 0 <= frac < den, a grant is 0 or between min and want, and refill loses nothing (before + exact
// refill = after, unless capped).
func FuzzArithmetic(f *testing.F) {
	f.Add(int64(20_000_000), int64(100_000_000), int64(60_000), []byte("take and return and more time"))
	f.Add(int64(1), int64(1), int64(1), []byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17})
	f.Add(int64(1_000_000_000_000_000), int64(1_000_000), int64(86_400_000), []byte("\xff\xff\xff\xff\xff\xff\xff\xff\x01"))
	f.Add(int64(100_000_000), int64(0), int64(0), []byte("no refill at all, ever"))
	f.Fuzz(func(t *testing.T, capacity, amount, period int64, ops []byte) {
		fuzzBucket(t, capacity, amount, period, -1, ops)
	})
}

// fuzzBucket is FuzzArithmetic (maxDebt < 0: no charges), and FuzzDebt with settled costs
// (Charge) down to maxDebt: every result against the reference, and the invariants, with
// -maxDebt <= tokens then, and the time to full from any level exact.
func fuzzBucket(t *testing.T, capacity, amount, period, maxDebt int64, ops []byte) {
	l, err := NewLimit(Micro(capacity), Micro(amount), Millis(period))
	if err != nil {
		return
	}
	debts := maxDebt >= 0
	kinds, fills := byte(3), int64(2) // take, return, refill; times move by up to 2 fill times
	if debts {
		maxDebt %= capacity + 1 // 0 <= maxDebt <= capacity
		kinds, fills = 4, 3     // and charge: a debt takes up to one more fill time to repay
	} else {
		maxDebt = 0
	}
	s := Full(l, 1_700_000_000_000)
	r := newRef(l, s)
	now := int64(s.Last)
	for len(ops) >= 9 {
		kind, v := ops[0], binary.LittleEndian.Uint64(ops[1:9])
		ops = ops[9:]
		// Times move forward, backwards one time in eight.
		step := int64(v % uint64(fills*int64(max(l.fill, 1))+2))
		if kind&7 == 7 {
			step = -step
		}
		now = max(0, now+step)
		before, last := s, s.Last
		amt := 1 + int64(v>>16)%(2*capacity)
		switch kind % kinds {
		case 0:
			least := 1 + int64(v>>8)%max(1, amt)
			share := 1 + int64(v>>40)%WholeShare
			unit := 1 + int64(v>>50)%max(1, least)
			got := s.TakeShare(l, Millis(now), Micro(amt), Micro(least), share, Micro(unit))
			if want := r.take(now, amt, least, share, unit); got != want {
				t.Fatalf("TakeShare(%s, now=%d, want=%d, min=%d, share=%d, unit=%d) from %+v = %+v, want %+v", l, now, amt, least, share, unit, before, got, want)
			}
			if got.Granted != 0 && (got.Granted < Micro(least) || got.Granted > Micro(amt)) {
				t.Fatalf("granted %d outside [%d, %d]", got.Granted, least, amt)
			}
		case 1:
			grantedAt := int64(last) - int64(v>>24)%(2*int64(max(l.fill, 1))+1)
			got := s.Return(l, Millis(now), Micro(amt), Millis(grantedAt))
			if want := r.ret(now, amt, grantedAt); got != want {
				t.Fatalf("Return(%s, now=%d, amount=%d, grantedAt=%d) from %+v = %+v, want %+v", l, now, amt, grantedAt, before, got, want)
			}
		case 2:
			s.Refill(l, Millis(now))
			r.refill(now)
			checkConservation(t, l, before, s, now)
		default:
			if kind&8 != 0 {
				amt = 0
			}
			refilled := before
			refilled.Refill(l, Millis(now))
			got := s.Charge(l, Millis(now), Micro(amt), Micro(maxDebt))
			if want := r.charge(now, amt, maxDebt); got != want {
				t.Fatalf("Charge(%s, now=%d, amount=%d, maxDebt=%d) from %+v = %+v, want %+v", l, now, amt, maxDebt, before, got, want)
			}
			if got.Granted < 0 || got.Granted > Micro(amt) || got.Granted > max(0, refilled.Tokens+Micro(maxDebt)) {
				t.Fatalf("Charge(%d, maxDebt=%d) debited %d from %+v", amt, maxDebt, got.Granted, refilled)
			}
			if amt == 0 && s != refilled {
				t.Fatalf("Charge(0) left %+v, a refill leaves %+v", s, refilled)
			}
		}
		if s.Tokens < -Micro(maxDebt) || s.Tokens > l.capacity || s.Frac < 0 || s.Frac >= l.den ||
			int64(s.Tokens) != r.tokens.Int64() || int64(s.Last) != r.last.Int64() || s.Frac != r.frac.Int64() {
			t.Fatalf("state %+v, reference tokens=%v last=%v frac=%v, capacity %d, max debt %d", s, r.tokens, r.last, r.frac, l.capacity, maxDebt)
		}
		if !debts {
			continue
		}
		if ttf, ok := s.TimeToFull(l); ok && s.Tokens < l.capacity {
			// The time to full from any level, debt included, is exact: one ms less does not fill.
			full, short := s, s
			full.Refill(l, s.Last+ttf)
			short.Refill(l, s.Last+ttf-1)
			if full.Tokens != l.capacity || short.Tokens == l.capacity {
				t.Fatalf("TimeToFull of %+v = %d ms: then %+v, a ms earlier %+v", s, ttf, full, short)
			}
		}
	}
}

// checkConservation: after a pure refill from before (at last) to s, either the bucket is full and
// the exact refill would have filled it, or before + exact refill = after exactly (Frac carries the
// fraction).
func checkConservation(t *testing.T, l Limit, before State, s State, now int64) {
	t.Helper()
	elapsed := max(0, now-int64(before.Last))
	exact := new(big.Rat).SetFrac(new(big.Int).Add(new(big.Int).Mul(big.NewInt(elapsed), big.NewInt(l.num)), big.NewInt(before.Frac)), big.NewInt(l.den))
	exact.Add(exact, new(big.Rat).SetInt64(int64(before.Tokens)))
	if s.Tokens == l.capacity && exact.Cmp(new(big.Rat).SetInt64(int64(l.capacity))) >= 0 {
		return
	}
	after := new(big.Rat).Add(new(big.Rat).SetInt64(int64(s.Tokens)), big.NewRat(s.Frac, l.den))
	if elapsed > 0 && exact.Cmp(after) != 0 {
		t.Fatalf("refill from %+v over %d ms at %d/%d to %+v: exact %s µ, state holds %s µ", before, elapsed, l.num, l.den, s, exact.FloatString(6), after.FloatString(6))
	}
}

// TestLeasePotential checks, on random histories of grants, spends and late returns, the two
// inequalities docs/leases.md builds the admission bound on, in exact arithmetic:
//
//	P(t) = B(t) + Σ over outstanding leases of max(0, unspent - r·(t - grantedAt)) <= C
//	W(t) = B(t) + Σ over live leases (age < τ) of unspent <= C + r·τ
//
// where B is the bucket, C its capacity, r its rate and τ the lease lifetime. Without the decay in
// Return (crediting the unspent amount in full) the second inequality fails on such histories;
// TestLeasePotentialCatchesFullCredit shows the check would notice.
func TestLeasePotential(t *testing.T) {
	for seed := range uint64(200) {
		if err := leaseHistory(seed, false); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
	}
}

func TestLeasePotentialCatchesFullCredit(t *testing.T) {
	for seed := range uint64(200) {
		if leaseHistory(seed, true) != nil {
			return
		}
	}
	t.Fatal("crediting returns in full never broke W <= C + r·τ: the property check is too weak")
}

type lease struct {
	unspent   Micro
	grantedAt Millis
}

func leaseHistory(seed uint64, fullCredit bool) error {
	rng := rand.New(rand.NewPCG(seed, 0x1ea5e))
	capTok := 1 + rng.Int64N(50)
	perMin := 1 + rng.Int64N(600)
	l, err := NewLimit(Micro(capTok)*PerToken, Micro(perMin)*PerToken, 60_000)
	if err != nil {
		return err
	}
	tau := Millis(1 + rng.Int64N(int64(l.fill)))
	s := Full(l, 0)
	now := Millis(0)
	var leases []lease
	rate := big.NewRat(l.num, l.den)
	for range 1000 {
		now += Millis(rng.Int64N(int64(tau)/2 + 1))
		switch rng.IntN(4) {
		case 0, 1: // an agent takes a lease
			res := s.TakeShare(l, now, Micro(1+rng.Int64N(capTok))*PerToken, PerToken, 1+rng.Int64N(WholeShare), PerToken)
			if res.Granted > 0 {
				leases = append(leases, lease{unspent: res.Granted, grantedAt: s.Last})
			}
		case 2: // a live lease is partly spent
			if i := rng.IntN(len(leases) + 1); i < len(leases) && s.Last-leases[i].grantedAt < tau {
				leases[i].unspent -= Micro(rng.Int64N(int64(leases[i].unspent) + 1))
			}
		case 3: // a lease, live or long expired, is returned
			if i := rng.IntN(len(leases) + 1); i < len(leases) {
				if fullCredit {
					s.Refill(l, now)
					s.Tokens = min(l.capacity, s.Tokens+leases[i].unspent)
				} else {
					s.Return(l, now, leases[i].unspent, leases[i].grantedAt)
				}
				leases = append(leases[:i], leases[i+1:]...)
			}
		}
		s.Refill(l, now)
		// A lease that is expired and fully decayed can neither be spent nor credit anything.
		leases = slices.DeleteFunc(leases, func(ls lease) bool {
			return s.Last-ls.grantedAt >= max(tau, l.fill)
		})
		p := new(big.Rat).SetInt64(int64(s.Tokens))
		w := new(big.Rat).SetInt64(int64(s.Tokens))
		for _, ls := range leases {
			v := new(big.Rat).Sub(new(big.Rat).SetInt64(int64(ls.unspent)), new(big.Rat).Mul(rate, new(big.Rat).SetInt64(int64(s.Last-ls.grantedAt))))
			if v.Sign() > 0 {
				p.Add(p, v)
			}
			if s.Last-ls.grantedAt < tau {
				w.Add(w, new(big.Rat).SetInt64(int64(ls.unspent)))
			}
		}
		if c := new(big.Rat).SetInt64(int64(l.capacity)); p.Cmp(c) > 0 && !fullCredit {
			return fmt.Errorf("at %d ms P = %s > C = %s (%s, τ=%d ms)", now, p.FloatString(0), c.FloatString(0), l, tau)
		}
		bound := new(big.Rat).Add(new(big.Rat).SetInt64(int64(l.capacity)), new(big.Rat).Mul(rate, new(big.Rat).SetInt64(int64(tau))))
		if w.Cmp(bound) > 0 {
			return fmt.Errorf("at %d ms W = %s > C + r·τ = %s (%s, τ=%d ms)", now, w.FloatString(0), bound.FloatString(0), l, tau)
		}
	}
	return nil
}
