package bucket

import (
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
		if maxDebt >= 0 {
			fuzzBucket(t, capacity, amount, period, maxDebt, ops)
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
// nothing and says to retry at the end of the period (fuzzCounter with debts).
func FuzzCounterDebt(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16})
	f.Add([]byte("a counter of a calendar quota, charged after the fact"))
	f.Fuzz(func(t *testing.T, data []byte) { fuzzCounter(t, data, true) })
}
