package agent

import (
	"github.com/leasebucket/leasebucket/agent/audit"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
)

// auditVerdict offers a finished check to the audit queue: every deny, unavailable, degraded
// and shadow-would-deny answer at high priority, a sample of the other allows. It never blocks:
// an allow that is not sampled costs one random number, an audited check one channel send.
func (s *Server) auditVerdict(api string, now clock.Nanos, sl *slot) {
	if s.audit == nil {
		return
	}
	v := &sl.v
	p := audit.High
	if v.Outcome == Allow && !v.Degraded && !v.ShadowDeny {
		if !s.audit.Sample() {
			return
		}
		p = audit.Sampled
	}
	s.offerAudit(api, now, sl, p)
}

// offerAudit builds the event and queues it. It is a function of its own so that the check
// path does not pay for the event (a 200-byte value) on the allows it does not sample.
func (s *Server) offerAudit(api string, now clock.Nanos, sl *slot, p audit.Priority) {
	v := &sl.v
	ev := audit.Event{
		At:         now,
		API:        api,
		Decision:   v.Outcome.String(),
		Tenant:     sl.q.Tenant,
		Cost:       sl.q.Cost,
		RetryAfter: v.RetryAfter,
		Degraded:   v.Degraded,
		Shadow:     v.ShadowDeny,
		Replayed:   sl.replayed,
		Policy:     s.lim.Policy(),
		Path:       sl.q.Path,
		Operation:  sl.q.Operation,
	}
	if v.Rule != nil {
		ev.Rule = v.Rule.Name
	}
	if v.Limits != nil {
		ev.Remaining = int64(min(max(v.Remaining, 0), v.Limits.Bucket.Capacity()) / bucket.PerToken)
	}
	s.audit.Offer(ev, p)
}
