package policy

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/calendar"
)

const calendarPolicy = `version: v1
rules:
  - name: llm
    routes: [/v1/chat]
    operations: [write]
    quota: 100000/month
    timezone: Europe/Berlin
    overrides:
      bigcorp: {quota: 5000000/month}
  - name: export
    routes: [/export]
    operations: [read]
    quota: 50/day
    cost: 5
    lease: off
  - name: rolling
    routes: [/export]
    operations: [write]
    limit: 50/day
default:
  limit: 10/minute
`

func TestCalendarQuota(t *testing.T) {
	s := mustParse(t, calendarPolicy)
	check := func(path, op, tenant string, requests int64, unit calendar.Unit, zone string) *Limits {
		t.Helper()
		r, err := s.Match(path, op)
		if err != nil {
			t.Fatal(err)
		}
		l, err := s.Limits(r, tenant, "")
		if err != nil {
			t.Fatal(err)
		}
		c := l.Calendar
		if c == nil || c.Unit != unit || c.Loc.String() != zone || l.Requests != requests || l.Burst != requests ||
			l.Bucket.Capacity() != bucket.Micro(requests)*bucket.PerToken || l.Bucket.Refills() {
			t.Fatalf("%s %s %s: limits %+v (calendar %v), want %d per calendar %s in %s, a counter that never refills",
				tenant, path, op, l, c, requests, unit, zone)
		}
		return l
	}
	llm := check("/v1/chat", "POST", "acme", 100000, calendar.Month, "Europe/Berlin")
	big := check("/v1/chat", "POST", "bigcorp", 5000000, calendar.Month, "Europe/Berlin")
	daily := check("/export", "GET", "acme", 50, calendar.Day, "UTC")
	if llm.Fingerprint == big.Fingerprint || llm.String() != "100000/month Europe/Berlin" || daily.String() != "50/day" {
		t.Errorf("fingerprints %s %s, strings %q %q", llm.Fingerprint, big.Fingerprint, llm.String(), daily.String())
	}
	// A rolling 50/day bucket and a calendar 50/day quota are different keys.
	r, _ := s.Match("/export", "POST")
	rolling, _ := s.Limits(r, "acme", "")
	if rolling.Calendar != nil || rolling.Fingerprint == daily.Fingerprint {
		t.Errorf("rolling limit %+v shares the calendar quota's fingerprint %s", rolling, daily.Fingerprint)
	}
	// The fingerprint follows the zone: the same quota in another zone is another counter.
	other := mustParse(t, strings.Replace(calendarPolicy, "Europe/Berlin", "America/New_York", 1))
	r, _ = other.Match("/v1/chat", "POST")
	ny, _ := other.Limits(r, "acme", "")
	if ny.Fingerprint == llm.Fingerprint || other.Digest() == s.Digest() {
		t.Errorf("a quota in another zone keeps fingerprint %s or digest", ny.Fingerprint)
	}
	// Runtime overrides of a calendar quota give a quota of the same period, in the rule's zone.
	o, err := s.CheckOverride("llm", "acme", "quota: 2000000/month")
	if err != nil || o.Spec != "{quota: 2000000/month}" {
		t.Fatalf("CheckOverride = %+v, %v; want the canonical {quota: 2000000/month}", o, err)
	}
	ovs, err := NewOverrides([]RuntimeOverride{o})
	if err != nil {
		t.Fatal(err)
	}
	with, problems := s.WithOverrides(ovs)
	if len(problems) != 0 {
		t.Fatalf("WithOverrides: %v", problems)
	}
	r, _ = with.Match("/v1/chat", "POST")
	if l, _ := with.Limits(r, "acme", ""); l.Calendar == nil || l.Calendar.Loc.String() != "Europe/Berlin" || l.Requests != 2000000 {
		t.Fatalf("runtime override: %+v, want 2000000 per month in Europe/Berlin", l)
	}
	for _, c := range []struct{ rule, spec, want string }{
		{"llm", "limit: 10/second", "required: rule \"llm\" is a calendar quota"},
		{"llm", "quota: 10/day", "quota is per month"},
		{"llm", "quota: 10/month, burst: 5", "burst: not used with quota"},
		{"rolling", "quota: 10/day", "only for a rule with a calendar quota"},
	} {
		if _, err := s.CheckOverride(c.rule, "t", c.spec); !errors.Is(err, ErrInvalidOverride) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("CheckOverride(%q, %q) = %v, want ErrInvalidOverride containing %q", c.rule, c.spec, err, c.want)
		}
	}
}

