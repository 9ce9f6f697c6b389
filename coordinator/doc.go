// Package coordinator turns an agent's wish for tokens into an atomic debit of a global bucket
// and a lease. It declares the Store the buckets live behind (implemented by redisstore and
// memstore) and holds no bucket state itself, so any number of replicas serve the same keys.
//
// PlanGrant is the grant rule, a pure function (docs/leases.md). Service is the
// CoordinatorService: thin handlers that resolve each item against the policy, plan it, send the
// batch to the Store in one call and map the outcome to statuses; the simulator calls it in
// process. Server serves a Service over gRPC with the standard health service (its status
// following a store probe), optional mutual TLS and a bounded graceful shutdown; cmd/coordinator
// wires it to Redis, the policy watcher and Prometheus (docs/coordinator.md).
package coordinator
