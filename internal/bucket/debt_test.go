package bucket

import (
	"encoding/binary"
	"math/big"
	"math/rand/v2"
	"testing"
)

// charge is State.Charge in the reference: refill, then debit min(amount, tokens + maxDebt),
// never negative.
func (r *ref) charge(now, amount, maxDebt int64) Result {
	r.refill(now)
	room := new(big.Int).Add(r.tokens, big.NewInt(maxDebt))
	d := big.NewInt(amount)
	if d.Cmp(room) > 0 {
		d = room
	}
	if d.Sign() < 0 {
		d.SetInt64(0)
	}
	r.tokens.Sub(r.tokens, d)
	return Result{Granted: Micro(d.Int64()), Remaining: Micro(r.tokens.Int64())}
}

// FuzzDebt drives a bucket with takes, returns, refills and settled costs (Charge) and checks every
// result against the arbitrary-precision reference, whose refill is the plain
// min(C, tokens + (elapsed·num + frac)/den) from any level, negative ones included, plus the
// invariants: -maxDebt <= tokens <= capacity; 0 <= frac < den; what a charge debits is at most its
// amount and at most tokens + maxDebt; Charge(0) is a refill; refill loses nothing.
func FuzzDebt(f *testing.F) {
	f.Add(int64(20_000_000), int64(100_000_000), int64(60_000), int64(10_000_000), []byte("take, charge below zero, wait, take again"))
	f.Add(int64(1), int64(1), int64(1), int64(1), []byte{3, 1, 2, 3, 4, 5, 6, 7, 8, 3, 9, 10, 11, 12, 13, 14, 15, 16, 17})
	f.Add(int64(3), int64(7000), int64(3), int64(3), []byte("\x03\xff\xff\xff\xff\xff\xff\xff\x01\x02\x05\x00\x00\x00\x00\x00\x00\x00"))
	f.Add(int64(1_000_000_000_000_000), int64(1_000_000), int64(86_400_000), int64(1_000_000_000_000_000), []byte("\x03\xff\xff\xff\xff\xff\xff\xff\x01"))
	f.Add(int64(100_000_000), int64(0), int64(0), int64(50_000_000), []byte("\x03no refill at all, ever, and a debt"))
	f.Fuzz(func(t *testing.T, capacity, amount, period, maxDebt int64, ops []byte) {
		l, err := NewLimit(Micro(capacity), Micro(amount), Millis(period))
		if err != nil || maxDebt < 0 {
			return
		}
		maxDebt %= capacity + 1 // 0 <= maxDebt <= capacity
		s := Full(l, 1_700_000_000_000)
		r := newRef(l, s)
		now := int64(s.Last)
		for len(ops) >= 9 {
			kind, v := ops[0], binary.LittleEndian.Uint64(ops[1:9])
			ops = ops[9:]
			// Times move by up to about 3 fill times (a debt takes up to one more to repay),
			// backwards one time in eight.
			step := int64(v % uint64(3*int64(max(l.fill, 1))+2))
			if kind&7 == 7 {
				step = -step
			}
			now = max(0, now+step)
			before, last := s, s.Last
			amt := 1 + int64(v>>16)%(2*capacity)
			switch kind % 4 {
			case 0:
				least := 1 + int64(v>>8)%max(1, amt)
				share := 1 + int64(v>>40)%WholeShare
				unit := 1 + int64(v>>50)%max(1, least)
				got := s.TakeShare(l, Millis(now), Micro(amt), Micro(least), share, Micro(unit))
				if want := r.take(now, amt, least, share, unit); got != want {
					t.Fatalf("TakeShare(%s, now=%d, want=%d, min=%d, share=%d, unit=%d) from %+v = %+v, want %+v", l, now, amt, least, share, unit, before, got, want)
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
	})
}

// TestDebtBudget checks the budget bound with debt on random histories of takes, settled costs and
// returns, over every window between two operations, in exact arithmetic: what the bucket debits
// (grants and charges, net of credits) over a window of w ms is at most C + r·w + maxDebt. The
// level starts at most C, ends at least -maxDebt, and refills at most r·w in between.
func TestDebtBudget(t *testing.T) {
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 0xdeb7))
		capTok := 1 + rng.Int64N(50)
		l, err := NewLimit(Micro(capTok)*PerToken, Micro(1+rng.Int64N(600))*PerToken, 60_000)
		if err != nil {
			t.Fatal(err)
		}
		maxDebt := Micro(rng.Int64N(capTok+1)) * PerToken
		s := Full(l, 0)
		type event struct {
			at  Millis
			net Micro // debited minus credited
		}
		var events []event
		now := Millis(0)
		for range 300 {
			now += Millis(rng.Int64N(int64(l.fill)/4 + 1))
			var net Micro
			switch rng.IntN(3) {
			case 0:
				net = s.Take(l, now, Micro(1+rng.Int64N(capTok))*PerToken, PerToken).Granted
			case 1:
				net = s.Charge(l, now, Micro(rng.Int64N(2*capTok+1))*PerToken, maxDebt).Granted
			default:
				net = -s.Return(l, now, Micro(rng.Int64N(capTok+1))*PerToken, now-Millis(rng.Int64N(int64(l.fill)))).Granted
			}
			if s.Tokens < -maxDebt {
				t.Fatalf("seed %d: level %d below -maxDebt %d", seed, s.Tokens, maxDebt)
			}
			events = append(events, event{now, net})
		}
		num, den := l.Rate()
		for i := range events {
			sum := new(big.Int)
			for j := i; j < len(events); j++ {
				sum.Add(sum, big.NewInt(int64(events[j].net)))
				// sum·den <= (C + maxDebt)·den + w·num
				lhs := new(big.Int).Mul(sum, big.NewInt(den))
				rhs := new(big.Int).Mul(big.NewInt(int64(l.capacity+maxDebt)), big.NewInt(den))
				rhs.Add(rhs, new(big.Int).Mul(big.NewInt(int64(events[j].at-events[i].at)), big.NewInt(num)))
				if lhs.Cmp(rhs) > 0 {
					t.Fatalf("seed %d: %d µ debited net in %d ms (%s, max debt %d µ): above C + r·w + max_debt",
						seed, sum, events[j].at-events[i].at, l, maxDebt)
				}
			}
		}
	}
}

