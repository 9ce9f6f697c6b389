package e2e

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/policy"
)

// stack is one of everything: Redis, a coordinator, an agent, a gateway, an upstream.
type stack struct {
	files       files
	redis       *redistest.Server
	coordinator string
	socket      string
	agent       *proctest.Process
	gw          *gateway
	up          *upstream
	client      *http.Client
}

func startStack(t *testing.T, gatewayArgs ...string) *stack {
	t.Helper()
	redistest.Require(t)
	s := &stack{files: writeFiles(t), redis: redistest.Start(t), up: startUpstream(t), client: httpClient(t)}
	s.coordinator, _ = startCoordinator(t, s.files, s.redis.Addr())
	s.socket, s.agent = startAgent(t, s.files, s.coordinator)
	s.gw = startGateway(t, s.files, s.socket, s.up.URL, gatewayArgs...)
	return s
}

// secrets are what no response may mention.
func (s *stack) secrets() []string {
	return append([]string{s.redis.Addr(), s.coordinator, s.socket, s.up.URL}, tenants...)
}

// cardLimits are the card example's limits (orders-read for acme: 100 per minute, burst 20)
// and their lease lifetime τ.
func cardLimits(t *testing.T, s *stack) (capacity, rate float64, tau time.Duration) {
	t.Helper()
	set, err := policy.Load(s.files.policy)
	if err != nil {
		t.Fatal(err)
	}
	r, err := set.Match("/orders/7", "GET")
	if err != nil {
		t.Fatal(err)
	}
	lim, err := set.Limits(r, "acme", "eu-west")
	if err != nil {
		t.Fatal(err)
	}
	if lim.Requests != 100 || lim.Period != time.Minute || lim.Burst != 20 {
		t.Fatalf("examples/policy.yaml: orders-read is %v, the tests assume the card's 100/1m burst 20", lim.Quota)
	}
	return 20, 100.0 / 60, lease.TTL(lim.Bucket)
}

