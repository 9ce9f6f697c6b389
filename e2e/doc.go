// Package e2e holds the end-to-end tests of the whole critical path, with real processes:
//
//	HTTP client ─▶ cmd/gateway (httplimit) ─Unix socket─▶ cmd/agent ─gRPC─▶ cmd/coordinator ─▶ redis-server
//	                    └─▶ upstream (a test server counting its calls)
//
// The first test that needs them builds cmd/coordinator, cmd/agent and cmd/gateway into a
// temporary directory (internal/testkit/proctest); each test starts its own redis-server
// (internal/testkit/redistest) and processes on free ports, with the shipped examples/policy.yaml. The
// package has no code of its own: `go test ./e2e` runs the suite (part of `make test`).
// TestMakeRun runs `make run`'s script itself (coordinator on its in-memory store, no Redis) and
// sends the README's first request as soon as the script says to try it.
package e2e
