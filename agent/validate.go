package agent

import (
	"errors"
	"fmt"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
)

// validate checks q against set as Check would, without charging or touching the lease table:
// the path normalizes, the tenant is valid, the rule has a slice for this agent's region and the
// cost is 1..burst. Envoy requests validate every descriptor before charging any.
func (l *Limiter) validate(set *policy.Set, q Query) error {
	r, err := set.Match(q.Path, q.Operation)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidRoute, err)
	}
	lim, err := set.Limits(r, q.Tenant, l.cfg.Region)
	if err != nil {
		if errors.Is(err, policy.ErrInvalidTenant) {
			return fmt.Errorf("%w: %w", ErrInvalidTenant, err)
		}
		return fmt.Errorf("%w: %w", ErrInvalidRoute, err)
	}
	cost := q.Cost
	if cost == 0 {
		cost = set.Cost(r)
	}
	if burst := int64(lim.Bucket.Capacity() / bucket.PerToken); cost < 0 || cost > burst {
		return fmt.Errorf("%w: cost %d is not in 1..%d, the burst of rule %q", ErrInvalidCost, cost, burst, r.Rule.Name)
	}
	return nil
}
