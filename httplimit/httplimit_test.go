package httplimit_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"

	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/httplimit"
	"github.com/leasebucket/leasebucket/policy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeChecker answers with a fixed result or error and records the requests it saw.
type fakeChecker struct {
	mu   sync.Mutex
	res  client.Result
	err  error
	reqs []client.Request
	// block, if set, makes Check wait for the context to end.
	block bool
}

func (f *fakeChecker) Check(ctx context.Context, req client.Request) (client.Result, error) {
	f.mu.Lock()
	f.reqs = append(f.reqs, req)
	res, err, block := f.res, f.err, f.block
	f.mu.Unlock()
	if block {
		<-ctx.Done()
		return client.Result{}, &client.UnreachableError{Target: "unix:/test.sock", Err: ctx.Err()}
	}
	return res, err
}

func (f *fakeChecker) set(res client.Result, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.res, f.err = res, err
}

func (f *fakeChecker) requests() []client.Request {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]client.Request(nil), f.reqs...)
}

// upstream counts the calls that reach it.
type upstream struct{ calls atomic.Int64 }

func (u *upstream) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	u.calls.Add(1)
	_, _ = w.Write([]byte("upstream"))
}

func loadExample(t testing.TB) *policy.Set {
	t.Helper()
	set, err := policy.Load("../examples/policy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	return set
}

// manualClock is the Filter's clock in tests.
type manualClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *manualClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *manualClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

type harness struct {
	chk     *fakeChecker
	up      *upstream
	clk     *manualClock
	handler http.Handler
	reg     *prometheus.Registry
}

// newHarness is a Filter on examples/policy.yaml whose identity is the X-Test-Tenant header (a
// stand-in for an authentication middleware in these tests).
func newHarness(t testing.TB, mod func(*httplimit.Config)) *harness {
	t.Helper()
	h := &harness{chk: &fakeChecker{}, up: &upstream{}, clk: &manualClock{t: time.Unix(1_700_000_000, 0)}, reg: prometheus.NewRegistry()}
	metrics, err := httplimit.NewMetrics(h.reg)
	if err != nil {
		t.Fatal(err)
	}
	cfg := httplimit.Config{
		Checker: h.chk,
		Policy:  httplimit.Static(loadExample(t)),
		Identity: func(r *http.Request) (string, bool) {
			v := r.Header.Get("X-Test-Tenant")
			return v, v != ""
		},
		Region:  "eu-west",
		Now:     h.clk.Now,
		Metrics: metrics,
		Logger:  zaptest.NewLogger(t),
	}
	if mod != nil {
		mod(&cfg)
	}
	f, err := httplimit.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.handler = f.Handler(h.up)
	return h
}

func (h *harness) do(method, target, tenant string, hdr ...string) *httptest.ResponseRecorder {
	r := httptest.NewRequest(method, target, nil)
	if tenant != "" {
		r.Header.Set("X-Test-Tenant", tenant)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Add(hdr[i], hdr[i+1])
	}
	w := httptest.NewRecorder()
	h.handler.ServeHTTP(w, r)
	return w
}

// TestDecisions: the HTTP answer to each agent decision; upstream is called only after an allow.
func TestDecisions(t *testing.T) {
	tests := []struct {
		name       string
		res        client.Result
		code       int
		retryAfter string
		degraded   bool
		upstream   bool
	}{
		{"allow", client.Result{Decision: client.Allow, Rule: "orders-write"}, 200, "", false, true},
		{"deny", client.Result{Decision: client.Deny, RetryAfter: 1500 * time.Millisecond, Rule: "orders-write"}, 429, "2", false, false},
		{"deny rounds up a millisecond", client.Result{Decision: client.Deny, RetryAfter: time.Millisecond, Rule: "orders-write"}, 429, "1", false, false},
		{"deny of whole seconds", client.Result{Decision: client.Deny, RetryAfter: 3 * time.Second, Rule: "orders-write"}, 429, "3", false, false},
		{"unavailable", client.Result{Decision: client.Unavailable, RetryAfter: time.Second, Rule: "orders-write"}, 503, "1", false, false},
		{"degraded allow", client.Result{Decision: client.Allow, Degraded: true, Rule: "orders-write"}, 200, "", true, true},
		{"degraded deny", client.Result{Decision: client.Deny, Degraded: true, RetryAfter: 11_001 * time.Millisecond, Rule: "orders-write"}, 429, "12", true, false},
		{"shadow deny is an allow", client.Result{Decision: client.Allow, ShadowDeny: true, Rule: "orders-write"}, 200, "", false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.chk.set(tt.res, nil)
			w := h.do("POST", "/orders/7", "acme")
			if w.Code != tt.code || w.Header().Get("Retry-After") != tt.retryAfter {
				t.Errorf("status %d Retry-After %q, want %d %q", w.Code, w.Header().Get("Retry-After"), tt.code, tt.retryAfter)
			}
			if got := w.Header().Get(httplimit.DefaultDegradedHeader) == "true"; got != tt.degraded {
				t.Errorf("degraded header %v, want %v", got, tt.degraded)
			}
			if got := h.up.calls.Load() == 1; got != tt.upstream {
				t.Errorf("upstream called: %v, want %v", got, tt.upstream)
			}
			if !tt.upstream {
				if want := http.StatusText(tt.code) + "\n"; w.Body.String() != want {
					t.Errorf("body %q, want the generic %q", w.Body.String(), want)
				}
				if w.Header().Get("Cache-Control") != "no-store" {
					t.Errorf("a refusal without Cache-Control: no-store")
				}
			}
		})
	}
}

