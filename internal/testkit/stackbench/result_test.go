package stackbench

import (
	"strings"
	"testing"
	"time"
)

// TestSummaryRatios: a lease row is compared with the direct row of its case and API and with the
// empty row of its API (whatever the case: another case's rows too), a direct row with the empty
// row only; per-check figures divide by the checks answered.
func TestSummaryRatios(t *testing.T) {
	run := func(m Mode, checks int64, cpu time.Duration) Result {
		r := Result{Case: "hot", API: Unary, Mode: m, Dist: Dist{Kind: Hot, N: 1}}
		r.Wall = time.Second
		r.Outcomes[Allowed] = checks
		r.CPU[ProcAgent] = cpu
		return r
	}
	var s Summary
	s.Add(run(Empty, 1000, 10*time.Millisecond)) // 10 µs/check
	s.Add(run(Direct, 500, 20*time.Millisecond)) // 40 µs/check
	s.Add(run(Lease, 800, 16*time.Millisecond))  // 20 µs/check
	s.Add(Result{Case: "other", API: Unary, Mode: Lease, Window: Window{Wall: time.Second, Outcomes: [numOutcomes]int64{Allowed: 1}}})
	s.Add(Result{Case: "other", API: Stream, Mode: Lease, Window: Window{Wall: time.Second, Outcomes: [numOutcomes]int64{Allowed: 1}}})
	lease := s.Find("hot", Unary, Lease)
	if got := lease.TotalCPUPerCheck(); got != 20 {
		t.Errorf("lease CPU/check = %v µs, want 20", got)
	}
	q := RatiosOf(lease, s.Find("hot", Unary, Direct), s.Find("hot", Unary, Empty))
	if q != (Ratios{DirectRate: 1.6, DirectCPU: 0.5, EmptyRate: 0.8}) {
		t.Errorf("RatiosOf = %+v", q)
	}
	var out strings.Builder
	s.Write(&out)
	rows := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(rows) != 7 {
		t.Fatalf("%d lines:\n%s", len(rows), out.String())
	}
	for i, want := range []string{
		"| hot | unary | empty | 1000 |",
		"| hot | unary | direct | 500 |",
		"| hot | unary | lease | 800 |",
		"| other | unary | lease | 1 |",
		"| other | stream | lease | 1 |",
	} {
		if !strings.HasPrefix(rows[i+2], want) {
			t.Errorf("row %d = %q, want it to start %q", i, rows[i+2], want)
		}
	}
	if !strings.HasSuffix(rows[3], "|  |  | 0.50 |") || !strings.HasSuffix(rows[4], "|  | 1.60 | 0.50 | 0.80 |") || !strings.HasSuffix(rows[5], "|  |  |  | 0.00 |") || !strings.HasSuffix(rows[6], "|  |  |  |  |") {
		t.Errorf("ratio columns:\n%s", out.String())
	}
}
