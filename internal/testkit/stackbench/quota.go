package stackbench

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/leasebucket/leasebucket/internal/testkit/envoyquota"
)

// Quota is Envoy's rate limit quota service: the callers are Envoy-faithful rate_limit_quota
// filters (internal/testkit/envoyquota), each on a connection of its own to the agent's socket,
// as that many Envoys on one node hold one each. A request is decided by its filter locally,
// from the assignment the agent gave it; the agent sees the filters' reports (every
// QuotaReporting) and sends assignments. A caller decides a request, pauses Load.Pause (the time
// its client takes to send the next one: a decision costs Envoy a few microseconds, so without it
// the callers would spin on decisions and offer a demand that only the client's CPU bounds), and
// decides the next: the outcome Allowed counts the requests an assignment admitted, Denied those
// it (or, before the bucket's first assignment, the no-assignment behaviour) refused.
const Quota API = "rlqs"

// QuotaReporting is the filters' reporting_interval: the one docs/gateway.md configures.
const QuotaReporting = time.Second

// quotaFilterYAML is the filters' configuration: the lease rule's route template as the bucket's
// path, the tenant from the verified JWT, failing closed (DENY_ALL) before the first assignment,
// as docs/gateway.md configures a fail-closed rule.
func quotaFilterYAML() string {
	return envoyquota.FilterYAML("leasebucket", QuotaReporting, time.Minute,
		envoyquota.Route{Prefix: Lease.prefix(), Template: Lease.Route()})
}

// startQuota starts the filters of a Quota load, each on its own connection, filter i to
// sockets[i mod n].
func (r *Runner) startQuota(sockets []string) error {
	cfg, err := envoyquota.ParseConfig(quotaFilterYAML())
	if err != nil {
		return err
	}
	for i := range max(1, r.load.Envoys) {
		conn, err := Dial(sockets[i%len(sockets)])
		if err != nil {
			return err
		}
		r.quotaConns = append(r.quotaConns, conn)
		f, err := envoyquota.New(cfg, conn, envoyquota.Options{})
		if err != nil {
			return err
		}
		r.filters = append(r.filters, f)
	}
	return nil
}

// quota is a caller of a Quota load: requests of its keys through filter f, back to back.
func (r *Runner) quota(c *caller, f *envoyquota.Filter, next func() int) {
	path := Lease.Path()
	for r.ctx.Err() == nil {
		req := envoyquota.HTTP(r.keys.Tenant(next()), Operation, path)
		t0 := time.Now()
		d := f.Decide(req)
		el := time.Since(t0)
		o := Denied
		var err error
		switch {
		case d.Allowed && d.Source == envoyquota.Assignment:
			o = Allowed
		case d.Allowed:
			// Unmatched, or a fallback that allows: nothing the benchmark configures.
			o, err = Failed, fmt.Errorf("stackbench: a quota request allowed by %v", d.Source)
		}
		c.record(r.measuring.Load(), el, o, err)
		if r.load.Pause > 0 {
			time.Sleep(r.load.Pause)
		}
	}
}

// stopQuota closes the filters (their streams end) and their connections.
func (r *Runner) stopQuota() {
	for _, f := range r.filters {
		f.Close()
	}
	for _, c := range r.quotaConns {
		_ = c.Close()
	}
}

// Admitted is the requests allowed per second of the measured window.
func (r *Result) Admitted() float64 { return float64(r.Outcomes[Allowed]) / r.Wall.Seconds() }

// AgentCPUPerAdmitted is the agent's CPU time per request allowed, in µs.
func (r *Result) AgentCPUPerAdmitted() float64 {
	return float64(r.CPU[ProcAgent]) / float64(time.Microsecond) / float64(r.Outcomes[Allowed])
}

// AdmittedPerAgentSecond is the requests allowed per second of the agent's CPU.
func (r *Result) AdmittedPerAgentSecond() float64 {
	return float64(r.Outcomes[Allowed]) / r.CPU[ProcAgent].Seconds()
}

// QuotaCase is a case of BenchmarkQuota: a key distribution under the quota rule.
type QuotaCase struct {
	Name string
	Keys Dist
}

// QuotaLimit and QuotaBurst never deny a key at any rate the load makes (a million a second), and
// give leases of τ = C/(4r) = 2.5 s, so that a fresh lease backs assignments of a whole second.
const (
	QuotaLimit = "1000000/second"
	QuotaBurst = 10_000_000
)

// QuotaCases are BenchmarkQuota's cases: one hot key, 100 and 1,000 tenants walked uniformly.
// The agent's work for RLQS grows with the buckets (a report and about one assignment per bucket
// and Envoy a second), not with the requests: its cost per request falls as the requests per
// bucket grow, which the three cases show.
var QuotaCases = []QuotaCase{
	{Name: "hot", Keys: Dist{Kind: Hot, N: 1}},
	{Name: "tenants-100", Keys: Dist{Kind: Uniform, N: 100}},
	{Name: "tenants-1k", Keys: Dist{Kind: Uniform, N: 1000}},
}

// QuotaPolicyYAML is the policy file of BenchmarkQuota: the benchmarked rule with QuotaLimit and
// QuotaBurst, leases on.
func QuotaPolicyYAML() []byte {
	return PolicyYAML(Case{Name: "quota", Limit: QuotaLimit, Burst: QuotaBurst}, Lease)
}

// WriteQuota prints the RLS and RLQS runs of BenchmarkQuota as one Markdown table: admitted
// requests a second, the agent's CPU per admitted request, the requests admitted per second of the
// agent's CPU, and each RLQS row's ratio to the RLS row of its case.
func (s *Summary) WriteQuota(w io.Writer) {
	var b strings.Builder
	b.WriteString("| case | API | admitted/s | denied % | agent CPU µs per admitted | admitted per agent CPU-second | client CPU µs per request | coord CPU µs per admitted | store ops per admitted | ×RLS admitted/s | ×RLS admitted per agent CPU-second |\n")
	b.WriteString("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, r := range s.results {
		if r.API != Quota && r.API != Envoy {
			continue
		}
		ratio, cpuRatio := "", ""
		if rls := s.Find(r.Case, Envoy, r.Mode); r.API == Quota && rls != nil {
			ratio = fmt.Sprintf("%.1f", r.Admitted()/rls.Admitted())
			cpuRatio = fmt.Sprintf("%.0f", r.AdmittedPerAgentSecond()/rls.AdmittedPerAgentSecond())
		}
		fmt.Fprintf(&b, "| %s | %s | %.0f | %.1f | %.3f | %.0f | %.2f | %.3f | %.5f | %s | %s |\n",
			r.Case, r.API, r.Admitted(), r.Percent(Denied), r.AgentCPUPerAdmitted(), r.AdmittedPerAgentSecond(),
			r.CPUPerCheck(ProcClient), float64(r.CPU[ProcCoordinator])/float64(time.Microsecond)/float64(r.Outcomes[Allowed]),
			r.StoreOps/float64(r.Outcomes[Allowed]), ratio, cpuRatio)
	}
	_, _ = io.WriteString(w, b.String())
}
