// Package stackbench is the whole-stack benchmark harness: what a rate-limit check costs through
// the agent's Unix socket when everything behind it is real, in lease mode (`lease: on`) and in
// direct mode (`lease: off`, one atomic take in Redis per check), against an empty handler.
//
// A Stack is one redis-server of its own (internal/testkit/redistest, a free port), one
// cmd/coordinator on it and one cmd/agent on that coordinator (or several, StartStackAgents: a
// fleet whose loads spread their callers over the agents), separate processes built by
// internal/testkit/proctest, sharing one policy file (PolicyYAML: one rule per Mode, each on its
// own route, with the limit the Case chooses), so that both modes are measured on the same
// processes. EmptyServer is cmd emptyagent: every check allowed, nothing else, on the same kind of
// socket and gRPC server. The harness drives them only through the agent's public APIs (the
// native AgentService's Check and CheckStream, Envoy's RateLimitService) and reads them only
// from the outside:
//
//   - CPU time of each process: utime+stime of /proc/<pid>/stat (ProcCPU), every thread
//     included;
//   - Redis: INFO commandstats, the calls of every command and of the script commands
//     (RedisProbe, which takes its own INFO calls out);
//   - store operations: the coordinator's leasebucket_coordinator_items_total, one per item of
//     its Acquire and Return calls (ScrapeSum of its /metrics);
//   - the machine: /proc/stat's CPU ticks and steal (ReadHostCPU), so a run says how much of
//     the shared machine the hypervisor gave to others while it measured.
//
// The load (StartLoad) is a closed loop of callers on one gRPC connection, drawing tenants from a
// Dist (one hot key, a uniform walk, Zipf), timing every check on the client side into a Hist.
// Measure warms a load up, then reads every counter around a measured window; Result.Merge adds
// up the windows of one run (BenchmarkStack cuts a run into slices, the modes taking turns),
// Result reports them per check as benchmark metrics and Summary prints the runs as one table.
//
// The entry points are BenchmarkStack and BenchmarkStackAgents, its cases on a fleet of agents
// (part of `make bench`; the README's Performance section says what they report and how to
// reproduce it), and TestHarness and TestHarnessAgents, which run the harness on tiny loads in
// `make test` and check that it measures what it claims.
package stackbench
