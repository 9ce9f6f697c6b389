package sim

import (
	"bytes"
	"cmp"
	"encoding/csv"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
)

// Outcome is what one scenario file produced: its run, its sweep and its capacity plan.
type Outcome struct {
	Scenario *Scenario
	Result   *Result
	Sweep    *SweepResult
	Plan     *Plan
}

// Failed reports whether a bound broke in any run of the outcome.
func (o *Outcome) Failed() bool {
	if o.Result != nil && o.Result.Failed() {
		return true
	}
	if o.Sweep != nil {
		for _, p := range o.Sweep.Points {
			if p.Failed() {
				return true
			}
		}
	}
	return false
}

// WriteReport writes dir/report.md and, for each scenario, dir/<name>/ with its CSV files and
// SVG plots (report.md embeds the plots).
func WriteReport(dir string, outs []*Outcome) error {
	for _, o := range outs {
		sub := filepath.Join(dir, o.Scenario.Name)
		if err := os.MkdirAll(sub, 0o755); err != nil {
			return fmt.Errorf("sim: %w", err)
		}
		if err := writeFiles(sub, o); err != nil {
			return err
		}
	}
	var b bytes.Buffer
	if err := markdown(&b, outs); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "report.md"), b.Bytes(), 0o644); err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	return nil
}

func writeFiles(dir string, o *Outcome) error {
	if r := o.Result; r != nil {
		if err := writeCSV(filepath.Join(dir, "timeline.csv"), timelineCSV(r)); err != nil {
			return err
		}
		if err := writeCSV(filepath.Join(dir, "identities.csv"), identitiesCSV(r)); err != nil {
			return err
		}
		if err := writeCSV(filepath.Join(dir, "keys.csv"), keysCSV(r)); err != nil {
			return err
		}
		if len(r.Crashes) > 0 {
			if err := writeCSV(filepath.Join(dir, "crashes.csv"), crashesCSV(r)); err != nil {
				return err
			}
		}
		if err := plotTimeline(filepath.Join(dir, "timeline.svg"), r); err != nil {
			return err
		}
		if r.Settled.Checks > 0 {
			if err := plotSettled(filepath.Join(dir, "settled.svg"), r); err != nil {
				return err
			}
			if err := plotDebtDepth(filepath.Join(dir, "debt-depth.svg"), r); err != nil {
				return err
			}
		}
	}
	if s := o.Sweep; s != nil {
		if err := writeCSV(filepath.Join(dir, "sweep.csv"), sweepCSV(s)); err != nil {
			return err
		}
		for _, p := range sweepPlots(s) {
			if err := plotSweep(filepath.Join(dir, p.file), p.title, p.yLabel, s, p.metrics); err != nil {
				return err
			}
		}
	}
	return nil
}

func writeCSV(path string, rows [][]string) error {
	var b bytes.Buffer
	w := csv.NewWriter(&b)
	if err := w.WriteAll(rows); err != nil {
		return fmt.Errorf("sim: %s: %w", path, err)
	}
	if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	return nil
}

func i64(v int64) string   { return strconv.FormatInt(v, 10) }
func f64(v float64) string { return strconv.FormatFloat(v, 'g', 8, 64) }
func tok(micro int64) string {
	return strconv.FormatFloat(float64(micro)/float64(bucket.PerToken), 'f', 3, 64)
}

var countsHeader = []string{"requests", "demand_tokens", "allowed_tokens", "ideal_tokens", "allowed", "denied",
	"false_denied", "held_elsewhere", "unavailable", "degraded", "degraded_denied", "shadow", "unanswered", "waited"}

func countsRow(c *Counts) []string {
	return []string{i64(c.Requests), i64(c.DemandTokens), i64(c.AllowedTokens), i64(c.IdealTokens), i64(c.Allowed),
		i64(c.Denied), i64(c.FalseDenied), i64(c.HeldElsewhere), i64(c.Unavailable), i64(c.Degraded), i64(c.DegradedDenied),
		i64(c.Shadow), i64(c.Unanswered), i64(c.Waited)}
}

func timelineCSV(r *Result) [][]string {
	rows := [][]string{append(append([]string{"second"}, countsHeader...), "coordinator_calls", "store_ops",
		"settled_actual_tokens", "debt_charged_tokens", "debt_forgiven_tokens", "debt_depth")}
	for i, s := range r.Timeline {
		rows = append(rows, append(append([]string{strconv.Itoa(i)}, countsRow(&s.Counts)...), i64(s.CoordinatorCalls), i64(s.StoreOps),
			tok(s.SettledActual), tok(s.DebtCharged), tok(s.DebtForgiven), f64(s.DebtDepth)))
	}
	return rows
}

func identitiesCSV(r *Result) [][]string {
	rows := [][]string{append([]string{"identity", "rule", "tenant"}, countsHeader...)}
	for _, id := range r.Identities {
		rows = append(rows, append([]string{id.Name, id.Rule, id.Tenant}, countsRow(&id.Counts)...))
	}
	return rows
}