// FuzzCounterDebt drives a calendar counter through takes, returns and settled costs and checks:
// -maxDebt <= Tokens <= quota; within each period what is debited (grants and charges) net of
// credits is at most quota + maxDebt and is exactly what the counter lost; a counter in debt grants
// nothing and says to retry at the end of the period.
func FuzzCounterDebt(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16})
	f.Add([]byte("a counter of a calendar quota, charged after the fact"))
	f.Fuzz(func(t *testing.T, data []byte) {
		next := func(n uint64) uint64 {
			var b [8]byte
			k := copy(b[:2], data)
			data = data[k:]
			return binary.LittleEndian.Uint64(b[:]) % n
		}
		quota := Micro(1 + next(1000))
		maxDebt := Micro(next(uint64(quota) + 1))
		period := Millis(1 + next(500))
		now := Millis(next(10_000))
		c := FreshCounter(quota, now)
		net := map[Millis]Micro{} // per period: debited - credited
		type grantT struct {
			at     Millis
			amount Micro
		}
		var grants []grantT
		for len(data) > 0 {
			now += Millis(next(uint64(period))) - period/4
			now = max(now, 0)
			around := max(0, c.Last+Millis(next(uint64(2*period)))-period)
			start := around - around%period
			w := Window{Start: start, End: start + period, Next: start + 2*period}
			before := c
			switch next(4) {
			case 0, 1:
				want := Micro(1 + next(uint64(quota)+5))
				least := Micro(1 + next(uint64(want)))
				res, err := c.Take(quota, w, now, want, least, int64(1+next(WholeShare)), Micro(1+next(4)))
				if err != nil {
					continue
				}
				if res.Granted > 0 {
					net[c.Period] += res.Granted
					grants = append(grants, grantT{c.Last, res.Granted})
				} else if c.Tokens < least && res.RetryAfter != Never && c.Last+res.RetryAfter != c.Expiry(w, 0) {
					t.Fatalf("denied with retry %d at %d, period ends at %d", res.RetryAfter, c.Last, c.Expiry(w, 0))
				}
			case 2:
				amount := Micro(next(uint64(2*quota) + 1))
				res, err := c.Charge(quota, w, now, amount, maxDebt)
				if err != nil {
					if c != before {
						t.Fatalf("failed charge changed the counter")
					}
					continue
				}
				if res.Granted < 0 || res.Granted > amount {
					t.Fatalf("charged %d of %d", res.Granted, amount)
				}
				net[c.Period] += res.Granted
			default:
				if len(grants) == 0 {
					continue
				}
				g := grants[next(uint64(len(grants)))]
				res, err := c.Return(quota, w, now, g.amount, g.at)
				if err != nil {
					continue
				}
				net[c.Period] -= res.Granted
			}
			if c.Tokens < -maxDebt || c.Tokens > quota || c.Last < before.Last || c.Period < before.Period {
				t.Fatalf("counter %+v after %+v breaks an invariant (quota %d, max debt %d)", c, before, quota, maxDebt)
			}
			if net[c.Period] > quota+maxDebt {
				t.Fatalf("period from %d debited %d net, above quota %d + max debt %d", c.Period, net[c.Period], quota, maxDebt)
			}
			if net[c.Period] >= 0 && c.Tokens != quota-net[c.Period] {
				t.Fatalf("counter holds %d, the period debited %d net of a quota of %d", c.Tokens, net[c.Period], quota)
			}
		}
	})
}
