package policy

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

// precedencePolicy exercises every precedence rule; each rule's name says what it holds.
const precedencePolicy = `
version: p1
methods:
  PURGE: write
operations:
  export: read
  approve: write
default:
  limit: 10/minute
  cost: {"*": 2, write: 3}
rules:
  - name: literal
    routes: [/, /a/b/c, /files/a%2Fb]
    operations: [read]
    limit: 10/s
  - name: param
    routes: ["/a/{x}/c", "/a/{x}"]
    operations: [read]
    limit: 10/s
  - name: wild
    routes: ["/a/*"]
    operations: [read, write]
    limit: 10/s
  - name: leftmost-param
    routes: ["/{y}/b/c/d"]
    operations: [read]
    limit: 10/s
  - name: get-only
    routes: ["/a/{x}"]
    operations: [GET]
    limit: 10/s
    cost: 2
  - name: export
    routes: ["/a/{x}"]
    operations: [export]
    limit: 10/s
    cost: {export: 5}
  - name: w-get
    routes: ["/w/*"]
    operations: [GET]
    limit: 10/s
  - name: w-read
    routes: ["/w/{id}"]
    operations: [read]
    limit: 10/s
  - name: longer
    routes: ["/l/{a}/*"]
    operations: [read]
    limit: 10/s
  - name: shorter
    routes: ["/l/*"]
    operations: [read]
    limit: 10/s
  - name: unicode
    routes: [/caf%C3%A9]
    operations: [read]
    limit: 10/s
`

func TestMatchPrecedence(t *testing.T) {
	s := mustParse(t, precedencePolicy)
	for _, tc := range []struct {
		path, op string
		rule     string // rule name
		tmpl, as string // template and operation entry of the route
	}{
		// Literal beats {param} beats *, decided at the leftmost segment where templates differ.
		{"/a/b/c", "GET", "literal", "/a/b/c", "read"},
		{"/a/z/c", "GET", "param", "/a/{x}/c", "read"},
		{"/a/z/y", "GET", "wild", "/a/*", "read"},
		{"/a/b/c/d", "GET", "wild", "/a/*", "read"}, // literal "a" beats {y} at segment 1
		{"/x/b/c/d", "GET", "leftmost-param", "/{y}/b/c/d", "read"},
		// Same template: an exact operation (method or named) beats its class.
		{"/a/z", "GET", "get-only", "/a/{x}", "GET"},
		{"/a/z", "HEAD", "param", "/a/{x}", "read"},
		{"/a/z", "read", "param", "/a/{x}", "read"},
		{"/a/z", "export", "export", "/a/{x}", "export"},
		// Template first, then operation: a more specific template with the class wins over a less
		// specific one that lists the exact method.
		{"/w/5", "GET", "w-read", "/w/{id}", "read"},
		{"/w/5/6", "GET", "w-get", "/w/*", "GET"},
		// A template without an entry for the operation falls through to the next candidate.
		{"/a/b/c", "POST", "wild", "/a/*", "write"},
		{"/a/b/c", "approve", "wild", "/a/*", "write"},
		{"/a/b/c", "PURGE", "wild", "/a/*", "write"},
		// The wildcard needs at least one segment; a longer template beats a shorter one.
		{"/l/1/2", "read", "longer", "/l/{a}/*", "read"},
		{"/l/1", "read", "shorter", "/l/*", "read"},
		{"/l", "read", "default", "", "read"},
		// Root, normalization, encoded slashes and unicode.
		{"/", "GET", "literal", "/", "read"},
		{"//a//b/./c/", "GET", "literal", "/a/b/c", "read"},
		{"/a/b%2Fc", "HEAD", "param", "/a/{x}", "read"}, // %2F does not split: one segment
		{"/files/a%2fb", "GET", "literal", "/files/a%2Fb", "read"},
		{"/files/a/b", "GET", "default", "", "read"},
		{"/café", "GET", "unicode", "/caf%C3%A9", "read"},
		{"/caf%c3%a9?x", "GET", "unicode", "/caf%C3%A9", "read"},
		{"/A/b/c", "GET", "default", "", "read"}, // case-sensitive
		// Unmatched routes and unknown operations go to the default rule.
		{"/nowhere", "GET", "default", "", "read"},
		{"/nowhere", "DELETE", "default", "", "write"},
		{"/nowhere", "export", "default", "", "read"},
		{"/a/b/c", "TRACE", "default", "", AnyOperation},
		{"/a/b/c", "get", "default", "", AnyOperation},
		{"/a/b/c", "", "default", "", AnyOperation},
	} {
		r, err := s.Match(tc.path, tc.op)
		if err != nil {
			t.Errorf("Match(%q, %q): %v", tc.path, tc.op, err)
			continue
		}
		if r.Rule.Name != tc.rule || r.Template() != tc.tmpl || r.Operation() != tc.as {
			t.Errorf("Match(%q, %q) = %s %q %s, want %s %q %s", tc.path, tc.op,
				r.Rule.Name, r.Template(), r.Operation(), tc.rule, tc.tmpl, tc.as)
		}
		if got := s.RouteByID(r.ID); got != r {
			t.Errorf("RouteByID(%d) = %v, want %v", r.ID, got, r)
		}
		if got, ok := s.Lookup(r.Rule.Name, r.Template(), r.Operation()); !ok || got != r {
			t.Errorf("Lookup(%s, %q, %s) = %v, %v; want %v", r.Rule.Name, r.Template(), r.Operation(), got, ok, r)
		}
	}
}

