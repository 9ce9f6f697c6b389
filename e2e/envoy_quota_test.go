package e2e

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	rlqfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/rate_limit_quota/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"

	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/internal/testkit/envoyquota"
	"github.com/leasebucket/leasebucket/policy"
)

// TestEnvoyQuotaConfig: the rate_limit_quota configuration in docs/gateway.md parses as an Envoy
// bootstrap with Envoy's own API types, its filter config as a RateLimitQuotaFilterConfig that
// passes the filter's validation, and it matches the policy: the quota filter after jwt_authn,
// the policy's domain, the agent's socket over HTTP/2; every bucket id carries exactly the tenant
// (from the verified JWT), a path and the method; a request each matcher takes maps, by its bucket
// id, to the rule its raw path meets; each matcher's fallbacks are that rule's failure mode; no
// matcher reuses an expired assignment.
func TestEnvoyQuotaConfig(t *testing.T) {
	bs := gatewayBootstrap(t, "<!-- envoy-rlqs:")
	if err := bs.ValidateAll(); err != nil {
		t.Fatalf("bootstrap: %v", err)
	}
	var hcm hcmv3.HttpConnectionManager
	if err := bs.GetStaticResources().GetListeners()[0].GetFilterChains()[0].GetFilters()[0].GetTypedConfig().UnmarshalTo(&hcm); err != nil {
		t.Fatal(err)
	}
	var names []string
	var cfg rlqfilterv3.RateLimitQuotaFilterConfig
	for _, f := range hcm.GetHttpFilters() {
		names = append(names, f.GetName())
		if f.GetName() == "envoy.filters.http.rate_limit_quota" {
			if err := f.GetTypedConfig().UnmarshalTo(&cfg); err != nil {
				t.Fatal(err)
			}
		}
	}
	if got := strings.Join(names, ","); got != "envoy.filters.http.jwt_authn,envoy.filters.http.rate_limit_quota,envoy.filters.http.router" {
		t.Fatalf("http filters %s: want authentication, then the quota filter, then the router", got)
	}
	if err := cfg.ValidateAll(); err != nil {
		t.Fatalf("rate_limit_quota: %v", err)
	}

	set, err := policy.Load("../examples/policy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	m := set.Envoy()
	if cfg.GetDomain() != m.Domain {
		t.Errorf("domain %q, the policy's envoy.domain is %q", cfg.GetDomain(), m.Domain)
	}
	agentCluster := cfg.GetRlqsServer().GetEnvoyGrpc().GetClusterName()
	for _, c := range bs.GetStaticResources().GetClusters() {
		if c.GetName() == agentCluster {
			pipe := c.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetPipe().GetPath()
			if pipe != client.DefaultSocket || c.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"] == nil {
				t.Errorf("cluster %s: want the agent's socket %s over HTTP/2", agentCluster, client.DefaultSocket)
			}
		}
	}

	// The matchers, through the Envoy-faithful filter: sample requests of the policy's routes.
	f, err := envoyquota.New(&cfg, nil, envoyquota.Options{})
	if err != nil {
		t.Fatal(err)
	}
	matched := map[string]bool{}
	for _, rq := range []struct{ method, path string }{
		{"GET", "/orders"}, {"POST", "/orders?draft=1"}, {"GET", "/orders/7"}, {"POST", "/orders/7"}, {"DELETE", "/orders/7?force=1"},
		{"POST", "/orders/7/cancel"}, {"GET", "/orders/7/cancel"}, {"GET", "/users/u1/orders/2026/03"},
		{"GET", "/products"}, {"GET", "/products/sku-1"}, {"GET", "/products/sku-1?color=red"}, {"GET", "/products/sku-1/reviews/9"},
		{"POST", "/products/sku-1"}, {"GET", "/search?q=x"}, {"GET", "/reports/daily"}, {"POST", "/unknown/thing"}, {"GET", "/"},
	} {
		req := envoyquota.HTTP("acme", rq.method, rq.path)
		id, settings, ok := f.Bucket(req)
		if !ok {
			t.Errorf("%s %s: no bucket; every request must be limited (on_no_match)", rq.method, rq.path)
			continue
		}
		keys := slices.Sorted(func(yield func(string) bool) {
			for k := range id {
				if !yield(k) {
					return
				}
			}
		})
		if want := slices.Sorted(slices.Values([]string{m.TenantKey, m.RouteKey, m.OperationKey})); !slices.Equal(keys, want) {
			t.Errorf("%s %s: bucket id keys %v, want %v", rq.method, rq.path, keys, want)
			continue
		}
		if id[m.TenantKey] != "acme" || id[m.OperationKey] != rq.method {
			t.Errorf("%s %s: bucket id %v: want the JWT's sub as the tenant and the method", rq.method, rq.path, id)
		}
		byBucket, err1 := set.Match(id[m.RouteKey], id[m.OperationKey])
		byRequest, err2 := set.Match(rq.path, rq.method)
		if err1 != nil || err2 != nil || byBucket.Rule.Name != byRequest.Rule.Name {
			t.Errorf("%s %s: its bucket %v maps to rule %v, the request itself to %v (%v, %v)", rq.method, rq.path, id,
				byBucket.Rule, byRequest.Rule, err1, err2)
			continue
		}
		matched[byRequest.Rule.Name] = true
		checkFallbacks(t, fmt.Sprintf("%s %s (rule %s)", rq.method, rq.path, byRequest.Rule.Name), byRequest.Rule, settings)
	}
	for _, want := range []string{"orders-read", "orders-write", "catalog-read", "search", "reports-read", policy.DefaultRuleName} {
		if !matched[want] {
			t.Errorf("no sample request reached rule %s", want)
		}
	}
}

