package agent

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/leasebucket/leasebucket/policy"
)

// TestRuleCounters: a check's counter is found by its rule's pointer and outcome; two rules of
// one name (a reload) count under one label; past maxCounterRules the table starts afresh and
// nothing counted is lost.
func TestRuleCounters(t *testing.T) {
	m := NewMetrics()
	old, reloaded := &policy.Rule{Name: "api"}, &policy.Rule{Name: "api"}
	for range 3 {
		m.decision(Verdict{Outcome: Allow, Rule: old})
	}
	m.decision(Verdict{Outcome: Allow, Rule: reloaded})
	m.decision(Verdict{Outcome: Deny, Rule: reloaded})
	m.decision(Verdict{Outcome: Deny}) // no rule
	if got := counterValue(t, m.decisions.WithLabelValues("api", "allow")); got != 4 {
		t.Errorf("api allows counted %v, want 4 (both rule pointers)", got)
	}
	if got := counterValue(t, m.decisions.WithLabelValues("api", "deny")); got != 1 {
		t.Errorf("api denies counted %v, want 1", got)
	}
	if got := counterValue(t, m.decisions.WithLabelValues("", "deny")); got != 1 {
		t.Errorf("denies without a rule counted %v, want 1", got)
	}
	if n := len(*m.counters.m.Load()); n != 3 {
		t.Errorf("%d rules remembered, want 3 (two of one name, and none)", n)
	}
	made := 0
	mk := func() prometheus.Counter {
		made++
		return prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})
	}
	rules := make([]*policy.Rule, maxCounterRules+10)
	for i := range rules {
		rules[i] = &policy.Rule{Name: "r"}
		m.counters.of(rules[i], int(Allow), mk)
	}
	if n := len(*m.counters.m.Load()); n > maxCounterRules || n < 10 {
		t.Errorf("%d rules remembered after %d, want at most %d", n, len(rules), maxCounterRules)
	}
	r := rules[len(rules)-1]
	allow, near := m.counters.of(r, int(Allow), mk), m.counters.of(r, nearLimitSlot, mk)
	if m.counters.of(r, int(Allow), mk) != allow || m.counters.of(r, nearLimitSlot, mk) != near || allow == near || made != len(rules)+1 {
		t.Errorf("%d counters made for %d rules and one near-limit counter: a remembered one was made again, or two slots share one", made, len(rules))
	}
	m.decision(Verdict{Outcome: Allow, Rule: old})
	if got := counterValue(t, m.decisions.WithLabelValues("api", "allow")); got != 5 {
		t.Errorf("api allows counted %v after the table started afresh, want 5", got)
	}
}

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}
