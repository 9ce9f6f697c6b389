package agent_test

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/leasebucket/leasebucket/agent"
)

// descriptor builds an Envoy descriptor from key/value pairs.
func descriptor(kv ...string) *commonv3.RateLimitDescriptor {
	d := &commonv3.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &commonv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}

func envoyRequest(ds ...*commonv3.RateLimitDescriptor) *ratelimitv3.RateLimitRequest {
	return &ratelimitv3.RateLimitRequest{Domain: "leasebucket", Descriptors: ds}
}

func envoyClient(t testing.TB, s *stack) ratelimitv3.RateLimitServiceClient {
	t.Helper()
	_, conn, _, _ := s.serve(t)
	return ratelimitv3.NewRateLimitServiceClient(conn)
}

// envoyCaller returns a function that sends one ShouldRateLimit of the leasebucket domain with
// the descriptors and hits_addend given, failing the test on an error.
func envoyCaller(t *testing.T, client ratelimitv3.RateLimitServiceClient) func(hits uint32, ds ...*commonv3.RateLimitDescriptor) *ratelimitv3.RateLimitResponse {
	return func(hits uint32, ds ...*commonv3.RateLimitDescriptor) *ratelimitv3.RateLimitResponse {
		t.Helper()
		resp, err := client.ShouldRateLimit(ctxTimeout(t, 5*time.Second),
			&ratelimitv3.RateLimitRequest{Domain: "leasebucket", Descriptors: ds, HitsAddend: hits})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
}

func headerValue(resp *ratelimitv3.RateLimitResponse, key string) (string, bool) {
	for _, h := range resp.ResponseHeadersToAdd {
		if h.Key == key {
			return h.Value, true
		}
	}
	return "", false
}

// TestEnvoyCardExample is the card's example through Envoy's rate limit service over the Unix
// socket, with go-control-plane's client: orders-read allows 100 per minute with bursts of 20, so
// with the global bucket's clock standing still 20 requests are OK, then OVER_LIMIT with the
// time until a retry can pass as the reset duration and a Retry-After header.
func TestEnvoyCardExample(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	_, conn, _, _ := s.serve(t)
	client := ratelimitv3.NewRateLimitServiceClient(conn)
	req := envoyRequest(descriptor("tenant", "acme", "path", "/orders/7?expand=items", "method", "GET"))
	for i := range 25 {
		resp, err := client.ShouldRateLimit(ctxTimeout(t, 5*time.Second), req)
		if err != nil {
			t.Fatalf("request %d: %v", i+1, err)
		}
		if len(resp.Statuses) != 1 {
			t.Fatalf("request %d: %d statuses for 1 descriptor", i+1, len(resp.Statuses))
		}
		st := resp.Statuses[0]
		lim := st.CurrentLimit
		if lim.GetName() != "orders-read" || lim.GetRequestsPerUnit() != 100 || lim.GetUnit() != ratelimitv3.RateLimitResponse_RateLimit_MINUTE || lim.GetUnitMultiplier() != nil {
			t.Fatalf("request %d: current_limit %v, want orders-read 100 per MINUTE", i+1, lim)
		}
		reset := st.DurationUntilReset.AsDuration()
		if _, ok := headerValue(resp, agent.DegradedHeader); ok {
			t.Fatalf("request %d: degraded header on a normal answer", i+1)
		}
		// orders-read sets headers: true, so the IETF fields come with every answer.
		if p, _ := headerValue(resp, agent.RateLimitPolicyHeader); p != `"orders-read";q=100;w=60` {
			t.Fatalf("request %d: %s = %q", i+1, agent.RateLimitPolicyHeader, p)
		}
		if i < 20 {
			if resp.OverallCode != ratelimitv3.RateLimitResponse_OK || st.Code != ratelimitv3.RateLimitResponse_OK {
				t.Fatalf("request %d: %v, want OK", i+1, resp)
			}
			// limit_remaining is the agent's estimate: what its lease holds plus what the bucket
			// held at the last refill. With the bucket's clock standing still exactly 19-i tokens
			// are left after request i+1. A refill landing during a check can lower the estimate
			// for that one answer by the new lease, never raise it: it is at most what is left.
			if left := uint32(19 - i); st.LimitRemaining > left {
				t.Fatalf("request %d: limit_remaining %d, but only %d of the burst of 20 are left", i+1, st.LimitRemaining, left)
			}
			// Time to full at 100/minute: 0.6 s per missing token.
			if want := time.Duration(20-st.LimitRemaining) * 600 * time.Millisecond; reset < want-time.Millisecond || reset > want+time.Millisecond {
				t.Fatalf("request %d: remaining %d, reset %v, want %v", i+1, st.LimitRemaining, reset, want)
			}
			if _, ok := headerValue(resp, agent.RetryAfterHeader); ok {
				t.Fatalf("request %d: Retry-After on an OK answer", i+1)
			}
			// A token comes every 0.6 s: the next one within a second.
			if r, _ := headerValue(resp, agent.RateLimitHeader); r != fmt.Sprintf(`"orders-read";r=%d;t=1`, st.LimitRemaining) {
				t.Fatalf("request %d: %s = %q", i+1, agent.RateLimitHeader, r)
			}
			continue
		}
		if resp.OverallCode != ratelimitv3.RateLimitResponse_OVER_LIMIT || st.Code != ratelimitv3.RateLimitResponse_OVER_LIMIT {
			t.Fatalf("request %d: %v, want OVER_LIMIT", i+1, resp)
		}
		if st.LimitRemaining != 0 || reset <= 0 || reset > 600*time.Millisecond {
			t.Fatalf("request %d: remaining %d, reset %v; want 0 and the time to the next token (≤ 600 ms)", i+1, st.LimitRemaining, reset)
		}
		if ra, _ := headerValue(resp, agent.RetryAfterHeader); ra != "1" {
			t.Fatalf("request %d: Retry-After %q, want 1 (seconds, rounded up)", i+1, ra)
		}
		if r, _ := headerValue(resp, agent.RateLimitHeader); r != `"orders-read";r=0;t=1` {
			t.Fatalf("request %d: %s = %q", i+1, agent.RateLimitHeader, r)
		}
	}
	hc := healthpb.NewHealthClient(conn)
	if resp, err := hc.Check(ctxTimeout(t, 5*time.Second), &healthpb.HealthCheckRequest{Service: "envoy.service.ratelimit.v3.RateLimitService"}); err != nil || resp.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health of the RLS service = %v, %v", resp, err)
	}
}