// TestCheckRequest: what the agent is asked: the identity's tenant, the path as received (escapes
// kept, no query), the method (or the configured operation), the cost, the idempotency key.
func TestCheckRequest(t *testing.T) {
	h := newHarness(t, func(c *httplimit.Config) {
		c.IdempotencyHeader = "Idempotency-Key"
		c.Cost = func(r *http.Request) int64 {
			if r.URL.Query().Get("bulk") != "" {
				return 5
			}
			return 0
		}
	})
	h.chk.set(client.Result{Decision: client.Allow, Rule: "orders-read"}, nil)
	h.do("GET", "/files/a%2Fb?x=1", "acme", "X-Forwarded-For", "10.9.9.9")
	h.do("POST", "/orders?bulk=1", "acme", "Idempotency-Key", "k-1")
	h.do("POST", "/orders", "acme", "Idempotency-Key", "k-1", "Idempotency-Key", "k-2") // twice: ignored
	h.do("POST", "/orders", "acme", "Idempotency-Key", strings.Repeat("k", 300))        // too long: ignored
	want := []client.Request{
		// Brief: none of these rules has headers on.
		{Tenant: "acme", Route: "/files/a%2Fb", Operation: "GET", Brief: true},
		{Tenant: "acme", Route: "/orders", Operation: "POST", Cost: 5, IdempotencyKey: "k-1", Brief: true},
		{Tenant: "acme", Route: "/orders", Operation: "POST", Brief: true},
		{Tenant: "acme", Route: "/orders", Operation: "POST", Brief: true},
	}
	got := h.chk.requests()
	if len(got) != len(want) {
		t.Fatalf("%d checks, want %d: %+v", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("check %d = %+v, want %+v", i, got[i], want[i])
		}
	}

	// Without IdempotencyHeader no key is passed, and a named operation replaces the method.
	h = newHarness(t, func(c *httplimit.Config) {
		c.Operation = func(r *http.Request) string {
			if r.URL.Query().Has("export") {
				return "export"
			}
			return r.Method
		}
	})
	h.chk.set(client.Result{Decision: client.Allow, Rule: "orders-export"}, nil)
	h.do("GET", "/orders?export", "acme", "Idempotency-Key", "k-1")
	if got := h.chk.requests(); got[0] != (client.Request{Tenant: "acme", Route: "/orders", Operation: "export", Brief: true}) {
		t.Errorf("check = %+v, want operation export and no idempotency key", got[0])
	}
}

