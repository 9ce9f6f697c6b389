package policy

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// TestExplainCard checks explain's answers for the design card's cases on the shipped example.
func TestExplainCard(t *testing.T) {
	s := loadExample(t)
	for _, tc := range []struct {
		name                     string
		tenant, path, op, region string
		rule, tmpl, entry        string
		reqs, burst              int64
		period                   time.Duration
		cost                     int64
		failure                  FailureMode
		override                 bool
		lines                    []string // lines String() must contain
	}{
		{
			name: "reading orders: 100/minute, burst 20", tenant: "acme", path: "/orders/7", op: "read",
			rule: "orders-read", tmpl: "/orders/{id}", entry: "read", reqs: 100, burst: 20, period: time.Minute,
			cost: 1, failure: Deny,
			lines: []string{
				"rule:        orders-read (line 26)",
				"template:    /orders/{id}  {id}=7",
				"limit:       100 per 1m, burst 20 (rule; global)",
				"cost:        1 token(s) per request",
				"on failure:  deny: 503 with Retry-After 2s",
				"key:         lb1:acme|/orders/%7B%7D|read|",
			},
		},
		{
			name: "GET is a read", tenant: "acme", path: "/orders/7/", op: "GET",
			rule: "orders-read", tmpl: "/orders/{id}", entry: "read", reqs: 100, burst: 20, period: time.Minute,
			cost: 1, failure: Deny,
			lines: []string{
				"route:       /orders/7/ (normalized /orders/7)",
				"operation:   GET (HTTP method of class read)",
				"why:         /orders/{id} is the most specific template matching /orders/7 with an entry for the operation; operation GET matches through its class read",
			},
		},
		{
			name: "a tenant override replaces the rule's limit", tenant: "bigcorp", path: "/orders/7", op: "GET",
			rule: "orders-read", tmpl: "/orders/{id}", entry: "read", reqs: 1000, burst: 100, period: time.Minute,
			cost: 1, failure: Deny, override: true,
			lines: []string{"limit:       1000 per 1m, burst 100 (tenant override; global)"},
		},
		{
			name: "writes on orders fail closed", tenant: "acme", path: "/orders/7", op: "POST",
			rule: "orders-write", tmpl: "/orders/{id}", entry: "write", reqs: 30, burst: 10, period: time.Minute,
			cost: 1, failure: Deny,
			lines: []string{"on failure:  deny: 503 with Retry-After 1s"},
		},
		{
			name: "a low-risk read with an emergency bucket", tenant: "acme", path: "/products/sku-1", op: "GET",
			rule: "catalog-read", tmpl: "/products/{sku}", entry: "read", reqs: 600, burst: 60, period: time.Minute,
			cost: 1, failure: Emergency,
			lines: []string{"on failure:  emergency: local bucket 5 per 1m, burst 3 per agent; responses marked degraded"},
		},
		{
			name: "a named operation replaces the class on the same template", tenant: "acme", path: "/orders", op: "export",
			rule: "orders-export", tmpl: "/orders", entry: "export", reqs: 60, burst: 30, period: time.Hour,
			cost: 10, failure: Deny,
			lines: []string{
				"replaces:    orders-read /orders read — same template; the exact operation export beats the class read",
				"cost:        10 token(s) per request",
			},
		},
		{
			name: "regional slice", tenant: "acme", path: "/search", op: "GET", region: "eu-west",
			rule: "search", tmpl: "/search", entry: "read", reqs: 180, burst: 18, period: time.Minute,
			cost: 1, failure: Deny,
			lines: []string{
				"limit:       180 per 1m, burst 18 (rule; regional, slice of region eu-west)",
				"key:         lb1:acme|/search|read|",
			},
		},
		{
			name: "shadow", tenant: "acme", path: "/reports/q3/summary", op: "GET",
			rule: "reports-read", tmpl: "/reports/*", entry: "read", reqs: 20, burst: 5, period: time.Minute,
			cost: 1, failure: Deny,
			lines: []string{"shadow:      yes: reported, never denied", "template:    /reports/*  *=q3/summary"},
		},
		{
			name: "unmatched route: the default rule, failing closed", tenant: "acme", path: "/admin/../secret/x", op: "DELETE",
			rule: "default", tmpl: "", entry: "write", reqs: 60, burst: 10, period: time.Minute,
			cost: 1, failure: Deny,
			lines: []string{
				"route:       /admin/../secret/x (normalized /secret/x)",
				"rule:        default (line 107), operation write",
				"why:         no template of any rule matches /secret/x for operation DELETE (or its class): the default rule applies",
				"key:         lb1:acme||write|",
			},
		},
		{
			name: "unknown operation", tenant: "acme", path: "/orders/7", op: "BREW",
			rule: "default", tmpl: "", entry: AnyOperation, reqs: 60, burst: 10, period: time.Minute,
			cost: 1, failure: Deny,
			lines: []string{
				"operation:   BREW (unknown to this policy)",
				"key:         lb1:acme||*|",
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, err := s.Explain(tc.tenant, tc.path, tc.op, tc.region)
			if err != nil {
				t.Fatal(err)
			}
			r := e.Route
			if r.Rule.Name != tc.rule || r.Template() != tc.tmpl || r.Operation() != tc.entry {
				t.Errorf("route = %s %q %s, want %s %q %s", r.Rule.Name, r.Template(), r.Operation(), tc.rule, tc.tmpl, tc.entry)
			}
			l := e.Limits
			if l.Requests != tc.reqs || l.Burst != tc.burst || l.Period != tc.period || l.Override != tc.override {
				t.Errorf("limits = %d/%s burst %d override %v, want %d/%s burst %d override %v",
					l.Requests, l.Period, l.Burst, l.Override, tc.reqs, tc.period, tc.burst, tc.override)
			}
			if e.Cost != tc.cost || r.Rule.OnFailure != tc.failure {
				t.Errorf("cost %d, failure %v; want %d, %v", e.Cost, r.Rule.OnFailure, tc.cost, tc.failure)
			}
			want, _ := s.Key(r, tc.tenant, tc.region)
			if e.Key != want {
				t.Errorf("key %q, want Key's %q", e.Key, want)
			}
			out := e.String()
			for _, line := range tc.lines {
				if !strings.Contains(out, line) {
					t.Errorf("explanation lacks %q:\n%s", line, out)
				}
			}
		})
	}
}