// TestEnvoyPerDescriptor: with envoy.charge: per_descriptor, as Envoy's reference service does,
// a refused descriptor leaves the others' charges spent.
func TestEnvoyPerDescriptor(t *testing.T) {
	data, err := os.ReadFile(examplePolicy)
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Replace(string(data), "  operation_key: method\n", "  operation_key: method\n  charge: per_descriptor\n", 1)
	s := newStack(t, parsePolicy(t, text), stackOptions{})
	call := envoyCaller(t, envoyClient(t, s))
	trial := descriptor("tenant", "trial-co", "path", "/orders", "method", "GET")
	acme := descriptor("tenant", "acme", "path", "/orders/1", "method", "GET")
	if resp := call(5, trial); resp.OverallCode != ratelimitv3.RateLimitResponse_OK {
		t.Fatalf("5 hits on trial-co's burst of 5 = %v", resp)
	}
	if resp := call(0, acme, trial); resp.OverallCode != ratelimitv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("acme OK + trial-co over = %v", resp)
	}
	n := 0
	for ; n < 1000 && call(0, acme).OverallCode == ratelimitv3.RateLimitResponse_OK; n++ {
	}
	if n != 19 {
		t.Fatalf("acme's bucket allowed %d more, want 19: the refused request was charged to it once", n)
	}
}

