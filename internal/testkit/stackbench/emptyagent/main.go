// Command emptyagent is the floor the stack benchmark compares the agent with: a process that
// answers every check allowed and does nothing else, on the same kind of listener (a Unix
// stream socket) and with the same gRPC server settings as cmd/agent, for the same three APIs
// (AgentService.Check and CheckStream, Envoy's RateLimitService.ShouldRateLimit). What the agent
// serves beyond it is the limiter's own cost.
//
// It logs one JSON record ("serving", with the socket) to stderr when it listens, and exits 0 on
// SIGINT or SIGTERM.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"

	"github.com/leasebucket/leasebucket/agent"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "emptyagent:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("emptyagent", flag.ContinueOnError)
	socket := fs.String("socket", "", "Unix socket to serve on (required)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *socket == "" {
		return errors.New("--socket is required")
	}
	ln, err := net.Listen("unix", *socket)
	if err != nil {
		return err
	}
	g := grpc.NewServer(agent.GRPCServerOptions()...) // cmd/agent's server options

	agentv1.RegisterAgentServiceServer(g, empty{})
	ratelimitv3.RegisterRateLimitServiceServer(g, emptyRLS{})
	errc := make(chan error, 1)
	go func() { errc <- g.Serve(ln) }()
	_ = json.NewEncoder(os.Stderr).Encode(map[string]string{"msg": "serving", "socket": *socket})
	select {
	case <-ctx.Done():
		g.Stop()
		return nil
	case err := <-errc:
		return err
	}
}

// empty answers every native check with an allow and nothing else.
type empty struct {
	agentv1.UnimplementedAgentServiceServer
}

func (empty) Check(context.Context, *agentv1.CheckRequest) (*agentv1.CheckResponse, error) {
	return &agentv1.CheckResponse{Decision: agentv1.Decision_DECISION_ALLOW}, nil
}

// CheckStream answers each message with one allow per check, in one allocation per message as
// the agent does.
func (empty) CheckStream(st agentv1.AgentService_CheckStreamServer) error {
	for {
		req, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		answers := make([]agentv1.CheckResponse, len(req.Checks))
		resp := &agentv1.CheckStreamResponse{Id: req.Id, Results: make([]*agentv1.CheckResponse, len(req.Checks))}
		for i := range answers {
			answers[i].Decision = agentv1.Decision_DECISION_ALLOW
			resp.Results[i] = &answers[i]
		}
		if err := st.Send(resp); err != nil {
			return err
		}
	}
}

// emptyRLS answers every Envoy request OK, with one OK status per descriptor.
type emptyRLS struct {
	ratelimitv3.UnimplementedRateLimitServiceServer
}

func (emptyRLS) ShouldRateLimit(_ context.Context, req *ratelimitv3.RateLimitRequest) (*ratelimitv3.RateLimitResponse, error) {
	statuses := make([]ratelimitv3.RateLimitResponse_DescriptorStatus, len(req.Descriptors))
	resp := &ratelimitv3.RateLimitResponse{
		OverallCode: ratelimitv3.RateLimitResponse_OK,
		Statuses:    make([]*ratelimitv3.RateLimitResponse_DescriptorStatus, len(statuses)),
	}
	for i := range statuses {
		statuses[i].Code = ratelimitv3.RateLimitResponse_OK
		resp.Statuses[i] = &statuses[i]
	}
	return resp, nil
}