// TestBadPath: a path that cannot be normalized is 400; the agent is not asked.
func TestBadPath(t *testing.T) {
	h := newHarness(t, nil)
	h.chk.set(client.Result{Decision: client.Allow}, nil)
	for _, target := range []string{"/orders/%00", "/" + strings.Repeat("a", 3000)} {
		w := h.do("GET", target, "acme")
		if w.Code != 400 || w.Body.String() != "Bad Request\n" {
			t.Errorf("%.20s…: %d %q, want 400 with a generic body", target, w.Code, w.Body.String())
		}
	}
	if n := len(h.chk.requests()); n != 0 || h.up.calls.Load() != 0 {
		t.Errorf("%d checks and %d upstream calls for bad paths, want none", n, h.up.calls.Load())
	}
	// A repeat of an idempotency key being decided is a 409.
	h.chk.set(client.Result{}, client.ErrIdempotencyPending)
	if w := h.do("POST", "/orders/7", "acme"); w.Code != 409 || w.Header().Get("Retry-After") != "1" || h.up.calls.Load() != 0 {
		t.Errorf("pending repeat: %d Retry-After %q, upstream calls %d; want 409 1, none", w.Code, w.Header().Get("Retry-After"), h.up.calls.Load())
	}
	// The agent's INVALID_ARGUMENT is a 400 too.
	h.chk.set(client.Result{}, &client.InvalidError{Msg: "cost 50 is not in 1..20"})
	if w := h.do("GET", "/orders/7", "acme"); w.Code != 400 || strings.Contains(w.Body.String(), "cost") {
		t.Errorf("invalid check: %d %q, want 400 with a generic body", w.Code, w.Body.String())
	}
}

// TestNoIdentity: without an identity a request is refused with 503 and the rule's Retry-After,
// unless an anonymous tenant is configured; an identity the policy cannot key is refused too.
func TestNoIdentity(t *testing.T) {
	h := newHarness(t, nil)
	h.chk.set(client.Result{Decision: client.Allow, Rule: "orders-read"}, nil)
	for _, tt := range []struct {
		method, path, tenant, retry string
	}{
		{"GET", "/orders/7", "", "2"},      // orders-read: retry_after_on_failure 2s
		{"POST", "/orders/7", "", "1"},     // orders-write: 1s
		{"GET", "/products/1", "", "1"},    // an emergency rule: the default 1s
		{"GET", "/orders/7", "a\x01", "2"}, // a control byte: not a tenant
	} {
		w := h.do(tt.method, tt.path, tt.tenant)
		if w.Code != 503 || w.Header().Get("Retry-After") != tt.retry {
			t.Errorf("%s %s tenant %q: %d Retry-After %q, want 503 %s", tt.method, tt.path, tt.tenant, w.Code, w.Header().Get("Retry-After"), tt.retry)
		}
	}
	if n := len(h.chk.requests()); n != 0 || h.up.calls.Load() != 0 {
		t.Errorf("%d checks and %d upstream calls without an identity, want none", n, h.up.calls.Load())
	}
	if got := counter(t, h.reg, "leasebucket_http_requests_total", "rule", "orders-read", "outcome", "no_identity"); got != 2 {
		t.Errorf("no_identity count for orders-read = %v, want 2", got)
	}

	h = newHarness(t, func(c *httplimit.Config) { c.Anonymous = "anonymous" })
	h.chk.set(client.Result{Decision: client.Allow, Rule: "orders-read"}, nil)
	if w := h.do("GET", "/orders/7", ""); w.Code != 200 {
		t.Errorf("anonymous request: %d, want 200", w.Code)
	}
	if w := h.do("GET", "/orders/7", "a\x01"); w.Code != 503 {
		t.Errorf("invalid identity with an anonymous tenant: %d, want 503 (never charged to the anonymous tenant)", w.Code)
	}
	if got := h.chk.requests(); len(got) != 1 || got[0].Tenant != "anonymous" {
		t.Errorf("checks %+v, want one as tenant anonymous", got)
	}

	if _, err := httplimit.New(httplimit.Config{Checker: h.chk, Policy: httplimit.Static(loadExample(t)),
		Identity: httplimit.FromContext, Anonymous: strings.Repeat("x", 200)}); err == nil {
		t.Error("New accepted an anonymous tenant longer than policy.MaxTenantLen")
	}
}