// TestEnvoyDescriptors: every descriptor is evaluated; the overall code is OVER_LIMIT if any is;
// a descriptor that is allowed keeps its charge when another is over its limit (as Envoy's
// reference service charges each descriptor on its own); hits_addend is the cost, the
// descriptor's own overriding the request's, and unset it is the rule's cost. The global
// bucket's clock stands still, so each bucket allows exactly its burst.
func TestEnvoyDescriptors(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	call := envoyCaller(t, envoyClient(t, s))
	// exhaust sends single requests until OVER_LIMIT and returns how many were OK.
	exhaust := func(d *commonv3.RateLimitDescriptor) int {
		t.Helper()
		for n := 0; n < 1000; n++ {
			if call(0, d).OverallCode == ratelimitv3.RateLimitResponse_OVER_LIMIT {
				return n
			}
		}
		t.Fatal("never over the limit")
		return 0
	}
	ok, over := ratelimitv3.RateLimitResponse_OK, ratelimitv3.RateLimitResponse_OVER_LIMIT

	// Request-level hits: trial-co's burst of 5 on /orders in one request.
	trial := descriptor("tenant", "trial-co", "path", "/orders", "method", "GET")
	if resp := call(5, trial); resp.OverallCode != ok || resp.Statuses[0].LimitRemaining != 0 || resp.Statuses[0].CurrentLimit.GetRequestsPerUnit() != 10 {
		t.Fatalf("5 hits on trial-co's burst of 5 = %v; want OK, 0 left of its override's 10/minute", resp)
	}
	// Two descriptors, one over: OVER_LIMIT, and the other is not charged (all or nothing).
	acme := descriptor("tenant", "acme", "path", "/orders/1", "method", "GET")
	resp := call(0, acme, trial)
	if resp.OverallCode != over || resp.Statuses[0].Code != ok || resp.Statuses[1].Code != over {
		t.Fatalf("acme OK + trial-co over = %v", resp)
	}
	if n := exhaust(acme); n != 20 {
		t.Fatalf("acme's bucket allowed %d more, want 20: the refused request charged nothing", n)
	}
	// The descriptor's hits_addend overrides the request's: 5 (not 1) takes trial-co's whole
	// burst on /orders/{id}.
	own := descriptor("tenant", "trial-co", "path", "/orders/5", "method", "GET")
	own.HitsAddend = wrapperspb.UInt64(5)
	if resp := call(1, own); resp.OverallCode != ok {
		t.Fatalf("descriptor hits 5 = %v, want OK", resp)
	}
	if n := exhaust(descriptor("tenant", "trial-co", "path", "/orders/5", "method", "GET")); n != 0 {
		t.Fatalf("%d allowed after the descriptor's 5 hits, want 0", n)
	}
	// Unset hits is the rule's cost: an export costs 10 of orders-export's 30.
	export := descriptor("tenant", "acme", "path", "/orders", "method", "export")
	if resp := call(0, export); resp.Statuses[0].LimitRemaining != 20 || resp.Statuses[0].CurrentLimit.GetUnit() != ratelimitv3.RateLimitResponse_RateLimit_HOUR {
		t.Fatalf("an export = %v; want 20 left of 60 per HOUR", resp)
	}
	if n := exhaust(export); n != 2 {
		t.Fatalf("%d more exports allowed, want 2", n)
	}
	// A descriptor without an operation entry goes to the default rule's bucket of unknown
	// operations.
	if resp := call(0, descriptor("tenant", "acme", "path", "/orders")); resp.Statuses[0].CurrentLimit.GetName() != "default" {
		t.Fatalf("no operation = %v; want the default rule", resp)
	}
}

// TestEnvoyFailureModes: with the coordinators unreachable, a fail-closed rule answers with an
// UNAVAILABLE error (Envoy's failure_mode_deny and status_on_error turn it into a 503), an
// emergency rule answers OK with the degraded header; a shadow rule over its limit answers OK
// and is counted.
func TestEnvoyFailureModes(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	s.lossOK = true
	client := envoyClient(t, s)
	s.coord.setFault(unreachable)
	_, err := client.ShouldRateLimit(ctxTimeout(t, 5*time.Second), envoyRequest(descriptor("tenant", "acme", "path", "/orders/7", "method", "POST")))
	if st := status.Convert(err); st.Code() != codes.Unavailable || !strings.Contains(st.Message(), `rule "orders-write" fails closed`) || !strings.Contains(st.Message(), "retry after 1s") {
		t.Fatalf("fail-closed descriptor = %v, want UNAVAILABLE naming the rule and its Retry-After", err)
	}
	resp, err := client.ShouldRateLimit(ctxTimeout(t, 5*time.Second), envoyRequest(descriptor("tenant", "acme", "path", "/products/9", "method", "GET")))
	if err != nil || resp.OverallCode != ratelimitv3.RateLimitResponse_OK {
		t.Fatalf("emergency descriptor = %v, %v; want OK", resp, err)
	}
	if v, ok := headerValue(resp, agent.DegradedHeader); !ok || v != "true" {
		t.Fatalf("emergency answer headers %v, want %s: true", resp.ResponseHeadersToAdd, agent.DegradedHeader)
	}
	// Over a limit beats unavailable: the request is refused either way, and 429 says more.
	resp, err = client.ShouldRateLimit(ctxTimeout(t, 5*time.Second), &ratelimitv3.RateLimitRequest{Domain: "leasebucket", HitsAddend: 3,
		Descriptors: []*commonv3.RateLimitDescriptor{descriptor("tenant", "acme", "path", "/products/9", "method", "GET"),
			descriptor("tenant", "acme", "path", "/orders/7", "method", "POST")}})
	if err != nil || resp.OverallCode != ratelimitv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("emergency bucket spent + fail-closed = %v, %v; want OVER_LIMIT", resp, err)
	}
	s.coord.setFault(healthy)

	shadow := envoyRequest(descriptor("tenant", "acme", "path", "/reports/q3", "method", "GET"))
	for i := range 8 {
		resp, err := client.ShouldRateLimit(ctxTimeout(t, 5*time.Second), shadow)
		if err != nil || resp.OverallCode != ratelimitv3.RateLimitResponse_OK {
			t.Fatalf("shadow request %d = %v, %v; want OK", i+1, resp, err)
		}
	}
	values := metricValues(t, s.reg)
	if got := values["leasebucket_agent_shadow_denials_total"]; got != 3 {
		t.Fatalf("shadow denials counted %v, want 3 (8 requests on a burst of 5)", got)
	}
	if got := values["leasebucket_agent_envoy_requests_total,code=unavailable"]; got != 1 {
		t.Fatalf("envoy unavailable answers %v, want 1", got)
	}
}

