package httplimit_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/httplimit"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
)

// settlingChecker is a fakeChecker that can Settle: it records each settle on a channel.
type settlingChecker struct {
	fakeChecker
	settled chan [2]int64
}

func (s *settlingChecker) Settle(_ context.Context, id uint64, cost int64) (client.Settled, error) {
	s.settled <- [2]int64{int64(id), cost}
	return client.Settled{Charged: cost}, nil
}

// TestSettleCosts: with SettleCosts, checks go out as estimates to settle; the cost the handler
// reports with ReportCost settles the check after the handler; a handler that reports nothing
// leaves the estimate; a Checker that cannot settle is refused at New.
func TestSettleCosts(t *testing.T) {
	chk := &settlingChecker{settled: make(chan [2]int64, 4)}
	chk.set(client.Result{Decision: client.Allow, Rule: "api", SettleID: 77}, nil)
	f, err := httplimit.New(httplimit.Config{
		Checker: chk, Policy: httplimit.Static(loadExample(t)), SettleCosts: true,
		Identity: func(*http.Request) (string, bool) { return "acme", true },
		Cost:     func(*http.Request) int64 { return 5 },
	})
	if err != nil {
		t.Fatal(err)
	}
	report := true
	h := f.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if report {
			httplimit.ReportCost(r.Context(), 42)
		}
		_, _ = w.Write([]byte("answer"))
	}))
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("GET", "/orders/1", nil))
	if w.Code != http.StatusOK || w.Body.String() != "answer" {
		t.Fatalf("response %d %q, want the handler's", w.Code, w.Body.String())
	}
	if reqs := chk.requests(); len(reqs) != 1 || !reqs[0].Settle || reqs[0].Cost != 5 {
		t.Fatalf("checks %+v, want one estimate of 5 to settle", reqs)
	}
	select {
	case got := <-chk.settled:
		if got != [2]int64{77, 42} {
			t.Errorf("settled %v, want check 77 at 42", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the reported cost was not settled")
	}
	report = false
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/orders/1", nil))
	select {
	case got := <-chk.settled:
		t.Errorf("settled %v without a reported cost, want the estimate to stand", got)
	case <-time.After(100 * time.Millisecond):
	}
	// ReportCost outside such a request does nothing: no settle, no panic.
	httplimit.ReportCost(context.Background(), 3)
	select {
	case got := <-chk.settled:
		t.Errorf("settled %v by a ReportCost outside a request", got)
	case <-time.After(50 * time.Millisecond):
	}

	_, err = httplimit.New(httplimit.Config{Checker: &fakeChecker{}, Policy: httplimit.Static(loadExample(t)), SettleCosts: true,
		Identity: func(*http.Request) (string, bool) { return "acme", true }})
	if err == nil || !strings.Contains(err.Error(), "Settle") {
		t.Errorf("New with a Checker that cannot settle = %v, want an error", err)
	}
}

const settleAgentPolicy = `version: settle-gw
rules:
  - name: llm
    routes: [/complete]
    operations: [write]
    limit: 1/day
    burst: 100
    max_debt: 20
default:
  limit: 10/minute
`

// TestSettleCostsThroughAgent: the filter in front of a real agent (Limiter, Refresher, Server
// on a Unix socket, a coordinator on the in-memory store whose clock stands still): requests
// allowed on an estimate of 1 and reporting 30 tokens each charge the bucket 30 each, down to
// max_debt below zero, where the next request is refused with 429.
func TestSettleCostsThroughAgent(t *testing.T) {
	set, err := policy.Parse("settle.yaml", []byte(settleAgentPolicy))
	if err != nil {
		t.Fatal(err)
	}
	store := memstore.New(memstore.WithClock(func() bucket.Millis { return 1_000_000 }))
	clk := clock.NewCoarse(time.Millisecond)
	defer clk.Close()
	ref := agent.NewRefresher(agent.RefresherConfig{Coordinator: coordinator.NewService(store, set), Clock: clk})
	lim := agent.New(agent.Config{AgentID: "gw-settle", Guard: clock.Guard}, set)
	ref.Start(lim)
	defer func() { _ = ref.Stop(context.Background()) }()
	dir, err := os.MkdirTemp("", "lbs")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	socket := filepath.Join(dir, "agent.sock")
	ln, err := agent.ListenUnix(socket, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	agent.NewServer(agent.ServerConfig{Limiter: lim, Clock: clk, MaxWait: time.Second}).Register(g)
	go func() { _ = g.Serve(ln) }()
	defer g.Stop()
	c, err := client.New(client.Options{Socket: socket})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	settled := make(chan struct{}, 16)
	f, err := httplimit.New(httplimit.Config{Checker: c, Policy: httplimit.Static(set), SettleCosts: true,
		Identity: func(*http.Request) (string, bool) { return "acme", true },
		Cost:     func(*http.Request) int64 { return 1 }})
	if err != nil {
		t.Fatal(err)
	}
	h := f.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		httplimit.ReportCost(r.Context(), 30)
		settled <- struct{}{}
	}))
	codes := []int{}
	for i := range 5 {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("POST", "/complete", nil))
		codes = append(codes, w.Code)
		if w.Code == http.StatusOK {
			<-settled
			// The settle goes out after the response: wait until the agent applied it.
			for deadline := time.Now().Add(5 * time.Second); lim.Stats().Settles.Load() < uint64(i+1); time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("request %d: its settle did not reach the agent within 5 s", i+1)
				}
			}
		}
	}
	// 100 tokens: three requests of 30 leave 10; the fourth is allowed on its estimate and
	// charged to -20 (max_debt), the fifth is refused.
	want := []int{200, 200, 200, 200, 429}
	for i := range want {
		if codes[i] != want[i] {
			t.Fatalf("answers %v, want %v", codes, want)
		}
	}
	if st := lim.Stats(); st.Settles.Load() != 4 || st.DebtForgiven.Load() != 0 {
		t.Errorf("%d settles, %d µ forgiven; want 4 and none", st.Settles.Load(), st.DebtForgiven.Load())
	}
}
