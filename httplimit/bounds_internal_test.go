package httplimit

import (
	"testing"

	"github.com/leasebucket/leasebucket/agent"
)

// TestIdempotencyKeyBound: the Filter passes exactly the keys the agent accepts, so a long key
// is charged as usual instead of turning into a 400.
func TestIdempotencyKeyBound(t *testing.T) {
	if maxIdempotencyKey != agent.MaxIdempotencyKey {
		t.Fatalf("maxIdempotencyKey = %d, the agent's MaxIdempotencyKey is %d", maxIdempotencyKey, agent.MaxIdempotencyKey)
	}
}
