package policy

import (
	"errors"
	"strings"
	"testing"
)

const chargesPolicy = `version: v1
rules:
  - name: chat
    routes: [/v1/chat]
    operations: [write]
    cost: 2
    limits:
      - {limit: 10/second, burst: 20}
      - {quota: 100000/day}
  - name: orders
    routes: ["/orders/{id}"]
    operations: [read]
    limit: 100/minute
  - name: writes
    scope: tenant
    operations: [write]
    limit: 1000/hour
    burst: 50
    overrides:
      bigcorp: {limit: 10000/hour, burst: 500}
  - name: everything
    scope: tenant
    quota: 1000000/month
default:
  limit: 60/minute
`

func TestCharges(t *testing.T) {
	s := mustParse(t, chargesPolicy)
	charged := func(path, op, tenant string) []string {
		t.Helper()
		r, err := s.Match(path, op)
		if err != nil {
			t.Fatal(err)
		}
		keys := []string{r.Rule.Name}
		for _, id := range r.Charges() {
			c := s.RouteByID(id)
			l, err := s.Limits(c, tenant, "")
			if err != nil {
				t.Fatal(err)
			}
			keys = append(keys, c.Rule.Name+"="+l.String())
			// The wire reference of every charge resolves to it.
			if back, ok := s.Lookup(c.Rule.Name, c.Template(), c.Operation()); !ok || back.ID != c.ID {
				t.Errorf("Lookup(%q, %q, %q) = %v, %v; want route %d", c.Rule.Name, c.Template(), c.Operation(), back, ok, c.ID)
			}
		}
		return keys
	}
	for _, tc := range []struct {
		path, op, tenant string
		want             string
	}{
		{"/v1/chat", "POST", "acme", "chat chat#2=100000/day writes=1000/1h burst 50 everything=1000000/month"},
		{"/v1/chat", "POST", "bigcorp", "chat chat#2=100000/day writes=10000/1h burst 500 everything=1000000/month"},
		{"/orders/7", "GET", "acme", "orders everything=1000000/month"},
		{"/other", "DELETE", "acme", "default writes=1000/1h burst 50 everything=1000000/month"},
		{"/other", "TRACE", "acme", "default everything=1000000/month"}, // an unknown operation: only the unfiltered budget
	} {
		if got := strings.Join(charged(tc.path, tc.op, tc.tenant), " "); got != tc.want {
			t.Errorf("%s %s %s charges %q, want %q", tc.tenant, tc.op, tc.path, got, tc.want)
		}
	}
	// Keys: a tenant budget's bucket is per tenant, the same on every route; a rule's second
	// limit has its own key beside the first.
	keyOf := func(path, op string, i int) string {
		r, _ := s.Match(path, op)
		if i >= 0 {
			r = s.RouteByID(r.Charges()[i])
		}
		k, err := s.Key(r, "acme", "")
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	chat, chat2, budget := keyOf("/v1/chat", "POST", -1), keyOf("/v1/chat", "POST", 0), keyOf("/v1/chat", "POST", 2)
	if chat == chat2 || !strings.HasPrefix(chat2, "lb1:{acme}|/v1/chat|write|") || !strings.HasPrefix(budget, "lb1:{acme}|@everything|*|") ||
		keyOf("/orders/7", "GET", 0) != budget {
		t.Errorf("keys: chat %s, chat#2 %s, budget %s (orders' %s)", chat, chat2, budget, keyOf("/orders/7", "GET", 0))
	}
	// A rule without several limits or budgets keeps its fingerprint; charged with a budget, its
	// key holds the tenant's hash tag, so that every bucket of the check shares a Cluster slot.
	plain := mustParse(t, "version: v1\nrules:\n  - {name: orders, routes: [\"/orders/{id}\"], operations: [read], limit: 100/minute}\ndefault: {limit: 60/minute}\n")
	r, _ := plain.Match("/orders/7", "GET")
	if k, _ := plain.Key(r, "acme", ""); strings.Replace(k, "lb1:acme|", "lb1:{acme}|", 1) != keyOf("/orders/7", "GET", -1) {
		t.Errorf("orders' key %s is not the same rule's in another policy %s with a hash tag", keyOf("/orders/7", "GET", -1), k)
	}
	// Explain lists every bucket and why.
	e, err := s.Explain("acme", "/v1/chat", "POST", "")
	if err != nil {
		t.Fatal(err)
	}
	text := e.String()
	for _, want := range []string{
		"also:        chat#2: 100000 per calendar day in UTC (limit 2 of rule chat)",
		"writes: 1000 per 1h, burst 50 (tenant budget writes (line 14): every request of the tenant of write)",
		"everything: 1000000 per calendar month in UTC (tenant budget everything (line 21): every request of the tenant)",
		"  key " + budget,
		"charged:     all 4 buckets or none",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("explain:\n%s\nwant %q", text, want)
		}
	}
	// Overrides: a tenant budget takes them; a rule of several limits does not.
	if _, err := s.CheckOverride("writes", "acme", "limit: 5/second"); err != nil {
		t.Errorf("override of a tenant budget: %v", err)
	}
	for _, rule := range []string{"chat", "chat#2"} {
		if _, err := s.CheckOverride(rule, "acme", "limit: 5/second"); !errors.Is(err, ErrInvalidOverride) {
			t.Errorf("override of %s: %v, want ErrInvalidOverride", rule, err)
		}
	}
	other := mustParse(t, strings.Replace(chargesPolicy, "quota: 100000/day", "quota: 200000/day", 1))
	if other.Digest() == s.Digest() {
		t.Error("a changed second limit keeps the digest")
	}
}

