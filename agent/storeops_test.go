package agent_test

import (
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/agent"
)

// storeOpsPolicy has a leased rule and a direct one, each a burst far above what the test checks;
// the leased rule's leases live 2.5 s (τ = C/4r), so one still holds tokens when the agent stops,
// more than the bucket's refill since its grant: they are handed back.
const storeOpsPolicy = `
version: "store-ops.1"
rules:
  - name: leased
    routes: ["/leased/{id}"]
    operations: [read]
    limit: 100/second
    burst: 1000
  - name: direct
    routes: ["/direct/{id}"]
    operations: [read]
    limit: 1000/second
    burst: 1000
    lease: off
default:
  limit: 60/minute
  burst: 10
`

// TestStoreOperationsByRule: leasebucket_agent_store_operations_total counts, by rule and call,
// exactly the items the coordinator received (Acquire items as acquire; leases handed back apart
// from them, in an Acquire's returns or a Return, as return). A direct rule's checks are one take
// each and hand nothing back; a leased key checked some 500 times a second takes a few leases for
// many checks and hands the last one back when the agent stops.
func TestStoreOperationsByRule(t *testing.T) {
	s := newStack(t, parsePolicy(t, storeOpsPolicy), stackOptions{})
	const leased, direct = 200, 30
	for i := range leased + direct {
		q := agent.Query{Tenant: "acme", Path: "/leased/1", Operation: "GET"}
		if i >= leased {
			q.Path = "/direct/1"
		}
		if v, err := s.srv.Decide(ctxTimeout(t, 5*time.Second), q); err != nil || v.Outcome != agent.Allow {
			t.Fatalf("check %d of %s: %s, %v; want an allow", i, q.Path, show(v), err)
		}
		time.Sleep(2 * time.Millisecond) // some 500 checks a second: a demand the leases measure
	}
	s.stop(t) // hands the leased key's lease back
	got := metricValues(t, s.reg)
	s.coord.mu.Lock()
	want := s.coord.ops
	s.coord.mu.Unlock()
	t.Logf("items the coordinator received: %v", want)
	for _, rule := range []string{"leased", "direct"} {
		for _, call := range []string{"acquire", "return"} {
			g := got["leasebucket_agent_store_operations_total,call="+call+",rule="+rule]
			if w := want[rule+" "+call]; g != float64(w) {
				t.Errorf("%s %s: the agent counts %v store operations, the coordinator received %d items", rule, call, g, w)
			}
		}
	}
	if n := want["direct acquire"]; n != direct || want["direct return"] != 0 {
		t.Errorf("direct rule: %d takes and %d returns for %d checks; want one take a check and nothing handed back", n, want["direct return"], direct)
	}
	if n := want["leased acquire"]; n < 1 || n > leased/2 {
		t.Errorf("leased rule: %d refills for %d checks of one key; want leases that serve many checks each", n, leased)
	}
	if want["leased return"] < 1 {
		t.Errorf("leased rule: no lease handed back at the agent's stop")
	}
}