func TestCalendarQuotaInvalid(t *testing.T) {
	rule := func(body string) string {
		return header + "  - name: q\n    routes: [/a]\n    operations: [read]\n" + body
	}
	for _, tc := range []struct {
		name, src, want string
	}{
		{"limit and quota", rule("    limit: 10/minute\n    quota: 10/day\n"),
			"test.yaml:7: rules[0].limit: a rule has either limit (a rolling token bucket) or quota (a calendar quota), not both"},
		{"burst", rule("    quota: 10/day\n    burst: 5\n"),
			"test.yaml:8: rules[0].burst: not used with quota: a calendar quota's capacity is the quota of its period"},
		{"period", rule("    quota: 10/week\n"),
			`test.yaml:7: rules[0].quota: "10/week": a calendar quota's period is day or month (for a rolling limit over any period, use limit)`},
		{"count", rule("    quota: ten/day\n"),
			`test.yaml:7: rules[0].quota: "ten/day": requests "ten" must be a whole number`},
		{"too many", rule("    quota: 9007199254/day\n"),
			`test.yaml:7: rules[0].quota: "9007199254/day": bucket: limit cannot be represented exactly: capacity 9007199254000000 µ exceeds 2^52 µ`},
		{"zone", rule("    quota: 10/day\n    timezone: Europe/Berln\n"),
			`test.yaml:8: rules[0].timezone: unknown time zone "Europe/Berln": name an IANA time zone such as UTC or Europe/Berlin`},
		{"local zone", rule("    quota: 10/day\n    timezone: Local\n"),
			`test.yaml:8: rules[0].timezone: "Local": name an IANA time zone such as UTC or Europe/Berlin (the machine's local zone differs between hosts)`},
		{"zone without quota", rule("    limit: 10/minute\n    timezone: UTC\n"),
			"test.yaml:8: rules[0].timezone: only used with quota (a calendar quota); a limit is a rolling token bucket"},
		{"regional", rule("    quota: 10/day\n    scope: regional\n    regions: {eu: {limit: 10/day}}\n"),
			"test.yaml:8: rules[0].scope: a calendar quota is global: one exact counter per period (regional slices need a limit)"},
		{"emergency", rule("    quota: 10/day\n    on_failure: emergency\n    emergency: {limit: 1/minute}\n"),
			"test.yaml:8: rules[0].on_failure: a calendar quota fails closed: on_failure: deny (no emergency bucket)"},
		{"cost above the quota", rule("    quota: 10/day\n    cost: 11\n"),
			"test.yaml:8: rules[0].cost: cost 11 of operation read exceeds burst 10 of the rule's limit: such a request could never be allowed"},
		{"override without quota", rule("    quota: 10/day\n    overrides:\n      big: {limit: 10/minute}\n"),
			"test.yaml:9: rules[0].overrides[big].quota: required: the rule is a calendar quota, so the override gives its own quota (such as 1000000/month)"},
		{"override of another period", rule("    quota: 10/day\n    overrides:\n      big: {quota: 100/month}\n"),
			"test.yaml:9: rules[0].overrides[big].quota: the rule's quota is per day; an override keeps the period (and the rule's time zone)"},
		{"override quota of a limit", rule("    limit: 10/minute\n    overrides:\n      big: {quota: 100/month}\n"),
			"test.yaml:9: rules[0].overrides[big].quota: only for a rule with a calendar quota; this rule has a limit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse("test.yaml", []byte(tc.src))
			var pe *ParseError
			if !errors.As(err, &pe) {
				t.Fatalf("Parse = %v, want a *ParseError", err)
			}
			if got := err.Error(); !strings.Contains(got, tc.want) {
				t.Fatalf("Parse:\n%s\nwant a line:\n%s", got, tc.want)
			}
		})
	}
}

func TestExplainCalendarQuota(t *testing.T) {
	s := mustParse(t, calendarPolicy)
	e, err := s.Explain("acme", "/v1/chat", "POST", "")
	if err != nil {
		t.Fatal(err)
	}
	text := e.String()
	for _, want := range []string{
		"quota:       100000 per calendar month in Europe/Berlin, all of it again at each month's start (rule; global)",
		"counter:     exact: 100000000000µ per period, spent and handed back within it; no refill",
		"key:         lb1:acme|/v1/chat|write|" + e.Limits.Fingerprint,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("explain:\n%s\nwant a line %q", text, want)
		}
	}
}

// FuzzCalendarQuota: a quota that parses is at least one request, its counter holds exactly that
// many tokens and never refills, and its string parses back to the same quota.
func FuzzCalendarQuota(f *testing.F) {
	for _, s := range []string{"100000/month", "1/day", " 7 / day ", "0/day", "10/week", "9007199254/month", "/day", "5"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		q, err := parseCalendarQuota(s, time.UTC)
		if err != nil {
			return
		}
		if q.Requests < 1 || q.Burst != q.Requests || q.Bucket.Capacity() != bucket.Micro(q.Requests)*bucket.PerToken ||
			q.Bucket.Refills() || q.Calendar == nil || (q.Calendar.Unit != calendar.Day && q.Calendar.Unit != calendar.Month) {
			t.Fatalf("parseCalendarQuota(%q) = %+v", s, q)
		}
		again, err := parseCalendarQuota(q.String(), time.UTC)
		if err != nil || again.Requests != q.Requests || again.Calendar.Unit != q.Calendar.Unit || again.Bucket != q.Bucket {
			t.Fatalf("%q parses to %+v whose string %q parses to %+v, %v", s, q, q.String(), again, err)
		}
	})
}