// TestEnvoyInvalid: malformed and oversized requests are INVALID_ARGUMENT with a message saying
// what is wrong, and nothing is charged: no key enters the lease table, no decision is made.
func TestEnvoyInvalid(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	client := envoyClient(t, s)
	ok := func() *commonv3.RateLimitDescriptor {
		return descriptor("tenant", "acme", "path", "/orders/7", "method", "GET")
	}
	many := func(n int) []*commonv3.RateLimitDescriptor {
		out := make([]*commonv3.RateLimitDescriptor, n)
		for i := range out {
			out[i] = ok()
		}
		return out
	}
	long := strings.Repeat("a", agent.MaxEnvoyValue+1)
	withHits := func(h uint64) *commonv3.RateLimitDescriptor { d := ok(); d.HitsAddend = wrapperspb.UInt64(h); return d }
	negative := ok()
	negative.IsNegativeHits = true
	override := ok()
	override.Limit = &commonv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 1000, Unit: typev3.RateLimitUnit_SECOND}
	for _, tc := range []struct {
		name string
		req  *ratelimitv3.RateLimitRequest
		msg  string
	}{
		{"wrong domain", &ratelimitv3.RateLimitRequest{Domain: "other", Descriptors: many(1)}, `domain "other" is not served here`},
		{"no descriptors", envoyRequest(), "no descriptors"},
		{"too many descriptors", envoyRequest(many(agent.MaxEnvoyDescriptors + 1)...), "17 descriptors, at most 16"},
		{"too many entries", envoyRequest(descriptor("tenant", "a", "path", "/", "method", "GET", "x", "1", "y", "2", "z", "3", "u", "4", "v", "5", "w", "6")), "9 entries, at most 8"},
		{"oversized value", envoyRequest(ok(), descriptor("tenant", "acme", "path", "/"+long)), "value of 2050 bytes"},
		{"oversized domain", &ratelimitv3.RateLimitRequest{Domain: long, Descriptors: many(1)}, "domain of 2049 bytes"},
		{"missing tenant", envoyRequest(ok(), descriptor("path", "/orders/7", "method", "GET")), `descriptor 1: agent: invalid tenant: no "tenant" entry`},
		{"empty tenant", envoyRequest(descriptor("tenant", "", "path", "/orders/7")), "invalid tenant"},
		{"control byte in tenant", envoyRequest(descriptor("tenant", "ac\x01me", "path", "/orders/7")), "control character"},
		{"missing path", envoyRequest(descriptor("tenant", "acme", "method", "GET")), `no "path" entry`},
		{"duplicate tenant", envoyRequest(descriptor("tenant", "acme", "tenant", "bigcorp", "path", "/orders")), `key "tenant" appears twice`},
		{"unknown key", envoyRequest(descriptor("tenant", "acme", "path", "/orders", "remote_address", "10.0.0.1")), `unknown key "remote_address"`},
		{"invalid path", envoyRequest(descriptor("tenant", "acme", "path", "/orders/%00")), "invalid route"},
		{"relative path", envoyRequest(descriptor("tenant", "acme", "path", "orders")), "invalid route"},
		{"cost above the burst", &ratelimitv3.RateLimitRequest{Domain: "leasebucket", Descriptors: many(2), HitsAddend: 21}, "cost 21 is not in 1..20"},
		{"descriptor hits above the burst", envoyRequest(ok(), withHits(1<<40)), "not in 1..20"},
		{"zero descriptor hits", envoyRequest(withHits(0)), "hits_addend 0"},
		{"huge descriptor hits", envoyRequest(withHits(1 << 63)), "hits_addend 9223372036854775808"},
		{"negative hits", envoyRequest(ok(), negative), "negative hits"},
		{"limit override", envoyRequest(override), "limit overrides are not supported"},
		{"empty descriptor", envoyRequest(ok(), &commonv3.RateLimitDescriptor{}), "descriptor 1: agent: invalid route: no entries"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := client.ShouldRateLimit(ctxTimeout(t, 5*time.Second), tc.req)
			st := status.Convert(err)
			if st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), tc.msg) {
				t.Fatalf("ShouldRateLimit = %v %q, want INVALID_ARGUMENT containing %q", st.Code(), st.Message(), tc.msg)
			}
		})
	}
	if n := s.lim.Keys(); n != 0 {
		t.Fatalf("%d keys in the lease table after invalid requests only, want 0 (nothing charged)", n)
	}
	values := metricValues(t, s.reg)
	if got := values["leasebucket_agent_envoy_requests_total,code=invalid"]; got == 0 {
		t.Fatal("invalid Envoy requests not counted")
	}
	for name := range values {
		if strings.HasPrefix(name, "leasebucket_agent_decisions_total") && values[name] != 0 {
			t.Fatalf("%s = %v after invalid requests only", name, values[name])
		}
	}
}

