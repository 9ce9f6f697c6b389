// Package proctest runs the module's commands as real child processes in tests. Binaries
// builds them with go build, once per test binary; Start runs one with its stderr kept (logged if the test fails) and
// kills it when the test ends; WaitTCP, Process.LogField, Process.Await and WaitFor poll until a
// process listens, logs a record or meets a condition; FreeAddr picks a port for it and Metric
// reads its Prometheus endpoint.
//
// Helpers that take a testing.TB call t.Fatal on failure, so they must run on that test's
// goroutine.
package proctest

import (
	"testing"
	"time"
)

const (
	// readyTimeout bounds how long a process may take to listen or to log a record.
	readyTimeout = 20 * time.Second

	pollEvery = 20 * time.Millisecond
)

// WaitFor polls cond until it holds, and fails the test if it does not within d; what names the
// awaited state in the failure message.
func WaitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	if !poll(d, cond) {
		t.Fatalf("no %s within %v", what, d)
	}
}

// poll calls cond every 20 ms until it returns true or d has passed since the first call, and
// reports whether it returned true. cond is called at least once.
func poll(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(pollEvery)
	}
	return true
}
