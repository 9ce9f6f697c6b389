package policy

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

const examplePath = "../examples/policy.yaml"

func loadExample(t testing.TB) *Set {
	t.Helper()
	s, err := Load(examplePath)
	if err != nil {
		t.Fatalf("Load(%s): %v", examplePath, err)
	}
	return s
}

func mustParse(t testing.TB, src string) *Set {
	t.Helper()
	s, err := Parse("test.yaml", []byte(src))
	if err != nil {
		t.Fatalf("Parse:\n%v", err)
	}
	return s
}

func TestExampleLoads(t *testing.T) {
	s := loadExample(t)
	if s.Version() != "2026-12-01.1" {
		t.Errorf("Version() = %q, want 2026-12-01.1", s.Version())
	}
	if len(s.Digest()) != 64 {
		t.Errorf("Digest() = %q, want 64 hex digits", s.Digest())
	}
	var names []string
	for _, r := range s.Rules() {
		names = append(names, r.Name)
	}
	if got, want := strings.Join(names, ","), "orders-read,orders-export,orders-write,catalog-read,search,reports-read"; got != want {
		t.Errorf("rules = %s, want %s", got, want)
	}

	// The card's rule: 100/minute, burst 20 = capacity 20 tokens refilled at 100 tokens per 60 s.
	r := s.Rule("orders-read")
	want, err := bucket.NewLimit(20*bucket.PerToken, 100*bucket.PerToken, 60000)
	if err != nil {
		t.Fatal(err)
	}
	if r.Quota.Bucket != want || r.Quota.Requests != 100 || r.Quota.Period != time.Minute || r.Quota.Burst != 20 {
		t.Errorf("orders-read quota = %+v, want 100/1m burst 20 with bucket %v", r.Quota, want)
	}
	if r.OnFailure != Deny || r.FailureRetryAfter != 2*time.Second || !r.Headers || r.Shadow {
		t.Errorf("orders-read = on_failure %v retry %v headers %v shadow %v", r.OnFailure, r.FailureRetryAfter, r.Headers, r.Shadow)
	}
	if w := s.Rule("orders-write"); w.OnFailure != Deny || w.FailureRetryAfter != time.Second {
		t.Errorf("orders-write fails %v with Retry-After %v, want deny 1s", w.OnFailure, w.FailureRetryAfter)
	}
	c := s.Rule("catalog-read")
	if c.OnFailure != Emergency || c.Emergency == nil || c.Emergency.Requests != 5 || c.Emergency.Burst != 3 {
		t.Errorf("catalog-read fails %v with emergency %+v, want emergency 5/1m burst 3", c.OnFailure, c.Emergency)
	}
	if d := s.Default(); d.OnFailure != Deny || !d.Default || d.Name != DefaultRuleName || s.Rule("default") != d {
		t.Errorf("default rule = %+v, want a fail-closed default", d)
	}
	if !s.Rule("reports-read").Shadow {
		t.Error("reports-read is not in shadow mode")
	}
	if e := s.Envoy(); e != (Envoy{Domain: "leasebucket", TenantKey: "tenant", RouteKey: "path", OperationKey: "method", SettleKey: "settle"}) {
		t.Errorf("Envoy() = %+v", e)
	}
	if cl, ok := s.MethodClass("PURGE"); !ok || cl != "write" {
		t.Errorf("MethodClass(PURGE) = %q, %v; want write", cl, ok)
	}
}

func TestDefaults(t *testing.T) {
	s := mustParse(t, `
version: "1.10"
default: {limit: 10/minute}
rules:
  - name: r
    routes: [/a]
    operations: [read]
    limit: 7/s
`)
	if s.Version() != "1.10" {
		t.Errorf("Version() = %q, want 1.10 as written", s.Version())
	}
	r := s.Rule("r")
	if r.Quota.Burst != 7 {
		t.Errorf("burst = %d, want the limit's 7 by default", r.Quota.Burst)
	}
	if r.Scope != Global || r.OnFailure != Deny || r.FailureRetryAfter != DefaultFailureRetryAfter || r.Shadow || r.Headers {
		t.Errorf("defaults = %+v", r)
	}
	if r.Cost("read") != 1 {
		t.Errorf("Cost(read) = %d, want 1", r.Cost("read"))
	}
	if e := s.Envoy(); e.Domain != "leasebucket" || e.TenantKey != "tenant" || e.RouteKey != "path" || e.OperationKey != "method" {
		t.Errorf("Envoy() = %+v, want the defaults", e)
	}
	for m, want := range map[string]string{"GET": "read", "HEAD": "read", "OPTIONS": "read", "POST": "write",
		"PUT": "write", "PATCH": "write", "DELETE": "write"} {
		if got, _ := s.MethodClass(m); got != want {
			t.Errorf("MethodClass(%s) = %q, want %q", m, got, want)
		}
	}
	if _, ok := s.MethodClass("TRACE"); ok {
		t.Error("TRACE has a class by default")
	}
}