// TestCardExample: the design card's example through the whole path. Tenant acme reads orders
// (100 per minute, burst 20): the burst is admitted at once, then requests are refused with 429
// and a Retry-After that works (a client waiting it out is admitted), then admitted at the
// refill rate. Upstream sees exactly the admitted requests; the checks travel on the agent's
// stream; the IETF headers describe the rule.
func TestCardExample(t *testing.T) {
	s := startStack(t)
	capacity, rate, tau := cardLimits(t, s)
	url := s.gw.url + "/orders/7"
	// A refusal's Retry-After is 1 s (a token per 600 ms, rounded up), or up to the longest pace,
	// three quarters of τ rounded up, when the burst outlasted the agent's first demand sample
	// (100 ms, a loaded machine) and the agent competed for the low bucket: it is paced until the
	// refill covers what it got (docs/leases.md).
	longest := int(math.Ceil((tau - tau/4).Seconds()))
	allowed, retryAfter := 0, 0
	start := time.Now()
	var burst []response
	for range 25 {
		burst = append(burst, send(t, s.client, "GET", url, "acme"))
	}
	burstTime := time.Since(start)
	for i, r := range burst {
		switch {
		case r.code == 200:
			allowed++
			if r.header.Get("RateLimit-Policy") != `"orders-read";q=100;w=60` || !strings.HasPrefix(r.header.Get("RateLimit"), `"orders-read";r=`) {
				t.Errorf("request %d: RateLimit-Policy %q, RateLimit %q", i+1, r.header.Get("RateLimit-Policy"), r.header.Get("RateLimit"))
			}
		case r.code == 429:
			ra, err := strconv.Atoi(r.header.Get("Retry-After"))
			if err != nil || ra < 1 || ra > longest || r.header.Get("RateLimit") != fmt.Sprintf(`"orders-read";r=0;t=%d`, ra) {
				t.Errorf("request %d: 429 with Retry-After %q, RateLimit %q; want 1 (a token per 600 ms) to %d, and r=0;t= the same",
					i+1, r.header.Get("Retry-After"), r.header.Get("RateLimit"), longest)
			}
			retryAfter = max(retryAfter, ra)
			checkRefusal(t, r, s.secrets()...)
		default:
			t.Errorf("request %d: status %d", i+1, r.code)
		}
		if i < 20 && r.code != 200 {
			t.Errorf("request %d of the burst of 20: %d", i+1, r.code)
		}
	}
	// The burst took burstTime; the bucket refilled rate·burstTime meanwhile.
	if extra := int(rate * burstTime.Seconds()); allowed > 20+extra {
		t.Errorf("%d of 25 allowed in %v, want the burst of 20 (+%d refilled)", allowed, burstTime, extra)
	}

	// A client that waits the Retry-After is admitted.
	time.Sleep(time.Duration(max(retryAfter, 1)) * time.Second)
	if r := send(t, s.client, "GET", url, "acme"); r.code != 200 {
		t.Errorf("after waiting Retry-After: %d, want 200", r.code)
	} else {
		allowed++
	}

	// Steady traffic, a request every 50 ms for 3 s: admitted at the refill rate (a token per
	// 600 ms), every refusal with a Retry-After of at least 1 s and at most the longest pace
	// (three quarters of τ, rounded up: the agent is paced until the refill covers what it got,
	// 1 s for one token, 2 s when a slow moment let two accumulate). The bounds use the times the
	// requests really took, so a slow machine cannot break them: at most what refilled while they ran, plus τ;
	// at least what refilled before the last refusal (a refusal means the tokens that came
	// before it were spent), less two for rounding and the refill in flight.
	const pace, window = 50 * time.Millisecond, 3 * time.Second
	paced := 0
	pacedStart := time.Now()
	var firstAnswer, lastRefusal time.Time
	for end := time.Now().Add(window); time.Now().Before(end); time.Sleep(pace) {
		sent := time.Now()
		r := send(t, s.client, "GET", url, "acme")
		if firstAnswer.IsZero() {
			firstAnswer = time.Now()
		}
		switch r.code {
		case 200:
			paced++
		case 429:
			lastRefusal = sent
			if ra, err := strconv.Atoi(r.header.Get("Retry-After")); err != nil || ra < 1 || ra > longest {
				t.Errorf("paced 429 with Retry-After %q, want 1 to %d", r.header.Get("Retry-After"), longest)
			}
		default:
			t.Errorf("paced request: %d", r.code)
		}
	}
	allowed += paced
	elapsed := time.Since(start)
	pacedTime := time.Since(pacedStart)
	if high := int(math.Ceil(rate * (pacedTime + tau).Seconds())); paced > high {
		t.Errorf("%d admitted in %v at a request per %v, more than the refill rate allows (%d)", paced, pacedTime, pace, high)
	}
	if lastRefusal.After(firstAnswer) {
		if low := int(rate*lastRefusal.Sub(firstAnswer).Seconds()) - 2; paced < low {
			t.Errorf("%d admitted in %v at a request per %v, refused at %v: want the refill rate's %d at least",
				paced, pacedTime, pace, lastRefusal.Sub(firstAnswer), low)
		}
	}
	// Admission bound over the whole test: C + r·(w + τ).
	if bound := capacity + rate*(elapsed+tau).Seconds(); float64(allowed) > bound {
		t.Errorf("%d admitted in %v, above the bound C + r·(w + τ) = %.1f", allowed, elapsed, bound)
	}
	if got := s.up.calls.Load(); got != int64(allowed) {
		t.Errorf("upstream called %d times, %d requests admitted", got, allowed)
	}
	if s.up.authSeen != 0 {
		t.Errorf("%d requests reached upstream with their bearer token", s.up.authSeen)
	}
	stream, unary := s.gw.metric(t, "leasebucket_gateway_agent_stream_checks_total"), s.gw.metric(t, "leasebucket_gateway_agent_unary_checks_total")
	t.Logf("%d admitted in %v (burst %d in %v, %d paced); checks: %v streamed, %v unary", allowed, elapsed, 20, burstTime, paced, stream, unary)
	if stream == 0 {
		t.Error("no check travelled on the agent's stream")
	}
}

