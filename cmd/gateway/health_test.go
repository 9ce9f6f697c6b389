package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/policy"
)

const examplePolicy = "../../examples/policy.yaml"

// serveAgent serves the real agent in process on socket (its coordinator a Service over an
// in-memory store) and returns a function that stops it, also called when the test ends.
func serveAgent(t *testing.T, socket string) (stop func()) {
	t.Helper()
	set, err := policy.Load(examplePolicy)
	if err != nil {
		t.Fatal(err)
	}
	log := zaptest.NewLogger(t)
	clk := clock.NewCoarse(time.Millisecond)
	ref := agent.NewRefresher(agent.RefresherConfig{Coordinator: coordinator.NewService(memstore.New(), set), Clock: clk, Logger: log})
	lim := agent.New(agent.Config{AgentID: "gateway-test", Region: "eu-west", Guard: clock.Guard}, set)
	ref.Start(lim)
	ln, err := agent.ListenUnix(socket, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	agent.NewServer(agent.ServerConfig{Limiter: lim, Clock: clk, Logger: log}).Register(g)
	served := make(chan struct{})
	go func() { _ = g.Serve(ln); close(served) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			g.Stop()
			<-served
			_ = ln.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = ref.Stop(ctx)
			clk.Close()
		})
	}
	t.Cleanup(stop)
	return stop
}

// get answers a GET of url: its status and body.
func get(t *testing.T, url string, header ...string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest("GET", url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header, string(b)
}

// awaitStatus polls url until it answers code.
func awaitStatus(t *testing.T, url string, code int) {
	t.Helper()
	proctest.WaitFor(t, 10*time.Second, url+" answering "+http.StatusText(code), func() bool {
		got, _, _ := get(t, url)
		return got == code
	})
}

// TestReadiness runs the gateway in process, started before its agent: it is live from the
// start, ready only while the agent answers (not before it starts, not after it stops), and a
// request made once it is ready is decided by the agent.
func TestReadiness(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer up.Close()
	dir, err := os.MkdirTemp("", "lbg") // short: a socket path has at most 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	socket := filepath.Join(dir, "agent.sock")
	tokens := writeFile(t, "tokens", "tok-acme acme\n")
	stderr := &proctest.Buffer{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--upstream", up.URL,
			"--policy", examplePolicy, "--tokens", tokens, "--agent-socket", socket, "--region", "eu-west"},
			func(string) string { return "" }, stderr)
	}()
	addr := waitAddr(t, stderr)
	admin := "http://" + waitLogAddr(t, stderr, "metrics")

	if code, _, body := get(t, admin+"/livez"); code != 200 || body != "live\n" {
		t.Errorf("/livez without an agent: %d %q, want 200 live", code, body)
	}
	if code, _, body := get(t, admin+"/readyz"); code != 503 || body != "not ready: the agent does not answer\n" {
		t.Errorf("/readyz without an agent: %d %q, want 503 naming the agent", code, body)
	}

	stop := serveAgent(t, socket)
	awaitStatus(t, admin+"/readyz", 200)
	code, hdr, _ := get(t, "http://"+addr+"/orders/7", "Authorization", "Bearer tok-acme")
	if code != 200 || hdr.Get("RateLimit") != `"orders-read";r=19;t=1` {
		t.Errorf("the first request once ready: %d RateLimit %q; want 200 with the agent's count, r=19", code, hdr.Get("RateLimit"))
	}

	stop()
	awaitStatus(t, admin+"/readyz", 503)
	if code, _, _ := get(t, admin+"/livez"); code != 200 {
		t.Errorf("/livez after the agent stopped: %d, want 200 (a restart of the gateway would not help)", code)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the gateway did not shut down")
	}
	http.DefaultClient.CloseIdleConnections()
}

// TestNotReadyWhenStopping: once the gateway is shutting down, /readyz answers 503 whatever the
// agent says, so a load balancer stops sending requests while those in flight finish.
func TestNotReadyWhenStopping(t *testing.T) {
	dir, err := os.MkdirTemp("", "lbg")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	socket := filepath.Join(dir, "agent.sock")
	serveAgent(t, socket)
	c, err := client.New(client.Options{Socket: socket, Logger: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	h := newHealth(c, time.Second, zaptest.NewLogger(t))
	mux := http.NewServeMux()
	h.register(mux)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	awaitStatus(t, srv.URL+"/readyz", 200)
	h.stop()
	if code, _, body := get(t, srv.URL+"/readyz"); code != 503 || body != "not ready: shutting down\n" {
		t.Errorf("/readyz while stopping: %d %q, want 503 shutting down", code, body)
	}
	if code, _, _ := get(t, srv.URL+"/livez"); code != 200 {
		t.Errorf("/livez while stopping: %d, want 200", code)
	}
	http.DefaultClient.CloseIdleConnections()
}
