package chaos

import (
	"bufio"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// writeDecisions writes the decision log, one JSON object per check, to dir/decisions.jsonl:
// times in microseconds since the run's zero, the key's bucket name (churn keys: "").
func writeDecisions(dir string, keys *Keys, records []Record) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(dir, "decisions.jsonl"))
	if err != nil {
		return err
	}
	w := bufio.NewWriterSize(f, 1<<20)
	for i := range records {
		r := &records[i]
		key, by := "", ""
		if r.Key >= 0 {
			key = keys.List[r.Key].Name
			if r.By > 0 {
				by = keys.List[r.Key].Buckets(keys)[r.By-1].Rule.Name
			}
		}
		fmt.Fprintf(w, `{"sent_us":%d,"recv_us":%d,"agent":%d,"gen":%d,"kind":%q,"key":%q,"cost":%d,"outcome":%q,"code":%q,"degraded":%t,"replayed":%t,"retry":%t,"envoy":%t,"stream":%t,"retry_after_ms":%d,"refused_by":%q}`+"\n",
			r.Sent.Microseconds(), r.Recv.Microseconds(), r.Agent, r.Gen, r.Kind, key, r.Cost, r.Outcome, r.Code, r.Degraded,
			r.Replayed, r.Retry, r.Envoy, r.Stream, r.RetryAfter.Milliseconds(), by)
	}
	if err := w.Flush(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// writeReport writes report.json and report.md into dir.
func writeReport(dir string, rep *Report) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "report.json"), b, 0o644); err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(dir, "report.md"))
	if err != nil {
		return err
	}
	rep.Markdown(f)
	return f.Close()
}

func fmtMs(d time.Duration) string {
	if d < 10*time.Millisecond {
		return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond))
	}
	return fmt.Sprintf("%d ms", d.Milliseconds())
}

// Summary is the report in a few lines, for a test log.
func (rep *Report) Summary() string {
	var b strings.Builder
	redis := "standalone Redis"
	if rep.Cluster {
		redis = "3-master Redis Cluster"
	}
	fmt.Fprintf(&b, "%s: %v, %s, %d coordinators, %d agents; %d checks (%d through Envoy's API, %d through the client package's stream, %d decided by Envoy-faithful quota filters), %d faults, %d bad inputs, %d violations\n",
		rep.Name, rep.Duration.Round(time.Second), redis, rep.Coordinators, rep.Agents, rep.Total.Checks, rep.EnvoyChecks, rep.StreamChecks,
		rep.ByKind[KindQuota.String()].Checks, len(rep.Steps), len(rep.Abuse.Probes), len(rep.Violations))
	l := rep.Check.Ledger
	fmt.Fprintf(&b, "ledger keys: debited %.3f, spent %.0f, stranded %.3f (bound %.3f; killed agents held %.0f of them); refunds %.0f, lost %.0f\n",
		l.Debited, l.Spent, l.Stranded, l.Bound, l.Held, l.Refunds, l.RefundsLost)
	for _, p := range l.Parts {
		fmt.Fprintf(&b, "ledger key %s (%s): debited %.3f, spent %.0f by %d allows; %d checks refused\n", p.Key, p.Bucket, p.Debited, p.Spent, p.Allowed, p.Denied)
	}
	for _, w := range rep.Check.Windows {
		if w.Allowed > 0 && (strings.Contains(w.Key, "|/hot|") || strings.Contains(w.Key, "cold-000") || strings.Contains(w.Key, ":"+quotaTenant(0)+"|") ||
			kindOfKey(w.Key) == KindDirect || (kindOfKey(w.Key) == KindMulti && w.Bucket != "multi")) {
			fmt.Fprintf(&b, "fullest window of %s (%s): %.0f tokens in %v, bound %.1f\n", w.Key, w.Bucket, w.Tokens, w.Span.Round(time.Millisecond), w.Bound)
		}
	}
	for _, r := range rep.RefusedBy {
		fmt.Fprintf(&b, "checks of several buckets refused by %s: %d × 429, %d × 503\n", r.Bucket, r.Deny, r.Unavailable)
	}
	for _, v := range rep.Violations {
		fmt.Fprintf(&b, "VIOLATION %s\n", v)
	}
	return b.String()
}