// TestTwoGatewaysShareOneQuota: two gateways, each on its own agent, each agent on its own
// coordinator, one Redis. Hammered together for one tenant, they admit what one bucket allows
// (C + r·(w + τ)), not twice the burst.
func TestTwoGatewaysShareOneQuota(t *testing.T) {
	redistest.Require(t)
	f := writeFiles(t)
	rdb := redistest.Start(t)
	up := startUpstream(t)
	c := httpClient(t)
	var gws []*gateway
	for range 2 {
		coord, _ := startCoordinator(t, f, rdb.Addr())
		socket, _ := startAgent(t, f, coord)
		gws = append(gws, startGateway(t, f, socket, up.URL))
	}
	s := &stack{files: f}
	capacity, rate, tau := cardLimits(t, s)

	const perGateway, workers = 40, 4
	var allowed [2]atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for g := range gws {
		for range workers {
			wg.Go(func() {
				for range perGateway / workers {
					r := send(t, c, "GET", gws[g].url+"/orders/7", "shared")
					switch r.code {
					case 200:
						allowed[g].Add(1)
					case 429:
					default:
						t.Errorf("gateway %d: status %d", g, r.code)
					}
				}
			})
		}
	}
	wg.Wait()
	elapsed := time.Since(start)
	total := allowed[0].Load() + allowed[1].Load()
	bound := capacity + rate*(elapsed+tau).Seconds()
	t.Logf("gateways admitted %d + %d = %d of %d in %v (bound %.1f)", allowed[0].Load(), allowed[1].Load(), total, 2*perGateway, elapsed, bound)
	if float64(total) > bound {
		t.Errorf("%d admitted across two gateways in %v, above one bucket's C + r·(w + τ) = %.1f: the quota was multiplied", total, elapsed, bound)
	}
	if total < int64(capacity)/2 || allowed[0].Load() == 0 || allowed[1].Load() == 0 {
		t.Errorf("admitted %d and %d: each gateway should get part of the burst of %v", allowed[0].Load(), allowed[1].Load(), capacity)
	}
	if got := up.calls.Load(); got != total {
		t.Errorf("upstream called %d times, %d admitted", got, total)
	}
}

// TestRedisDown: with Redis gone, a fail-closed write answers 503 with the rule's short
// Retry-After and never reaches upstream; a low-risk read with an emergency bucket is served
// degraded (marked) until the agent's emergency bucket is empty, then 429.
func TestRedisDown(t *testing.T) {
	s := startStack(t)
	if r := send(t, s.client, "GET", s.gw.url+"/products/1", "warm"); r.code != 200 || r.header.Get("X-RateLimit-Degraded") != "" {
		t.Fatalf("before the outage: %d degraded %q", r.code, r.header.Get("X-RateLimit-Degraded"))
	}
	s.redis.Kill()
	before := s.up.calls.Load()
	checkEmergency(t, s, "writer", "reader")
	if got := s.up.calls.Load() - before; got != 3 {
		t.Errorf("upstream called %d times during the outage, want the 3 degraded reads", got)
	}
}

