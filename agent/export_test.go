package agent

import "context"

// Decide is the check path for one query, for the tests of package agent_test: what Check does
// without the protobuf.
func (s *Server) Decide(ctx context.Context, q Query) (Verdict, error) {
	sl := [1]slot{{q: q}}
	s.decide(ctx, apiCheck, sl[:])
	return sl[0].v, sl[0].err
}
