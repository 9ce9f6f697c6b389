package policy

import (
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
)

func mustOverrides(t *testing.T, entries ...RuntimeOverride) *Overrides {
	t.Helper()
	o, err := NewOverrides(entries)
	if err != nil {
		t.Fatalf("NewOverrides: %v", err)
	}
	return o
}

// limitsFor resolves tenant's limits of a request on s.
func limitsFor(t *testing.T, s *Set, tenant, path, op, region string) *Limits {
	t.Helper()
	r, err := s.Match(path, op)
	if err != nil {
		t.Fatal(err)
	}
	l, err := s.Limits(r, tenant, region)
	if err != nil {
		t.Fatalf("Limits(%s, %s): %v", r, tenant, err)
	}
	return l
}

func TestWithOverrides(t *testing.T) {
	file := loadExample(t)
	o := mustOverrides(t,
		RuntimeOverride{Rule: "orders-read", Tenant: "bigcorp", Spec: "{limit: 2000/1m, burst: 200}"}, // replaces the file's
		RuntimeOverride{Rule: "orders-read", Tenant: "newco", Spec: "{limit: 50/1m, burst: 5}"},
		RuntimeOverride{Rule: "default", Tenant: "newco", Spec: "{limit: 5/1m, burst: 2}"},
	)
	s, problems := file.WithOverrides(o)
	if len(problems) != 0 {
		t.Fatalf("problems: %v", problems)
	}
	if want := file.Version() + "+o" + o.Digest()[:FingerprintLen]; s.Version() != want {
		t.Errorf("Version() = %q, want %q", s.Version(), want)
	}
	if len(s.Version()) > MaxVersionLen || s.Digest() == file.Digest() {
		t.Errorf("version %q (max %d), digest %s (file's %s)", s.Version(), MaxVersionLen, s.Digest(), file.Digest())
	}
	if s.Base() != file || file.Base() != file || s.Overrides() != o || file.Overrides() != nil {
		t.Error("Base/Overrides do not name the file's Set and the snapshot")
	}

	for _, c := range []struct {
		tenant, path, op string
		want             string // limit as Quota.String
		override         bool
	}{
		{"bigcorp", "/orders/7", "GET", "2000/1m burst 200", true}, // runtime beats the file's 1000/1m
		{"newco", "/orders/7", "GET", "50/1m burst 5", true},
		{"trial-co", "/orders/7", "GET", "10/1m burst 5", true}, // file override untouched
		{"acme", "/orders/7", "GET", "100/1m burst 20", false},
		{"newco", "/admin", "DELETE", "5/1m burst 2", true},       // default rule
		{"bigcorp", "/orders/7", "POST", "30/1m burst 10", false}, // another rule
	} {
		l := limitsFor(t, s, c.tenant, c.path, c.op, "")
		if l.Quota.String() != c.want || l.Override != c.override {
			t.Errorf("%s %s %s: %s override=%t, want %s override=%t", c.tenant, c.op, c.path, l.Quota, l.Override, c.want, c.override)
		}
		// The same request on the file's Set: only the runtime overrides differ.
		fl := limitsFor(t, file, c.tenant, c.path, c.op, "")
		_, runtime := s.RuntimeOverride(limitsRule(t, s, c.path, c.op), c.tenant)
		if (fl.Fingerprint != l.Fingerprint) != runtime {
			t.Errorf("%s %s %s: fingerprint %s on the file's Set, %s with overrides; runtime override %t",
				c.tenant, c.op, c.path, fl.Fingerprint, l.Fingerprint, runtime)
		}
	}

	// A route of one Set is foreign to the other.
	r, _ := file.Match("/orders/7", "GET")
	if _, err := s.Limits(r, "acme", ""); !errors.Is(err, ErrForeignRoute) {
		t.Errorf("file route on the derived Set: %v, want ErrForeignRoute", err)
	}

	// Applying to a Set with overrides replaces them; the empty snapshot gives the file back.
	o2 := mustOverrides(t, RuntimeOverride{Rule: "orders-read", Tenant: "newco", Spec: "{limit: 60/1m, burst: 6}"})
	s2, _ := s.WithOverrides(o2)
	if want := file.Version() + "+o" + o2.Digest()[:FingerprintLen]; s2.Version() != want {
		t.Errorf("re-applied Version() = %q, want %q", s2.Version(), want)
	}
	if l := limitsFor(t, s2, "bigcorp", "/orders/7", "GET", ""); l.Quota.String() != "1000/1m burst 100" {
		t.Errorf("bigcorp after its runtime override is gone: %s, want the file's 1000/1m burst 100", l.Quota)
	}
	for _, empty := range []*Overrides{nil, mustOverrides(t)} {
		if back, p := s.WithOverrides(empty); back != file || p != nil {
			t.Errorf("WithOverrides(%v) = version %s, %v; want the file's Set", empty, back.Version(), p)
		}
	}

	// The derived Set explains with its own version and the effective limit.
	e, err := s.Explain("bigcorp", "/orders/7", "GET", "")
	if err != nil || e.Version != s.Version() || e.Limits.Burst != 200 {
		t.Errorf("Explain: version %s burst %d (%v)", e.Version, e.Limits.Burst, err)
	}
}

