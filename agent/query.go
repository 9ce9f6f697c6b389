package agent

import (
	"errors"
	"fmt"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
)

// Query is one check.
type Query struct {
	Tenant    string
	Path      string // the request path as received
	Operation string // class, named operation or HTTP method
	Cost      int64  // tokens; 0 means the rule's cost
	// Settle: Cost is an estimate, to be replaced by the actual cost with Limiter.Settle once the
	// response is done; an allowed check's Verdict carries the SettleID.
	Settle bool
	// after: Cost was incurred after the response (an Envoy descriptor of apply_on_stream_done);
	// it is charged with ChargeAfter, never decided.
	after bool
}

// Errors of Check: the request is malformed, not a decision.
var (
	ErrInvalidTenant = errors.New("agent: invalid tenant")
	ErrInvalidRoute  = errors.New("agent: invalid route")
	ErrInvalidCost   = errors.New("agent: invalid cost")
	// ErrClosed: the Limiter was closed (shutting down); no decision is made.
	ErrClosed = errors.New("agent: limiter closed")
)

// resolved is a query resolved against one policy view: the route it matched, the limits it is
// charged to, its cost, and its entry in the lease table (nil before the key's first check).
type resolved struct {
	view  *view
	route policy.Route
	lim   *policy.Limits
	cost  int64 // µ, 1..capacity
	hash  uint64
	e     *entry
	// charges: the route charges other buckets too, all or nothing (charges.go)
	charges bool
	// settle: the query's cost is an estimate to settle (settle.go)
	settle bool
}

// resolve is the one place a query meets the policy: it matches the route, finds the limits (from
// the key's entry when it has one, so a check on a live key costs a match and a table lookup),
// and checks the cost. Check, Fallback, the validation of Envoy requests and the bucket of an
// idempotency key all start here, so they accept and refuse exactly the same queries.
func (l *Limiter) resolve(v *view, q Query) (resolved, error) {
	var res resolved
	err := l.resolveInto(v, q, &res)
	return res, err
}

// resolveInto is resolve writing into res, which Check keeps on its stack: the hot path copies
// no resolved value. On an error res is left partly written and must not be used.
func (l *Limiter) resolveInto(v *view, q Query, res *resolved) error {
	r, err := v.set.Match(q.Path, q.Operation)
	if err != nil {
		return routeError(err)
	}
	res.view, res.route, res.hash = v, r, v.table.hash(r.ID, q.Tenant)
	if res.e = v.table.get(res.hash, r.ID, q.Tenant); res.e != nil {
		res.lim = res.e.lim
	} else if res.lim, err = v.set.Limits(r, q.Tenant, l.cfg.Region); err != nil {
		return routeError(err)
	}
	cost := q.Cost
	if cost == 0 {
		cost = v.set.Cost(r)
	}
	if burst := int64(res.lim.Bucket.Capacity() / bucket.PerToken); cost < 1 || cost > burst {
		return costError(cost, burst, r.Rule.Name)
	}
	res.cost = cost * int64(bucket.PerToken)
	res.settle = q.Settle
	if len(r.Charges()) > 0 {
		if q.Cost != 0 {
			if err := l.resolveCharges(v, r, q.Tenant, cost); err != nil {
				return err
			}
		}
		res.charges = true
	}
	return nil
}

// routeError maps the policy's refusal of a query to Check's errors. It and costError are kept
// out of line: resolve runs on every check, its errors on few.
//
//go:noinline
func routeError(err error) error {
	if errors.Is(err, policy.ErrInvalidTenant) {
		return fmt.Errorf("%w: %w", ErrInvalidTenant, err)
	}
	return fmt.Errorf("%w: %w", ErrInvalidRoute, err)
}

//go:noinline
func costError(cost, burst int64, rule string) error {
	return fmt.Errorf("%w: cost %d is not in 1..%d, the burst of rule %q", ErrInvalidCost, cost, burst, rule)
}

// key is the bucket key the query is charged to (the identity of an idempotency key).
func (r *resolved) key(tenant string) string { return r.view.set.KeyFor(r.route, tenant, r.lim) }