func TestChargesInvalid(t *testing.T) {
	for _, tc := range []struct {
		name, src, want string
	}{
		{"limits beside limit", header + "  - name: r\n    routes: [/a]\n    operations: [read]\n    limit: 1/s\n    limits: [{limit: 2/s}]\n",
			"test.yaml:7: rules[0].limit: not beside limits: list every limit of the rule under limits"},
		{"the same limit twice", header + "  - name: r\n    routes: [/a]\n    operations: [read]\n    limits: [{limit: 60/minute}, {limit: 1/s, burst: 60}]\n",
			"test.yaml:7: rules[0].limits[1]: the same limit as limits[0] (1/1s burst 60): list it once"},
		{"a cost above a second limit", header + "  - name: r\n    routes: [/a]\n    operations: [read]\n    cost: 5\n    limits: [{limit: 10/s}, {quota: 4/day}]\n",
			"test.yaml:7: rules[0].cost: cost 5 of operation read exceeds burst 4 of the rule's limit 2: such a request could never be allowed"},
		{"too many limits", header + "  - name: r\n    routes: [/a]\n    operations: [read]\n    limits: [{limit: 1/s}, {limit: 2/s}, {limit: 3/s}, {limit: 4/s}, {limit: 5/s}]\n",
			"test.yaml:7: rules[0].limits: more than 4 limits"},
		{"a bad limit", header + "  - name: r\n    routes: [/a]\n    operations: [read]\n    limits:\n      - {limit: 1/s}\n      - {quota: 5/week}\n",
			`test.yaml:9: rules[0].limits[1].quota: "5/week": a calendar quota's period is day or month`},
		{"overrides of several limits", header + "  - name: r\n    routes: [/a]\n    operations: [read]\n    limits: [{limit: 1/s}, {quota: 5/day}]\n    overrides: {big: {limit: 2/s}}\n",
			"test.yaml:8: rules[0].overrides: not available for a rule with several limits"},
		{"direct several limits with a quota", header + "  - name: r\n    routes: [/a]\n    operations: [read]\n    limits: [{limit: 1/s}, {quota: 5/day}]\n    lease: off\n",
			"test.yaml:8: rules[0].lease: lease: off takes every limit in one atomic script of token buckets; limit 2 is a calendar quota (5/day): keep leases, or give it a rule of its own"},
		{"a direct budget", header + "  - name: b\n    scope: tenant\n    limit: 10/s\n    lease: off\n",
			"test.yaml:7: rules[0].lease: a tenant budget is charged from leases by its leased routes, and in the atomic take of a route with lease: off"},
		{"a direct quota under a budget", header + "  - name: r\n    routes: [/a]\n    operations: [read]\n    quota: 10/day\n    lease: off\n  - name: b\n    scope: tenant\n    limit: 100/s\n",
			`test.yaml:4: r: rule "r" has lease: off, and tenant budget "b" (line 9) covers its operation read: a direct check takes every bucket in one atomic script of token buckets, and the rule's limit 10/day is a calendar quota`},
		{"a direct route under a quota budget", header + "  - name: r\n    routes: [/a]\n    operations: [read]\n    limit: 10/s\n    lease: off\n  - name: b\n    scope: tenant\n    limits: [{limit: 100/s}, {quota: 1000/month}]\n",
			`and the budget's limit 1000/month is a calendar quota (keep leases on the rule)`},
		{"budget with routes", header + "  - name: b\n    scope: tenant\n    routes: [/a]\n    limit: 1/s\n",
			"test.yaml:6: rules[0].routes: a tenant budget (scope: tenant) applies to every route of the tenant; it has no routes"},
		{"budget of a method", header + "  - name: b\n    scope: tenant\n    operations: [GET]\n    limit: 1/s\n",
			`test.yaml:6: rules[0].operations[0]: a tenant budget lists classes (read, write), not "GET"`},
		{"budget with a cost", header + "  - name: b\n    scope: tenant\n    limit: 1/s\n    cost: 2\n",
			"test.yaml:7: rules[0].cost: a tenant budget is charged each request's cost on its route; it has no cost of its own"},
		{"budget in emergency", header + "  - name: b\n    scope: tenant\n    limit: 10/s\n    on_failure: emergency\n    emergency: {limit: 1/s}\n",
			"test.yaml:7: rules[0].on_failure: a tenant budget fails closed: on_failure: deny (no emergency bucket)"},
		{"a cost above a budget", header + "  - name: r\n    routes: [/a]\n    operations: [read]\n    limit: 10/s\n    cost: 5\n  - name: b\n    scope: tenant\n    limit: 1/s\n    burst: 3\n",
			`test.yaml:9: rules[1]: rule "r"'s cost 5 of operation read exceeds the burst 3 of tenant budget "b" (1/1s burst 3): such a request could never be allowed`},
		{"too many buckets for a check", header + "  - name: r\n    routes: [/a]\n    operations: [read]\n    limits: [{limit: 1/s}, {limit: 2/s}, {limit: 3/s}, {limit: 4/s}]\n" +
			"  - {name: b1, scope: tenant, limits: [{limit: 10/s}, {limit: 11/s}, {limit: 12/s}]}\n" +
			"  - {name: b2, scope: tenant, limits: [{limit: 20/s}, {limit: 21/s}, {limit: 22/s}, {limit: 23/s}]}\n",
			`rules[2]: rule "r"'s route /a read would charge more than 8 buckets besides its own with tenant budget "b2"`},
		{"default as a budget", "version: v1\ndefault: {limit: 10/minute, scope: tenant}\n",
			`test.yaml:2: default.scope: "tenant" must be global or regional`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse("test.yaml", []byte(tc.src))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Parse:\n%v\nwant a line:\n%s", err, tc.want)
			}
		})
	}
}