// TestAgentDown: with the agent gone (killed), the gateway applies each route's failure mode
// itself: the same answers as for a Redis outage, from the filter's own emergency bucket; when
// an agent is back on the socket, normal answers resume.
func TestAgentDown(t *testing.T) {
	s := startStack(t)
	if r := send(t, s.client, "GET", s.gw.url+"/products/1", "warm"); r.code != 200 {
		t.Fatalf("before the outage: %d", r.code)
	}
	s.agent.Kill()
	before := s.up.calls.Load()
	checkEmergency(t, s, "writer", "reader")
	r := send(t, s.client, "GET", s.gw.url+"/orders/7", "acme") // orders-read fails closed, Retry-After 2s
	if r.code != 503 || r.header.Get("Retry-After") != "2" {
		t.Errorf("fail-closed read without an agent: %d Retry-After %q, want 503 2", r.code, r.header.Get("Retry-After"))
	}
	checkRefusal(t, r, s.secrets()...)
	if got := s.up.calls.Load() - before; got != 3 {
		t.Errorf("upstream called %d times during the outage, want the 3 degraded reads", got)
	}

	startAgentOn(t, s.files, s.coordinator, s.socket)
	deadline := time.Now().Add(10 * time.Second)
	for {
		r := send(t, s.client, "GET", s.gw.url+"/orders/7", "acme")
		if r.code == 200 && r.header.Get("X-RateLimit-Degraded") == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("10 s after the agent restarted: %d", r.code)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// checkEmergency checks the answers during an outage for two tenants without leases: writer's
// order write fails closed; reader's product reads (catalog-read: emergency bucket of 5 per
// minute, burst 3) are served degraded three times, then refused 429 with the emergency
// bucket's Retry-After (a token per 12 s), marked degraded.
func checkEmergency(t *testing.T, s *stack, writer, reader string) {
	t.Helper()
	r := send(t, s.client, "POST", s.gw.url+"/orders/1", writer)
	if r.code != 503 || r.header.Get("Retry-After") != "1" {
		t.Errorf("fail-closed write: %d Retry-After %q, want 503 1", r.code, r.header.Get("Retry-After"))
	}
	checkRefusal(t, r, s.secrets()...)
	for i := range 3 {
		r := send(t, s.client, "GET", s.gw.url+"/products/9", reader)
		if r.code != 200 || r.header.Get("X-RateLimit-Degraded") != "true" || r.header.Get("RateLimit") != "" {
			t.Errorf("emergency read %d: %d degraded %q RateLimit %q, want 200 marked degraded, no RateLimit",
				i+1, r.code, r.header.Get("X-RateLimit-Degraded"), r.header.Get("RateLimit"))
		}
	}
	r = send(t, s.client, "GET", s.gw.url+"/products/9", reader)
	retry, _ := strconv.Atoi(r.header.Get("Retry-After"))
	if r.code != 429 || r.header.Get("X-RateLimit-Degraded") != "true" || retry < 11 || retry > 12 {
		t.Errorf("emergency bucket empty: %d degraded %q Retry-After %q, want 429 degraded, 12 (a token per 12 s)",
			r.code, r.header.Get("X-RateLimit-Degraded"), r.header.Get("Retry-After"))
	}
	checkRefusal(t, r, s.secrets()...)
}

// TestForwardedForChangesNothing: the identity is the bearer token's tenant. Headers a client
// writes about addresses or tenants neither create buckets nor reach upstream, and without a
// token they are no identity at all.
func TestForwardedForChangesNothing(t *testing.T) {
	s := startStack(t)
	start := time.Now()
	allowed := 0
	for i := range 30 {
		ip := fmt.Sprintf("198.51.100.%d", i+1)
		r := send(t, s.client, "GET", s.gw.url+"/orders/7", "spoof",
			"X-Forwarded-For", ip, "X-Real-IP", ip, "Forwarded", "for="+ip, "True-Client-IP", ip,
			"X-Tenant", fmt.Sprintf("other-%d", i), "X-Authenticated-User", "globex")
		switch r.code {
		case 200:
			allowed++
		case 429:
			checkRefusal(t, r, s.secrets()...)
		default:
			t.Errorf("request %d: %d", i+1, r.code)
		}
	}
	if extra := int(100.0 / 60 * time.Since(start).Seconds()); allowed < 20 || allowed > 20+extra {
		t.Errorf("%d of 30 spoofed requests admitted, want one tenant's burst of 20 (+%d refilled)", allowed, extra)
	}
	s.up.mu.Lock()
	for xff, n := range s.up.forwarded {
		if xff != "127.0.0.1" {
			t.Errorf("upstream saw X-Forwarded-For %q (%d times), want only the real peer 127.0.0.1", xff, n)
		}
	}
	s.up.mu.Unlock()
	// No token: the spoofed headers are not an identity.
	r := send(t, s.client, "GET", s.gw.url+"/orders/7", "", "X-Forwarded-For", "10.0.0.1", "X-Authenticated-User", "acme")
	if r.code != 401 {
		t.Errorf("no token, spoofed headers: %d, want 401", r.code)
	}
	checkRefusal(t, r, s.secrets()...)
	if got := s.up.calls.Load(); got != int64(allowed) {
		t.Errorf("upstream called %d times, %d admitted", got, allowed)
	}
}

// TestIdempotencyKey: a repeat of an Idempotency-Key is answered with the first decision and not
// charged again.
func TestIdempotencyKey(t *testing.T) {
	s := startStack(t)
	url := s.gw.url + "/orders/7"
	remaining := func(r response) string {
		t.Helper()
		if r.code != 200 {
			t.Fatalf("status %d", r.code)
		}
		_, rest, _ := strings.Cut(r.header.Get("RateLimit"), ";r=")
		n, _, _ := strings.Cut(rest, ";")
		return n
	}
	first := remaining(send(t, s.client, "GET", url, "idem", "Idempotency-Key", "k-1"))
	again := remaining(send(t, s.client, "GET", url, "idem", "Idempotency-Key", "k-1"))
	other := remaining(send(t, s.client, "GET", url, "idem", "Idempotency-Key", "k-2"))
	a, _ := strconv.Atoi(first)
	b, _ := strconv.Atoi(other)
	if again != first || b != a-1 {
		t.Errorf("remaining %s, %s, %s for keys k-1, k-1, k-2: want the repeat not charged", first, again, other)
	}
}
