package coordinator

import (
	"errors"
	"fmt"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
)

// ErrCostAboveCapacity is PlanGrant's error when the least grant of a request exceeds the bucket's
// capacity: no wait can satisfy it (the service answers DENIED, retry never).
var ErrCostAboveCapacity = lease.ErrCostAboveCapacity

// PlanGrant is the grant rule (docs/leases.md): lease.Size applied to what an agent reports for
// one key (what its waiting checks need, the least grant worth having, its demand) with the
// bucket's limit, the route's cost per request and the rule's mode, all taken from the
// coordinator's own policy. It is a pure function; the store applies the plan atomically.
func PlanGrant(limit bucket.Limit, cost bucket.Micro, direct bool, ask lease.Ask) (lease.Plan, error) {
	p, err := lease.Size(limit, cost, direct, ask)
	if errors.Is(err, lease.ErrInvalidAsk) {
		return lease.Plan{}, fmt.Errorf("%w: %w", ErrInvalidRequest, err)
	}
	return p, err
}
