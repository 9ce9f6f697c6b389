package sim

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

// store is one place buckets live: the global store (in the home region) or a region's store
// for regional rules. Each is a real memstore on the virtual clock.
type store struct {
	name       string
	outageName string // how an outage names it: global or the region
	region     int
	mem        *memstore.Store
	ops        int64
	keys       int
}

// storeShell is the coordinator.Store a region's coordinators see: it routes each key to the
// store holding it, fails the keys a partition or an outage makes unreachable, counts operations,
// checks the budget bound on what the grant rule hands out, and — only when a scenario asks for a
// broken grant rule (faults.overgrant_factor) — reports grants larger than what was debited.
type storeShell struct {
	w      *world
	region int
}

var _ coordinator.Store = (*storeShell)(nil)

var (
	errUnreachable = errors.New("sim: store unreachable")
	errAllDown     = errors.New("sim: every store of the batch is unreachable")
)

func (s *storeShell) reachable(st int) bool {
	w := s.w
	if o := w.storeOutage(st, w.now); o != nil {
		return false
	}
	sr := w.stores[st].region
	return sr == s.region || !w.partitioned(s.region, w.now) && !w.partitioned(sr, w.now)
}

// route resolves a request's key; keys the simulator did not derive from its identities cannot
// reach a store (the coordinator derives the same keys from the same policy).
func (s *storeShell) route(name string) (*key, error) {
	k := s.w.keyIdx[name]
	if k == nil {
		return nil, fmt.Errorf("sim: unknown bucket key %q", name)
	}
	return k, nil
}

// reach resolves a request's key and the store holding it; an error fails that request alone.
func (s *storeShell) reach(name string) (*key, *store, error) {
	k, err := s.route(name)
	if err != nil {
		return nil, nil, err
	}
	if !s.reachable(k.store) {
		return nil, nil, errUnreachable
	}
	return k, s.w.stores[k.store], nil
}

// answered counts an operation st answered on k. An answer that changed the bucket (changed: no
// error, not replayed, not stale) sets k's level; answered reports whether it also moved tokens.
func (s *storeShell) answered(st *store, k *key, r bucket.Result, now bucket.Millis, changed bool) bool {
	w := s.w
	st.ops++
	k.ops++
	w.res.Backend.StoreOps++
	w.second(w.now).StoreOps++
	if changed {
		k.level = bucket.State{Tokens: r.Remaining, Last: now}
		w.debtLevel(k, int64(r.Remaining))
	}
	return changed && r.Granted > 0
}

// Take implements coordinator.Store.
func (s *storeShell) Take(ctx context.Context, reqs []coordinator.TakeRequest) ([]coordinator.TakeResult, error) {
	out := make([]coordinator.TakeResult, len(reqs))
	served := 0
	for i := range reqs {
		k, st, err := s.reach(reqs[i].Key)
		if err != nil {
			out[i].Err = err
			continue
		}
		served++
		res, err := st.mem.Take(ctx, reqs[i:i+1])
		if err != nil {
			return nil, err
		}
		r := res[0]
		changed := r.Err == nil && !r.Replayed && !r.Stale
		if changed && r.Credited > 0 {
			s.budget(k, -float64(r.Credited)) // the lease handed back first, in the same operation
		}
		if changed && reqs[i].Debt > 0 {
			s.debt(k, reqs[i].Debt, r.Debited) // then the debt, before the take
		}
		if s.answered(st, k, r.Result, r.Now, changed) {
			if f := s.w.overgrant; f > 1 {
				r.Granted = bucket.Micro(float64(r.Granted) * f)
			}
			k.grants++
			k.granted += int64(r.Granted)
			s.budget(k, float64(r.Granted))
		}
		out[i] = r
	}
	if served == 0 && len(reqs) > 0 {
		return nil, errAllDown
	}
	return out, nil
}

// Return implements coordinator.Store.
func (s *storeShell) Return(ctx context.Context, reqs []coordinator.ReturnRequest) ([]coordinator.ReturnResult, error) {
	out := make([]coordinator.ReturnResult, len(reqs))
	served := 0
	for i := range reqs {
		k, st, err := s.reach(reqs[i].Key)
		if err != nil {
			out[i].Err = err
			continue
		}
		served++
		res, err := st.mem.Return(ctx, reqs[i:i+1])
		if err != nil {
			return nil, err
		}
		r := res[0]
		if s.answered(st, k, r.Result, r.Now, r.Err == nil && !r.Replayed && !r.Stale) {
			s.budget(k, -float64(r.Granted))
		}
		out[i] = r
	}
	if served == 0 && len(reqs) > 0 {
		return nil, errAllDown
	}
	return out, nil
}

// debt books a debt the store charged on k: debited of the debt sent, the rest forgiven. The debit
// counts in the budget and in the debt bound's charge.
func (s *storeShell) debt(k *key, sent, debited bucket.Micro) {
	w := s.w
	sec := w.second(w.now)
	sec.DebtCharged += int64(debited)
	sec.DebtForgiven += int64(sent - debited)
	w.res.Settled.StoreDebited += int64(debited)
	w.res.Settled.StoreForgiven += int64(sent - debited)
	k.debited += int64(debited)
	s.budget(k, float64(debited))
	w.charge(k, w.now, float64(debited))
}

// budget checks DESIGN §5's budget bound on key: what the grant rule hands out and the store
// debits as debt, minus what is credited back, in any window of length w, is at most
// C + r·w + max_debt (docs/leases.md, "Debt").
func (s *storeShell) budget(k *key, x float64) {
	w := s.w
	if e := k.budget.add(w.now, x, k.rate); e > k.budgetBound+tolerance {
		w.violate("budget", k.name, w.now,
			"net grants and debts in [%s, %s] exceed C + r·w + max_debt by %s tokens", time.Duration(k.budget.start), time.Duration(w.now),
			tokens(int64(e-k.budgetBound)))
	}
}
