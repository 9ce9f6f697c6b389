package agent

import (
	"fmt"
	"testing"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/leasebucket/leasebucket/policy"
)

// TestCurrentLimit: a rule's limit in Envoy's units: the largest unit dividing the period, with a
// multiplier above one; periods that are not whole seconds per second, rounded down.
func TestCurrentLimit(t *testing.T) {
	for _, tc := range []struct {
		requests int64
		period   time.Duration
		want     string
	}{
		{100, time.Minute, "100 MINUTE x1"},
		{60, time.Hour, "60 HOUR x1"},
		{5, 2 * time.Hour, "5 HOUR x2"},
		{9, 90 * time.Second, "9 SECOND x90"},
		{1000, 7 * 24 * time.Hour, "1000 DAY x7"},
		{10, 500 * time.Millisecond, "20 SECOND x1"},
		{5, 1500 * time.Millisecond, "3 SECOND x1"},
		{1, 1500 * time.Millisecond, "1 SECOND x1"},
		{1 << 40, time.Second, "4294967295 SECOND x1"},
	} {
		v := Verdict{Rule: &policy.Rule{Name: "r"}, Limits: &policy.Limits{Quota: policy.Quota{Requests: tc.requests, Period: tc.period}}}
		rl := currentLimit(&v)
		mult := uint32(1)
		if rl.UnitMultiplier != nil {
			mult = rl.UnitMultiplier.Value
			if mult < 2 {
				t.Errorf("%d/%v: multiplier %d sent; 1 is the default and left out", tc.requests, tc.period, mult)
			}
		}
		got := ratelimitv3.RateLimitResponse_RateLimit_Unit_name[int32(rl.Unit)]
		if s := fmtLimit(rl.RequestsPerUnit, got, mult); s != tc.want || rl.Name != "r" {
			t.Errorf("%d/%v = %s (%q), want %s", tc.requests, tc.period, s, rl.Name, tc.want)
		}
	}
}

func fmtLimit(n uint32, unit string, mult uint32) string {
	return fmt.Sprintf("%d %s x%d", n, unit, mult)
}

// TestRateLimitFieldHelpers: the IETF fields' window scaling and next token, as the HTTP
// middleware computes them.
func TestRateLimitFieldHelpers(t *testing.T) {
	for _, tc := range []struct {
		limit  int64
		window time.Duration
		q, w   int64
	}{{100, time.Minute, 100, 60}, {5, 1500 * time.Millisecond, 10, 3}, {3, 250 * time.Millisecond, 12, 1}, {7, 7 * time.Second, 7, 7}} {
		if q, w, ok := quotaWindow(tc.limit, tc.window); !ok || q != tc.q || w != tc.w {
			t.Errorf("quotaWindow(%d, %v) = %d, %d, %v; want %d, %d", tc.limit, tc.window, q, w, ok, tc.q, tc.w)
		}
	}
	per := 600 * time.Millisecond
	for _, tc := range []struct{ reset, want time.Duration }{
		{0, 0}, {600 * time.Millisecond, 600 * time.Millisecond}, {1200 * time.Millisecond, 600 * time.Millisecond},
		{1300 * time.Millisecond, 100 * time.Millisecond}, {100 * time.Millisecond, 100 * time.Millisecond},
	} {
		if got := nextToken(tc.reset, per); got != tc.want {
			t.Errorf("nextToken(%v) = %v, want %v", tc.reset, got, tc.want)
		}
	}
	if got := sfString(`a"b\c`); got != `"a\"b\\c"` {
		t.Errorf("sfString = %s", got)
	}
}

// TestEnvoyResponseUndecided: a descriptor left without a decision (a wait that leaked out, or no
// outcome at all) is never answered OK, which Envoy would let through: alone or beside allowed
// descriptors it makes the answer OVER_LIMIT, with a Retry-After, and it wins over a descriptor
// that fails closed, as a refusal does.
func TestEnvoyResponseUndecided(t *testing.T) {
	s := &Server{}
	for _, tc := range []struct {
		name     string
		outcomes []Outcome
	}{
		{"wait alone", []Outcome{Wait}},
		{"no outcome", []Outcome{0}},
		{"beside allowed", []Outcome{Allow, Wait, Allow}},
		{"beside fail-closed", []Outcome{Unavailable, 0}},
	} {
		slots := make([]slot, len(tc.outcomes))
		for i, o := range tc.outcomes {
			slots[i].v = Verdict{Outcome: o, RetryAfter: time.Second}
		}
		resp, err := s.envoyResponse(slots)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if resp.OverallCode != ratelimitv3.RateLimitResponse_OVER_LIMIT {
			t.Errorf("%s: overall %v, want OVER_LIMIT", tc.name, resp.OverallCode)
		}
		for i, o := range tc.outcomes {
			want := ratelimitv3.RateLimitResponse_OVER_LIMIT
			if o == Allow {
				want = ratelimitv3.RateLimitResponse_OK
			}
			if got := resp.Statuses[i].Code; got != want {
				t.Errorf("%s: descriptor %d (outcome %d) answered %v, want %v", tc.name, i, o, got, want)
			}
		}
		retry := ""
		for _, h := range resp.ResponseHeadersToAdd {
			if h.Key == RetryAfterHeader {
				retry = h.Value
			}
		}
		if retry == "" {
			t.Errorf("%s: no %s header", tc.name, RetryAfterHeader)
		}
	}
	// And the allowed answer the same code gives: every descriptor allowed is OK.
	resp, err := s.envoyResponse([]slot{{v: Verdict{Outcome: Allow}}, {v: Verdict{Outcome: Allow}}})
	if err != nil || resp.OverallCode != ratelimitv3.RateLimitResponse_OK {
		t.Errorf("all allowed: %v, %v; want OK", resp.GetOverallCode(), err)
	}
}