// Markdown writes the report for people: the load, the fault matrix with what was measured,
// the bounds, the bad input, the resources and the violations.
func (rep *Report) Markdown(w io.Writer) {
	redis := "a standalone Redis"
	if rep.Cluster {
		redis = "a 3-master Redis Cluster"
	}
	fmt.Fprintf(w, "# Chaos run: %s\n\n", rep.Name)
	fmt.Fprintf(w, "%s, %v: %s (append-only, fsync always), %d coordinators, %d agents (`--max-keys %d`), every process real, reached through proxies the harness controls.\n\n",
		rep.Started.UTC().Format(time.RFC3339), rep.Duration.Round(time.Second), redis, rep.Coordinators, rep.Agents, rep.MaxKeys)
	fmt.Fprintf(w, "**Violations: %d.**\n\n", len(rep.Violations))
	for _, v := range rep.Violations {
		fmt.Fprintf(w, "- %s\n", v)
	}
	if len(rep.Violations) > 0 {
		fmt.Fprintln(w)
	}

	fmt.Fprintf(w, "## Load\n\n%d checks over Unix sockets (%d through Envoy's `ShouldRateLimit`, %d through the Go client package's `CheckStream` batches with partial answers), offered per agent: hot %g/s, cold %g/s over %d tenants, churn %g/s (a new tenant each), fail-closed %g/s, emergency %g/s, ledger %g/s, the long tail %g/s over %d tenants (each in turn), direct mode (`lease: off`) %g/s on one key, the multi rule (two limits and a tenant budget, all or nothing) %g/s over %d tenants; and %g/s over %d tenants of the quota rule decided by an Envoy-faithful rate_limit_quota filter on each agent (kind quota: its local decisions, the time of each its admission).\n\n",
		rep.Total.Checks, rep.EnvoyChecks, rep.StreamChecks, rep.Load.Hot, rep.Load.Cold, rep.Load.ColdTenants, rep.Load.Churn, rep.Load.Closed,
		rep.Load.Emergency, rep.Load.Ledger, rep.Load.Tail, rep.Load.TailTenants, rep.Load.Direct, rep.Load.Multi, rep.Load.MultiTenants, rep.Load.Quota, rep.Load.QuotaTenants)
	fmt.Fprintln(w, "| kind | checks | allow | of which degraded | deny (429) | unavailable (503) | errors | p50 | p99 | max |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|")
	kinds := make([]string, 0, len(rep.ByKind))
	for k := range rep.ByKind {
		kinds = append(kinds, k)
	}
	slices.Sort(kinds)
	for _, k := range append(kinds, "all") {
		m := rep.Total
		if k != "all" {
			m = rep.ByKind[k]
		}
		if m.Checks == 0 {
			continue
		}
		fmt.Fprintf(w, "| %s | %d | %d | %d | %d | %d | %d | %s | %s | %s |\n", k, m.Checks, m.Allows, m.Degraded, m.Denies,
			m.Unavailable, m.Errors, fmtMs(m.P50), fmtMs(m.P99), fmtMs(m.Max))
	}

	if by := rep.RefusedBy; len(by) > 0 {
		fmt.Fprint(w, "\nChecks of several buckets refused (native answers, which name the bucket):")
		for _, r := range by {
			fmt.Fprintf(w, " by %s %d × 429 and %d × 503;", r.Bucket, r.Deny, r.Unavailable)
		}
		fmt.Fprintln(w)
	}

	fmt.Fprintln(w, "\n## Faults\n\nOne at a time, under load. *Measured* counts the checks sent from the fault until the system settled after it.")
	fmt.Fprintln(w, "\n| fault | expected | measured |")
	fmt.Fprintln(w, "|---|---|---|")
	for _, st := range rep.Steps {
		fmt.Fprintf(w, "| %s (%v) | %s | %s |\n", st.Name, (st.To - st.From).Round(100*time.Millisecond), st.Expect, st.measured())
	}

	fmt.Fprintln(w, "\n## Bounds")
	fmt.Fprintln(w, "\nAdmission, per key: allowed ≤ C + r·(w + τ), w the span of the window, plus the clock slack (5 ms and 0.1 %); τ = 0 on the direct rule's key (`lease: off`: C + r·w); every bucket a check of the multi rule charges is held to its own bound by every allowed check that charged it. The fullest window of each kind:")
	fmt.Fprintln(w, "\n| key | bucket | allowed over the run | fullest window | tokens in it | bound |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|")
	// Two keys of each kind, in the order of the keys; of the long tail's thousands of keys, the
	// two whose fullest windows held the most.
	var shown, tail []Window
	seen := map[Kind]int{}
	for _, win := range rep.Check.Windows {
		switch kind := kindOfKey(win.Key); {
		case kind == KindTail:
			tail = append(tail, win)
		case kind == KindMulti && seen[kind] < 6: // each of the three buckets of two tenants
			seen[kind]++
			shown = append(shown, win)
		case kind != KindMulti && seen[kind] < 2:
			seen[kind]++
			shown = append(shown, win)
		}
	}
	slices.SortStableFunc(tail, func(a, b Window) int {
		return cmp.Or(cmp.Compare(b.Tokens, a.Tokens), cmp.Compare(b.Allowed, a.Allowed))
	})
	for _, win := range append(shown, tail[:min(2, len(tail))]...) {
		fmt.Fprintf(w, "| `%s` | %s | %d | %v | %.0f | %.1f |\n", win.Key, win.Bucket, win.Allowed, win.Span.Round(time.Millisecond), win.Tokens, win.Bound)
	}
	if len(tail) > 0 {
		fmt.Fprintf(w, "\nThe long tail: %d keys allowed a check.\n", len(tail))
	}
	fmt.Fprintf(w, "\nEmergency buckets, per agent process and key: degraded allows ≤ C_e + r_e·w. %d buckets used;", len(rep.Check.Emergency))
	if len(rep.Check.Emergency) > 0 {
		e := rep.Check.Emergency[0]
		fmt.Fprintf(w, " the fullest window: %.0f in %v (bound %.1f).\n", e.Tokens, e.Span.Round(time.Millisecond), e.Bound)
	} else {
		fmt.Fprintln(w)
	}
	l := rep.Check.Ledger
	fmt.Fprintf(w, "\nLedger keys (1 token a day, burst in the policy: the ledger rule's key, and the multi rule's first limit of each tenant): debited in Redis %.6f = spent %.0f + stranded %.6f. Stranded bound (outstanding leases of agents killed with SIGKILL + returns the agents reported lost + refunds the agents reported lost + unanswered checks + 1): %.3f; the killed agents held %.0f tokens of the ledger keys. %d checks of a ledger key got no answer. Checks of several buckets gave back %.0f costs when one bucket refused (%.0f of them could not be).\n",
		l.Debited, l.Spent, l.Stranded, l.Bound, l.Held, l.Errors, l.Refunds, l.RefundsLost)
	if len(l.Parts) > 0 {
		fmt.Fprintln(w, "\n| ledger key | bucket | debited | spent | allowed | refused |")
		fmt.Fprintln(w, "|---|---|---|---|---|---|")
		for _, p := range l.Parts {
			fmt.Fprintf(w, "| `%s` | %s | %.6f | %.0f | %d | %d |\n", p.Key, p.Bucket, p.Debited, p.Spent, p.Allowed, p.Denied)
		}
	}
	fmt.Fprintf(w, "\nIdempotent repeats answered without a charge: %d.\n", rep.Check.Replays)

	if len(rep.Abuse.Probes) > 0 {
		fmt.Fprintln(w, "\n## Bad input\n\n| target | request | want | got |")
		fmt.Fprintln(w, "|---|---|---|---|")
		for _, p := range rep.Abuse.Probes {
			mark := ""
			if !p.OK() {
				mark = " **✗**"
			}
			fmt.Fprintf(w, "| %s | %s | %s | %s%s |\n", p.Target, p.Name, p.Want, p.Got, mark)
		}
	}

	fmt.Fprintf(w, "\n## Resources over the steady phase (%v)\n\n", (rep.SteadyTo - rep.SteadyFrom).Round(time.Second))
	fmt.Fprint(w, "Largest value of the second quarter → of the last quarter (the first quarter is warm-up).\n\n")
	fmt.Fprintln(w, "| process | RSS (MiB) | goroutines | open fds | most keys |")
	fmt.Fprintln(w, "|---|---|---|---|---|")
	for _, g := range rep.Growth {
		gr, keys := "—", "—"
		if g.Goroutines[0] >= 0 {
			gr = fmt.Sprintf("%d → %d", g.Goroutines[0], g.Goroutines[1])
		}
		if g.MaxKeys > 0 {
			keys = fmt.Sprint(g.MaxKeys)
		}
		fmt.Fprintf(w, "| %s | %.1f → %.1f | %s | %d → %d | %s |\n", g.Name, float64(g.RSSKiB[0])/1024, float64(g.RSSKiB[1])/1024,
			gr, g.FDs[0], g.FDs[1], keys)
	}
	if len(rep.AgentTotals) > 0 {
		fmt.Fprint(w, "\n## Agent counters at the end (processes alive then)\n\n")
		names := make([]string, 0, len(rep.AgentTotals))
		for n := range rep.AgentTotals {
			names = append(names, n)
		}
		slices.Sort(names)
		for _, n := range names {
			fmt.Fprintf(w, "- `leasebucket_agent_%s` %g\n", n, rep.AgentTotals[n])
		}
	}
}