// checkFallbacks: the two behaviours of a bucket are its rule's failure mode: DENY_ALL for a
// fail-closed rule, the emergency bucket (burst and rate) for an emergency rule, ALLOW_ALL for a
// shadow rule (it never denies); a report interval; never reuse_last_assignment.
func checkFallbacks(t *testing.T, what string, r *policy.Rule, s *rlqfilterv3.RateLimitQuotaBucketSettings) {
	t.Helper()
	if s.GetReportingInterval() == nil {
		t.Errorf("%s: no reporting_interval", what)
	}
	eb := s.GetExpiredAssignmentBehavior()
	if eb.GetReuseLastAssignment() != nil {
		t.Errorf("%s: reuse_last_assignment admits past the lease behind the assignment", what)
	}
	for name, fb := range map[string]*typev3.RateLimitStrategy{
		"no_assignment_behavior":      s.GetNoAssignmentBehavior().GetFallbackRateLimit(),
		"expired_assignment_behavior": eb.GetFallbackRateLimit(),
	} {
		switch {
		case fb == nil:
			t.Errorf("%s: %s unset (allows everything, or abandons into no_assignment_behavior)", what, name)
		case r.Shadow:
			if fb.GetBlanketRule() != typev3.RateLimitStrategy_ALLOW_ALL || fb.GetTokenBucket() != nil {
				t.Errorf("%s: %s %v, want ALLOW_ALL (a shadow rule never denies)", what, name, fb)
			}
		case r.OnFailure == policy.Emergency:
			em := r.Emergency
			tb := fb.GetTokenBucket()
			if tb == nil || em == nil {
				t.Errorf("%s: %s %v, want the emergency bucket", what, name, fb)
				continue
			}
			perFill := time.Duration(tb.GetTokensPerFill().GetValue())
			if int64(tb.MaxTokens) != em.Burst || perFill*em.Period != time.Duration(em.Requests)*tb.FillInterval.AsDuration() {
				t.Errorf("%s: %s %v, want the emergency bucket: burst %d, %d per %v", what, name, tb, em.Burst, em.Requests, em.Period)
			}
		default:
			if fb.GetBlanketRule() != typev3.RateLimitStrategy_DENY_ALL || fb.GetTokenBucket() != nil {
				t.Errorf("%s: %s %v, want DENY_ALL (the rule fails closed)", what, name, fb)
			}
		}
	}
}