func TestCost(t *testing.T) {
	s := mustParse(t, precedencePolicy)
	for _, tc := range []struct {
		path, op string
		want     int64
	}{
		{"/a/b/c", "GET", 1},   // default cost
		{"/a/z", "GET", 2},     // rule-wide cost
		{"/a/z", "export", 5},  // per-operation cost
		{"/nowhere", "GET", 1}, // default rule, class read: not in its cost map
		{"/nowhere", "PUT", 3}, // default rule, class write
		{"/nowhere", "BREW", 2},
	} {
		r, err := s.Match(tc.path, tc.op)
		if err != nil {
			t.Fatal(err)
		}
		if got := s.Cost(r); got != tc.want {
			t.Errorf("Cost(Match(%q, %q) = %v) = %d, want %d", tc.path, tc.op, r, got, tc.want)
		}
	}
}

func TestRoutesAreDenseAndBounded(t *testing.T) {
	s := mustParse(t, precedencePolicy)
	// 15 (template, operation) pairs of rules + 2 classes + "*" of the default rule.
	if got, want := s.NumRoutes(), 15+3; got != want {
		t.Errorf("NumRoutes() = %d, want %d", got, want)
	}
	seen := map[string]bool{}
	for id := 0; id < s.NumRoutes(); id++ {
		r := s.RouteByID(uint32(id))
		if !r.Valid() || r.ID != uint32(id) {
			t.Fatalf("RouteByID(%d) = %v", id, r)
		}
		k := r.Rule.Name + " " + r.Template() + " " + r.Operation()
		if seen[k] {
			t.Errorf("route %s appears twice", k)
		}
		seen[k] = true
	}
	if r := s.RouteByID(uint32(s.NumRoutes())); r.Valid() {
		t.Errorf("RouteByID(NumRoutes()) = %v, want the zero Route", r)
	}
	// Whatever the path, only routes of the Set come back: keys are bounded by
	// tenants × routes, never by the paths an attacker sends.
	ids := map[uint32]bool{}
	for i := range 2000 {
		r, err := s.Match(fmt.Sprintf("/a/%d/x%d/%d", i, i*7, i%3), []string{"GET", "POST", "FOO", "export"}[i%4])
		if err != nil {
			t.Fatal(err)
		}
		ids[r.ID] = true
	}
	if len(ids) > s.NumRoutes() {
		t.Errorf("%d distinct routes from random paths, more than the Set's %d", len(ids), s.NumRoutes())
	}
}

func TestMatchErrors(t *testing.T) {
	s := mustParse(t, precedencePolicy)
	for _, p := range []string{"", "a/b", "/a\x00", "/a%00", "/a%zz", "/\xff", "/" + strings.Repeat("a", MaxPathLen)} {
		if r, err := s.Match(p, "GET"); !errors.Is(err, ErrInvalidPath) || r.Valid() {
			t.Errorf("Match(%.30q) = %v, %v; want ErrInvalidPath", p, r, err)
		}
	}
}