func limitsRule(t *testing.T, s *Set, path, op string) string {
	t.Helper()
	r, err := s.Match(path, op)
	if err != nil {
		t.Fatal(err)
	}
	return r.Rule.Name
}

// TestOverridesDeterministic: a snapshot's digest and the Set it makes depend on its content
// only, not on the order it was read in.
func TestOverridesDeterministic(t *testing.T) {
	file := loadExample(t)
	a := RuntimeOverride{Rule: "orders-read", Tenant: "x", Spec: "{limit: 5/1m, burst: 5}"}
	b := RuntimeOverride{Rule: "orders-write", Tenant: "x", Spec: "{limit: 6/1m, burst: 6}"}
	c := RuntimeOverride{Rule: "nope", Tenant: "x", Spec: "{limit: 6/1m, burst: 6}"}
	o1, o2 := mustOverrides(t, a, b, c), mustOverrides(t, c, b, a)
	if o1.Digest() != o2.Digest() || o1.Digest() == "" {
		t.Fatalf("digests %q, %q", o1.Digest(), o2.Digest())
	}
	s1, p1 := file.WithOverrides(o1)
	s2, p2 := file.WithOverrides(o2)
	if s1.Version() != s2.Version() || s1.Digest() != s2.Digest() || len(p1) != 1 || len(p2) != 1 {
		t.Errorf("versions %s, %s; digests %s, %s; problems %v, %v", s1.Version(), s2.Version(), s1.Digest(), s2.Digest(), p1, p2)
	}
	o3 := mustOverrides(t, a, RuntimeOverride{Rule: b.Rule, Tenant: b.Tenant, Spec: "{limit: 7/1m, burst: 7}"})
	if o3.Digest() == o1.Digest() {
		t.Error("a changed spec kept the digest")
	}
}