func keysCSV(r *Result) [][]string {
	rows := [][]string{{"key", "capacity_tokens", "rate_per_second", "ttl_ms", "granted_tokens", "spent_tokens",
		"returned_tokens", "grants", "store_ops", "admit_excess_tokens", "admit_bound_tokens", "budget_excess_tokens",
		"budget_bound_tokens", "peak_burst_share", "max_debt_tokens", "debited_tokens", "charged_excess_tokens",
		"debt_bound_tokens", "lowest_level_tokens", "charged_tokens", "admit_lag_ms"}}
	for _, k := range r.Keys {
		rows = append(rows, []string{k.Key, tok(k.CapacityMicro), f64(k.RatePerSecond / float64(bucket.PerToken)),
			i64(k.TTL.Milliseconds()), tok(k.Granted), tok(k.Spent), tok(k.Returned), i64(k.Grants), i64(k.Ops),
			tok(int64(k.AdmitExcess)), tok(int64(k.AdmitBound)), tok(int64(k.BudgetExcess)), tok(int64(k.BudgetBound)),
			f64(k.PeakBurstShare), tok(k.MaxDebt), tok(k.Debited), tok(int64(k.ChargedExcess)), tok(int64(k.DebtBound)),
			tok(k.Lowest), tok(k.Charged), i64(k.Lag.Milliseconds())})
	}
	return rows
}

func crashesCSV(r *Result) [][]string {
	rows := [][]string{{"agent", "id", "at_s", "outstanding_tokens", "stranded_tokens"}}
	for _, c := range r.Crashes {
		rows = append(rows, []string{strconv.Itoa(c.Agent), c.ID, f64(c.At.Seconds()), tok(c.Outstanding), tok(c.Stranded)})
	}
	return rows
}

// sweepColumns are the figures a sweep reports for each point.
var sweepColumns = []struct {
	name string
	get  func(*Result) float64
}{
	{"utilisation", (*Result).Utilisation},
	{"underuse", (*Result).Underuse},
	{"false_deny_share", (*Result).FalseDenyShare},
	{"stranded_per_crash_tokens", func(r *Result) float64 { return r.StrandedPerCrash() / float64(bucket.PerToken) }},
	{"stranded_share", func(r *Result) float64 { return ratio(r.Loss.Stranded, r.Totals.IdealTokens*int64(bucket.PerToken)) }},
	{"crashes", func(r *Result) float64 { return float64(len(r.Crashes)) }},
	{"coordinator_calls_per_1k_checks", func(r *Result) float64 { return 1000 * r.CallsPerCheck() }},
	{"store_ops_per_1k_checks", func(r *Result) float64 { return 1000 * r.StoreOpsPerCheck() }},
	{"unavailable_share", func(r *Result) float64 { return ratio(r.Totals.Unavailable, r.Totals.Requests) }},
	{"wait_p99_ms", func(r *Result) float64 { return float64(r.Latency.WaitP99) / 1e6 }},
	{"peak_burst_share", (*Result).PeakBurstShare},
	{"violations", func(r *Result) float64 { return float64(r.ViolationCount) }},
}

func sweepCSV(s *SweepResult) [][]string {
	head := []string{s.Parameter}
	for _, c := range sweepColumns {
		head = append(head, c.name)
	}
	rows := [][]string{head}
	for _, p := range s.Points {
		row := []string{f64(p.Value)}
		for _, c := range sweepColumns {
			row = append(row, f64(c.get(p)))
		}
		rows = append(rows, row)
	}
	return rows
}

type sweepPlot struct {
	file, title, yLabel string
	metrics             []sweepMetric
}

func sweepPlots(s *SweepResult) []sweepPlot {
	pct := func(f func(*Result) float64) func(*Result) float64 {
		return func(r *Result) float64 { return 100 * f(r) }
	}
	return []sweepPlot{
		{"sweep-loss.svg", "quota lost and false denies vs " + s.Parameter, "% of ideal admissions / of requests", []sweepMetric{
			{"under-use (% of ideal)", pct((*Result).Underuse)},
			{"stranded by crashes (% of ideal)", func(r *Result) float64 {
				return 100 * ratio(r.Loss.Stranded, r.Totals.IdealTokens*int64(bucket.PerToken))
			}},
			{"false denies (% of requests)", pct((*Result).FalseDenyShare)},
		}},
		{"sweep-load.svg", "coordinator and store load vs " + s.Parameter, "per 1,000 checks", []sweepMetric{
			{"coordinator calls", func(r *Result) float64 { return 1000 * r.CallsPerCheck() }},
			{"store (Redis) operations", func(r *Result) float64 { return 1000 * r.StoreOpsPerCheck() }},
		}},
	}
}

