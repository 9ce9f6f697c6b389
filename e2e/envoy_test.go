package e2e

import (
	"encoding/json"
	"os"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	jwtv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/policy"
)

// The typed configs the Envoy example uses; their packages register them for protojson.
var (
	_ = (*tlsv3.UpstreamTlsContext)(nil)
	_ = (*upstreamhttpv3.HttpProtocolOptions)(nil)
)

// validator is what protoc-gen-validate generates for every Envoy message.
type validator interface{ ValidateAll() error }

// TestEnvoyConfig: the Envoy configuration in docs/gateway.md parses as an Envoy bootstrap with
// Envoy's own API types, passes their validation rules, and matches the policy's envoy mapping
// and the agent: the rate limit filter after jwt_authn, the policy's domain, fail closed with
// 503, the agent's socket over HTTP/2, and descriptors of exactly the tenant (from the verified
// JWT's payload), the path and the method.
func TestEnvoyConfig(t *testing.T) {
	bs := gatewayBootstrap(t, "<!-- envoy:")
	valid := func(what string, m validator) {
		t.Helper()
		if err := m.ValidateAll(); err != nil {
			t.Errorf("%s: %v", what, err)
		}
	}
	valid("bootstrap", bs)
	unpack := func(what string, cfg interface{ GetTypedConfig() *anypb.Any }, m proto.Message) {
		t.Helper()
		if err := cfg.GetTypedConfig().UnmarshalTo(m); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		valid(what, m.(validator))
	}

	set, err := policy.Load("../examples/policy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	mapping := set.Envoy()

	res := bs.GetStaticResources()
	var hcm hcmv3.HttpConnectionManager
	unpack("http_connection_manager", res.GetListeners()[0].GetFilterChains()[0].GetFilters()[0], &hcm)

	var names []string
	var jwt jwtv3.JwtAuthentication
	var rl ratelimitv3.RateLimit
	for _, f := range hcm.GetHttpFilters() {
		names = append(names, f.GetName())
		switch f.GetName() {
		case "envoy.filters.http.jwt_authn":
			unpack(f.GetName(), f, &jwt)
		case "envoy.filters.http.ratelimit":
			unpack(f.GetName(), f, &rl)
		case "envoy.filters.http.router":
			unpack(f.GetName(), f, &routerv3.Router{})
		}
	}
	if got := strings.Join(names, ","); got != "envoy.filters.http.jwt_authn,envoy.filters.http.ratelimit,envoy.filters.http.router" {
		t.Errorf("http filters %s: want authentication, then the rate limit, then the router", got)
	}

	// The rate limit filter: the policy's domain, fail closed with 503, the agent's cluster.
	if rl.GetDomain() != mapping.Domain {
		t.Errorf("domain %q, the policy's envoy.domain is %q", rl.GetDomain(), mapping.Domain)
	}
	if !rl.GetFailureModeDeny() || rl.GetStatusOnError().GetCode() != typev3.StatusCode_ServiceUnavailable {
		t.Errorf("failure_mode_deny %v, status_on_error %v: want fail closed with 503", rl.GetFailureModeDeny(), rl.GetStatusOnError().GetCode())
	}
	if rl.GetRateLimitService().GetTransportApiVersion() != corev3.ApiVersion_V3 {
		t.Error("rate_limit_service: want transport_api_version V3")
	}
	agentCluster := rl.GetRateLimitService().GetGrpcService().GetEnvoyGrpc().GetClusterName()
	found := false
	for _, c := range res.GetClusters() {
		if c.GetName() != agentCluster {
			continue
		}
		found = true
		pipe := c.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetPipe().GetPath()
		if pipe != client.DefaultSocket {
			t.Errorf("cluster %s: pipe %q, want the agent's default socket %q", agentCluster, pipe, client.DefaultSocket)
		}
		var po upstreamhttpv3.HttpProtocolOptions
		opts := c.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
		if opts == nil || opts.UnmarshalTo(&po) != nil || po.GetExplicitHttpConfig().GetHttp2ProtocolOptions() == nil {
			t.Errorf("cluster %s: want explicit HTTP/2 (gRPC)", agentCluster)
		}
		valid("cluster "+agentCluster, &po)
	}
	if !found {
		t.Fatalf("no cluster %q for the rate limit service", agentCluster)
	}

	// The descriptors: tenant from the verified JWT's payload, path and method from the request.
	payload := ""
	for _, p := range jwt.GetProviders() {
		payload = p.GetPayloadInMetadata()
	}
	if payload == "" {
		t.Fatal("jwt_authn: no payload_in_metadata: the tenant has nowhere to come from")
	}
	routes := hcm.GetRouteConfig().GetVirtualHosts()[0].GetRoutes()
	if len(routes) == 0 {
		t.Fatal("no routes")
	}
	for _, r := range routes {
		limits := r.GetRoute().GetRateLimits()
		if len(limits) == 0 {
			t.Errorf("route %v has no rate_limits", r.GetMatch())
		}
		for _, l := range limits {
			keys := map[string]*routev3.RateLimit_Action{}
			for _, a := range l.GetActions() {
				var key string
				switch {
				case a.GetMetadata() != nil:
					key = a.GetMetadata().GetDescriptorKey()
				case a.GetRequestHeaders() != nil:
					key = a.GetRequestHeaders().GetDescriptorKey()
				default:
					t.Errorf("an action other than metadata and request_headers: %v", a)
					continue
				}
				if keys[key] != nil {
					t.Errorf("descriptor key %q twice", key)
				}
				keys[key] = a
			}
			if len(keys) != 3 || keys[mapping.TenantKey] == nil || keys[mapping.RouteKey] == nil || keys[mapping.OperationKey] == nil {
				t.Errorf("descriptor keys %v, want exactly %q, %q and %q", keys, mapping.TenantKey, mapping.RouteKey, mapping.OperationKey)
				continue
			}
			md := keys[mapping.TenantKey].GetMetadata()
			var path []string
			for _, seg := range md.GetMetadataKey().GetPath() {
				path = append(path, seg.GetKey())
			}
			if md == nil || md.GetSource() != routev3.RateLimit_Action_MetaData_DYNAMIC ||
				md.GetMetadataKey().GetKey() != "envoy.filters.http.jwt_authn" || strings.Join(path, ".") != payload+".sub" {
				t.Errorf("the tenant must come from jwt_authn's dynamic metadata %s.sub, not %v", payload, keys[mapping.TenantKey])
			}
			if h := keys[mapping.RouteKey].GetRequestHeaders().GetHeaderName(); h != ":path" {
				t.Errorf("%s from %q, want :path", mapping.RouteKey, h)
			}
			if h := keys[mapping.OperationKey].GetRequestHeaders().GetHeaderName(); h != ":method" {
				t.Errorf("%s from %q, want :method", mapping.OperationKey, h)
			}
		}
	}
}

// gatewayBootstrap reads the YAML block after marker in docs/gateway.md as an Envoy bootstrap,
// with Envoy's own API types.
func gatewayBootstrap(t *testing.T, marker string) *bootstrapv3.Bootstrap {
	t.Helper()
	doc, err := os.ReadFile("../docs/gateway.md")
	if err != nil {
		t.Fatal(err)
	}
	var tree any
	if err := yaml.Unmarshal([]byte(fenced(t, string(doc), marker, "yaml")), &tree); err != nil {
		t.Fatalf("docs/gateway.md: the block after %q is not YAML: %v", marker, err)
	}
	js, err := json.Marshal(tree)
	if err != nil {
		t.Fatal(err)
	}
	var bs bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(js, &bs); err != nil {
		t.Fatalf("docs/gateway.md, the block after %q: not an Envoy bootstrap: %v", marker, err)
	}
	return &bs
}

// fenced returns the first fenced code block of language lang after marker in doc.
func fenced(t *testing.T, doc, marker, lang string) string {
	t.Helper()
	_, after, ok := strings.Cut(doc, marker)
	if !ok {
		t.Fatalf("marker %q not found", marker)
	}
	_, body, ok := strings.Cut(after, "```"+lang+"\n")
	if !ok {
		t.Fatalf("no ```%s block after %q", lang, marker)
	}
	body, _, ok = strings.Cut(body, "```")
	if !ok {
		t.Fatalf("unterminated ```%s block after %q", lang, marker)
	}
	return body
}

// TestEnvoyAfterResponseConfig: the per-route rate limit configuration in docs/gateway.md for costs
// known after the response parses with Envoy's types and passes their validation; its request
// path entry charges an estimate with the policy's three descriptor keys, and its stream-end entry
// adds the policy's settle key, is applied on stream done and takes its hits from a format.
func TestEnvoyAfterResponseConfig(t *testing.T) {
	doc, err := os.ReadFile("../docs/gateway.md")
	if err != nil {
		t.Fatal(err)
	}
	var tree struct {
		PerFilter map[string]any `yaml:"typed_per_filter_config"`
	}
	if err := yaml.Unmarshal([]byte(fenced(t, string(doc), "<!-- envoy-after:", "yaml")), &tree); err != nil {
		t.Fatal(err)
	}
	js, err := json.Marshal(tree.PerFilter["envoy.filters.http.ratelimit"])
	if err != nil {
		t.Fatal(err)
	}
	var a anypb.Any
	if err := protojson.Unmarshal(js, &a); err != nil {
		t.Fatalf("not a typed config: %v", err)
	}
	var per ratelimitv3.RateLimitPerRoute
	if err := a.UnmarshalTo(&per); err != nil {
		t.Fatal(err)
	}
	if err := per.ValidateAll(); err != nil {
		t.Fatal(err)
	}
	set, err := policy.Load("../examples/policy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	m := set.Envoy()
	keys := func(rl *routev3.RateLimit) []string {
		var ks []string
		for _, act := range rl.Actions {
			switch {
			case act.GetMetadata() != nil:
				ks = append(ks, act.GetMetadata().DescriptorKey)
			case act.GetRequestHeaders() != nil:
				ks = append(ks, act.GetRequestHeaders().DescriptorKey)
			case act.GetGenericKey() != nil:
				ks = append(ks, act.GetGenericKey().DescriptorKey)
			}
		}
		return ks
	}
	if len(per.RateLimits) != 2 {
		t.Fatalf("%d rate limits, want the request's and the stream end's", len(per.RateLimits))
	}
	req, end := per.RateLimits[0], per.RateLimits[1]
	if got, want := strings.Join(keys(req), ","), strings.Join([]string{m.TenantKey, m.RouteKey, m.OperationKey}, ","); got != want || req.ApplyOnStreamDone {
		t.Errorf("request path entry: keys %s (want %s), on stream done %v (want false)", got, want, req.ApplyOnStreamDone)
	}
	if got, want := strings.Join(keys(end), ","), strings.Join([]string{m.TenantKey, m.RouteKey, m.OperationKey, m.SettleKey}, ","); got != want || !end.ApplyOnStreamDone {
		t.Errorf("stream end entry: keys %s (want %s), on stream done %v (want true)", got, want, end.ApplyOnStreamDone)
	}
	if end.GetHitsAddend().GetFormat() == "" || req.GetHitsAddend().GetNumber().GetValue() != 1 {
		t.Errorf("hits addends %v and %v, want 1 on the request path and a format at the stream end", req.GetHitsAddend(), end.GetHitsAddend())
	}
}
