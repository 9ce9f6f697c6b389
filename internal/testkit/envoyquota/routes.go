package envoyquota

import (
	"fmt"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/structpb"
)

// JWTFilter and JWTPayload are where Envoy's jwt_authn puts a verified token's payload
// (payload_in_metadata): the tenant of a request is its sub claim.
const (
	JWTFilter  = "envoy.filters.http.jwt_authn"
	JWTPayload = "jwt_payload"
)

// HTTP is a request of tenant (its verified JWT's sub claim) for method and path.
func HTTP(tenant, method, path string) Request {
	r := Request{Headers: map[string]string{":method": method, ":path": path}}
	if tenant != "" {
		payload, _ := structpb.NewStruct(map[string]any{"sub": tenant})
		r.Metadata = map[string]*structpb.Struct{JWTFilter: {Fields: map[string]*structpb.Value{JWTPayload: structpb.NewStructValue(payload)}}}
	}
	return r
}

// Route is one bucket matcher of FilterYAML: a request whose :path starts with Prefix (and, if
// Method is set, whose :method is Method) goes to the bucket {tenant: the JWT's sub, path:
// Template, method: its :method}, the policy's envoy mapping with the route template as the path.
type Route struct {
	Prefix, Method, Template string
	// Emergency is the fallback of a route with on_failure: emergency: a token bucket of Burst
	// tokens refilling PerSecond; nil for a fail-closed route (DENY_ALL).
	Emergency *Emergency
}

// Emergency is a rule's emergency bucket.
type Emergency struct{ Burst, PerSecond int }

// FilterYAML is a rate_limit_quota filter configuration (the typed_config, in YAML) for the
// agent's cluster: the domain, one bucket matcher per route in order, reports every reporting
// interval, and each route's failure mode as its no_assignment_behavior and
// expired_assignment_behavior (for expiredTimeout), as docs/gateway.md configures them.
func FilterYAML(domain string, reporting, expiredTimeout time.Duration, routes ...Route) string {
	var b strings.Builder
	fmt.Fprintf(&b, "rlqs_server:\n  envoy_grpc: {cluster_name: leasebucket_agent}\ndomain: %s\nbucket_matchers:\n  matcher_list:\n    matchers:\n", domain)
	for _, r := range routes {
		pred := fmt.Sprintf(`single_predicate: {input: {name: path, typed_config: {"@type": %s, header_name: ":path"}}, value_match: {prefix: %q}}`, typeOf(headerInputURL), r.Prefix)
		if r.Method != "" {
			pred = fmt.Sprintf(`and_matcher: {predicate: [{%s}, {single_predicate: {input: {name: method, typed_config: {"@type": %s, header_name: ":method"}}, value_match: {exact: %q}}}]}`,
				pred, typeOf(headerInputURL), r.Method)
		}
		fallback := "{blanket_rule: DENY_ALL}"
		if r.Emergency != nil {
			fallback = fmt.Sprintf("{token_bucket: {max_tokens: %d, tokens_per_fill: %d, fill_interval: 1s}}", r.Emergency.Burst, r.Emergency.PerSecond)
		}
		fmt.Fprintf(&b, `    - predicate: {%s}
      on_match:
        action:
          name: quota
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings
            bucket_id_builder:
              bucket_id_builder:
                tenant: {custom_value: {name: tenant, typed_config: {"@type": %s, filter: %s, path: [{key: %s}, {key: sub}]}}}
                path: {string_value: %q}
                method: {custom_value: {name: method, typed_config: {"@type": %s, header_name: ":method"}}}
            reporting_interval: %s
            no_assignment_behavior: {fallback_rate_limit: %s}
            expired_assignment_behavior:
              expired_assignment_behavior_timeout: %s
              fallback_rate_limit: %s
`, pred, typeOf(metadataInputURL), JWTFilter, JWTPayload, r.Template, typeOf(headerInputURL), seconds(reporting), fallback, seconds(expiredTimeout), fallback)
	}
	return b.String()
}

func typeOf(url string) string { return url }

func seconds(d time.Duration) string { return fmt.Sprintf("%gs", d.Seconds()) }