// FuzzEnvoyRequest builds RateLimitRequests from fuzz bytes and sends them through the socket:
// the agent never panics, answers INVALID_ARGUMENT or a decision per descriptor, and an
// INVALID_ARGUMENT never charges (no decision is counted, no key is added).
func FuzzEnvoyRequest(f *testing.F) {
	for _, seed := range [][]byte{
		{0, 1, 3, 0, 4, 'a', 'c', 'm', 'e', 1, 2, '/', 'o', 2, 3, 'G', 'E', 'T'},
		{0, 2, 3, 0, 1, 'x', 1, 1, '/', 3, 0, 1, 0, 1, 'y', 1, 1, '/', 4, 1, 0},
		{1, 1, 2, 0, 1, 'x', 1, 1, '/'},
		{0, 1, 2, 0, 200, 'q', 1, 255, '/'},
		{0, 17, 1, 0, 0},
		{0, 1, 9, 0, 1, 'a', 1, 1, '/', 2, 1, 'G', 3, 1, 'z', 4, 1, 'v'},
		{2, 1, 3, 0, 2, 0xc3, 0x28, 1, 1, '/', 2, 0, 5, 1, 0x7f},
	} {
		f.Add(seed)
	}
	s := newStack(f, loadPolicy(f, examplePolicy), stackOptions{maxWait: 20 * time.Millisecond})
	client := envoyClient(f, s)
	f.Fuzz(func(t *testing.T, data []byte) {
		req := fuzzRequest(data)
		before, keys := decisionsTotal(t, s.reg), s.lim.Keys()
		resp, err := client.ShouldRateLimit(ctxTimeout(t, 5*time.Second), req)
		switch st := status.Convert(err); st.Code() {
		case codes.OK:
			if len(resp.Statuses) != len(req.Descriptors) {
				t.Fatalf("%d statuses for %d descriptors", len(resp.Statuses), len(req.Descriptors))
			}
			if got := decisionsTotal(t, s.reg) - before; got != float64(len(req.Descriptors)) {
				t.Fatalf("%v decisions for %d descriptors", got, len(req.Descriptors))
			}
		case codes.InvalidArgument:
			if after := decisionsTotal(t, s.reg); after != before || s.lim.Keys() != keys {
				t.Fatalf("INVALID_ARGUMENT %q charged: decisions %v → %v, keys %d → %d", st.Message(), before, after, keys, s.lim.Keys())
			}
		default:
			t.Fatalf("ShouldRateLimit(%v) = %v", req, err)
		}
	})
}

