package agent_test

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// overridesCoordinator is a coordinator with runtime overrides (in memory) on loopback gRPC.
type overridesCoordinator struct {
	svc  *coordinator.Service
	pol  *coordinator.Policies
	ovs  *memstore.Overrides
	conn *grpc.ClientConn
}

func serveOverridesCoordinator(t *testing.T, set *policy.Set, withOverrides bool) *overridesCoordinator {
	t.Helper()
	c := &overridesCoordinator{ovs: memstore.NewOverrides()}
	c.svc = coordinator.NewService(memstore.New(), set, coordinator.WithUnknownVersion(func(v string) bool { return c.pol.Miss(v) }))
	c.pol = coordinator.NewPolicies(c.svc, set, c.ovs, zaptest.NewLogger(t), time.Second)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	coordinatorv1.RegisterCoordinatorServiceServer(g, c.svc)
	if withOverrides {
		coordinatorv1.RegisterOverridesServiceServer(g, coordinator.NewOverridesServer(c.pol))
	}
	done := make(chan struct{})
	go func() { _ = g.Serve(ln); close(done) }()
	c.conn, err = grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.conn.Close()
		g.Stop()
		<-done
	})
	return c
}

// put writes a runtime override as the admin API does: checked, stored, read back.
func (c *overridesCoordinator) put(t *testing.T, rule, tenant, spec string) {
	t.Helper()
	o, err := c.pol.Current().CheckOverride(rule, tenant, spec)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := c.ovs.PutOverride(ctx, o, coordinator.DefaultOverridesBounds); err != nil {
		t.Fatal(err)
	}
	if err := c.pol.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
}

// overridesAgent is a Limiter and Refresher whose policy comes from a PolicySource.
type overridesAgent struct {
	src *agent.PolicySource
	lim *agent.Limiter
	clk *clock.Coarse
}

func startOverridesAgent(t *testing.T, set *policy.Set, c *overridesCoordinator) *overridesAgent {
	t.Helper()
	a := &overridesAgent{clk: clock.NewCoarse(time.Millisecond)}
	t.Cleanup(a.clk.Close)
	a.src = agent.NewPolicySource(agent.PolicySourceConfig{File: set, Client: agent.NewOverridesClient(c.conn),
		Apply: func(s *policy.Set) { a.lim.SetPolicy(s) }, Logger: zaptest.NewLogger(t)})
	ref := agent.NewRefresher(agent.RefresherConfig{Coordinator: agent.CoordinatorClient(c.conn), Clock: a.clk,
		ReloadPolicy: func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = a.src.Refresh(ctx)
		},
		Logger: zaptest.NewLogger(t)})
	a.lim = agent.New(agent.Config{AgentID: "agent-ov", Guard: clock.Guard}, a.src.Current())
	ref.Start(a.lim)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := ref.Stop(ctx); err != nil {
			t.Errorf("Refresher.Stop: %v", err)
		}
	})
	return a
}