func TestLookup(t *testing.T) {
	s := loadExample(t)
	for _, tc := range []struct {
		rule, tmpl, op string
		ok             bool
	}{
		{"orders-read", "/orders/{id}", "read", true},
		{"orders-read", "/users/{uid}/orders/*", "read", true},
		{"default", "", "write", true},
		{"default", "", AnyOperation, true},
		{"orders-read", "/orders/{oid}", "read", false}, // templates as written
		{"orders-read", "/orders/{id}", "write", false},
		{"orders-write", "/orders/{id}", "read", false},
		{"nope", "/orders/{id}", "read", false},
		{"default", "/orders", "read", false},
	} {
		r, ok := s.Lookup(tc.rule, tc.tmpl, tc.op)
		if ok != tc.ok || ok && (r.Rule.Name != tc.rule || r.Template() != tc.tmpl || r.Operation() != tc.op) {
			t.Errorf("Lookup(%q, %q, %q) = %v, %v; want ok=%v", tc.rule, tc.tmpl, tc.op, r, ok, tc.ok)
		}
	}
}

func TestLimits(t *testing.T) {
	s := loadExample(t)
	route := func(path, op string) Route {
		r, err := s.Match(path, op)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	orders := route("/orders/7", "GET")
	for _, tc := range []struct {
		tenant         string
		reqs, burst    int64
		override       bool
		fingerprintSet string
	}{
		{"acme", 100, 20, false, "rule"},
		{"bigcorp", 1000, 100, true, "bigcorp"},
		{"trial-co", 10, 5, true, "trial"},
	} {
		l, err := s.Limits(orders, tc.tenant, "ignored-for-global")
		if err != nil {
			t.Fatal(err)
		}
		if l.Requests != tc.reqs || l.Burst != tc.burst || l.Override != tc.override || l.Scope != Global || l.Region != "" {
			t.Errorf("Limits(orders, %s) = %+v, want %d/min burst %d override %v", tc.tenant, l, tc.reqs, tc.burst, tc.override)
		}
	}
	a, _ := s.Limits(orders, "acme", "")
	b, _ := s.Limits(orders, "bigcorp", "")
	if a.Fingerprint == b.Fingerprint {
		t.Error("an override with another limit has the rule's fingerprint")
	}
	// The same limit on another rule has the same fingerprint (the key still differs by route).
	users, _ := s.Limits(route("/users/1/orders/2", "GET"), "acme", "")
	if users.Fingerprint != a.Fingerprint {
		t.Errorf("same limit, fingerprints %s and %s", users.Fingerprint, a.Fingerprint)
	}

	search := route("/search", "GET")
	for region, want := range map[string]int64{"eu-west": 180, "us-east": 120} {
		l, err := s.Limits(search, "acme", region)
		if err != nil || l.Requests != want || l.Region != region || l.Scope != Regional {
			t.Errorf("Limits(search, acme, %s) = %+v, %v; want the %d/min slice", region, l, err, want)
		}
	}
	if _, err := s.Limits(search, "acme", "mars"); !errors.Is(err, ErrUnknownRegion) {
		t.Errorf("Limits(search, mars) = %v, want ErrUnknownRegion", err)
	}
	if _, err := s.Limits(search, "acme", ""); !errors.Is(err, ErrUnknownRegion) {
		t.Errorf("Limits(search, no region) = %v, want ErrUnknownRegion", err)
	}
	if _, err := s.Limits(orders, "", ""); !errors.Is(err, ErrInvalidTenant) {
		t.Errorf("Limits(orders, empty tenant) = %v, want ErrInvalidTenant", err)
	}
	if _, err := s.Limits(Route{}, "acme", ""); !errors.Is(err, ErrForeignRoute) {
		t.Errorf("Limits(zero Route) = %v, want ErrForeignRoute", err)
	}
	other := loadExample(t)
	if _, err := other.Limits(orders, "acme", ""); !errors.Is(err, ErrForeignRoute) {
		t.Errorf("Limits(route of another Set) = %v, want ErrForeignRoute", err)
	}

	catalog := route("/products/1", "GET")
	l, err := s.Limits(catalog, "acme", "")
	if err != nil || l.Emergency == nil || l.Emergency.Requests != 5 || l.Emergency.Burst != 3 {
		t.Errorf("Limits(catalog) = %+v, %v; want emergency 5/min burst 3", l, err)
	}
	if l, _ := s.Limits(orders, "acme", ""); l.Emergency != nil {
		t.Errorf("a deny rule has an emergency quota %+v", l.Emergency)
	}
}

func TestOverrideEmergency(t *testing.T) {
	s := mustParse(t, `
version: e1
default: {limit: 10/minute}
rules:
  - name: r
    routes: [/a]
    operations: [read]
    limit: 100/minute
    burst: 10
    on_failure: emergency
    emergency: {limit: 5/minute, burst: 3}
    overrides:
      own: {limit: 50/minute, burst: 6, emergency: {limit: 2/minute, burst: 1}}
      inherits: {limit: 50/minute, burst: 6}
`)
	r, _ := s.Match("/a", "GET")
	for tenant, want := range map[string]int64{"acme": 3, "own": 1, "inherits": 3} {
		l, err := s.Limits(r, tenant, "")
		if err != nil || l.Emergency == nil || l.Emergency.Burst != want {
			t.Errorf("Limits(%s).Emergency = %+v, %v; want burst %d", tenant, l.Emergency, err, want)
		}
	}
	if got := s.Rule("r").OverrideTenants(); strings.Join(got, ",") != "inherits,own" {
		t.Errorf("OverrideTenants() = %v", got)
	}
}

func TestHotPathDoesNotAllocate(t *testing.T) {
	s := loadExample(t)
	r, _ := s.Match("/orders/7", "GET")
	sr, _ := s.Match("/search", "GET")
	for name, f := range map[string]func(){
		"Match clean":          func() { _, _ = s.Match("/orders/7/cancel", "POST") },
		"Match canonical %":    func() { _, _ = s.Match("/orders/a%2Fb", "GET") },
		"Match default":        func() { _, _ = s.Match("/not/a/route", "GET") },
		"Match unknown op":     func() { _, _ = s.Match("/orders/7", "BREW") },
		"Limits":               func() { _, _ = s.Limits(r, "acme", "") },
		"Limits override":      func() { _, _ = s.Limits(r, "bigcorp", "") },
		"Limits region":        func() { _, _ = s.Limits(sr, "acme", "eu-west") },
		"Cost":                 func() { _ = s.Cost(r) },
		"RouteByID and Lookup": func() { _ = s.RouteByID(3); _, _ = s.Lookup("orders-read", "/orders/{id}", "read") },
	} {
		if n := testing.AllocsPerRun(200, f); n != 0 {
			t.Errorf("%s allocates %v times per call, want 0", name, n)
		}
	}
}

// TestManyOperations covers the hashed operation lookup used when a Set names many operations.
func TestManyOperations(t *testing.T) {
	var ops strings.Builder
	for i := range maxLinearOps {
		fmt.Fprintf(&ops, "  op%02d: %s\n", i, []string{"read", "write"}[i%2])
	}
	s := mustParse(t, "version: m1\noperations:\n"+ops.String()+`default: {limit: 10/minute}
rules:
  - name: r
    routes: [/a]
    operations: [op03, write]
    limit: 1/s
`)
	if s.opList != nil {
		t.Fatalf("%d operations resolved linearly, want a map above %d", len(s.ops), maxLinearOps)
	}
	for _, tc := range []struct{ op, rule, entry string }{
		{"op03", "r", "op03"}, {"op05", "r", "write"}, {"POST", "r", "write"}, {"op04", "default", "read"},
		{"GET", "default", "read"}, {"op99", "default", AnyOperation},
	} {
		r, err := s.Match("/a", tc.op)
		if err != nil || r.Rule.Name != tc.rule || r.Operation() != tc.entry {
			t.Errorf("Match(/a, %s) = %v, %v; want %s %s", tc.op, r, err, tc.rule, tc.entry)
		}
	}
}

func TestCheckRegion(t *testing.T) {
	s := loadExample(t)
	for _, region := range []string{"eu-west", "us-east"} {
		if err := s.CheckRegion(region); err != nil {
			t.Errorf("CheckRegion(%s) = %v", region, err)
		}
	}
	err := s.CheckRegion("ap-south")
	if !errors.Is(err, ErrUnknownRegion) || !strings.Contains(err.Error(), "[search]") {
		t.Errorf("CheckRegion(ap-south) = %v, want ErrUnknownRegion naming search", err)
	}
	if err := mustParse(t, precedencePolicy).CheckRegion("anywhere"); err != nil {
		t.Errorf("a Set without regional rules rejects a region: %v", err)
	}
}