func (st StepResult) measured() string {
	m := st.Measured
	s := fmt.Sprintf("%d checks: %d allow (%d degraded), %d deny, %d unavailable, %d errors; p99 %s",
		m.Checks, m.Allows, m.Degraded, m.Denies, m.Unavailable, m.Errors, fmtMs(m.P99))
	if o := st.Outcome; o != nil {
		s += fmt.Sprintf("; after τ: %d checks, %d × 503, %d degraded allows, %d allows without a lease",
			o.Checked, o.Unavailable, o.DegradedAllows, o.Allowed)
		if o.Recovery >= 0 {
			s += fmt.Sprintf("; the load's first fail-closed allow %s after the restore began", fmtMs(o.Recovery))
		}
		if o.Others > 0 {
			s += fmt.Sprintf("; keys of the other masters: %d checks, %d failure-mode answers", o.Others, o.OthersFailed)
		}
	}
	s += fmt.Sprintf("; restored in %s, then every agent allowed a fresh key within %s", fmtMs(st.Restored-st.To), fmtMs(st.Recovered))
	if sd := st.Stranded; sd != nil {
		s += fmt.Sprintf("; outstanding leases at the kill %.0f tokens (ledger keys %.0f)", sd.Outstanding, sd.Ledger)
	}
	if st.Err != "" {
		s += "; error: " + st.Err
	}
	return s
}

