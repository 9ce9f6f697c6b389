package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// binDir holds the binaries TestMain built.
var binDir string

func TestMain(m *testing.M) {
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	dir, err := os.MkdirTemp("", "lb-e2e-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	binDir = dir
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i, name := range []string{"coordinator", "agent", "gateway"} {
		wg.Go(func() {
			cmd := exec.Command("go", "build", "-o", filepath.Join(dir, name), "../cmd/"+name)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := cmd.CombinedOutput(); err != nil {
				errs[i] = fmt.Errorf("go build cmd/%s: %w\n%s", name, err, out)
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			fmt.Fprintln(os.Stderr, "e2e:", err)
			return 1
		}
	}
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: goroutines left behind:", err)
			return 1
		}
	}
	return code
}

// process is a child process whose stderr is kept for failure messages and scanned for JSON log
// records.
type process struct {
	name   string
	cmd    *exec.Cmd
	mu     sync.Mutex
	stderr bytes.Buffer
	done   chan struct{}
	err    error
}

func startProcess(t *testing.T, name string, args ...string) *process {
	t.Helper()
	p := &process{name: name, cmd: exec.Command(filepath.Join(binDir, name), args...), done: make(chan struct{})}
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // never outlive the test binary
	p.cmd.Stderr = p
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.kill()
		if t.Failed() {
			t.Logf("%s stderr (last lines):\n%s", name, lastLines(p.output(), 30))
		}
	})
	return p
}

func (p *process) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stderr.Write(b)
}

func (p *process) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stderr.String()
}

// kill sends SIGKILL and waits until the process is gone.
func (p *process) kill() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

// logField waits for a JSON log record with msg and returns its field.
func (p *process) logField(t *testing.T, msg, field string) string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		sc := bufio.NewScanner(strings.NewReader(p.output()))
		for sc.Scan() {
			var rec map[string]any
			if json.Unmarshal(sc.Bytes(), &rec) == nil && rec["msg"] == msg {
				if v, ok := rec[field].(string); ok {
					return v
				}
			}
		}
		select {
		case <-p.done:
			t.Fatalf("%s exited (%v) before logging %q:\n%s", p.name, p.err, msg, lastLines(p.output(), 30))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not log %q:\n%s", p.name, msg, lastLines(p.output(), 30))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func waitTCP(t *testing.T, addr string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, 100*time.Millisecond)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not listening: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
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
func startCoordinator(t *testing.T, f files, redisAddr string) (string, *process) {
	t.Helper()
	addr := freeAddr(t)
	p := startProcess(t, "coordinator", "--listen", addr, "--policy", f.policy, "--redis-addrs", redisAddr,
		"--metrics-listen", "", "--health-interval", "100ms", "--store-timeout", "500ms",
		"--redis-timeout", "500ms", "--redis-dial-timeout", "200ms")
	waitTCP(t, addr)
	return addr, p
}

// startAgent runs an agent on a socket in a fresh directory.
func startAgent(t *testing.T, f files, coordinator string) (socket string, p *process) {
	t.Helper()
	dir, err := os.MkdirTemp("", "lbe") // short: a socket path has at most 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	socket = filepath.Join(dir, "agent.sock")
	return socket, startAgentOn(t, f, coordinator, socket)
}

func startAgentOn(t *testing.T, f files, coordinator, socket string) *process {
	t.Helper()
	p := startProcess(t, "agent", "--socket", socket, "--coordinators", coordinator, "--policy", f.policy,
		"--region", "eu-west", "--metrics-listen", "")
	p.logField(t, "agent serving", "policy_version")
	return p
}

// gateway is a running gateway process.
type gateway struct {
	*process
	url     string // http://host:port
	metrics string // host:port of /metrics
}

func startGateway(t *testing.T, f files, socket, upstream string, extra ...string) *gateway {
	t.Helper()
	args := append([]string{"--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--upstream", upstream,
		"--agent-socket", socket, "--policy", f.policy, "--tokens", f.tokens, "--region", "eu-west",
		"--idempotency-header", "Idempotency-Key"}, extra...)
	p := startProcess(t, "gateway", args...)
	g := &gateway{process: p, metrics: p.logField(t, "metrics", "addr")}
	g.url = "http://" + p.logField(t, "gateway serving", "addr")
	return g
}

// metric reads one unlabelled counter from the gateway's /metrics.
func (g *gateway) metric(t *testing.T, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + g.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("metric %s not found", name)
	return 0
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