// counter reads the counter name{labels} from reg, labels given as name, value pairs; 0 if
// there is no such series.
func counter(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			match := len(labels) == 2*len(m.GetLabel())
			for _, l := range m.GetLabel() {
				found := false
				for i := 0; i+1 < len(labels); i += 2 {
					found = found || (labels[i] == l.GetName() && labels[i+1] == l.GetValue())
				}
				match = match && found
			}
			if match {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// TestRateLimitHeaders: the IETF fields appear only for rules with headers on, only for answers
// about the rule's own bucket, and t agrees with Retry-After.
func TestRateLimitHeaders(t *testing.T) {
	tests := []struct {
		name         string
		method, path string
		res          client.Result
		policy, rl   string // "" for absent
	}{
		{"allow", "GET", "/orders/7",
			client.Result{Decision: client.Allow, Rule: "orders-read", Limit: 100, Window: time.Minute, Remaining: 19, Reset: 600 * time.Millisecond},
			`"orders-read";q=100;w=60`, `"orders-read";r=19;t=1`},
		{"allow of a full bucket", "GET", "/orders/7",
			client.Result{Decision: client.Allow, Rule: "orders-read", Limit: 100, Window: time.Minute, Remaining: 20},
			`"orders-read";q=100;w=60`, `"orders-read";r=20;t=0`},
		{"deny: t is Retry-After", "GET", "/orders/7",
			client.Result{Decision: client.Deny, Rule: "orders-read", Limit: 100, Window: time.Minute, RetryAfter: 594 * time.Millisecond, Reset: 12 * time.Second},
			`"orders-read";q=100;w=60`, `"orders-read";r=0;t=1`},
		{"allow of an emptied bucket: t is the next token, not the time to full", "GET", "/orders/7",
			client.Result{Decision: client.Allow, Rule: "orders-read", Limit: 100, Window: time.Minute, Remaining: 0, Reset: 11_700 * time.Millisecond},
			`"orders-read";q=100;w=60`, `"orders-read";r=0;t=1`},
		{"a slow rule: the next token in 40 s", "GET", "/orders/7",
			client.Result{Decision: client.Allow, Rule: "orders-read", Limit: 60, Window: time.Hour, Remaining: 3, Reset: 160 * time.Second},
			`"orders-read";q=60;w=3600`, `"orders-read";r=3;t=40`},
		{"a slow rule, a token's time to the next", "GET", "/orders/7",
			client.Result{Decision: client.Allow, Rule: "orders-read", Limit: 60, Window: time.Hour, Remaining: 3, Reset: 120 * time.Second},
			`"orders-read";q=60;w=3600`, `"orders-read";r=3;t=60`},
		{"a tenant override's limit", "GET", "/orders/7",
			client.Result{Decision: client.Allow, Rule: "orders-read", Limit: 1000, Window: time.Minute, Remaining: 99, Reset: 60 * time.Millisecond},
			`"orders-read";q=1000;w=60`, `"orders-read";r=99;t=1`},
		{"a window that is not whole seconds", "GET", "/orders/7",
			client.Result{Decision: client.Allow, Rule: "orders-read", Limit: 5, Window: 1500 * time.Millisecond, Remaining: 4, Reset: 2500 * time.Millisecond},
			`"orders-read";q=10;w=3`, `"orders-read";r=4;t=1`}, // a token per 300 ms
		{"headers off for the rule", "POST", "/orders/7",
			client.Result{Decision: client.Deny, Rule: "orders-write", Limit: 30, Window: time.Minute, RetryAfter: time.Second},
			"", ""},
		{"degraded: not the rule's bucket", "GET", "/orders/7",
			client.Result{Decision: client.Allow, Degraded: true, Rule: "orders-read", Limit: 100, Window: time.Minute, Remaining: 2},
			"", ""},
		{"a rule this policy does not know", "GET", "/orders/7",
			client.Result{Decision: client.Allow, Rule: "renamed", Limit: 100, Window: time.Minute, Remaining: 2},
			"", ""},
		{"the agent decided with another rule, headers off", "GET", "/orders/7",
			client.Result{Decision: client.Allow, Rule: "orders-write", Limit: 30, Window: time.Minute, Remaining: 2},
			"", ""},
		{"unavailable", "GET", "/orders/7",
			client.Result{Decision: client.Unavailable, Rule: "orders-read", Limit: 100, Window: time.Minute, RetryAfter: 2 * time.Second},
			"", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.chk.set(tt.res, nil)
			w := h.do(tt.method, tt.path, "acme")
			if got := w.Header().Get("RateLimit-Policy"); got != tt.policy {
				t.Errorf("RateLimit-Policy %q, want %q", got, tt.policy)
			}
			if got := w.Header().Get("RateLimit"); got != tt.rl {
				t.Errorf("RateLimit %q, want %q", got, tt.rl)
			}
			if strings.Contains(w.Header().Get("RateLimit")+w.Header().Get("RateLimit-Policy"), "pk=") {
				t.Error("a partition key in the RateLimit fields")
			}
		})
	}
}

// TestBriefWithoutHeaders: a check for a rule with headers off is sent Brief (its allow's
// RateLimit fields would not be read); one for a rule with headers on is not.
func TestBriefWithoutHeaders(t *testing.T) {
	h := newHarness(t, nil)
	h.chk.set(client.Result{Decision: client.Allow, Rule: "orders-read", Limit: 100, Window: time.Minute, Remaining: 19}, nil)
	h.do("GET", "/orders/7", "acme")  // orders-read: headers on
	h.do("POST", "/orders/7", "acme") // orders-write: headers off
	reqs := h.chk.requests()
	if len(reqs) != 2 || reqs[0].Brief || !reqs[1].Brief {
		t.Fatalf("checks sent %+v; want orders-read's not brief, orders-write's brief", reqs)
	}
}

// TestAgentUnreachable: the Filter applies the matched rule's failure mode itself: fail-closed
// rules answer 503 with their Retry-After; emergency rules spend the Filter's own emergency
// bucket per key (degraded), then answer 429 until it refills; shadow rules let requests through.
func TestAgentUnreachable(t *testing.T) {
	h := newHarness(t, nil)
	h.chk.set(client.Result{}, &client.UnreachableError{Target: "unix:/x", Err: errors.New("connection refused")})

	w := h.do("POST", "/orders/7", "acme")
	if w.Code != 503 || w.Header().Get("Retry-After") != "1" || w.Header().Get(httplimit.DefaultDegradedHeader) != "" {
		t.Errorf("fail-closed write: %d Retry-After %q, want 503 1, not degraded", w.Code, w.Header().Get("Retry-After"))
	}
	if w := h.do("GET", "/orders/7", "acme"); w.Code != 503 || w.Header().Get("Retry-After") != "2" {
		t.Errorf("fail-closed read: %d Retry-After %q, want 503 2", w.Code, w.Header().Get("Retry-After"))
	}
	if h.up.calls.Load() != 0 {
		t.Fatalf("upstream called %d times for fail-closed routes", h.up.calls.Load())
	}

	// catalog-read: emergency 5/minute, burst 3.
	for i := range 3 {
		w := h.do("GET", "/products/9", "acme")
		if w.Code != 200 || w.Header().Get(httplimit.DefaultDegradedHeader) != "true" {
			t.Fatalf("emergency read %d: %d degraded %q, want 200 degraded", i, w.Code, w.Header().Get(httplimit.DefaultDegradedHeader))
		}
	}
	w = h.do("GET", "/products/9", "acme")
	if w.Code != 429 || w.Header().Get("Retry-After") != "12" || w.Header().Get(httplimit.DefaultDegradedHeader) != "true" {
		t.Errorf("emergency bucket empty: %d Retry-After %q degraded %q, want 429 12 (a token per 12 s) degraded",
			w.Code, w.Header().Get("Retry-After"), w.Header().Get(httplimit.DefaultDegradedHeader))
	}
	if h.up.calls.Load() != 3 {
		t.Errorf("upstream called %d times, want the 3 emergency allows", h.up.calls.Load())
	}
	// Another tenant has its own bucket; the first refills at the emergency rate.
	if w := h.do("GET", "/products/9", "globex"); w.Code != 200 {
		t.Errorf("another tenant: %d, want 200 from its own emergency bucket", w.Code)
	}
	h.clk.Advance(11 * time.Second)
	if w := h.do("GET", "/products/9", "acme"); w.Code != 429 || w.Header().Get("Retry-After") != "1" {
		t.Errorf("after 11 s: %d Retry-After %q, want 429 1", w.Code, w.Header().Get("Retry-After"))
	}
	h.clk.Advance(time.Second)
	if w := h.do("GET", "/products/9", "acme"); w.Code != 200 {
		t.Errorf("after 12 s: %d, want 200 (one token refilled)", w.Code)
	}

	// reports-read is a shadow rule: it never denies.
	if w := h.do("GET", "/reports/q3", "acme"); w.Code != 200 {
		t.Errorf("shadow rule with the agent unreachable: %d, want 200", w.Code)
	}
	if got := counter(t, h.reg, "leasebucket_http_agent_unreachable_total"); got < 8 {
		t.Errorf("agent_unreachable_total = %v, want every check counted", got)
	}
}

// TestAgentTimeout: an agent that does not answer within Timeout is unreachable.
func TestAgentTimeout(t *testing.T) {
	h := newHarness(t, func(c *httplimit.Config) { c.Timeout = 30 * time.Millisecond })
	h.chk.mu.Lock()
	h.chk.block = true
	h.chk.mu.Unlock()
	start := time.Now()
	w := h.do("POST", "/orders/7", "acme")
	if w.Code != 503 || time.Since(start) > time.Second {
		t.Errorf("%d after %v, want 503 after the 30 ms timeout", w.Code, time.Since(start))
	}
}

// TestEmergencyKeysBounded: the Filter's emergency buckets are bounded; a key that finds no room
// is refused with 503 rather than given a fresh bucket, and buckets that refilled make room.
func TestEmergencyKeysBounded(t *testing.T) {
	h := newHarness(t, func(c *httplimit.Config) { c.MaxEmergencyKeys = 2 })
	h.chk.set(client.Result{}, &client.UnreachableError{Target: "unix:/x", Err: errors.New("refused")})
	for _, tenant := range []string{"a", "b"} {
		if w := h.do("GET", "/products/9", tenant); w.Code != 200 {
			t.Fatalf("tenant %s: %d, want 200", tenant, w.Code)
		}
	}
	h.clk.Advance(2 * time.Second) // past the sweep interval, but the buckets are not full yet
	if w := h.do("GET", "/products/9", "c"); w.Code != 503 {
		t.Errorf("third key with room for two: %d, want 503", w.Code)
	}
	if w := h.do("GET", "/products/9", "a"); w.Code != 200 {
		t.Errorf("a key that has its bucket: %d, want 200", w.Code)
	}
	h.clk.Advance(time.Minute) // every bucket refilled: full is the same as absent
	if w := h.do("GET", "/products/9", "c"); w.Code != 200 {
		t.Errorf("third key after the buckets refilled: %d, want 200", w.Code)
	}
}

// TestClientGone: a request whose client went away is not sent upstream.
func TestClientGone(t *testing.T) {
	h := newHarness(t, nil)
	h.chk.mu.Lock()
	h.chk.block = true
	h.chk.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	r := httptest.NewRequest("GET", "/products/9", nil).WithContext(ctx)
	r.Header.Set("X-Test-Tenant", "acme")
	time.AfterFunc(10*time.Millisecond, cancel)
	h.handler.ServeHTTP(httptest.NewRecorder(), r)
	if h.up.calls.Load() != 0 {
		t.Error("upstream called for a request whose client went away")
	}
}

// TestMetrics: outcomes are counted by rule.
func TestMetrics(t *testing.T) {
	h := newHarness(t, nil)
	h.chk.set(client.Result{Decision: client.Allow, Rule: "orders-read"}, nil)
	h.do("GET", "/orders/1", "acme")
	h.do("GET", "/orders/2", "acme")
	h.chk.set(client.Result{Decision: client.Deny, Rule: "orders-read", RetryAfter: time.Second}, nil)
	h.do("GET", "/orders/3", "acme")
	for _, tt := range []struct {
		outcome string
		want    float64
	}{{"allow", 2}, {"deny", 1}, {"unavailable", 0}} {
		if got := counter(t, h.reg, "leasebucket_http_requests_total", "rule", "orders-read", "outcome", tt.outcome); got != tt.want {
			t.Errorf("requests_total{orders-read,%s} = %v, want %v", tt.outcome, got, tt.want)
		}
	}
}

func TestNewRequiresItsParts(t *testing.T) {
	set := loadExample(t)
	for _, cfg := range []httplimit.Config{
		{Policy: httplimit.Static(set), Identity: httplimit.FromContext},
		{Checker: &fakeChecker{}, Identity: httplimit.FromContext},
		{Checker: &fakeChecker{}, Policy: httplimit.Static(set)},
	} {
		if _, err := httplimit.New(cfg); err == nil {
			t.Errorf("New(%+v) accepted a Config without a required part", cfg)
		}
	}
}