// kindOfKey names the kind of a bucket key by its tenant.
func kindOfKey(key string) Kind {
	tenant, _, _ := strings.Cut(strings.TrimPrefix(key, "lb1:"), "|")
	tenant = strings.TrimSuffix(strings.TrimPrefix(tenant, "{"), "}") // a key charged with others holds a hash tag
	switch {
	case tenant == hotTenant():
		return KindHot
	case strings.HasPrefix(tenant, "cold-"):
		return KindCold
	case strings.HasPrefix(tenant, "fc-"):
		return KindClosed
	case strings.HasPrefix(tenant, "em-"):
		return KindEmergency
	case tenant == ledgerTenant():
		return KindLedger
	case strings.HasPrefix(tenant, "qt-"):
		return KindQuota
	case strings.HasPrefix(tenant, "tl-"):
		return KindTail
	case tenant == directTenant():
		return KindDirect
	case strings.HasPrefix(tenant, "mt-"):
		return KindMulti
	}
	return KindChurn
}

// Refusals counts the refusals of checks of several buckets by the bucket that refused.
type Refusals struct {
	Bucket            string
	Deny, Unavailable int
}

// refusedBy counts the records' refusals of checks of several buckets by the bucket their
// answer named, in the order of the buckets (native answers only: Envoy's do not name it).
func refusedBy(keys *Keys, records []Record) []Refusals {
	var out []Refusals
	at := map[string]int{}
	for i := range records {
		r := &records[i]
		if r.By == 0 || r.Key < 0 {
			continue
		}
		name := keys.List[r.Key].Buckets(keys)[r.By-1].Rule.Name
		j, ok := at[name]
		if !ok {
			j = len(out)
			at[name] = j
			out = append(out, Refusals{Bucket: name})
		}
		switch r.Outcome {
		case OutDeny:
			out[j].Deny++
		case OutUnavailable:
			out[j].Unavailable++
		}
	}
	slices.SortFunc(out, func(a, b Refusals) int { return cmp.Compare(a.Bucket, b.Bucket) })
	return out
}
