package agent

import (
	"strings"
	"testing"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
)

// TestCalendarAnswers: a calendar quota's answers in Envoy's and the IETF fields' terms: its
// count per day or month, a reset at the end of the period (not a refill), the period's length
// as the window.
func TestCalendarAnswers(t *testing.T) {
	set, err := policy.Parse("test.yaml", []byte(`version: v1
rules:
  - name: monthly
    routes: [/m]
    operations: [read]
    quota: 3000/month
    timezone: Europe/Berlin
    headers: true
default:
  quota: 100/day
`))
	if err != nil {
		t.Fatal(err)
	}
	limits := func(path string) (*policy.Rule, *policy.Limits) {
		r, err := set.Match(path, "GET")
		if err != nil {
			t.Fatal(err)
		}
		l, err := set.Limits(r, "acme", "")
		if err != nil {
			t.Fatal(err)
		}
		return r.Rule, l
	}
	rule, monthly := limits("/m")
	_, daily := limits("/other")
	for _, tc := range []struct {
		l    *policy.Limits
		unit ratelimitv3.RateLimitResponse_RateLimit_Unit
		n    uint32
	}{{monthly, ratelimitv3.RateLimitResponse_RateLimit_MONTH, 3000}, {daily, ratelimitv3.RateLimitResponse_RateLimit_DAY, 100}} {
		got := currentLimit(&Verdict{Limits: tc.l})
		if got.Unit != tc.unit || got.RequestsPerUnit != tc.n || got.UnitMultiplier != nil {
			t.Errorf("currentLimit(%v) = %v, want %d per %v", tc.l, got, tc.n, tc.unit)
		}
	}
	berlin, _ := time.LoadLocation("Europe/Berlin")
	now := time.Date(2026, 2, 27, 12, 0, 0, 0, berlin) // 1.5 days before March in Berlin
	half := monthly.Bucket.Capacity() / 2
	if got, want := resetMs(monthly, half, now), int64(36*time.Hour/time.Millisecond); got != want {
		t.Errorf("resetMs of a half-spent February = %d, want %d (until March 1st in Berlin)", got, want)
	}
	if got := resetMs(monthly, monthly.Bucket.Capacity(), now); got != 0 {
		t.Errorf("resetMs of an unspent quota = %d, want 0", got)
	}
	if got := window(monthly, now); got != 28*24*time.Hour {
		t.Errorf("window in February = %v, want 28 days", got)
	}
	v := &Verdict{Outcome: Allow, Rule: rule, Limits: monthly}
	reset := time.Duration(resetMs(monthly, half, now)) * time.Millisecond
	p, s := rateLimitFields(v, half, reset, window(monthly, now))
	if p != `"monthly";q=3000;w=2419200` || s != `"monthly";r=1500;t=129600` {
		t.Errorf("RateLimit fields = %q, %q; want the month as the window and its end as t", p, s)
	}
	if !strings.Contains(monthly.String(), "Europe/Berlin") || bucket.Micro(monthly.Requests)*bucket.PerToken != monthly.Bucket.Capacity() {
		t.Errorf("limits %v", monthly)
	}
}
