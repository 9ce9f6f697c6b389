// Package chaos is the harness that checks leasebucket's promises from the outside, with real
// processes under load and faults: never more than the budget, nothing lost beyond the stated
// bound, always the route's failure behaviour, no leaks over time, clear errors for bad input.
//
// A run (Run) starts a Redis (standalone or a 3-master Cluster, internal/testkit/redistest), coordinator
// and agent processes built from cmd/coordinator and cmd/agent, and a TCP Proxy in front of every
// Redis node and every coordinator, so faults can slow, hang or cut each path. Load generators
// call the agents over their Unix sockets (native API and Envoy's) for a hot key, skewed cold
// keys with mixed costs, churning tenants, fail-closed and emergency routes and a ledger key,
// with idempotent retries, and log every decision with its send and receive times. A schedule
// of faults (Step) kills and restarts agents, coordinators and Redis, and slows, hangs or cuts
// the proxies, one at a time; then a bad-input client (Abuse) sends malformed requests, and a
// steady phase samples every process's RSS, goroutines and open descriptors (Sampler).
//
// The checker (Check) works only from the decision log and Redis' state: the admission bound
// C + r·(w + τ) per key and window, each agent's emergency bucket, the failure mode of every
// route during every outage, idempotent repeats, and an exact ledger on a key that barely
// refills (tokens debited in Redis = spent + stranded, stranded at most what killed agents
// held). docs/reliability.md describes the method, the fault matrix and the figures; the tests
// of this package are the entry points (`make test` runs the short form, `make chaos` and
// `make soak` the long ones).
package chaos
