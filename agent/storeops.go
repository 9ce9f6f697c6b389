package agent

import (
	"sync"
	"sync/atomic"
)

// storeOps counts, by rule name, the store operations the calls built ask for: each Acquire item
// (a refill, or a debt alone, with the key's own lease handed back in the same operation) and
// each lease handed back on its own (in an Acquire's Returns or in a Return) is one operation on a
// global bucket, as the coordinator counts its items. Over a rule's checks it says what the rule's
// leases save: about one operation per check where its keys are checked less often than a lease
// lives, which direct mode (`lease: off`) costs as well (docs/leases.md). Names, not rules, key the
// counts, so that they carry over a policy reload.
type storeOps struct {
	m sync.Map // rule name → *ruleOps
}

// ruleOps are one rule's counts.
type ruleOps struct {
	acquires, returns atomic.Uint64
}

// of is rule's counts, created on its first operation.
func (s *storeOps) of(rule string) *ruleOps {
	if v, ok := s.m.Load(rule); ok {
		return v.(*ruleOps)
	}
	v, _ := s.m.LoadOrStore(rule, new(ruleOps))
	return v.(*ruleOps)
}

// count adds the operations of call c: an Acquire's items (its entries) and the leases it hands
// back apart from them (its backs).
func (s *storeOps) count(c *Call) {
	for _, e := range c.entries {
		s.of(e.rule.Name).acquires.Add(1)
	}
	for _, e := range c.backs {
		s.of(e.rule.Name).returns.Add(1)
	}
}

// StoreOps calls f with each rule's store operations so far: Acquire items and leases handed back
// alone (see storeOps), for every rule that asked for one.
func (s *Stats) StoreOps(f func(rule string, acquires, returns uint64)) {
	s.ops.m.Range(func(k, v any) bool {
		o := v.(*ruleOps)
		f(k.(string), o.acquires.Load(), o.returns.Load())
		return true
	})
}
