package e2e

import (
	"errors"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
)

// TestMakeRun is a new user's first minute: it runs `make run`'s script (on free ports and in its
// own directory, so it runs beside a developer's stack), waits for the line that says to try
// curl, and at once sends the README's first request. The answer is the README's: 200, its
// headers (RateLimit fields counting the first request of the burst) and the upstream's first
// call as the body.
func TestMakeRun(t *testing.T) {
	for _, tool := range []string{"bash", "setsid", "go", "env"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s not found: make run needs it", tool)
			}
			t.Skipf("%s not found: make run needs it", tool)
		}
	}
	want := readmeFirstRequest(t)

	dir, err := os.MkdirTemp("", "lbrun") // short: a socket path has at most 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	addrs := freeAddrs(t, 6)
	gatewayAddr := addrs[4]
	script, err := filepath.Abs("../scripts/run-local.sh")
	if err != nil {
		t.Fatal(err)
	}
	envBin, _ := exec.LookPath("env")
	p := proctest.Start(t, envBin,
		"LEASEBUCKET_RUN_DIR="+dir,
		"LEASEBUCKET_RUN_COORDINATOR="+addrs[0],
		"LEASEBUCKET_RUN_COORDINATOR_METRICS="+addrs[1],
		"LEASEBUCKET_RUN_AGENT_METRICS="+addrs[2],
		"LEASEBUCKET_RUN_UPSTREAM="+addrs[3],
		"LEASEBUCKET_RUN_GATEWAY="+gatewayAddr,
		"LEASEBUCKET_RUN_GATEWAY_METRICS="+addrs[5],
		// The same build settings as the other tests' binaries: the builds share the cache.
		"CGO_ENABLED=0",
		// As in startAgentOn: on a loaded machine the first refill can outlast the default 50 ms
		// wait; this test is about the stack being ready, not about refill latency.
		"LEASEBUCKET_AGENT_MAX_WAIT=1s",
		"bash", script)
	var pids []int
	stopped := false
	t.Cleanup(func() {
		// SIGTERM lets the script stop its processes in order (proctest's SIGKILL would leave
		// them running); then none may be left.
		if !stopped {
			p.Terminate(t)
		}
		for _, pid := range pids {
			if syscall.Kill(pid, 0) == nil {
				t.Errorf("process %d still running after the script stopped", pid)
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})

	// The first run builds the commands: allow for a cold build cache.
	exited := make(chan struct{})
	go func() { _ = p.Wait(); close(exited) }()
	readyLine := regexp.MustCompile(`leasebucket: .*\(pid (\d+)\).*\(pid (\d+)\).*\(pid (\d+)\).*\(pid (\d+)\) ready`)
	proctest.WaitFor(t, 5*time.Minute, "ready line from make run", func() bool {
		select {
		case <-exited:
			t.Fatalf("make run's script exited (%v) before its ready line:\n%s", p.Wait(), p.Stderr())
		default:
		}
		return strings.Contains(p.Stderr(), "leasebucket: try ")
	})
	m := readyLine.FindStringSubmatch(p.Stderr())
	if m == nil {
		t.Fatalf("no ready line with four pids:\n%s", p.Stderr())
	}
	for _, s := range m[1:] {
		pid, _ := strconv.Atoi(s)
		pids = append(pids, pid)
	}
	if tryLine := "curl -i -H 'Authorization: Bearer demo-acme' http://" + gatewayAddr + "/orders/7"; !strings.Contains(p.Stderr(), tryLine) {
		t.Errorf("the ready line does not say to try the README's request (%s):\n%s", tryLine, p.Stderr())
	}

	// At once, the README's first request.
	req, err := http.NewRequest(want.method, want.url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.URL.Host = gatewayAddr
	for k, v := range want.reqHeader {
		req.Header.Set(k, v)
	}
	c := httpClient(t)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != want.code {
		t.Errorf("the README's first request: %s, want %d as the README shows", resp.Status, want.code)
	}
	for k, v := range want.header {
		if k == "Date" {
			continue
		}
		if got := resp.Header.Get(k); got != v {
			t.Errorf("header %s: %q, want the README's %q", k, got, v)
		}
	}
	if got := strings.TrimRight(string(body), "\n"); got != want.body {
		t.Errorf("body %q, want the README's %q", got, want.body)
	}

	stopped = true
	p.Terminate(t) // Ctrl-C's path: the script stops everything and exits 0
}

// readmeRequest is a request the README shows and the response it shows for it.
type readmeRequest struct {
	method, url string
	reqHeader   map[string]string
	code        int
	header      map[string]string
	body        string
}

// readmeFirstRequest reads the README's first `$ curl` example: the command and the response
// printed under it.
func readmeFirstRequest(t *testing.T) readmeRequest {
	t.Helper()
	data, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	text := string(data)
	i := strings.Index(text, "```\n$ curl ")
	if i < 0 {
		t.Fatal("README.md: no ```-block starting with $ curl")
	}
	block := text[i+len("```\n"):]
	block = block[:strings.Index(block, "\n```")]
	lines := strings.Split(block, "\n")
	r := readmeRequest{method: "GET", reqHeader: map[string]string{}, header: map[string]string{}}
	args, err := shellWords(strings.TrimPrefix(lines[0], "$ "))
	if err != nil {
		t.Fatalf("README.md: %q: %v", lines[0], err)
	}
	for j := 1; j < len(args); j++ {
		switch a := args[j]; {
		case a == "-i":
		case a == "-H" && j+1 < len(args):
			k, v, _ := strings.Cut(args[j+1], ":")
			r.reqHeader[k] = strings.TrimSpace(v)
			j++
		case a == "-X" && j+1 < len(args):
			r.method = args[j+1]
			j++
		case strings.HasPrefix(a, "http://"):
			r.url = a
		default:
			t.Fatalf("README.md: the first curl has an argument this test does not know: %q", a)
		}
	}
	if _, err := url.Parse(r.url); err != nil || r.url == "" {
		t.Fatalf("README.md: the first curl's URL %q: %v", r.url, err)
	}
	status := strings.Fields(lines[1]) // HTTP/1.1 200 OK
	if len(status) < 2 {
		t.Fatalf("README.md: %q is not a status line", lines[1])
	}
	if r.code, err = strconv.Atoi(status[1]); err != nil {
		t.Fatalf("README.md: %q is not a status line", lines[1])
	}
	j := 2
	for ; j < len(lines) && lines[j] != ""; j++ {
		k, v, ok := strings.Cut(lines[j], ": ")
		if !ok {
			t.Fatalf("README.md: %q is not a header line", lines[j])
		}
		r.header[http.CanonicalHeaderKey(k)] = v
	}
	r.body = strings.Join(lines[min(j+1, len(lines)):], "\n")
	if len(r.header) == 0 || r.body == "" {
		t.Fatalf("README.md: the first curl shows no headers or no body:\n%s", block)
	}
	return r
}

// shellWords splits a command line on spaces, honouring single quotes (all the README uses).
func shellWords(s string) ([]string, error) {
	var words []string
	var w strings.Builder
	inWord, quoted := false, false
	for _, c := range s {
		switch {
		case c == '\'':
			quoted, inWord = !quoted, true
		case c == ' ' && !quoted:
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
		default:
			w.WriteRune(c)
			inWord = true
		}
	}
	if quoted {
		return nil, errors.New("unterminated quote")
	}
	if inWord {
		words = append(words, w.String())
	}
	return words, nil
}

// freeAddrs returns n distinct 127.0.0.1 addresses whose ports were free a moment ago.
func freeAddrs(t *testing.T, n int) []string {
	t.Helper()
	seen := map[string]bool{}
	var addrs []string
	for len(addrs) < n {
		if a := proctest.FreeAddr(t); !seen[a] {
			seen[a] = true
			addrs = append(addrs, a)
		}
	}
	return addrs
}
