package sim

import (
	"testing"
	"time"
)

// benchScenario is a fleet in steady state: 10 agents share 100 tenants, each within its quota,
// so leases answer almost every check locally and one refill serves a few hundred checks. It
// makes 2M checks per simulated second.
const benchScenario = `
name: bench
seed: 7
duration: 2s
agents: 10
policy: |
  version: bench
  rules:
    - name: api
      routes: ["/api/*"]
      operations: [read]
      limit: 40000/s
      burst: 40000
  default:
    limit: 60/minute
    burst: 10
identities:
  - name: t
    tenants: 100
    path: /api/orders
    operation: GET
traffic:
  - identities: t
    rate: 2M/s
`

// BenchmarkSimulatedChecks measures simulated checks per wall second: every check is a real
// Limiter.Check, checked against the oracle and the admission bound.
func BenchmarkSimulatedChecks(b *testing.B) {
	sc, err := parseScenario("bench.yaml", []byte(benchScenario))
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	var checks int64
	var elapsed time.Duration
	for b.Loop() {
		start := time.Now()
		res, err := runScenario(sc, Options{})
		elapsed += time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
		if res.Failed() {
			b.Fatal(res.Violations)
		}
		checks += res.Checks
	}
	b.ReportMetric(float64(checks)/elapsed.Seconds(), "checks/s")
}
