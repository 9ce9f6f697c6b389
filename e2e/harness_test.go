package e2e

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
)

// bins are the commands the tests run, built on first use.
var bins = proctest.NewBinaries(map[string]string{
	"coordinator": "../cmd/coordinator", "agent": "../cmd/agent", "gateway": "../cmd/gateway",
})

func TestMain(m *testing.M) {
	code := m.Run()
	bins.Remove()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: goroutines left behind:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// startProcess runs the command name.
func startProcess(t *testing.T, name string, args ...string) *proctest.Process {
	t.Helper()
	return proctest.Start(t, bins.Path(t, name), args...)
}

// files are the inputs every process of a test reads: the shipped example policy and the
// gateway's bearer tokens.
type files struct {
	policy, tokens string
}

// tokens of the tests' tenants: "tok-<tenant>".
var tenants = []string{"acme", "globex", "initech", "spoof", "idem", "writer", "reader", "shared", "warm"}

func writeFiles(t *testing.T) files {
	t.Helper()
	dir := t.TempDir()
	pol, err := os.ReadFile("../examples/policy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	f := files{policy: filepath.Join(dir, "policy.yaml"), tokens: filepath.Join(dir, "tokens")}
	var toks strings.Builder
	for _, tn := range tenants {
		fmt.Fprintf(&toks, "tok-%s %s\n", tn, tn)
	}
	for path, data := range map[string][]byte{f.policy: pol, f.tokens: []byte(toks.String())} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

// startCoordinator runs a coordinator on the Redis at redisAddr and returns its address.
func startCoordinator(t *testing.T, f files, redisAddr string) (string, *proctest.Process) {
	t.Helper()
	addr := proctest.FreeAddr(t)
	p := startProcess(t, "coordinator", "--listen", addr, "--policy", f.policy, "--redis-addrs", redisAddr,
		"--metrics-listen", "", "--health-interval", "100ms", "--store-timeout", "500ms",
		"--redis-timeout", "500ms", "--redis-dial-timeout", "200ms")
	proctest.WaitTCP(t, addr)
	return addr, p
}

// startAgent runs an agent on a socket in a fresh directory.
func startAgent(t *testing.T, f files, coordinator string) (socket string, p *proctest.Process) {
	t.Helper()
	dir, err := os.MkdirTemp("", "lbe") // short: a socket path has at most 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	socket = filepath.Join(dir, "agent.sock")
	return socket, startAgentOn(t, f, coordinator, socket)
}

func startAgentOn(t *testing.T, f files, coordinator, socket string) *proctest.Process {
	t.Helper()
	// --max-wait of 1 s: under a loaded CI machine a first refill can outlast the default 50 ms,
	// and these tests are about what the gateway answers, not about refill latency.
	p := startProcess(t, "agent", "--socket", socket, "--coordinators", coordinator, "--policy", f.policy,
		"--region", "eu-west", "--metrics-listen", "", "--max-wait", "1s")
	p.LogField(t, "agent serving", "policy_version")
	return p
}

// gateway is a running gateway process.
type gateway struct {
	*proctest.Process
	url     string // http://host:port
	metrics string // host:port of /metrics
}

func startGateway(t *testing.T, f files, socket, upstream string, extra ...string) *gateway {
	t.Helper()
	args := append([]string{"--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--upstream", upstream,
		"--agent-socket", socket, "--policy", f.policy, "--tokens", f.tokens, "--region", "eu-west",
		"--idempotency-header", "Idempotency-Key"}, extra...)
	p := startProcess(t, "gateway", args...)
	g := &gateway{Process: p, metrics: p.LogField(t, "metrics", "addr")}
	g.url = "http://" + p.LogField(t, "gateway serving", "addr")
	return g
}

// metric reads one unlabelled counter from the gateway's /metrics.
func (g *gateway) metric(t *testing.T, name string) float64 {
	t.Helper()
	return proctest.Metric(t, g.metrics, name)
}

// upstream is the service behind the gateways: it counts the calls that reach it and keeps the
// X-Forwarded-For and Authorization headers it saw.
type upstream struct {
	*httptest.Server
	calls     atomic.Int64
	mu        sync.Mutex
	forwarded map[string]int // X-Forwarded-For values seen
	authSeen  int            // requests that still carried Authorization
}

func startUpstream(t *testing.T) *upstream {
	t.Helper()
	u := &upstream{forwarded: map[string]int{}}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.calls.Add(1)
		u.mu.Lock()
		u.forwarded[r.Header.Get("X-Forwarded-For")]++
		if r.Header.Get("Authorization") != "" {
			u.authSeen++
		}
		u.mu.Unlock()
		w.Header().Set("Content-Type", "text/plain")
		_, _ = io.WriteString(w, "upstream ok\n")
	}))
	t.Cleanup(u.Close)
	return u
}

// response is what a client saw.
type response struct {
	code   int
	header http.Header
	body   string
}

// httpClient is the tests' client; each test closes its idle connections.
func httpClient(t *testing.T) *http.Client {
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	t.Cleanup(c.CloseIdleConnections)
	return c
}

// send makes one request as tenant ("" for none), with extra header name/value pairs.
func send(t *testing.T, c *http.Client, method, url, tenant string, hdr ...string) response {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if tenant != "" {
		req.Header.Set("Authorization", "Bearer tok-"+tenant)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return response{code: resp.StatusCode, header: resp.Header, body: string(b)}
}

// refusalHeaders are the only headers a refusal may carry besides the HTTP server's own.
var refusalHeaders = map[string]bool{
	"Content-Type": true, "X-Content-Type-Options": true, "Cache-Control": true, "Retry-After": true,
	"Ratelimit": true, "Ratelimit-Policy": true, "X-Ratelimit-Degraded": true,
	"Date": true, "Content-Length": true, "Www-Authenticate": true,
}

// checkRefusal fails the test if a refused response says more than its status: its body must be
// the status text, its headers only those above, and nothing in it may name an internal
// (secrets: tenants, addresses, socket paths, key prefixes, component names).
func checkRefusal(t *testing.T, r response, secrets ...string) {
	t.Helper()
	if want := http.StatusText(r.code) + "\n"; r.body != want {
		t.Errorf("%d body %q, want %q", r.code, r.body, want)
	}
	all := r.body
	for k, vs := range r.header {
		if !refusalHeaders[k] {
			t.Errorf("%d carries header %s: %q", r.code, k, vs)
		}
		all += k + ": " + strings.Join(vs, ",") + "\n"
	}
	lower := strings.ToLower(all)
	for _, s := range append(secrets, "lb1:", "redis", "coordinator", "agent", "lease", "shard", "2026-12-01") {
		if s != "" && strings.Contains(lower, strings.ToLower(s)) {
			t.Errorf("%d response mentions %q:\n%s", r.code, s, all)
		}
	}
}
