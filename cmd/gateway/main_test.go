package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leasebucket/leasebucket/httplimit"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func writeFile(t *testing.T, name, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestLoadTokens(t *testing.T) {
	toks, err := loadTokens(writeFile(t, "tokens", "# demo tokens\n\ntok-acme acme\n  tok-globex\tglobex  \n"))
	if err != nil {
		t.Fatal(err)
	}
	if len(toks.tenants) != 2 {
		t.Fatalf("%d tokens, want 2", len(toks.tenants))
	}
	_, err = loadTokens(writeFile(t, "bad", "tok-a acme\nlonely\ntok-b bad\x01tenant\ntok-a again\n"))
	if err == nil {
		t.Fatal("a bad tokens file was accepted")
	}
	for _, want := range []string{"bad:2: want TOKEN TENANT", "bad:3: policy: invalid tenant", "bad:4: token listed twice"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if _, err := loadTokens(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Error("a missing tokens file was accepted")
	}
}

// TestAuthenticate: a valid bearer token puts its tenant in the context and is not passed on;
// anything else is 401, except a request without Authorization when anonymous is on.
func TestAuthenticate(t *testing.T) {
	toks, err := loadTokens(writeFile(t, "tokens", "tok-acme acme\n"))
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		tenant string
		ok     bool
		auth   string
		calls  int
	}
	next := http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		got.tenant, got.ok = httplimit.FromContext(r)
		got.auth = r.Header.Get("Authorization")
		got.calls++
	})
	tests := []struct {
		name      string
		auth      []string
		anonymous bool
		code      int
		tenant    string
	}{
		{"valid token", []string{"Bearer tok-acme"}, false, 200, "acme"},
		{"scheme is case-insensitive", []string{"bearer tok-acme"}, false, 200, "acme"},
		{"wrong token", []string{"Bearer tok-nobody"}, false, 401, ""},
		{"wrong token with anonymous on", []string{"Bearer tok-nobody"}, true, 401, ""},
		{"basic auth", []string{"Basic dG9rLWFjbWU6"}, false, 401, ""},
		{"empty bearer", []string{"Bearer "}, false, 401, ""},
		{"two headers", []string{"Bearer tok-acme", "Bearer tok-acme"}, false, 401, ""},
		{"no header", nil, false, 401, ""},
		{"no header, anonymous on", nil, true, 200, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got.tenant, got.ok, got.auth, got.calls = "", false, "", 0
			r := httptest.NewRequest("GET", "/orders/7", nil)
			for _, a := range tt.auth {
				r.Header.Add("Authorization", a)
			}
			r.Header.Set("X-Forwarded-For", "203.0.113.9") // never an identity
			w := httptest.NewRecorder()
			toks.authenticate(next, tt.anonymous).ServeHTTP(w, r)
			if w.Code != tt.code {
				t.Fatalf("status %d, want %d", w.Code, tt.code)
			}
			if tt.code == 401 {
				if got.calls != 0 || w.Header().Get("WWW-Authenticate") != "Bearer" {
					t.Errorf("401 passed the request on (%d calls) or without a challenge", got.calls)
				}
				return
			}
			if got.tenant != tt.tenant || got.ok != (tt.tenant != "") || got.auth != "" {
				t.Errorf("tenant %q (%v), Authorization passed on %q; want %q and no token", got.tenant, got.ok, got.auth, tt.tenant)
			}
		})
	}
}

func TestFlags(t *testing.T) {
	noenv := func(string) string { return "" }
	if err := run(context.Background(), []string{"--help"}, noenv, io.Discard); err != nil {
		t.Errorf("--help: %v", err)
	}
	for _, args := range [][]string{
		{"--policy", "p", "--tokens", "t"},
		{"--upstream", "http://x", "--tokens", "t"},
		{"--upstream", "http://x", "--policy", "p"},
		{"--upstream", "http://x", "--policy", "p", "--tokens", "t", "--check-timeout", "0s"},
		{"--upstream", "http://x", "--policy", "p", "--tokens", "t", "extra"},
	} {
		if _, err := parseFlags(args, noenv, io.Discard); err == nil {
			t.Errorf("parseFlags(%q) accepted it", args)
		}
	}
	env := map[string]string{"LEASEBUCKET_GATEWAY_UPSTREAM": "http://u", "LEASEBUCKET_POLICY": "p",
		"LEASEBUCKET_GATEWAY_TOKENS": "t", "LEASEBUCKET_GATEWAY_UNARY": "true", "LEASEBUCKET_AGENT_SOCKET": "/s.sock"}
	c, err := parseFlags([]string{"--upstream", "http://flag"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.upstream != "http://flag" || c.policyFile != "p" || !c.unary || c.socket != "/s.sock" {
		t.Errorf("config %+v: want the flag over the environment, the environment over defaults", c)
	}
	if err := run(context.Background(), []string{"--upstream", "ftp://x", "--policy", "p", "--tokens", "t"}, noenv, io.Discard); err == nil {
		t.Error("an ftp upstream was accepted")
	}
}

// TestRunWithoutAgent runs the gateway in process with no agent on its socket: the filter
// applies each route's failure mode (fail-closed writes 503; emergency reads degraded), the
// upstream sees only what was allowed, and the gateway shuts down cleanly.
func TestRunWithoutAgent(t *testing.T) {
	var calls atomic.Int64
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if r.Header.Get("Authorization") != "" {
			t.Error("the bearer token reached upstream")
		}
	}))
	defer up.Close()
	tokens := writeFile(t, "tokens", "tok-acme acme\n")
	stderr := &proctest.Buffer{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--listen", "127.0.0.1:0", "--upstream", up.URL, "--policy", "../../examples/policy.yaml",
			"--tokens", tokens, "--agent-socket", filepath.Join(t.TempDir(), "none.sock"), "--region", "eu-west"},
			func(string) string { return "" }, stderr)
	}()
	addr := waitAddr(t, stderr)
	get := func(method, path string) *http.Response {
		req, _ := http.NewRequest(method, "http://"+addr+path, nil)
		req.Header.Set("Authorization", "Bearer tok-acme")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	if resp := get("POST", "/orders/7"); resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "1" {
		t.Errorf("write without an agent: %d Retry-After %q, want 503 1", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	if resp := get("GET", "/products/9"); resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Degraded") != "true" {
		t.Errorf("emergency read without an agent: %d degraded %q, want 200 marked degraded", resp.StatusCode, resp.Header.Get("X-RateLimit-Degraded"))
	}
	if calls.Load() != 1 {
		t.Errorf("upstream saw %d requests, want the 1 allowed", calls.Load())
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

// waitAddr reads the gateway's "gateway serving" log line for its address.
func waitAddr(t *testing.T, stderr *proctest.Buffer) string {
	t.Helper()
	return waitLogAddr(t, stderr, "gateway serving")
}

// waitLogAddr reads the addr field of the gateway's first log record msg.
func waitLogAddr(t *testing.T, stderr *proctest.Buffer, msg string) string {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		sc := bufio.NewScanner(strings.NewReader(stderr.String()))
		for sc.Scan() {
			var rec struct{ Msg, Addr string }
			if json.Unmarshal(sc.Bytes(), &rec) == nil && rec.Msg == msg {
				return rec.Addr
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("gateway did not log %q:\n%s", msg, stderr)
	return ""
}