func TestExplainReplaced(t *testing.T) {
	s := mustParse(t, precedencePolicy)
	e, err := s.Explain("acme", "/a/b/c", "GET", "")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range e.Replaced {
		got = append(got, c.Route.String()+": "+c.Reason)
	}
	want := []string{
		`param /a/{x}/c read: less specific template: segment 2: literal "b" beats {x}`,
		`wild /a/* read: less specific template: segment 2: literal "b" beats *`,
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("replaced:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func TestExplainErrors(t *testing.T) {
	s := loadExample(t)
	if _, err := s.Explain("acme", "/a%zz", "GET", ""); !errors.Is(err, ErrInvalidPath) {
		t.Errorf("bad path: %v, want ErrInvalidPath", err)
	}
	if _, err := s.Explain("", "/orders", "GET", ""); !errors.Is(err, ErrInvalidTenant) {
		t.Errorf("empty tenant: %v, want ErrInvalidTenant", err)
	}
	e, err := s.Explain("acme", "/search", "GET", "mars")
	if !errors.Is(err, ErrUnknownRegion) {
		t.Errorf("unknown region: %v, want ErrUnknownRegion", err)
	}
	if e.Route.Rule == nil || e.Route.Rule.Name != "search" {
		t.Errorf("a failed explanation should still name the matched rule, got %v", e.Route)
	}
}