func TestOverrideProblems(t *testing.T) {
	file := loadExample(t)
	good := RuntimeOverride{Rule: "orders-read", Tenant: "ok", Spec: "{limit: 5/1m, burst: 5}"}
	bad := []struct {
		o    RuntimeOverride
		want string
	}{
		{RuntimeOverride{"no-such-rule", "t", "{limit: 5/1m}"}, `unknown rule "no-such-rule"`},
		{RuntimeOverride{"orders-read", "", "{limit: 5/1m}"}, "invalid tenant: empty"},
		{RuntimeOverride{"orders-read", "t", "{limit: 5/fortnight}"}, `limit: "5/fortnight": period "fortnight"`},
		{RuntimeOverride{"orders-read", "t", "{limit: 5/1m, brust: 3}"}, `brust: unknown field (did you mean "burst"?)`},
		{RuntimeOverride{"orders-read", "t", ""}, "empty spec"},
		{RuntimeOverride{"orders-export", "t", "{limit: 5/1m, burst: 5}"}, `cost 10 exceeds burst 5 of the override`},
		{RuntimeOverride{"search", "t", "{limit: 5/1m, burst: 5}"}, `regions: required: rule "search" is regional`},
		{RuntimeOverride{"search", "t", "{limit: 2/1m, burst: 2, regions: {eu-west: {limit: 1/1m, burst: 1}, ap: {limit: 1/1m, burst: 1}}}"},
			`must name the same regions as rule "search" (eu-west, us-east)`},
		{RuntimeOverride{"orders-read", "t", "{limit: 5/1m, regions: {eu: {limit: 5/1m}}}"}, "only allowed when the rule has scope: regional"},
		{RuntimeOverride{"orders-read", "t", "{limit: 50/1m, emergency: {limit: 1/1m, burst: 1}}"}, "only used with on_failure: emergency"},
		{RuntimeOverride{"catalog-read", "t", "{limit: 4/1m, burst: 2}"}, "the rule's emergency 5/1m burst 3 must be strictly smaller than the override (4/1m burst 2)"},
		{RuntimeOverride{"catalog-read", "t", "{limit: 40/1m, burst: 20, emergency: {limit: 40/1m, burst: 2}}"}, "emergency 40/1m burst 2 must be strictly smaller"},
		{RuntimeOverride{"orders-read", "t", "{limit: 1/365d, burst: 9000000}"}, "cannot be represented exactly"},
		{RuntimeOverride{"orders-read", "t", "[1, 2]"}, "must be a mapping with fields limit, burst, quota, regions, emergency"},
		{RuntimeOverride{"orders-read", "t", "{limit: 5/1m"}, "invalid YAML"},
		{RuntimeOverride{"orders-read", "t", strings.Repeat(" ", MaxOverrideSpecLen+1)}, "spec longer than"},
	}
	entries := []RuntimeOverride{good}
	for i, c := range bad {
		if c.o.Tenant != "" {
			c.o.Tenant = fmt.Sprintf("t%d", i) // distinct (rule, tenant) pairs in one snapshot
		}
		entries = append(entries, c.o)
		_, err := file.CheckOverride(c.o.Rule, c.o.Tenant, c.o.Spec)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("CheckOverride(%q, %q, %q) = %v, want an error containing %q", c.o.Rule, c.o.Tenant, c.o.Spec, err, c.want)
		}
		if !errors.Is(err, ErrUnknownRule) && !errors.Is(err, ErrInvalidOverride) {
			t.Errorf("CheckOverride(%q): %v wraps neither ErrUnknownRule nor ErrInvalidOverride", c.o.Spec, err)
		}
	}
	s, problems := file.WithOverrides(mustOverrides(t, entries...))
	if len(problems) != len(bad) {
		t.Fatalf("%d problems, want %d: %v", len(problems), len(bad), problems)
	}
	if l := limitsFor(t, s, "ok", "/orders", "GET", ""); l.Quota.String() != "5/1m burst 5" {
		t.Errorf("the good override beside bad ones: %s", l.Quota)
	}
	if _, ok := s.RuntimeOverride("orders-export", "t5"); ok {
		t.Error("an override that did not apply is reported as applied")
	}
}

func TestCheckOverrideCanonical(t *testing.T) {
	file := loadExample(t)
	for _, c := range []struct{ rule, spec, want string }{
		{"orders-read", "limit: 1000/minute, burst: 100", "{limit: 1000/1m, burst: 100}"},
		{"orders-read", "{ limit: 90/90s }", "{limit: 90/90s, burst: 90}"},
		{"orders-read", "limit: 10/1m30s\nburst: 4\n", "{limit: 10/90s, burst: 4}"},
		{"search", "{limit: 300/1m, burst: 30, regions: {us-east: {limit: 2/s, burst: 12}, eu-west: {limit: 180/1m, burst: 18}}}",
			`{limit: 300/1m, burst: 30, regions: {"eu-west": {limit: 180/1m, burst: 18}, "us-east": {limit: 2/1s, burst: 12}}}`},
		{"catalog-read", "{limit: 60/1m, burst: 6, emergency: {limit: 1/1m, burst: 1}}",
			"{limit: 60/1m, burst: 6, emergency: {limit: 1/1m, burst: 1}}"},
	} {
		o, err := file.CheckOverride(c.rule, "tenant", c.spec)
		if err != nil || o.Spec != c.want {
			t.Errorf("CheckOverride(%q) = %q, %v; want %q", c.spec, o.Spec, err, c.want)
			continue
		}
		again, err := file.CheckOverride(c.rule, "tenant", o.Spec)
		if err != nil || again.Spec != o.Spec {
			t.Errorf("canonical %q does not parse to itself: %q, %v", o.Spec, again.Spec, err)
		}
	}
}