// TestChargesDirect: lease: off on a rule with several limits and on a rule a tenant budget
// covers; the check takes every bucket in one script, so all its keys share the tenant's hash tag.
func TestChargesDirect(t *testing.T) {
	s := mustParse(t, header+`  - name: direct
    routes: [/d]
    operations: [write]
    lease: off
    limits: [{limit: 10/s, burst: 20}, {limit: 100/minute}]
  - name: single
    routes: [/s]
    operations: [write]
    lease: off
    limit: 5/s
  - name: leased
    routes: [/l]
    operations: [read]
    limit: 5/s
  - name: b
    scope: tenant
    operations: [write]
    limit: 1000/hour
    burst: 50
`)
	for _, path := range []string{"/d", "/s"} {
		r, _ := s.Match(path, "POST")
		if !r.Rule.Direct || len(r.Charges()) == 0 {
			t.Fatalf("%s: direct %t, charges %v", path, r.Rule.Direct, r.Charges())
		}
		own, _ := s.Key(r, "acme", "")
		for _, id := range r.Charges() {
			k, _ := s.Key(s.RouteByID(id), "acme", "")
			if hashTag(k) != "acme" || hashTag(own) != "acme" {
				t.Errorf("%s: keys %s and %s, want the hash tag {acme} on both", path, own, k)
			}
		}
		e, err := s.Explain("acme", path, "POST", "")
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{"lease:       off: every check is one atomic take of its cost from all", "slot:        keys tagged {acme}"} {
			if !strings.Contains(e.String(), want) {
				t.Errorf("explain %s:\n%s\nwant %q", path, e, want)
			}
		}
	}
	// A route charged with nothing keeps a key without a tag.
	r, _ := s.Match("/l", "GET")
	if k, _ := s.Key(r, "acme", ""); hashTag(k) != "" || strings.ContainsAny(k, "{}") {
		t.Errorf("leased route's key %s holds a hash tag", k)
	}
}