// fuzzRequest decodes fuzz bytes into a request. Byte by byte: the domain (0 the policy's, 1
// another, 2 one too long), the descriptors count, then per descriptor its entries count and
// per entry a key selector, a value length (255: longer than MaxEnvoyValue) and the value; then
// optionally hits, per descriptor hits, negative hits and overrides.
func fuzzRequest(data []byte) *ratelimitv3.RateLimitRequest {
	r := bytes.NewReader(data)
	next := func() int {
		b, err := r.ReadByte()
		if err != nil {
			return 0
		}
		return int(b)
	}
	req := &ratelimitv3.RateLimitRequest{}
	switch next() % 3 {
	case 0:
		req.Domain = "leasebucket"
	case 1:
		req.Domain = "other"
	default:
		req.Domain = strings.Repeat("d", agent.MaxEnvoyValue+1)
	}
	keys := []string{"tenant", "path", "method", "other", ""}
	for range next() % 20 {
		d := &commonv3.RateLimitDescriptor{}
		for range next() % 11 {
			key := keys[next()%len(keys)]
			n := next()
			var value string
			if n == 255 {
				value = "/" + strings.Repeat("v", agent.MaxEnvoyValue)
			} else {
				b := make([]byte, n%64)
				_, _ = r.Read(b)
				value = strings.ToValidUTF8(string(b), "?") // protobuf strings are UTF-8
				if key == "path" && n%2 == 0 {
					value = "/orders/" + value
				}
			}
			d.Entries = append(d.Entries, &commonv3.RateLimitDescriptor_Entry{Key: key, Value: value})
		}
		switch flags := next(); {
		case flags&1 != 0:
			d.HitsAddend = wrapperspb.UInt64(uint64(next()))
		case flags&2 != 0:
			d.IsNegativeHits = true
		case flags&4 != 0:
			d.Limit = &commonv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 1}
		}
		req.Descriptors = append(req.Descriptors, d)
	}
	req.HitsAddend = uint32(next() % 32)
	return req
}

// decisionsTotal sums leasebucket_agent_decisions_total over its labels.
func decisionsTotal(t testing.TB, reg *prometheus.Registry) float64 {
	t.Helper()
	var sum float64
	for name, v := range metricValues(t, reg) {
		if strings.HasPrefix(name, "leasebucket_agent_decisions_total,") {
			sum += v
		}
	}
	return sum
}

// metricValues gathers reg into name[,label=value...] → value (counters, gauges, histogram
// sample counts).
func metricValues(t testing.TB, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	values := map[string]float64{}
	for _, f := range families {
		for _, m := range f.Metric {
			name := f.GetName()
			for _, l := range m.Label {
				name += "," + l.GetName() + "=" + l.GetValue()
			}
			switch {
			case m.Counter != nil:
				values[name] = m.Counter.GetValue()
			case m.Gauge != nil:
				values[name] = m.Gauge.GetValue()
			case m.Histogram != nil:
				values[name] = float64(m.Histogram.GetSampleCount())
			}
		}
	}
	return values
}

// TestEnvoyTogether: descriptors of fresh keys, charged together, wait for each key's refill in
// turn and are then all charged once.
func TestEnvoyTogether(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	send := envoyCaller(t, envoyClient(t, s))
	call := func(ds ...*commonv3.RateLimitDescriptor) *ratelimitv3.RateLimitResponse { return send(0, ds...) }
	a := descriptor("tenant", "acme", "path", "/orders/1", "method", "GET")
	b := descriptor("tenant", "beta", "path", "/orders/2", "method", "GET")
	if resp := call(a, b); resp.OverallCode != ratelimitv3.RateLimitResponse_OK || resp.Statuses[0].Code != ratelimitv3.RateLimitResponse_OK ||
		resp.Statuses[1].Code != ratelimitv3.RateLimitResponse_OK {
		t.Fatalf("two fresh descriptors = %v, want both OK", resp)
	}
	for _, d := range []*commonv3.RateLimitDescriptor{a, b} {
		n := 0
		for ; n < 1000 && call(d).OverallCode == ratelimitv3.RateLimitResponse_OK; n++ {
		}
		if n != 19 {
			t.Fatalf("%v allowed %d more, want 19: the request charged each once", d, n)
		}
	}
	// Both over now: the first refusing descriptor names its bucket, the request is refused.
	if resp := call(a, b); resp.OverallCode != ratelimitv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("two exhausted descriptors = %v, want OVER_LIMIT", resp)
	}
}
