package agent

import (
	"maps"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasebucket/leasebucket/policy"
)

// A rule's counters of the check path, by slot: its decision counters by outcome, then its
// near-limit counter.
const (
	nearLimitSlot = int(Wait) + 1
	counterSlots  = nearLimitSlot + 1
)

type ruleSlots [counterSlots]prometheus.Counter

// maxCounterRules bounds the rules ruleCounters remembers. Each policy reload brings new rule
// pointers; past the bound the table starts afresh (the counters themselves live in their
// CounterVec, which hands back the same child for the same labels: nothing is lost).
const maxCounterRules = 1024

// ruleCounters finds a check's counter by its rule's pointer and a slot: a lookup in a map keyed
// by a pointer that is only read on the check path (copied, with the rule's slots, when a counter
// is added, under a lock), instead of a CounterVec's label hashing or a sync.Map's hashing of
// the rule's name per check.
type ruleCounters struct {
	m  atomic.Pointer[map[*policy.Rule]*ruleSlots]
	mu sync.Mutex
}

// of returns the counter of rule r (nil for none) in slot, made by mk the first time.
func (rc *ruleCounters) of(r *policy.Rule, slot int, mk func() prometheus.Counter) prometheus.Counter {
	if m := rc.m.Load(); m != nil {
		if s := (*m)[r]; s != nil && s[slot] != nil {
			return s[slot]
		}
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	old := rc.m.Load()
	next := map[*policy.Rule]*ruleSlots{}
	slots := new(ruleSlots)
	if old != nil {
		if s := (*old)[r]; s != nil {
			if s[slot] != nil {
				return s[slot]
			}
			*slots = *s
		}
		if len(*old) < maxCounterRules {
			next = maps.Clone(*old)
		}
	}
	slots[slot] = mk()
	next[r] = slots
	rc.m.Store(&next)
	return slots[slot]
}