func TestNewOverridesBounds(t *testing.T) {
	dup := RuntimeOverride{Rule: "r", Tenant: "t", Spec: "{limit: 1/1s}"}
	if _, err := NewOverrides([]RuntimeOverride{dup, dup}); err == nil || !strings.Contains(err.Error(), "given twice") {
		t.Errorf("duplicate: %v", err)
	}
	many := make([]RuntimeOverride, MaxRuntimeOverrides+1)
	for i := range many {
		many[i] = RuntimeOverride{Rule: "r", Tenant: strings.Repeat("t", i%100) + string(rune('a'+i%26)), Spec: "x"}
	}
	if _, err := NewOverrides(many); !errors.Is(err, ErrTooManyOverrides) {
		t.Errorf("%d overrides: %v, want ErrTooManyOverrides", len(many), err)
	}
	big := make([]RuntimeOverride, 1000)
	for i := range big {
		big[i] = RuntimeOverride{Rule: "r", Tenant: string(rune(0x4e00 + i)), Spec: strings.Repeat("x", MaxOverridesBytes/1000)}
	}
	if _, err := NewOverrides(big); !errors.Is(err, ErrTooManyOverrides) {
		t.Errorf("%d bytes: %v, want ErrTooManyOverrides", 1000*(MaxOverridesBytes/1000), err)
	}
}

// FuzzOverrideSpec: any spec is either rejected with ErrInvalidOverride or accepted in a
// canonical form that is accepted again unchanged and applies with the limits it states.
func FuzzOverrideSpec(f *testing.F) {
	for _, s := range []string{"{limit: 1000/minute, burst: 100}", "limit: 5/1s", "{limit: 1/1d, burst: 9}",
		"{limit: 2/1m, emergency: {limit: 1/1m, burst: 1}}", "{limit: 300/1m, regions: {eu-west: {limit: 180/1m}, us-east: {limit: 120/1m}}}",
		"[", "{limit: &a 1/1s, burst: *a}", "{limit: 0/1s}"} {
		f.Add("orders-read", s)
		f.Add("catalog-read", s)
		f.Add("search", s)
	}
	file := loadExample(f)
	f.Fuzz(func(t *testing.T, rule, spec string) {
		o, err := file.CheckOverride(rule, "tenant", spec)
		if err != nil {
			if !errors.Is(err, ErrInvalidOverride) && !errors.Is(err, ErrUnknownRule) {
				t.Fatalf("CheckOverride(%q, %q): %v wraps neither sentinel", rule, spec, err)
			}
			return
		}
		again, err := file.CheckOverride(rule, "tenant", o.Spec)
		if err != nil || again != o {
			t.Fatalf("canonical %q: %+v, %v", o.Spec, again, err)
		}
		s, problems := file.WithOverrides(mustOverrides(t, o))
		if len(problems) != 0 {
			t.Fatalf("accepted override %q does not apply: %v", o.Spec, problems)
		}
		if got, ok := s.RuntimeOverride(rule, "tenant"); !ok || got != o.Spec {
			t.Fatalf("rule %s: runtime override %q, %t; want %q", rule, got, ok, o.Spec)
		}
	})
}

// TestDocsRuntimeOverrides keeps the docs true: every `lbctl overrides set` they show is a valid
// override of the example policy.
func TestDocsRuntimeOverrides(t *testing.T) {
	file := loadExample(t)
	re := regexp.MustCompile(`lbctl overrides set --rule (\S+) --tenant (\S+)(?:\s+--reason '[^']*')?\s+'([^']*)'`)
	n := 0
	for _, doc := range []string{"../docs/policy.md", "../docs/coordinator.md"} {
		data, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		text := strings.ReplaceAll(string(data), "\\\n", "")
		for _, m := range re.FindAllStringSubmatch(text, -1) {
			n++
			if _, err := file.CheckOverride(m[1], m[2], m[3]); err != nil {
				t.Errorf("%s: %s: %v", doc, m[0], err)
			}
		}
	}
	if n < 3 {
		t.Errorf("found %d lbctl overrides set examples in the docs", n)
	}
}