// check decides q, waiting for the refills it needs.
func (a *overridesAgent) check(t *testing.T, q agent.Query) agent.Verdict {
	t.Helper()
	for range 10 {
		v, err := a.lim.Check(a.clk.Now(), q)
		if err != nil {
			t.Fatal(err)
		}
		if v.Outcome != agent.Wait {
			return v
		}
		select {
		case <-v.Ticket.Ready():
			if v := v.Ticket.Verdict(); v.Outcome != agent.Wait {
				return v
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("check %v: no refill within 10 s", q)
		}
	}
	t.Fatalf("check %v still waits after 10 refills", q)
	return agent.Verdict{}
}

// allows counts the checks of q allowed in a row, up to limit.
func (a *overridesAgent) allows(t *testing.T, q agent.Query, limit int) int {
	t.Helper()
	for i := range limit {
		if v := a.check(t, q); v.Outcome != agent.Allow {
			return i
		}
	}
	return limit
}

// TestPolicySourceFollowsCoordinator: an agent enforces a runtime override once it has fetched
// it, and its policy version is then the coordinator's; one whose version the coordinator no
// longer knows fetches the overrides again and works on.
func TestPolicySourceFollowsCoordinator(t *testing.T) {
	set := loadPolicy(t, examplePolicy)
	c := serveOverridesCoordinator(t, set, true)
	a := startOverridesAgent(t, set, c)
	newco := agent.Query{Tenant: "newco", Path: "/orders/7", Operation: "GET"}

	c.put(t, "orders-read", "newco", "{limit: 5/1m, burst: 2}")
	// Not fetched yet: the agent works on under the file's version, which the coordinator still
	// serves with the file's limit (burst 20).
	if a.lim.Policy().Version() != set.Version() {
		t.Fatalf("agent at %s before fetching", a.lim.Policy().Version())
	}
	if n := a.allows(t, agent.Query{Tenant: "oldco", Path: "/orders/7", Operation: "GET"}, 3); n != 3 {
		t.Fatalf("under the file's version: %d of 3 allowed", n)
	}

	if err := a.src.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := a.lim.Policy().Version(), c.svc.Policy().Version(); got != want || got == set.Version() {
		t.Fatalf("agent at %s, coordinator at %s", got, want)
	}
	if n := a.allows(t, newco, 5); n != 2 {
		t.Errorf("newco under its override (burst 2): %d allowed in a row", n)
	}

	// Four more changes push the agent's version out of the coordinator's memory
	// (coordinator.KeepVersions): its next refill is refused, it fetches the overrides and goes on.
	for i := range coordinator.KeepVersions {
		c.put(t, "orders-read", fmt.Sprintf("other-%d", i), "{limit: 50/1m, burst: 5}")
	}
	fresh := agent.Query{Tenant: "other-0", Path: "/orders/1", Operation: "GET"}
	deadline := time.Now().Add(20 * time.Second)
	for a.lim.Policy().Version() != c.svc.Policy().Version() {
		if time.Now().After(deadline) {
			t.Fatalf("agent still at %s, coordinator at %s", a.lim.Policy().Version(), c.svc.Policy().Version())
		}
		a.check(t, fresh) // refused under the stale version: the route fails closed meanwhile
		time.Sleep(20 * time.Millisecond)
	}
	if n := a.allows(t, fresh, 6); n != 5 {
		t.Errorf("other-0 under its override (burst 5): %d allowed in a row", n)
	}

	// A file reload keeps the overrides.
	if err := a.src.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	before := a.lim.Policy().Version()
	a.src.SetFile(set)
	if a.lim.Policy().Version() != before {
		t.Errorf("the same file again changed the version: %s → %s", before, a.lim.Policy().Version())
	}
}

// TestPolicySourceRun: the poll loop picks up a change and a deletion.
func TestPolicySourceRun(t *testing.T) {
	set := loadPolicy(t, examplePolicy)
	c := serveOverridesCoordinator(t, set, true)
	a := startOverridesAgent(t, set, c)
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); a.src.Run(ctx, 20*time.Millisecond) }()
	t.Cleanup(func() { stop(); <-done })
	wait := func(want string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for a.lim.Policy().Version() != want {
			if time.Now().After(deadline) {
				t.Fatalf("agent at %s, want %s", a.lim.Policy().Version(), want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	c.put(t, "default", "newco", "{limit: 1/1m, burst: 1}")
	wait(c.svc.Policy().Version())
	if _, err := c.ovs.DeleteOverride(context.Background(), "default", "newco"); err != nil {
		t.Fatal(err)
	}
	if err := c.pol.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	wait(set.Version())
}

// TestPolicySourceOlderCoordinator: a coordinator without the OverridesService is one without
// runtime overrides: the agent uses its file alone and keeps working.
func TestPolicySourceOlderCoordinator(t *testing.T) {
	set := loadPolicy(t, examplePolicy)
	c := serveOverridesCoordinator(t, set, false)
	a := startOverridesAgent(t, set, c)
	if err := a.src.Refresh(context.Background()); err != nil {
		t.Fatalf("Refresh from a coordinator without the service: %v", err)
	}
	if a.lim.Policy() != set {
		t.Errorf("policy %s, want the file's", a.lim.Policy().Version())
	}
	if n := a.allows(t, agent.Query{Tenant: "acme", Path: "/orders/7", Operation: "GET"}, 3); n != 3 {
		t.Errorf("%d of 3 allowed", n)
	}
}