// header puts "rules:" on line 3, so the first rule starts on line 4.
const header = "version: v1\ndefault: {limit: 10/minute}\nrules:\n"

func TestInvalid(t *testing.T) {
	for _, tc := range []struct {
		name string
		src  string
		want []string // complete lines of the error, in order
	}{
		{"unknown field", header + `
  - name: r
    routes: [/a]
    operations: [read]
    limit: 10/minute
    brust: 5
`, []string{
			`test.yaml:9: rules[0].brust: unknown field (did you mean "burst"?); known fields: name, description, routes, operations, limit, burst, quota, timezone, limits, cost, scope, regions, on_failure, retry_after_on_failure, emergency, shadow, headers, lease, max_debt, overrides`,
		}},
		{"unknown top-level field and missing sections", `rulez: []
`, []string{
			`test.yaml:1: rulez: unknown field (did you mean "rules"?); known fields: version, methods, operations, envoy, rules, default`,
			`test.yaml:1: version: required: the policy set version agents and coordinators agree on`,
			`test.yaml:1: default: required: the rule for unmatched routes and operations`,
		}},
		{"zero limit", header + `  - name: r
    routes: [/a]
    operations: [read]
    limit: 0/minute
`, []string{`test.yaml:7: rules[0].limit: "0/minute": the limit must allow at least 1 request per period`}},
		{"bad period and burst", header + `  - name: r
    routes: [/a]
    operations: [read]
    limit: 10/fortnight
    burst: twenty
`, []string{
			`test.yaml:7: rules[0].limit: "10/fortnight": period "fortnight" must be second, minute, hour, day or a duration such as 30s, 1m30s, 2d`,
			`test.yaml:8: rules[0].burst: must be a whole number, not "twenty"`,
		}},
		{"impossible periods", header + `  - name: r
    routes: [/a]
    operations: [read]
    limit: 1/1.5ms
    burst: 0
  - name: s
    routes: [/b]
    operations: [read]
    limit: 1/0s
`, []string{
			`test.yaml:7: rules[0].limit: "1/1.5ms": period "1.5ms" must be a whole number of milliseconds`,
			`test.yaml:8: rules[0].burst: 0 must be at least 1 (the bucket's capacity in tokens)`,
			`test.yaml:12: rules[1].limit: "1/0s": period "0s" must be at least 1ms`,
		}},
		{"unrepresentable", header + `  - name: huge-burst
    routes: [/a]
    operations: [read]
    limit: 1/1ms
    burst: 5000000000
  - name: huge-limit
    routes: [/b]
    operations: [read]
    limit: 10000000000/s
  - name: slow-fill
    routes: [/c]
    operations: [read]
    limit: 1/365d
    burst: 9000000
`, []string{
			`test.yaml:8: rules[0].burst: 1/1ms burst 5000000000: bucket: limit cannot be represented exactly: capacity 5000000000000000 µ exceeds 2^52 µ`,
			`test.yaml:12: rules[1].limit: 10000000000/1s burst 10000000000: bucket: limit cannot be represented exactly: more than 9007199254 tokens`,
			`test.yaml:17: rules[2].burst: 1/365d burst 9000000: bucket: limit cannot be represented exactly: filling 9000000000000 µ at 1 µ per 31536 ms takes longer than 2^45 ms`,
		}},
		{"emergency larger than the main limit", header + `  - name: r
    routes: [/a]
    operations: [read]
    limit: 10/minute
    burst: 5
    on_failure: emergency
    emergency: {limit: 20/minute, burst: 2}
  - name: s
    routes: [/b]
    operations: [read]
    limit: 10/minute
    burst: 5
    on_failure: emergency
    emergency: {limit: 1/minute, burst: 5}
`, []string{
			`test.yaml:10: rules[0].emergency: emergency 20/1m burst 2 must be strictly smaller than the rule's limit (10/1m burst 5) in both rate and burst`,
			`test.yaml:17: rules[1].emergency: emergency 1/1m burst 5 must be strictly smaller than the rule's limit (10/1m burst 5) in both rate and burst`,
		}},
		{"emergency against overrides and regions", header + `  - name: r
    routes: [/a]
    operations: [read]
    limit: 100/minute
    burst: 10
    scope: regional
    regions:
      eu: {limit: 96/minute, burst: 8}
      us: {limit: 4/minute, burst: 2}
    on_failure: emergency
    emergency: {limit: 5/minute, burst: 3}
    overrides:
      own:
        limit: 50/minute
        burst: 5
        regions:
          eu: {limit: 40/minute, burst: 4}
          us: {limit: 10/minute, burst: 1}
        emergency: {limit: 10/minute, burst: 1}
`, []string{
			`test.yaml:14: rules[0].emergency: emergency 5/1m burst 3 must be strictly smaller than the rule's limit region us (4/1m burst 2) in both rate and burst`,
			`test.yaml:16: rules[0].overrides[own].emergency: emergency 10/1m burst 1 must be strictly smaller than tenant "own"'s override region us (10/1m burst 1) in both rate and burst`,
		}},
		{"failure mode mismatches", header + `  - name: r
    routes: [/a]
    operations: [read]
    limit: 10/minute
    emergency: {limit: 1/minute, burst: 1}
  - name: s
    routes: [/b]
    operations: [read]
    limit: 10/minute
    on_failure: emergency
    retry_after_on_failure: 2s
  - name: t
    routes: [/c]
    operations: [read]
    limit: 10/minute
    on_failure: maybe
    retry_after_on_failure: 2h
    lease: maybe
`, []string{
			`test.yaml:8: rules[0].emergency: only used with on_failure: emergency; this rule fails closed (deny)`,
			`test.yaml:9: rules[1].emergency: required with on_failure: emergency (the local emergency bucket's limit and burst)`,
			`test.yaml:14: rules[1].retry_after_on_failure: applies only to on_failure: deny (an empty emergency bucket answers 429 with its own Retry-After)`,
			`test.yaml:19: rules[2].on_failure: "maybe" must be deny or emergency`,
			`test.yaml:20: rules[2].retry_after_on_failure: 2h0m0s is longer than 1h0m0s`,
			`test.yaml:21: rules[2].lease: "maybe" must be on or off`,
		}},
		{"regional slices do not sum up", header + `  - name: r
    routes: [/a]
    operations: [read]
    limit: 100/minute
    burst: 10
    scope: regional
    regions:
      eu: {limit: 60/minute, burst: 6}
      us: {limit: 30/minute, burst: 5}
`, []string{
			`test.yaml:10: rules[0].regions: region bursts sum to 11, but the rule's burst is 10 (eu 60/1m burst 6, us 30/1m burst 5): slices must sum to the global quota`,
			`test.yaml:10: rules[0].regions: region limits sum to 90/1m, but the rule's limit is 100/1m (eu 60/1m burst 6, us 30/1m burst 5): slices must sum to the global quota`,
		}},
		{"regional slices in other periods sum exactly", header + `  - name: r
    routes: [/a]
    operations: [read]
    limit: 100/minute
    burst: 10
    scope: regional
    regions:
      eu: {limit: 1/s, burst: 6}
      us: {limit: 39/30s, burst: 4}
`, []string{
			`test.yaml:10: rules[0].regions: region limits sum to 138/1m, but the rule's limit is 100/1m (eu 1/1s burst 6, us 39/30s burst 4): slices must sum to the global quota`,
		}},
		{"scope and regions", header + `  - name: r
    routes: [/a]
    operations: [read]
    limit: 100/minute
    scope: regional
  - name: s
    routes: [/b]
    operations: [read]
    limit: 100/minute
    regions:
      eu: {limit: 100/minute}
  - name: t
    routes: [/c]
    operations: [read]
    limit: 100/minute
    scope: planetary
  - name: u
    routes: [/d]
    operations: [read]
    limit: 100/minute
    scope: regional
    regions:
      EU: {limit: 100/minute}
`, []string{
			`test.yaml:4: rules[0].regions: required with scope: regional (the per-region slices of the quota)`,
			`test.yaml:13: rules[1].regions: only allowed with scope: regional`,
			`test.yaml:19: rules[2].scope: "planetary" must be global, regional or tenant`,
			`test.yaml:26: rules[3].regions[EU]: region "EU" must match ^[a-z0-9][a-z0-9._-]{0,31}$`,
		}},
		{"overrides", header + `  - name: r
    routes: [/a]
    operations: [read]
    limit: 100/minute
    overrides:
      "bad\ttenant": {limit: 1/s}
      typo: {limit: 1/s, brust: 1}
      reg: {limit: 1/s, regions: {eu: {limit: 1/s}}}
      dup: {limit: 1/s}
      dup: {limit: 2/s}
  - name: s
    routes: [/b]
    operations: [read]
    limit: 100/minute
    burst: 10
    scope: regional
    regions:
      eu: {limit: 60/minute, burst: 6}
      us: {limit: 40/minute, burst: 4}
    overrides:
      a: {limit: 200/minute, burst: 20}
      b:
        limit: 200/minute
        burst: 20
        regions:
          eu: {limit: 100/minute, burst: 10}
          ap: {limit: 100/minute, burst: 10}
`, []string{
			`test.yaml:9: rules[0].overrides["bad\ttenant"]: invalid tenant: control character at byte 3`,
			`test.yaml:10: rules[0].overrides[typo].brust: unknown field (did you mean "burst"?); known fields: limit, burst, quota, regions, emergency`,
			`test.yaml:11: rules[0].overrides[reg].regions: only allowed when the rule has scope: regional`,
			`test.yaml:13: rules[0].overrides[dup]: duplicate key (first on line 12)`,
			`test.yaml:24: rules[1].overrides[a].regions: required: the rule is regional, so the override needs its own slices`,
			`test.yaml:28: rules[1].overrides[b].regions: must name the same regions as the rule (eu, us)`,
		}},
		{"costs", header + `  - name: r
    routes: [/a]
    operations: [read, GET]
    limit: 10/minute
    burst: 5
    cost: {GET: 6}
  - name: s
    routes: [/b]
    operations: [read]
    limit: 10/minute
    cost: {write: 1, read: 0}
  - name: t
    routes: [/c]
    operations: [read]
    limit: 10/minute
    burst: 5
    on_failure: emergency
    emergency: {limit: 1/minute, burst: 2}
    cost: 3
    overrides:
      x: {limit: 10/minute, burst: 2}
`, []string{
			`test.yaml:9: rules[0].cost: cost 6 of operation GET exceeds burst 5 of the rule's limit: such a request could never be allowed`,
			`test.yaml:14: rules[1].cost[write]: "write" is not an operation of this rule (read)`,
			`test.yaml:14: rules[1].cost[read]: 0 must be at least 1 token`,
			`test.yaml:22: rules[2].cost: cost 3 of operation read exceeds burst 2 of tenant "x"'s override: such a request could never be allowed`,
			`test.yaml:22: rules[2].cost: cost 3 of operation read exceeds the emergency burst 2: the emergency bucket could never allow it`,
			`test.yaml:24: rules[2].overrides[x]: the rule's emergency 1/1m burst 2 must be strictly smaller than tenant "x"'s override (10/1m burst 2) in both rate and burst`,
		}},
		{"max_debt", header + `  - name: r
    routes: [/a]
    operations: [read]
    limit: 10/minute
    burst: 5
    max_debt: -1
  - name: s
    routes: [/b]
    operations: [read]
    limit: 10/minute
    max_debt: 2.5
  - name: t
    routes: [/c]
    operations: [read]
    limit: 10/minute
    burst: 5
    max_debt: 6
    overrides:
      x: {limit: 10/minute, burst: 5}
  - name: u
    routes: [/d]
    operations: [read]
    limits:
      - {limit: 10/second, burst: 20}
      - {quota: 8/day}
    max_debt: 10
  - name: v
    scope: tenant
    quota: 3/month
    max_debt: 4
  - name: w
    routes: [/e]
    operations: [read]
    limit: 10/minute
    burst: 5
    max_debt: 4
    overrides:
      y: {limit: 10/minute, burst: 3}
  - name: z
    routes: [/f]
    operations: [read]
    limit: 10/minute
    max_debt: "5"
`, []string{
			`test.yaml:9: rules[0].max_debt: -1 must not be negative (tokens below zero a settled cost may take the bucket)`,
			`test.yaml:14: rules[1].max_debt: must be a whole number, not a decimal number`,
			`test.yaml:20: rules[2].max_debt: 6 exceeds burst 5 of the rule's limit: a debt larger than the capacity is refused`,
			`test.yaml:20: rules[2].max_debt: 6 exceeds burst 5 of tenant "x"'s override: a debt larger than the capacity is refused`,
			`test.yaml:29: rules[3].max_debt: 10 exceeds burst 8 of the rule's limit 2: a debt larger than the capacity is refused`,
			`test.yaml:33: rules[4].max_debt: 4 exceeds burst 3 of the rule's limit: a debt larger than the capacity is refused`,
			`test.yaml:39: rules[5].max_debt: 4 exceeds burst 3 of tenant "y"'s override: a debt larger than the capacity is refused`,
			`test.yaml:46: rules[6].max_debt: must be a whole number, not "5"`,
		}},
		{"templates", header + `  - name: r
    routes:
      - /orders/{id}.json
      - /a/*/b
      - orders
      - /a/
      - /a/%41
      - /a/%2f
      - /a//b
      - /x/{id}/{id}
      - /y/{1d}
      - /z/./a
      - /ok/{id}
      - /ok/{other}
    operations: [read]
    limit: 1/s
`, []string{
			`test.yaml:6: rules[0].routes[0]: template "/orders/{id}.json": segment "{id}.json": a parameter must be a whole segment such as {id}`,
			`test.yaml:7: rules[0].routes[1]: template "/a/*/b": '*' is allowed only as the last segment`,
			`test.yaml:8: rules[0].routes[2]: template "orders" must start with '/'`,
			`test.yaml:9: rules[0].routes[3]: template "/a/" must not end with '/' (trailing slashes are dropped from paths)`,
			`test.yaml:10: rules[0].routes[4]: template "/a/%41": segment "%41" is not in normalized form (write "A"): a normalized path never contains it`,
			`test.yaml:11: rules[0].routes[5]: template "/a/%2f": segment "%2f" is not in normalized form (write "%2F"): a normalized path never contains it`,
			`test.yaml:12: rules[0].routes[6]: template "/a//b" has an empty segment`,
			`test.yaml:13: rules[0].routes[7]: template "/x/{id}/{id}": parameter {id} appears twice`,
			`test.yaml:14: rules[0].routes[8]: template "/y/{1d}": parameter name "1d" must match [A-Za-z_][A-Za-z0-9_]* (at most 32 bytes)`,
			`test.yaml:15: rules[0].routes[9]: template "/z/./a": dot segments are resolved in paths and cannot match`,
			`test.yaml:17: rules[0].routes[11]: template "/ok/{other}" matches the same paths as "/ok/{id}" on line 16`,
		}},
		{"operations", header + `  - name: r
    routes: [/a]
    operations: [read, delete, read, get]
    limit: 1/s
  - name: s
    routes: []
    operations: []
    limit: 1/s
`, []string{
			`test.yaml:6: rules[0].operations[1]: unknown operation "delete": not a class (read, write), a named operation or an HTTP method of this policy`,
			`test.yaml:6: rules[0].operations[2]: operation "read" is listed twice`,
			`test.yaml:6: rules[0].operations[3]: unknown operation "get": not a class (read, write), a named operation or an HTTP method of this policy`,
			`test.yaml:9: rules[1].routes: must list at least one template`,
			`test.yaml:10: rules[1].operations: must list at least one operation`,
		}},
		{"tie between two rules", header + `  - name: a
    routes: ["/orders/{id}"]
    operations: [read]
    limit: 1/s
  - name: b
    routes: [/x, "/orders/{oid}"]
    operations: [GET, read]
    limit: 1/s
`, []string{
			`test.yaml:9: rules[1].routes[1]: template "/orders/{oid}" with operation "read" is also claimed by rule "a" (template "/orders/{id}", line 5): the most specific match would be a tie`,
		}},
		{"names", header + `  - name: r
    routes: [/a]
    operations: [read]
    limit: 1/s
  - name: r
    routes: [/b]
    operations: [read]
    limit: 1/s
  - name: default
    routes: [/c]
    operations: [read]
    limit: 1/s
  - name: "has space"
    routes: [/d]
    operations: [read]
    limit: 1/s
  - routes: [/e]
    operations: [read]
    limit: 1/s
`, []string{
			`test.yaml:8: rules[1].name: rule "r" is already defined on line 4`,
			`test.yaml:12: rules[2].name: "default" is reserved for the default section`,
			`test.yaml:16: rules[3].name: "has space" must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`,
			`test.yaml:20: rules[4].name: required`,
		}},
		{"methods, operations and envoy", `version: "bad version"
methods:
  get: read
  FETCH: Read
  LIST: list
operations:
  read: write
  Export: read
  bulk: list
envoy:
  domain: lb
  tenant_key: x
  route_key: x
  colour: red
default: {limit: 10/minute, name: d}
`, []string{
			`test.yaml:1: version: "bad version" must match ^[A-Za-z0-9][A-Za-z0-9._:+-]{0,63}$`,
			`test.yaml:3: methods[get]: HTTP method "get" must match ^[A-Z][A-Z0-9_-]{0,31}$`,
			`test.yaml:4: methods[FETCH]: class "Read" must match ^[a-z][a-z0-9_-]{0,31}$`,
			`test.yaml:7: operations[read]: "read" is used as a class (by a method or another operation); a named operation needs its own name`,
			`test.yaml:8: operations[Export]: named operation "Export" must match ^[a-z][a-z0-9_.-]{0,63}$`,
			`test.yaml:11: envoy: tenant_key, route_key, operation_key and settle_key must be different descriptor keys (got "x", "x", "method", "settle")`,
			`test.yaml:14: envoy.colour: unknown field; known fields: domain, tenant_key, route_key, operation_key, settle_key, charge`,
			`test.yaml:15: default.name: unknown field; known fields: description, limit, burst, quota, timezone, limits, cost, scope, regions, on_failure, retry_after_on_failure, emergency, shadow, headers, lease, max_debt, overrides`,
		}},
		{"types", header + `  - name: [r]
    routes: /a
    operations: [read]
    limit: 1/s
    shadow: yes
    headers: 1
    burst: 1.5
`, []string{
			`test.yaml:4: rules[0].name: must be a single value`,
			`test.yaml:5: rules[0].routes: must be a list`,
			`test.yaml:8: rules[0].shadow: must be true or false, not "yes"`,
			`test.yaml:9: rules[0].headers: must be true or false, not a whole number`,
			`test.yaml:10: rules[0].burst: must be a whole number, not a decimal number`,
		}},
		{"duplicate field", "version: v1\nversion: v2\ndefault: {limit: 1/s}\n", []string{
			`test.yaml:2: version: duplicate field (first on line 1)`,
		}},
		{"bucket key too long", header + `  - name: r
    routes: ["/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa/{b}/cccccccccccccccccccccccccccccccc/{d}/eeeeeeee"]
    operations: [read]
    limit: 1/s
`, []string{
			`test.yaml:5: rules[0].routes[0]: template "/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa/{b}/cccccccccccccccccccccccccccccccc/{d}/eeeeeeee" with operation "read" makes bucket keys of up to 514 bytes, more than 512: shorten it`,
		}},
		{"yaml syntax", header + `  - name: a
    routes: [/orders/{id}]
`, []string{
			`test.yaml:5: invalid YAML: did not find expected ',' or ']' (inside [ ] or { }, quote templates with braces: ["/orders/{id}"])`,
		}},
		{"aliases", `version: v1
default: &d {limit: 10/minute}
rules:
  - name: a
    routes: [/a]
    operations: [read]
    <<: *d
`, []string{
			`test.yaml:7: YAML aliases are not supported in policy files: write the value out`,
		}},
		{"two documents", "version: v1\ndefault: {limit: 1/s}\n---\nversion: v2\n", []string{
			`test.yaml:3: a policy file holds one YAML document; found another`,
		}},
		{"empty", "", []string{`test.yaml:1: empty policy file`}},
		{"only comments", "# nothing\n", []string{`test.yaml:1: empty policy file`}},
		{"not a mapping", "- a\n- b\n", []string{
			`test.yaml:1: must be a mapping with fields version, methods, operations, envoy, rules, default`,
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := Parse("test.yaml", []byte(tc.src))
			if err == nil {
				t.Fatalf("Parse succeeded (version %q), want errors:\n%s", s.Version(), strings.Join(tc.want, "\n"))
			}
			var pe *ParseError
			if !errors.As(err, &pe) {
				t.Fatalf("error %T is not a *ParseError: %v", err, err)
			}
			if got, want := err.Error(), strings.Join(tc.want, "\n"); got != want {
				t.Errorf("errors:\n%s\nwant:\n%s", got, want)
			}
			if len(pe.Errors) != len(tc.want) {
				t.Errorf("%d errors, want %d", len(pe.Errors), len(tc.want))
			}
		})
	}
}

