package policy

import (
	"strings"
	"testing"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

const debtPolicy = `version: v1
rules:
  - name: chat
    routes: [/v1/chat]
    operations: [write]
    limits:
      - {limit: 10/second, burst: 20}
      - {quota: 100000/day}
    max_debt: 15
  - name: search
    routes: [/search]
    operations: [read]
    limit: 100/minute
    burst: 40
    scope: regional
    regions:
      eu: {limit: 50/minute, burst: 20}
      us: {limit: 50/minute, burst: 20}
    max_debt: 8
  - name: writes
    scope: tenant
    operations: [write]
    limit: 1000/hour
    burst: 50
    max_debt: 30
    overrides:
      bigcorp: {limit: 10000/hour, burst: 500}
default:
  limit: 60/minute
`

// TestMaxDebt checks how max_debt resolves: in µ on each bucket of the rule (every limit of a rule
// with limits, every region slice, every tenant override), capped at the capacity of a bucket a
// runtime override made smaller; 0 where it is not set.
func TestMaxDebt(t *testing.T) {
	s := mustParse(t, debtPolicy)
	const tok = bucket.PerToken
	if r := s.Rule("chat"); r.MaxDebt != 15 || len(r.Extra) != 1 || r.Extra[0].MaxDebt != 15 {
		t.Fatalf("chat: MaxDebt %d, extra %v; want 15 on both limits", r.MaxDebt, r.Extra)
	}
	chat, err := s.Match("/v1/chat", "write")
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range chat.Charges() {
		c := s.RouteByID(id)
		l, err := s.Limits(c, "acme", "")
		if err != nil {
			t.Fatal(err)
		}
		want := 15 * tok
		if c.Rule.Name == "writes" {
			want = 30 * tok // the tenant budget charged beside them has its own
		}
		if l.MaxDebt != want {
			t.Errorf("%s: MaxDebt %d µ, want %d", c.Rule.Name, l.MaxDebt, want)
		}
	}
	for _, c := range []struct {
		tenant, path, op, region string
		want                     bucket.Micro
	}{
		{"acme", "/v1/chat", "write", "", 15 * tok},
		{"acme", "/search", "read", "eu", 8 * tok},
		{"acme", "/search", "read", "us", 8 * tok},
		{"acme", "/other", "read", "", 0}, // the default rule has none
	} {
		if l := limitsFor(t, s, c.tenant, c.path, c.op, c.region); l.MaxDebt != c.want {
			t.Errorf("%s %s %s %s: MaxDebt %d µ, want %d", c.tenant, c.op, c.path, c.region, l.MaxDebt, c.want)
		}
	}
	// The tenant budget: the rule's and the file override's buckets, and a runtime override whose
	// burst is below the rule's max_debt caps it at its capacity.
	budget := s.RouteByID(chat.Charges()[len(chat.Charges())-1])
	if budget.Rule.Name != "writes" {
		t.Fatalf("the last charge of chat is %s, want the tenant budget writes", budget.Rule.Name)
	}
	o := mustOverrides(t, RuntimeOverride{Rule: "writes", Tenant: "small", Spec: "{limit: 100/1h, burst: 10}"})
	so, problems := s.WithOverrides(o)
	if len(problems) != 0 {
		t.Fatalf("problems: %v", problems)
	}
	budget = so.RouteByID(budget.ID)
	for tenant, want := range map[string]bucket.Micro{"acme": 30 * tok, "bigcorp": 30 * tok, "small": 10 * tok} {
		l, err := so.Limits(budget, tenant, "")
		if err != nil {
			t.Fatal(err)
		}
		if l.MaxDebt != want {
			t.Errorf("writes for %s: MaxDebt %d µ, want %d", tenant, l.MaxDebt, want)
		}
	}
}

// TestMaxDebtDigestAndExplain: max_debt is part of what a Set means (its digest), a policy without
// it keeps the digest it had, and explain shows it.
func TestMaxDebtDigestAndExplain(t *testing.T) {
	with := mustParse(t, debtPolicy)
	other := mustParse(t, strings.Replace(debtPolicy, "max_debt: 8", "max_debt: 7", 1))
	without := mustParse(t, strings.Replace(debtPolicy, "    max_debt: 8\n", "", 1))
	zero := mustParse(t, strings.Replace(debtPolicy, "max_debt: 8", "max_debt: 0", 1))
	if with.Digest() == other.Digest() || with.Digest() == without.Digest() {
		t.Error("max_debt does not change the digest")
	}
	if without.Digest() != zero.Digest() {
		t.Error("max_debt: 0 and no max_debt have different digests")
	}
	e, err := with.Explain("acme", "/search", "read", "eu")
	if err != nil {
		t.Fatal(err)
	}
	if out := e.String(); !strings.Contains(out, "max debt:    8 token(s): costs settled after the response may take the bucket that far below zero") {
		t.Errorf("explain:\n%s\nwants the max debt line", out)
	}
	e, err = with.Explain("acme", "/v1/chat", "write", "")
	if err != nil {
		t.Fatal(err)
	}
	if out := e.String(); !strings.Contains(out, "max debt:    15 token(s)") || !strings.Contains(out, "writes: 1000 per 1h, burst 50, max debt 30") {
		t.Errorf("explain:\n%s\nwants the max debt of each bucket charged", out)
	}
	e, err = without.Explain("acme", "/search", "read", "eu")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(e.String(), "max debt") {
		t.Errorf("explain without max_debt:\n%s", e.String())
	}
}
