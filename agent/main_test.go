package agent_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain checks that no test leaves a goroutine behind (refreshers, servers, clocks, calls),
// unless the binary runs as a benchmark's server process.
func TestMain(m *testing.M) {
	if os.Getenv(benchServerEnv) != "" {
		os.Exit(benchServerMain())
	}
	goleak.VerifyTestMain(m)
}
