// Command lbcheck sends checks to a leasebucket agent and prints one line per decision: a way to
// see the agent work, and to probe a node's agent by hand. With --health it asks a server's gRPC
// health service instead (an agent's or a coordinator's), for scripts that wait for one.
//
//	lbcheck [--agent-socket PATH | --agent-addr HOST:PORT] [--n N] [--every D] tenant=T route=PATH op=OP [cost=N]
//	lbcheck --health [--agent-socket PATH | --agent-addr HOST:PORT] [--service NAME]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/internal/cli"
	"github.com/leasebucket/leasebucket/policy"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

const usageHeader = `Usage: lbcheck [flags] tenant=T route=PATH op=OP [cost=N]
       lbcheck -health [flags]

Sends N checks to a leasebucket agent, one after the other, and prints one line per decision:
allow, deny (429) or unavailable (503), with Retry-After, the tokens left as the agent sees them,
the rule's limit and the rule that decided. op is a class (read, write), a named operation or an
HTTP method; cost 0 (the default) is the rule's cost. Exits 1 if a check fails (the agent is
unreachable or rejects the check as malformed). --agent-socket can also be set by the environment
variable shown in parentheses, as for the agent and the gateway.

With --health and no arguments it asks the server's gRPC health service (grpc.health.v1) for
--service instead, which works for an agent and for a coordinator (--agent-addr), prints the
status, and exits 1 unless it is SERVING.

Flags:
`

func main() {
	cli.Main("lbcheck", func(ctx context.Context) error { return run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr) })
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := cli.NewFlags("lbcheck", usageHeader, getenv, stderr)
	var socket, addr string
	fs.EnvString(&socket, "agent-socket", "LEASEBUCKET_AGENT_SOCKET", agent.DefaultSocket, "the agent's Unix `socket`")
	fs.Rename("socket", "agent-socket")
	fs.StringVar(&addr, "agent-addr", "", "the agent's TCP `address` (its --listen) instead of the socket; with --health, any server's")
	fs.Rename("addr", "agent-addr")
	n := fs.Int("n", 1, "`number` of checks")
	every := fs.Duration("every", 0, "pause between checks")
	timeout := fs.Duration("timeout", time.Second, "deadline of each check (with --health: of the health call)")
	health := fs.Bool("health", false, "ask the server's gRPC health service instead of checking")
	service := fs.String("service", "", "with --health: the service whose status to ask (default: the server's overall status)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	cli.PrintDeprecated(stderr, "lbcheck", fs.Deprecated())
	var req *agentv1.CheckRequest
	if *health {
		if fs.NArg() > 0 {
			return fmt.Errorf("--health takes no arguments, got %q", fs.Args())
		}
	} else {
		var err error
		if req, err = parseRequest(fs.Args()); err != nil {
			return err
		}
	}
	target := "unix:" + socket // relative or absolute
	if addr != "" {
		target = "passthrough:///" + addr
	}
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	if *health {
		return checkHealth(ctx, conn, *service, *timeout, stdout)
	}
	client := agentv1.NewAgentServiceClient(conn)
	width := len(strconv.Itoa(*n))
	for i := 1; i <= *n; i++ {
		if i > 1 && *every > 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(*every):
			}
		}
		cctx, cancel := context.WithTimeout(ctx, *timeout)
		resp, err := client.Check(cctx, req)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			st := status.Convert(err)
			return fmt.Errorf("check %d: %s: %s", i, st.Code(), st.Message())
		}
		fmt.Fprintf(stdout, "%*d  %s\n", width, i, format(resp))
	}
	return nil
}

// checkHealth prints the health status of service and fails unless it is SERVING.
func checkHealth(ctx context.Context, conn *grpc.ClientConn, service string, timeout time.Duration, stdout io.Writer) error {
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	resp, err := healthpb.NewHealthClient(conn).Check(cctx, &healthpb.HealthCheckRequest{Service: service})
	if err != nil {
		st := status.Convert(err)
		return fmt.Errorf("health: %s: %s", st.Code(), st.Message())
	}
	fmt.Fprintln(stdout, resp.Status)
	if resp.Status != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("health: %s", resp.Status)
	}
	return nil
}

// parseRequest reads key=value words.
func parseRequest(words []string) (*agentv1.CheckRequest, error) {
	req := &agentv1.CheckRequest{}
	for _, w := range words {
		k, v, ok := strings.Cut(w, "=")
		if !ok {
			return nil, fmt.Errorf("%q: want key=value (see --help)", w)
		}
		switch k {
		case "tenant":
			req.Tenant = v
		case "route", "path":
			req.Route = v
		case "op", "operation", "method":
			req.Operation = v
		case "cost":
			c, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("cost=%q: %w", v, err)
			}
			req.Cost = c
		default:
			return nil, fmt.Errorf("unknown key %q (want tenant, route, op, cost)", k)
		}
	}
	if req.Tenant == "" || req.Route == "" || req.Operation == "" {
		return nil, errors.New("tenant=, route= and op= are required (see --help)")
	}
	return req, nil
}

// format shows one decision. Retry-After is also shown as the HTTP header a gateway would send
// (whole seconds, rounded up).
func format(r *agentv1.CheckResponse) string {
	var b strings.Builder
	switch r.Decision {
	case agentv1.Decision_DECISION_ALLOW:
		b.WriteString("allow      ")
	case agentv1.Decision_DECISION_DENY:
		b.WriteString("deny (429) ")
	case agentv1.Decision_DECISION_UNAVAILABLE:
		b.WriteString("unavailable (503)")
	default:
		b.WriteString(r.Decision.String())
	}
	if r.Degraded {
		b.WriteString(" degraded")
	}
	if r.ShadowDeny {
		b.WriteString(" shadow-deny")
	}
	if r.RetryAfterMs > 0 {
		fmt.Fprintf(&b, " Retry-After: %d (%dms)", (r.RetryAfterMs+999)/1000, r.RetryAfterMs)
	}
	fmt.Fprintf(&b, "  remaining=%d", r.Remaining)
	if r.WindowMs > 0 {
		fmt.Fprintf(&b, " limit=%d/%s", r.Limit, policy.FormatPeriod(time.Duration(r.WindowMs)*time.Millisecond))
	}
	if r.Rule != "" {
		fmt.Fprintf(&b, " rule=%s", r.Rule)
	}
	return b.String()
}
