// Package cli holds what leasebucket's commands share: the signal handling and exit status of
// main; one style of flags (--name, each server flag with an environment variable as its
// default), one --help layout and the deprecation of renamed flags and variables; the logger
// that --log-level and --log-format configure; and the Go runtime's and the process's metrics
// every server serves (RuntimeCollectors).
//
// Naming. A flag has one name in every command that has it (--policy, --policy-interval,
// --region, --log-level, --log-format, --agent-socket where a command talks to the agent). Its
// environment variable is LEASEBUCKET_ + the flag in upper case with '-' as '_', with the
// command's name in between for what belongs to one command (LEASEBUCKET_AGENT_METRICS_LISTEN,
// LEASEBUCKET_COORDINATOR_LISTEN) and without it for what several commands share
// (LEASEBUCKET_POLICY, LEASEBUCKET_REGION, LEASEBUCKET_LOG_LEVEL, LEASEBUCKET_AGENT_SOCKET).
package cli

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

// Main calls run with a context that SIGINT or SIGTERM cancels. If run fails, Main prints
// "name: error" on stderr and exits with status 1.
func Main(name string, run func(ctx context.Context) error) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, name+":", err)
		os.Exit(1)
	}
}