// markdown writes the report of outs. It reads no clock: the same outcomes give the same bytes.
func markdown(w io.Writer, outs []*Outcome) error {
	var b strings.Builder
	b.WriteString("# leasebucket simulation report\n\n")
	b.WriteString("Each scenario runs the production lease core (`agent.Limiter`, one per simulated agent), the " +
		"coordinator's handlers and grant rule (`coordinator.Service`) and the in-memory bucket store " +
		"(`coordinator/memstore`) on a virtual clock, and measures them against an ideal limiter: one exact " +
		"bucket per identity that sees every request at once. Runs are deterministic: the same scenario and " +
		"seed give this report byte for byte. The reference is [docs/simulator.md](../../docs/simulator.md).\n\n")
	b.WriteString("## Summary\n\n")
	b.WriteString("| scenario | utilisation | under-use | false denies | crashes | stranded per crash | 503 | store ops / 1k checks | bounds |\n")
	b.WriteString("|---|--:|--:|--:|--:|--:|--:|--:|---|\n")
	for _, o := range outs {
		r := o.Result
		if r == nil {
			continue
		}
		fmt.Fprintf(&b, "| [%s](#%s) | %s | %s | %s | %d | %s | %s | %.1f | %s |\n", r.Scenario, anchor(r.Scenario),
			pct(r.Utilisation()), pct(r.Underuse()), pct(r.FalseDenyShare()), len(r.Crashes), perCrash(r),
			pct(ratio(r.Totals.Unavailable, r.Totals.Requests)), 1000*r.StoreOpsPerCheck(), boundsCell(r))
	}
	b.WriteString("\n")
	for _, o := range outs {
		scenarioMarkdown(&b, o)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// code is a table cell in code font: a | would end the cell.
func code(s string) string { return "`" + strings.ReplaceAll(s, "|", "\\|") + "`" }

func anchor(name string) string { return strings.ToLower(strings.ReplaceAll(name, " ", "-")) }

func pct(x float64) string { return fmt.Sprintf("%.2f%%", 100*x) }

func perCrash(r *Result) string {
	if len(r.Crashes) == 0 {
		return "—"
	}
	return fmt.Sprintf("%.2f tokens", r.StrandedPerCrash()/float64(bucket.PerToken))
}

// violationList lists r's violations kept (the first of each kind and key).
func violationList(b *strings.Builder, r *Result) {
	for _, v := range r.Violations {
		fmt.Fprintf(b, "- %s at %s on %s: %s\n", v.Kind, dfmt(v.At), code(v.Key), v.Detail)
	}
	b.WriteString("\n")
}

func boundsCell(r *Result) string {
	if r.Failed() {
		return fmt.Sprintf("**FAILED** (%d violations)", r.ViolationCount)
	}
	return "held"
}

func tokens2(micro int64) string {
	return strconv.FormatFloat(float64(micro)/float64(bucket.PerToken), 'f', 2, 64)
}

func scenarioMarkdown(b *strings.Builder, o *Outcome) {
	sc, r := o.Scenario, o.Result
	fmt.Fprintf(b, "## %s\n\n", sc.Name)
	if sc.Description != "" {
		fmt.Fprintf(b, "%s\n\n", strings.TrimSpace(sc.Description))
	}
	if sc.Question != "" {
		fmt.Fprintf(b, "**Question.** %s\n\n", strings.TrimSpace(sc.Question))
	}
	if r != nil {
		fmt.Fprintf(b, "**Answer.** %s\n\n", answer(r))
		setupMarkdown(b, sc, r)
		resultMarkdown(b, sc, r)
	}
	if o.Sweep != nil {
		sweepMarkdown(b, sc, o.Sweep)
	}
	if o.Plan != nil {
		planMarkdown(b, o.Plan)
	}
}

// answer is the run in a few sentences.
func answer(r *Result) string {
	var s []string
	s = append(s, fmt.Sprintf("Agents admitted %s of what the ideal limiter admitted (%s tokens of %s; under-use %s).",
		pct(r.Utilisation()), i64(r.Totals.AllowedTokens), i64(r.Totals.IdealTokens), pct(r.Underuse())))
	if n := len(r.Crashes); n > 0 {
		rate := r.PerSecond(r.Totals.AllowedTokens * int64(bucket.PerToken))
		each := r.StrandedPerCrash()
		worst := int64(0)
		for _, c := range r.Crashes {
			worst = max(worst, c.Stranded)
		}
		s = append(s, fmt.Sprintf("%d agent crashes stranded %s tokens in all: %s tokens per crash on average (at most %s), "+
			"%s of the ideal admissions; one crash costs what the fleet admits in %s.",
			n, tokens2(r.Loss.Stranded), strconv.FormatFloat(each/float64(bucket.PerToken), 'f', 2, 64), tokens2(worst),
			pct(ratio(r.Loss.Stranded, r.Totals.IdealTokens*int64(bucket.PerToken))), dur(each/rate)))
	}
	s = append(s, fmt.Sprintf("%s of requests were false denies (429 while tokens of their key sat unused and were wasted: in a full bucket, or a lease that ended unspent); %s were refused while tokens of their key sat elsewhere and were used later.",
		pct(r.FalseDenyShare()), pct(ratio(r.Totals.HeldElsewhere, r.Totals.Requests))))
	if r.Totals.Unavailable+r.Totals.Degraded > 0 {
		s = append(s, fmt.Sprintf("%s requests got 503 and %s were admitted degraded.", i64(r.Totals.Unavailable), i64(r.Totals.Degraded)))
	}
	s = append(s, fmt.Sprintf("The busiest window used %.3f of a key's burst C (the admission bound allows up to 1 + r·τ/C).", r.PeakBurstShare()))
	if st := &r.Settled; st.Checks > 0 {
		s = append(s, fmt.Sprintf("Costs settled after the response (the figures above compare estimates; the debt of the actual "+
			"costs is repaid from the same buckets): admitted requests were charged %s of their buckets' budget "+
			"(the settled checks' actual costs came to %s of it; %s tokens of debt forgiven); the worst window reached %.3f of the debt bound "+
			"C + r·(w + τ) + max_debt, and the lowest level %s tokens against -max_debt = -%s.",
			pct(st.Utilisation()), pct(ratio(st.Actual, st.Budget)), tokens2(st.DebtForgiven), st.WorstRatio(),
			tokens2(st.Deepest), tokens2(st.DeepestMax)))
	}
	if r.Failed() {
		s = append(s, fmt.Sprintf("**%d bound violations: this run FAILED** (see Bounds).", r.ViolationCount))
	} else {
		s = append(s, "Every bound held (admission, budget, debt, loss, conservation).")
	}
	return strings.Join(s, " ")
}

// dfmt writes a duration with three significant digits.
func dfmt(d time.Duration) string {
	if d == 0 {
		return "0"
	}
	unit := time.Duration(1)
	for x := d; x >= 1000; x /= 10 {
		unit *= 10
	}
	return d.Round(unit).String()
}

// dur formats seconds for people.
func dur(sec float64) string {
	if math.IsInf(sec, 0) || math.IsNaN(sec) {
		return "—"
	}
	return dfmt(time.Duration(sec * float64(time.Second)))
}

func setupMarkdown(b *strings.Builder, sc *Scenario, r *Result) {
	b.WriteString("### Setup\n\n| | |\n|---|---|\n")
	var regions []string
	for _, g := range sc.Regions {
		regions = append(regions, fmt.Sprintf("%s: %d agents, %d coordinator replicas", g.Name, g.Agents, g.Coordinators))
	}
	fmt.Fprintf(b, "| run | %s simulated, seed %d, tick %s |\n", sc.Duration, sc.Seed, sc.Tick)
	fmt.Fprintf(b, "| regions | %s (global store in %s) |\n", strings.Join(regions, "; "), sc.Home)
	n := sc.Network
	fmt.Fprintf(b, "| network (one way) | agent ↔ coordinator %s, coordinator ↔ store %s, cross-region +%s, jitter +%.0f%% at most |\n",
		n.AgentCoordinator, n.CoordinatorStore, n.CrossRegion, 100*n.Jitter)
	a := sc.Agent
	fmt.Fprintf(b, "| agent shell | max wait %s, call timeout %s, %d calls in flight, expiry sweep every %s, want factor %g |\n",
		a.MaxWait, a.CallTimeout, a.MaxInFlight, a.SweepEvery, a.WantFactor)
	for i, t := range sc.Traffic {
		g := sc.group(t.Identities)
		skew := "uniform"
		switch {
		case t.Skew.Zipf > 0:
			skew = fmt.Sprintf("Zipf %g", t.Skew.Zipf)
		case t.Skew.Hot > 0:
			skew = fmt.Sprintf("one hot key takes %s", pct(t.Skew.Hot))
		}
		shape := ""
		switch t.Shape.Kind {
		case "diurnal":
			shape = fmt.Sprintf(", diurnal ±%s over %s", pct(t.Shape.Amplitude), t.Shape.Period)
		case "bursts":
			shape = fmt.Sprintf(", bursts of %g× for %s every %s", t.Shape.Factor, t.Shape.Length, t.Shape.Every)
		}
		fmt.Fprintf(b, "| traffic %d | %s checks/s (%s) over %d agents: %d tenants of %s on `%s %s`, %s%s |\n",
			i, strconv.FormatFloat(float64(t.Rate), 'f', -1, 64), t.Arrivals, len(t.nodes), len(g.names), g.Name,
			g.Operation, g.Path, skew, shape)
	}
	c := sc.Crashes
	if c.RatePerAgentHour > 0 || len(c.Schedule) > 0 {
		fmt.Fprintf(b, "| crashes | %g per agent-hour, %d scheduled; restart after %s; traffic of a down agent: %s |\n",
			c.RatePerAgentHour, len(c.Schedule), c.RestartAfter, c.Traffic)
	}
	for _, o := range sc.Outages {
		what := "coordinators of " + o.Region
		if o.Kind == "redis" {
			what = "store " + o.Store
		}
		fmt.Fprintf(b, "| outage | %s down (%s) from %s to %s |\n", what, o.Mode, o.From, o.To)
	}
	for _, p := range sc.Partitions {
		fmt.Fprintf(b, "| partition | %s cut off from %s to %s |\n", p.Region, p.From, p.To)
	}
	if f := sc.Faults.OvergrantFactor; f > 1 {
		fmt.Fprintf(b, "| fault | grants reported %g× what the bucket was debited (a broken grant rule) |\n", f)
	}
	for _, rule := range usedRules(sc, r) {
		mode := fmt.Sprintf("lease TTL %s", lease.TTL(rule.Quota.Bucket))
		if rule.Direct {
			mode = "lease: off (every check one take)"
		}
		fmt.Fprintf(b, "| rule %s | %s, %s scope, on failure %s, %s |\n", rule.Name, rule.Quota, rule.Scope,
			rule.OnFailure, mode)
	}
	b.WriteString("\n")
}

// ruleOps writes, where the scenario's checks go to more than one rule, each rule's store
// operations per check as the agents count them (leasebucket_agent_store_operations_total over
// decisions_total): the figure that says whether a rule's leases save anything (docs/leases.md,
// choosing the mode of a rule). The buckets a check charges besides its rule's own count under
// their own names, with no checks of their own.
func ruleOps(b *strings.Builder, sc *Scenario, r *Result) {
	rules := usedRules(sc, r)
	if len(rules) < 2 && len(r.RuleOps) < 2 {
		return
	}
	checks := r.ChecksByRule()
	b.WriteString("Store operations by rule, as the agents count them (near 1,000 per 1,000 checks a rule's leases save nothing):\n\n")
	b.WriteString("| rule | lease | checks | store operations | per 1,000 checks |\n|---|---|--:|--:|--:|\n")
	seen := map[string]bool{}
	for _, rule := range rules {
		seen[rule.Name] = true
		mode := "on"
		if rule.Direct {
			mode = "off"
		}
		ops := r.RuleOps[rule.Name]
		fmt.Fprintf(b, "| %s | %s | %s | %s | %.1f |\n", code(rule.Name), mode, i64(checks[rule.Name]), i64(ops), 1000*ratio(ops, checks[rule.Name]))
	}
	var rest []string
	for name := range r.RuleOps {
		if !seen[name] {
			rest = append(rest, name)
		}
	}
	slices.Sort(rest)
	for _, name := range rest {
		fmt.Fprintf(b, "| %s | | — | %s | |\n", code(name), i64(r.RuleOps[name]))
	}
	b.WriteString("\n")
}

// usedRules are the policy rules the scenario's identities resolve to, in policy order.
func usedRules(sc *Scenario, r *Result) []*policy.Rule {
	seen := map[string]bool{}
	for _, id := range r.Identities {
		seen[id.Rule] = true
	}
	var out []*policy.Rule
	for _, rule := range append(sc.policy.Rules(), sc.policy.Default()) {
		if seen[rule.Name] {
			out = append(out, rule)
			seen[rule.Name] = false
		}
	}
	return out
}

func resultMarkdown(b *strings.Builder, sc *Scenario, r *Result) {
	t := &r.Totals
	b.WriteString("### Decisions\n\n| | count | share of requests |\n|---|--:|--:|\n")
	row := func(name string, v int64) {
		fmt.Fprintf(b, "| %s | %s | %s |\n", name, i64(v), pct(ratio(v, t.Requests)))
	}
	row("requests", t.Requests)
	row("admitted from leases", t.Allowed)
	row("429 (over the limit)", t.Denied)
	row("of which false denies (tokens of the key wasted meanwhile)", t.FalseDenied)
	row("of which while tokens sat elsewhere (another lease, the bucket)", t.HeldElsewhere)
	row("503 (fail closed)", t.Unavailable)
	row("admitted degraded (emergency bucket)", t.Degraded)
	row("429 from an empty emergency bucket", t.DegradedDenied)
	row("admitted by a shadow rule that would deny", t.Shadow)
	row("unanswered (agent crashed, or none alive)", t.Unanswered)
	row("waited for a refill", t.Waited)
	if r.Dropped > 0 {
		fmt.Fprintf(b, "| dropped with a down agent (not counted above) | %s | |\n", i64(r.Dropped))
	}
	fmt.Fprintf(b, "\nTokens: demanded %s, ideal %s, admitted %s: utilisation %s, under-use %s.\n\n",
		i64(t.DemandTokens), i64(t.IdealTokens), i64(t.AllowedTokens), pct(r.Utilisation()), pct(r.Underuse()))
	if len(r.Groups) > 1 {
		b.WriteString("By rule, and the region the checks arrived in:\n\n")
		b.WriteString("| rule | scope | region | requests | ideal | admitted | utilisation | 429 | false denies | 503 | degraded | waited | wait p50 | wait p99 |\n")
		b.WriteString("|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
		for _, g := range r.Groups {
			c := &g.Counts
			fmt.Fprintf(b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", g.Rule, g.Scope, g.Region,
				i64(c.Requests), i64(c.IdealTokens), i64(c.AllowedTokens), pct(ratio(c.AllowedTokens, c.IdealTokens)),
				i64(c.Denied), i64(c.FalseDenied), i64(c.Unavailable), i64(c.Degraded), i64(c.Waited), dfmt(g.WaitP50), dfmt(g.WaitP99))
		}
		b.WriteString("\n")
	}
	fmt.Fprintf(b, "![decisions per second](%s/timeline.svg)\n\n", sc.Name)

	l := &r.Loss
	b.WriteString("### Where the granted tokens went\n\n")
	tokenShares(b, "granted", l.Granted, []tokenRow{
		{"granted to agents", l.Granted},
		{"spent (admitted)", l.Spent},
		{"returned unspent", l.Returned},
		{"… credited back to the bucket", l.Credited},
		{"… decayed (refill the bucket had meanwhile, or its cap)", l.Decayed},
		{"… lost (the Return failed or was rejected)", l.Lost},
		{"expired, not returned (the refill since the grant covers them)", l.Expired},
		{"stranded in crashed agents' leases", l.Stranded},
		{"held by live agents at the end", l.HeldAtEnd},
	})
	if n := len(r.Crashes); n > 0 {
		worst := slices.MaxFunc(r.Crashes, func(a, c Crash) int { return int(a.Stranded - c.Stranded) })
		fmt.Fprintf(b, "**Crashes.** %d crashes stranded %s tokens, %s per crash (most: %s by %s at %s). "+
			"The crashed agents held or had in flight %s tokens: the loss bound (stranded ≤ outstanding) %s. "+
			"Per crash: [crashes.csv](%s/crashes.csv).\n\n",
			n, tokens2(l.Stranded), strconv.FormatFloat(r.StrandedPerCrash()/float64(bucket.PerToken), 'f', 2, 64),
			tokens2(worst.Stranded), worst.ID, dfmt(worst.At), tokens2(l.Outstanding), heldWord(l.Stranded <= l.Outstanding), sc.Name)
	}

	if r.Settled.Checks > 0 {
		settledMarkdown(b, sc, r)
	}

	b.WriteString("### Bounds\n\n")
	fmt.Fprintf(b, "Checked after every admission and every grant, on all %d keys, over every window: "+
		"admission (spent ≤ C + r·(w + τ); with lease: off, τ is the longest a check waits, agent.max_wait), budget (granted + debited − credited ≤ C + r·w + max_debt), "+
		"debt (spent + debited ≤ C + r·(w + τ) + max_debt, level ≥ -max_debt), loss (stranded ≤ outstanding), "+
		"conservation (every token an agent applied was spent, returned or held).\n\n", len(r.Keys))
	keys := slices.Clone(r.Keys)
	slices.SortStableFunc(keys, func(a, c KeyBound) int {
		return -cmp.Compare(a.AdmitExcess/a.AdmitBound, c.AdmitExcess/c.AdmitBound)
	})
	b.WriteString("| key (closest to its bound) | C | τ | admission excess / bound | budget excess / bound |\n|---|--:|--:|--:|--:|\n")
	for _, k := range keys[:min(5, len(keys))] {
		tau := k.TTL.String()
		if k.TTL == 0 {
			tau = "off: wait " + k.Lag.String()
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s / %s | %s / %s |\n", code(k.Key), tokens2(k.CapacityMicro), tau,
			tokens2(int64(k.AdmitExcess)), tokens2(int64(k.AdmitBound)), tokens2(int64(k.BudgetExcess)), tokens2(int64(k.BudgetBound)))
	}
	b.WriteString("\n")
	if r.Failed() {
		fmt.Fprintf(b, "**FAILED: %d violations.** The first of each kind and key:\n\n", r.ViolationCount)
		violationList(b, r)
	} else {
		b.WriteString("No bound broke.\n\n")
	}

	g := &r.Backend
	b.WriteString("### Load on coordinators and stores\n\n| | total | per second | per 1,000 checks |\n|---|--:|--:|--:|\n")
	lr := func(name string, v int64) {
		fmt.Fprintf(b, "| %s | %s | %.1f | %.2f |\n", name, i64(v), r.PerSecond(v), 1000*ratio(v, t.Requests))
	}
	lr("checks", t.Requests)
	lr("Acquire calls", g.AcquireCalls)
	lr("Acquire items", g.AcquireItems)
	lr("Return calls", g.ReturnCalls)
	lr("Return items", g.ReturnItems)
	lr("calls that failed", g.FailedCalls)
	if g.StaleBacks > 0 {
		lr("hand-backs overtaken at the store (STALE), sent again", g.StaleBacks)
	}
	lr("store (Redis) operations", g.StoreOps)
	for _, rg := range g.Regions {
		fmt.Fprintf(b, "| coordinator calls in %s, per replica (%d) | %s | %.1f | |\n", rg.Name, rg.Coordinators,
			i64(rg.Calls/int64(rg.Coordinators)), r.PerSecond(rg.Calls)/float64(rg.Coordinators))
	}
	for _, s := range g.Stores {
		fmt.Fprintf(b, "| operations on store %s (%d keys) | %s | %.1f | |\n", s.Name, s.Keys, i64(s.Ops), r.PerSecond(s.Ops))
	}
	if g.HotKey != "" {
		fmt.Fprintf(b, "| operations on the busiest key %s | %s | %.1f | |\n", code(g.HotKey), i64(g.HotKeyOps), r.PerSecond(g.HotKeyOps))
	}
	b.WriteString("\n")
	ruleOps(b, sc, r)

	lat := &r.Latency
	fmt.Fprintf(b, "### Check latency\n\n%s of checks were answered at once from the agent (no modelled time); %s waited "+
		"for a refill's answer (or the max wait; %s fell back to the failure mode).\n\n",
		pct(ratio(lat.Local, lat.Local+lat.Waited)), i64(lat.Waited), i64(lat.FellBack))
	b.WriteString("| | p50 | p99 | p99.9 | max |\n|---|--:|--:|--:|--:|\n")
	fmt.Fprintf(b, "| all checks | %s | %s | %s | %s |\n", dfmt(lat.AllP50), dfmt(lat.AllP99), dfmt(lat.AllP999), dfmt(lat.WaitMax))
	fmt.Fprintf(b, "| checks that waited | %s | %s | %s | %s |\n\n", dfmt(lat.WaitP50), dfmt(lat.WaitP99), dfmt(lat.WaitP999), dfmt(lat.WaitMax))

	ids := slices.Clone(r.Identities)
	slices.SortStableFunc(ids, func(a, c IdentityResult) int { return int(c.Requests - a.Requests) })
	fmt.Fprintf(b, "### Identities\n\nThe %d busiest of %d (all in [identities.csv](%s/identities.csv)):\n\n", min(10, len(ids)), len(ids), sc.Name)
	b.WriteString("| identity | requests | ideal | admitted | utilisation | 429 | false denies | 503 | degraded |\n|---|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, id := range ids[:min(10, len(ids))] {
		fmt.Fprintf(b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", code(id.Name), i64(id.Requests), i64(id.IdealTokens),
			i64(id.AllowedTokens), pct(ratio(id.AllowedTokens, id.IdealTokens)), i64(id.Denied), i64(id.FalseDenied),
			i64(id.Unavailable), i64(id.Degraded))
	}
	b.WriteString("\n")
}

func heldWord(ok bool) string {
	if ok {
		return "held"
	}
	return "**broke**"
}

// sweepValue is a sweep point's value as the report shows it: lease's 1 and 0 named.
func sweepValue(param string, v float64) string {
	if param == "lease" && v == 1 {
		return "1 (on)"
	} else if param == "lease" {
		return "0 (off)"
	}
	return fmt.Sprintf("%g", v)
}

func sweepMarkdown(b *strings.Builder, sc *Scenario, s *SweepResult) {
	fmt.Fprintf(b, "### Sweep over %s\n\n", s.Parameter)
	fmt.Fprintf(b, "%d runs of %s each, one per value (all figures in [sweep.csv](%s/sweep.csv)).\n\n",
		len(s.Points), s.Points[0].Duration, sc.Name)
	fmt.Fprintf(b, "| %s | utilisation | under-use | stranded per crash | crashes | false denies | 503 | coordinator calls / 1k | store ops / 1k | wait p99 | peak burst | bounds |\n", s.Parameter)
	b.WriteString("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|\n")
	for _, p := range s.Points {
		fmt.Fprintf(b, "| %s | %s | %s | %s | %d | %s | %s | %.1f | %.1f | %s | %.3f | %s |\n", sweepValue(s.Parameter, p.Value), pct(p.Utilisation()),
			pct(p.Underuse()), perCrash(p), len(p.Crashes), pct(p.FalseDenyShare()), pct(ratio(p.Totals.Unavailable, p.Totals.Requests)),
			1000*p.CallsPerCheck(), 1000*p.StoreOpsPerCheck(), dfmt(p.Latency.WaitP99), p.PeakBurstShare(), boundsCell(p))
	}
	b.WriteString("\n")
	for _, p := range s.Points {
		if p.Failed() {
			fmt.Fprintf(b, "**FAILED at %s %s: %d violations.** The first of each kind and key:\n\n",
				s.Parameter, sweepValue(s.Parameter, p.Value), p.ViolationCount)
			violationList(b, p)
		}
	}
	for _, p := range sweepPlots(s) {
		fmt.Fprintf(b, "![%s](%s/%s)\n\n", p.title, sc.Name, p.file)
	}
}

func planMarkdown(b *strings.Builder, p *Plan) {
	b.WriteString("### Capacity plan\n\n")
	u := p.Utilisation
	if p.CardReplicas > 0 {
		fmt.Fprintf(b, "**The card's plan** (every check goes through a limiter replica to Redis): "+
			"ceil(%s / (%s × %g)) = **%d replicas**, with the card's assumed %s checks/s per replica.\n\n",
			si(p.Peak), si(p.CardReplica), u, p.CardReplicas, si(p.CardReplica))
	}
	fmt.Fprintf(b, "**Ours.** Agents answer checks from leases; only refills reach coordinators and Redis. This run measured, "+
		"in steady state, **%.4f coordinator calls and %.4f store operations per check** (the busiest key takes %s of the "+
		"store operations). At the peak of %s checks/s and %s target utilisation:\n\n",
		p.CallsPerCheck, p.StoreOpsPerCheck, pct(p.HotKeyShare), si(p.Peak), pct(u))
	b.WriteString("| | card (assumed) | ours | source of our figure |\n|---|--:|--:|---|\n")
	fmt.Fprintf(b, "| work per check at the limiter | one Redis round trip | %.4f store operations | this simulation |\n", p.StoreOpsPerCheck)
	fmt.Fprintf(b, "| checks/s one unit answers | %s per limiter replica | %s per agent core | %s |\n", si(p.CardReplica), perCore(p.AgentCheckNs), p.AgentCheckNs.Source)
	fmt.Fprintf(b, "| refill items/s per coordinator core | — | %s | %s |\n", si(p.CoordinatorItems.Value), p.CoordinatorItems.Source)
	fmt.Fprintf(b, "| operations/s per Redis shard | — | %s | %s |\n", si(p.RedisOps.Value), p.RedisOps.Source)
	fmt.Fprintf(b, "| operations/s on one key | — | %s | %s |\n\n", si(p.RedisKeyOps.Value), p.RedisKeyOps.Source)
	fmt.Fprintf(b, "Benchmark results: %s.\n\n", p.Bench)
	fmt.Fprintf(b, "- **Agent CPU**: %s checks/s × %s / %g = **%.2f cores** across the fleet, %.2f per agent (%d agents).\n",
		si(p.Peak), dfmt(time.Duration(p.AgentCheckNs.Value)), u, p.AgentCores, p.AgentCoresEach, p.Agents)
	if p.Coordinators > 0 {
		fmt.Fprintf(b, "- **Coordinator cores**: ceil(%s × %.4f / (%s × %g)) = **%d**, as replicas of one core (plus one spare to lose one).\n",
			si(p.Peak), p.StoreOpsPerCheck, si(p.CoordinatorItems.Value), u, p.Coordinators)
	}
	if p.RedisShards > 0 {
		fmt.Fprintf(b, "- **Redis shards**: ceil(%s × %.4f / (%s × %g)) = **%d**.\n",
			si(p.Peak), p.StoreOpsPerCheck, si(p.RedisOps.Value), u, p.RedisShards)
	}
	if p.RedisKeyOps.Value > 0 {
		verdict := "fits in one shard"
		if !p.HotKeyFits {
			verdict = "**does not fit in one shard**: raise that rule's burst (longer leases) or split the identity"
		}
		fmt.Fprintf(b, "- **Hot key**: %s ops/s × %s = %s ops/s on %s, against %s × %g: %s.\n",
			si(p.RedisLoad), pct(p.HotKeyShare), si(p.HotKeyLoad), code(p.HotKey), si(p.RedisKeyOps.Value), u, verdict)
	}
	if len(p.Missing) > 0 {
		fmt.Fprintf(b, "- Not computed for want of a figure: %s. Run `make bench` (bench/latest.json) or pass the figures to `cmd/sim`.\n",
			strings.Join(p.Missing, ", "))
	}
	b.WriteString("\n")
}

func perCore(f Figure) string {
	if f.Value <= 0 {
		return "—"
	}
	return si(1e9 / f.Value)
}

// si formats a rate with a K or M suffix and four significant digits.
func si(v float64) string {
	switch {
	case v <= 0:
		return "—"
	case v >= 1e6:
		return strconv.FormatFloat(v/1e6, 'g', 4, 64) + "M"
	case v >= 1e3:
		return strconv.FormatFloat(v/1e3, 'g', 4, 64) + "K"
	}
	return strconv.FormatFloat(v, 'g', 4, 64)
}

// tokenRow is a row of a tokenShares table.
type tokenRow struct {
	name string
	v    int64
}

// tokenShares writes a table of token counts and their shares of total (named of).
func tokenShares(b *strings.Builder, of string, total int64, rows []tokenRow) {
	fmt.Fprintf(b, "| | tokens | share of %s |\n|---|--:|--:|\n", of)
	for _, r := range rows {
		fmt.Fprintf(b, "| %s | %s | %s |\n", r.name, tokens2(r.v), pct(ratio(r.v, total)))
	}
	b.WriteString("\n")
}

// settledMarkdown reports what costs settled after the response did: where the actual costs went
// (credited, spent from leases, debited, forgiven), the budget they used, and the debt bound.
func settledMarkdown(b *strings.Builder, sc *Scenario, r *Result) {
	st := &r.Settled
	b.WriteString("### Costs settled after the response\n\n")
	fmt.Fprintf(b, "%s allowed checks carried an estimate to settle; %s were settled (%s lost with a crashed agent, "+
		"%s not due before the end, %s allowed without a settle id).\n\n",
		i64(st.Checks), i64(st.Settles), i64(st.LostInCrash), i64(st.Pending), i64(st.Unheld))
	tokenShares(b, "actual", st.Actual, []tokenRow{
		{"actual costs of the settled checks", st.Actual},
		{"their estimates", st.Estimates},
		{"estimates given back (into the lease, or handed back)", st.Credited},
		{"estimates that stayed spent (no lease held them)", st.Uncredited},
		{"beyond the estimates: spent from leases", st.SpentExtra},
		{"beyond the estimates: sent as debt", st.Debt},
		{"… debited by the stores", st.DebtCharged},
		{"… forgiven (the bucket was at -max_debt)", st.DebtForgiven},
		{"… lost (never sent, or its call failed)", st.DebtLost},
	})
	fmt.Fprintf(b, "**Utilisation.** The keys' buckets could admit %s tokens over the run (C + r·T each); admitted "+
		"requests were charged %s (%s: spent from leases, net of estimates given back, plus debt debited), and the settled "+
		"checks' actual costs came to %s (%s of the budget; what exceeds the charge was forgiven or lost).\n\n",
		tokens2(st.Budget), tokens2(st.Charged), pct(st.Utilisation()), tokens2(st.Actual), pct(ratio(st.Actual, st.Budget)))
	fmt.Fprintf(b, "**Debt bound.** On each key, what leases spent plus what the store debited in any window of length w "+
		"is at most C + r·(w + τ + 1 ms) + max_debt. Closest: %s, whose worst window exceeded r·w by %s tokens of the "+
		"%s allowed: **%.3f of the bound**. The lowest level a store answered was %s tokens on %s, against -max_debt = -%s.\n\n",
		code(st.WorstKey), tokens2(int64(st.WorstExcess)), tokens2(int64(st.WorstBound)), st.WorstRatio(),
		tokens2(st.Deepest), code(st.DeepestKey), tokens2(st.DeepestMax))
	fmt.Fprintf(b, "![settled costs per second](%s/settled.svg)\n\n![debt depth](%s/debt-depth.svg)\n\n", sc.Name, sc.Name)
}