func TestLoadErrors(t *testing.T) {
	if _, err := Load(filepath.Join(t.TempDir(), "missing.yaml")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Load(missing) = %v, want os.ErrNotExist", err)
	}
	big := filepath.Join(t.TempDir(), "big.yaml")
	if err := os.WriteFile(big, []byte("version: v1\n"+strings.Repeat("# padding\n", MaxFileSize/10+1)), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := Load(big)
	if err == nil || !strings.Contains(err.Error(), big+": file is larger than 4194304 bytes") {
		t.Errorf("Load(big) = %v, want a size error naming the file", err)
	}
}

// TestDigest: the digest is the meaning, not the text.
func TestDigest(t *testing.T) {
	a := mustParse(t, `
version: v1
# a comment
default: {limit: 10/minute}
rules:
  - name: a
    routes: [/a, /b]
    operations: [read, write]
    limit: 100/minute
  - name: b
    routes: [/c]
    operations: [read]
    limit: 5/s
`)
	reordered := mustParse(t, `
version: v1
rules:
  - {name: b, routes: [/c], operations: [read], limit: 5/s}
  - name: a
    limit: 100/minute
    operations: [write, read]
    routes: [/b, /a]
default:
  limit: 10/minute
`)
	if a.Digest() != reordered.Digest() {
		t.Errorf("reformatting and reordering changed the digest: %s vs %s", a.Digest(), reordered.Digest())
	}
	changed := mustParse(t, `
version: v1
default: {limit: 10/minute}
rules:
  - {name: b, routes: [/c], operations: [read], limit: 5/s}
  - {name: a, routes: [/a, /b], operations: [read, write], limit: 100/minute, burst: 99}
`)
	if a.Digest() == changed.Digest() {
		t.Error("a changed burst kept the digest")
	}
	bumped := mustParse(t, strings.Replace(`
version: v1
default: {limit: 10/minute}
rules:
  - {name: b, routes: [/c], operations: [read], limit: 5/s}
  - {name: a, routes: [/a, /b], operations: [read, write], limit: 100/minute}
`, "v1", "v2", 1))
	if a.Digest() == bumped.Digest() {
		t.Error("a new version kept the digest")
	}
}

func TestErrorsAreBounded(t *testing.T) {
	var b strings.Builder
	b.WriteString("version: v1\ndefault: {limit: 10/minute}\nrules:\n")
	for i := range 3 * maxErrors {
		fmt.Fprintf(&b, "  - {name: r%d, routes: [/a%d], operations: [read], limit: 0/s}\n", i, i)
	}
	start := time.Now()
	_, err := Parse("test.yaml", []byte(b.String()))
	var pe *ParseError
	if !errors.As(err, &pe) || len(pe.Errors) != maxErrors+1 {
		t.Fatalf("got %v, want %d errors and a summary", err, maxErrors)
	}
	if last := pe.Errors[maxErrors].Error(); last != "test.yaml: 200 more problems not shown" {
		t.Errorf("summary = %q", last)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("parsing took %v", d)
	}
}

func TestLeaseSwitch(t *testing.T) {
	for _, tc := range []struct {
		value  string
		direct bool
	}{{"", false}, {"on", false}, {"off", true}, {"true", false}, {"false", true}} {
		src := "version: v1\nrules:\n  - name: r\n    routes: [/a]\n    operations: [read]\n    limit: 10/s\n"
		if tc.value != "" {
			src += "    lease: " + tc.value + "\n"
		}
		src += "default: {limit: 1/s}\n"
		s, err := Parse("test.yaml", []byte(src))
		if err != nil {
			t.Fatalf("lease: %q: %v", tc.value, err)
		}
		if got := s.Rule("r").Direct; got != tc.direct {
			t.Errorf("lease: %q: Direct = %t, want %t", tc.value, got, tc.direct)
		}
	}
}
