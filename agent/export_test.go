package agent

import (
	"context"

	"github.com/leasebucket/leasebucket/internal/clock"
)

// ParseSet is parseSet (a policy file's text, parsed or the test failed), for the tests of
// package agent_test.
var ParseSet = parseSet

// Decide is the check path for one query, for the tests of package agent_test: what Check does
// without the protobuf.
func (s *Server) Decide(ctx context.Context, q Query) (Verdict, error) {
	sl := [1]slot{{q: q}}
	s.decide(ctx, apiCheck, sl[:])
	return sl[0].v, sl[0].err
}

// HoldForTest keeps the hold of an allowed check of q at now without deciding it (as for a check
// of lease: off), for the tests of the settle window.
func (l *Limiter) HoldForTest(q Query, now clock.Nanos) uint64 { return l.holdAfter(now, q) }

// Holds is the number of checks waiting for Settle.
func (l *Limiter) Holds() int { return l.holds.Len() }
