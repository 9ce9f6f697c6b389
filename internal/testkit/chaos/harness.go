package chaos

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// Options shape a run.
type Options struct {
	Name         string // names the report ("short", "standalone", "cluster", "soak", ...)
	Cluster      bool
	Coordinators int
	Agents       int
	MaxKeys      int
	Load         LoadConfig
	Warmup       time.Duration // steady load before the first fault
	Schedule     []Step        // the faults, one at a time
	Settle       time.Duration // after each fault is undone, before the next
	Abuse        bool          // run the bad-input client after the faults
	// Steady is the soak phase after the faults: steady load, resources sampled every
	// SampleEvery; the growth check compares its quarters.
	Steady      time.Duration
	SampleEvery time.Duration
	// Blips, if not zero, injects a short fault that restarts nothing every Blips during the
	// steady phase (alternately the coordinator path cut for a second and Redis slowed for two),
	// so a soak also covers reconnects.
	Blips     time.Duration
	WrapStore func(coordinator.Store) coordinator.Store // see StackConfig
	Bin       Binaries
	OutDir    string // if set, the report and the processes' logs are written under OutDir/Name
	Seed      uint64
}

// StepResult is one executed fault with what the clients saw while it lasted.
type StepResult struct {
	Name, Expect string
	Outage       bool
	Nodes        []int // the Redis nodes of an outage (nil: every key)
	// Times since the run's zero: Do called, Do returned (the fault holds), Undo called, settled.
	At, From, To, End time.Duration
	Err               string
	// Restored is when Undo returned (processes restarted and ready, proxies passing again);
	// Recovered is the time from then until every agent allowed a check on a fresh key of a
	// fail-closed rule (a new tenant each try, so no key's own backoff delays it).
	Restored, Recovered time.Duration
	Measured            Measured
	Outcome             *OutageResult // for outages
	Stranded            *Strand       // for agents killed with SIGKILL
}

// Measured counts the clients' checks sent during a step (or a phase).
type Measured struct {
	Checks, Allows, Denies, Unavailable, Degraded, Errors int
	P50, P99, Max                                         time.Duration
}

// Strand is what a killed agent held when it died.
type Strand struct {
	Agent       int
	Outstanding float64 // its outstanding-lease gauge just before the kill
	Ledger      float64 // of which the ledger key's leases (debug endpoint)
	Lost        float64 // its tokens_lost_total until then
}

// Report is everything a run measured and found.
type Report struct {
	Name         string
	Cluster      bool
	Coordinators int
	Agents       int
	MaxKeys      int
	Load         LoadConfig
	Started      time.Time
	Duration     time.Duration
	Steps        []StepResult
	Total        Measured
	ByKind       map[string]Measured
	RefusedBy    []Refusals // refusals of checks of several buckets, by the bucket that refused
	EnvoyChecks  int
	StreamChecks int // through the client package
	Check        Result
	Abuse        AbuseResult
	Growth       []Growth
	SteadyFrom   time.Duration
	SteadyTo     time.Duration
	DebtLevels   []DebtLevel        // the lowest Redis level of each bucket that may go into debt
	AgentTotals  map[string]float64 // summed over agent processes alive at the end
	Coordinator  map[string]float64 // summed over coordinators alive at the end
	Violations   []Violation
	Logs         string // where the processes' logs were kept, if anywhere
}

// runner is one run in progress.
type runner struct {
	t                      testing.TB
	o                      Options
	s                      *Stack
	keys                   *Keys
	load                   *Load
	strandable, held, lost float64
	refunds, refundsLost   float64 // charge_refunds_total, charge_refunds_lost_total of every process before it stopped
	lastStrand             *Strand // set by stopAgent for the step that killed an agent
	nodes                  map[string]int
	logf                   func(string, ...any)
}

// Run starts a stack, puts it under load, runs the schedule, the bad input and the steady
// phase, stops everything gracefully and checks what the clients saw against the bounds. It
// fails t only for harness errors (a process that cannot start); broken promises are the
// report's Violations, for the caller to judge.
func Run(t testing.TB, o Options) *Report {
	t.Helper()
	dir, err := os.MkdirTemp("", "chaos") // short: Unix socket paths are limited to 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	keys, err := NewKeys()
	if err != nil {
		t.Fatal(err)
	}
	r := &runner{t: t, o: o, keys: keys, logf: t.Logf, nodes: map[string]int{}}
	rep := &Report{Name: o.Name, Cluster: o.Cluster, Coordinators: o.Coordinators, Agents: o.Agents,
		MaxKeys: o.MaxKeys, Load: o.Load, Started: time.Now()}
	if o.OutDir != "" {
		// After the stack's own cleanups (they stop the processes), before the directory goes.
		rep.Logs = filepath.Join(o.OutDir, o.Name, "logs")
		t.Cleanup(func() { keepLogs(dir, rep.Logs) })
	}
	r.s = NewStack(t, StackConfig{Dir: dir, Bin: o.Bin, Cluster: o.Cluster, Coordinators: o.Coordinators,
		Agents: o.Agents, MaxKeys: o.MaxKeys, WrapStore: o.WrapStore})
	r.load, err = NewLoad(r.s, keys, o.Load, o.Seed)
	if err != nil {
		t.Fatal(err)
	}
	sampler := NewSampler(r.s, o.SampleEvery)
	defer sampler.Stop()
	debts := watchDebt(r.s, r.load.DebtKeys())
	defer debts.Stop()
	r.load.Start()
	defer r.load.Stop()
	r.logf("%s: stack up in %v; warm-up %v", o.Name, r.s.Since().Round(time.Millisecond), o.Warmup)
	time.Sleep(o.Warmup)

	for _, st := range o.Schedule {
		rep.Steps = append(rep.Steps, r.step(st))
	}
	if o.Abuse {
		rep.Abuse = Abuse(r.s, keys, o.Seed)
		r.logf("%s: %d bad inputs sent, %d answered otherwise than documented", o.Name, len(rep.Abuse.Probes), len(rep.Abuse.Violations))
	}
	rep.SteadyFrom = r.s.Since()
	end := time.Now().Add(o.Steady)
	blip := 0
	for time.Until(end) > 0 {
		wait := time.Until(end)
		if o.Blips > 0 {
			wait = min(wait, o.Blips)
		}
		time.Sleep(wait)
		if o.Blips > 0 && time.Until(end) > o.Blips/2 {
			st := CoordinatorProxy(Cut, 0, time.Second)
			if blip%2 == 1 {
				st = RedisProxy(Delay, 40*time.Millisecond, 2*time.Second, nil)
			}
			blip++
			rep.Steps = append(rep.Steps, r.step(st))
		}
	}
	rep.SteadyTo = r.s.Since()
	r.load.Stop()
	sampler.Stop()
	records := r.load.Records()
	var debtViolations []Violation
	rep.DebtLevels, debtViolations = debts.Stop()

	rep.AgentTotals, rep.Coordinator = r.stopAll()
	ledger := r.ledgerFacts()
	res := Check(CheckInput{Keys: keys, Records: records, Outages: outages(rep.Steps), NodeOf: r.nodeOf,
		IdempotencyWindow: agent.DefaultIdempotencyWindow, Ledger: ledger})
	rep.Check = res
	rep.Growth, rep.Violations = CheckGrowth(sampler.Series(), rep.SteadyFrom, rep.SteadyTo, o.MaxKeys)
	rep.Violations = append(rep.Violations, res.Violations...)
	rep.Violations = append(rep.Violations, debtViolations...)
	rep.Violations = append(rep.Violations, rep.Abuse.Violations...)
	next := 0 // res.Outages follows the outage steps in order (outages)
	for i := range rep.Steps {
		st := &rep.Steps[i]
		st.Measured = measure(records, func(rc *Record) bool { return rc.Sent >= st.At && rc.Sent < st.End })
		if st.Err != "" {
			rep.Violations = append(rep.Violations, Violation{Check: "process", Detail: st.Name + ": " + st.Err})
		}
		if st.Outage && st.Err == "" && next < len(res.Outages) {
			st.Outcome = &res.Outages[next]
			next++
		}
	}
	rep.Total = measure(records, func(*Record) bool { return true })
	rep.ByKind = map[string]Measured{}
	for k := range numKinds {
		rep.ByKind[k.String()] = measure(records, func(rc *Record) bool { return rc.Kind == k })
	}
	for i := range records {
		if records[i].Envoy {
			rep.EnvoyChecks++
		}
		if records[i].Stream {
			rep.StreamChecks++
		}
	}
	rep.RefusedBy = refusedBy(keys, records)
	rep.Duration = time.Since(rep.Started)
	if o.OutDir != "" {
		if err := writeReport(filepath.Join(o.OutDir, o.Name), rep); err != nil {
			t.Errorf("write the report: %v", err)
		}
		if err := writeDecisions(filepath.Join(o.OutDir, o.Name), keys, records); err != nil {
			t.Errorf("write the decisions: %v", err)
		}
	}
	return rep
}

// step runs one fault and returns what happened.
func (r *runner) step(st Step) StepResult {
	res := StepResult{Name: st.Name, Expect: st.Expect, Outage: st.Outage, Nodes: st.Nodes}
	r.lastStrand = nil
	if st.Quiesce {
		r.quiesceLedger()
	}
	res.At = r.s.Since()
	if err := st.Do(r); err != nil {
		res.Err = err.Error()
	}
	res.From = r.s.Since()
	time.Sleep(st.Hold)
	res.To = r.s.Since()
	if err := st.Undo(r); err != nil && res.Err == "" {
		res.Err = err.Error()
	}
	res.Restored = r.s.Since()
	if err := r.waitRecovered(); err != nil && res.Err == "" {
		res.Err = err.Error()
	}
	res.Recovered = r.s.Since() - res.Restored
	time.Sleep(r.o.Settle)
	if st.Quiesce {
		for i := range r.s.Agents {
			r.load.ResumeLedger(i)
		}
	}
	res.End = r.s.Since()
	res.Stranded = r.lastStrand
	r.logf("%s: %-60s %v held, done at %v %s", r.o.Name, st.Name, st.Hold, res.End.Round(time.Millisecond), res.Err)
	return res
}

// recoveryTimeout bounds the wait for the system to answer normally again after a fault.
const recoveryTimeout = time.Minute

// waitRecovered waits until every agent allows a check on a fresh key of the fail-closed rule:
// it reaches a coordinator that reaches Redis.
func (r *runner) waitRecovered() error {
	deadline := time.Now().Add(recoveryTimeout)
	for _, a := range r.s.Agents {
		if p := a.Process(); p == nil || !p.Running() {
			continue
		}
		for n := 0; ; n++ {
			ctx, cancel := context.WithTimeout(context.Background(), checkTimeout)
			resp, err := a.Client.Check(ctx, &agentv1.CheckRequest{Tenant: fmt.Sprintf("probe-%d-%d-%d", a.Index, r.s.Since(), n),
				Route: closedPath(n), Operation: "POST"})
			cancel()
			if err == nil && resp.Decision == agentv1.Decision_DECISION_ALLOW {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("agent %d does not allow a fresh key %v after the fault was undone", a.Index, recoveryTimeout)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return nil
}

// quiesceLedger pauses the ledger's checks on every agent and waits until no agent has a
// refill of the ledger key queued or in flight (see Step.Quiesce).
func (r *runner) quiesceLedger() {
	for i := range r.s.Agents {
		r.load.PauseLedger(i)
	}
	for i := range r.s.Agents {
		r.waitLedgerQuiet(i, false)
	}
}

// waitLedgerQuiet waits until agent i has no refill of the ledger key queued or in flight (and,
// withMulti, of the multi rule's ledger buckets): its debug endpoint shows the keys not
// refilling, or refilling only because a prefetched lease waits to be installed (no call is
// sent for it then).
func (r *runner) waitLedgerQuiet(i int, withMulti bool) {
	a := r.s.Agents[i]
	if p := a.Process(); p == nil || !p.Running() {
		return
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if _, busy, err := r.ledgerLeases(a, withMulti); err == nil && !busy {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	r.t.Errorf("chaos: agent %d's ledger keys never settled", i)
}

// ledgerLeases reads agent a's leases of the ledger key (and, withMulti, of the multi rule's
// ledger buckets, its first limit): the tokens they hold, and whether a refill of one is queued
// or in flight.
func (r *runner) ledgerLeases(a *Agent, withMulti bool) (held float64, busy bool, err error) {
	type leased struct{ tenant, rule string }
	bs := []leased{{ledgerTenant(), "ledger"}}
	if withMulti {
		for _, k := range r.load.MultiKeys() {
			bs = append(bs, leased{k.Tenant, k.Rule.Name})
		}
	}
	for _, b := range bs {
		ls, err := debugLeases(a.DebugAddr(), b.tenant)
		if err != nil {
			return 0, false, err
		}
		for _, l := range ls {
			if l.Rule != b.rule {
				continue
			}
			held += l.Tokens + l.NextTokens
			if l.Refilling && l.NextTokens == 0 {
				busy = true
			}
		}
	}
	return held, busy, nil
}

// stopAgent stops agent i after pausing its ledger and multi checks. Before a SIGKILL it reads
// what the agent holds: its outstanding-lease gauge bounds what it strands.
func (r *runner) stopAgent(i int, graceful bool) error {
	r.load.PauseLedger(i)
	r.load.PauseMulti(i)
	r.waitLedgerQuiet(i, true)
	a := r.s.Agents[i]
	m, err := Scrape(a.MetricsAddr())
	if err != nil {
		return fmt.Errorf("scrape agent %d: %w", i, err)
	}
	lost := m["leasebucket_agent_tokens_lost_total"]
	if graceful {
		before := a.ShutdownLost()
		err := r.s.StopAgent(i, true)
		r.lost += lost + a.ShutdownLost() - before
		r.addRefunds(m)
		return err
	}
	var ledger float64
	if held, _, err := r.ledgerLeases(a, true); err == nil {
		ledger = held
	}
	// The gauge again, as close to the kill as the harness can read it (nothing of the ledger
	// keys moves meanwhile: their checks are paused and no refill of them is in flight).
	if m2, err := Scrape(a.MetricsAddr()); err == nil {
		m = m2
	}
	s := Strand{Agent: i, Outstanding: m["leasebucket_agent_outstanding_lease_tokens"], Ledger: ledger,
		Lost: m["leasebucket_agent_tokens_lost_total"]}
	if err := r.s.StopAgent(i, false); err != nil {
		return err
	}
	r.strandable += s.Outstanding
	r.held += s.Ledger
	r.lost += s.Lost
	r.addRefunds(m)
	r.lastStrand = &s
	return nil
}

// addRefunds adds what a process about to stop said of the refunds of checks of several buckets.
func (r *runner) addRefunds(m map[string]float64) {
	r.refunds += m["leasebucket_agent_charge_refunds_total"]
	r.refundsLost += m["leasebucket_agent_charge_refunds_lost_total"]
}

func (r *runner) setRedisProxies(nodes []int, m Mode, d time.Duration) {
	for i, p := range r.s.RedisProxies {
		if nodes == nil || slices.Contains(nodes, i) {
			p.Set(m, d)
		}
	}
}

func (r *runner) setCoordinatorProxies(m Mode, d time.Duration) {
	for _, c := range r.s.Coordinators {
		c.Proxy.Set(m, d)
	}
}

// nodeOf places a key, once per key (the placement does not change: the cluster has no
// replicas to fail over to).
func (r *runner) nodeOf(key string) int {
	if n, ok := r.nodes[key]; ok {
		return n
	}
	n, err := r.s.NodeOf(key)
	if err != nil {
		r.t.Errorf("chaos: %v", err)
		n = -1
	}
	r.nodes[key] = n
	return n
}

// stopAll stops every agent gracefully (each returns its leases), then the coordinators, and
// returns their counters read just before.
func (r *runner) stopAll() (agents, coordinators map[string]float64) {
	agents, coordinators = map[string]float64{}, map[string]float64{}
	for i, a := range r.s.Agents {
		m, err := Scrape(a.MetricsAddr())
		if err != nil {
			r.t.Errorf("chaos: scrape agent %d: %v", i, err)
			continue
		}
		for _, name := range agentTotals {
			agents[name] += sum(m, "leasebucket_agent_"+name)
		}
		r.lost += m["leasebucket_agent_tokens_lost_total"]
		r.addRefunds(m)
		before := a.ShutdownLost()
		if err := r.s.StopAgent(i, true); err != nil {
			r.t.Errorf("chaos: %v\n%s", err, a.Process().Tail())
		}
		r.lost += a.ShutdownLost() - before
	}
	for i, c := range r.s.Coordinators {
		if m, err := Scrape(c.Metrics); err == nil {
			for _, name := range coordinatorTotals {
				coordinators[name] += sum(m, "leasebucket_coordinator_"+name)
			}
		}
		if err := r.s.StopCoordinator(i, true); err != nil {
			r.t.Errorf("chaos: %v", err)
		}
	}
	return agents, coordinators
}

var agentTotals = []string{"decisions_total", "degraded_admissions_total", "lease_grants_total", "lease_granted_tokens_total",
	"lease_returns_total", "lease_returned_tokens_total", "lease_credited_tokens_total", "tokens_lost_total",
	"lease_expiries_total", "evictions_total", "acquire_calls_total", "acquire_resends_total", "wait_fallbacks_total", "refills_dropped_total",
	"idempotent_replays_total", "invalid_checks_total",
	"charge_refunds_total", "charge_refunds_lost_total", "settles_total", "debt_tokens_total", "debt_charged_tokens_total",
	"debt_forgiven_tokens_total", "debt_lost_tokens_total", "settle_credited_tokens_total"}

var coordinatorTotals = []string{"grants_total", "granted_tokens_total", "returns_total", "returned_tokens_total",
	"replays_total", "store_errors_total", "redis_round_trips_total"}

// ledgerFacts reads the ledger keys after every agent stopped — the ledger rule's and the multi
// rule's first limit of each tenant: Redis' levels and what the agents said about their leases.
func (r *runner) ledgerFacts() *LedgerFacts {
	f := &LedgerFacts{Strandable: r.strandable, Held: r.held, Lost: r.lost, Refunds: r.refunds, RefundsLost: r.refundsLost}
	elapsed := bucket.Millis(r.s.Since()/time.Millisecond) + 1
	for _, k := range append([]*Key{r.load.LedgerKey()}, r.load.MultiKeys()...) {
		h, err := r.s.HGetAll(k.Name)
		if err != nil {
			r.t.Errorf("chaos: read the ledger key %s: %v", k.Name, err)
			return nil
		}
		if len(h) == 0 {
			continue // never used (no load of it)
		}
		level, err := strconv.ParseInt(h["t"], 10, 64)
		if err != nil {
			r.t.Errorf("chaos: the ledger key %s's tokens %q: %v", k.Name, h["t"], err)
			return nil
		}
		f.Keys = append(f.Keys, LedgerLevel{Key: k.ID, Capacity: k.Limit.Capacity(), Level: bucket.Micro(level),
			Refill: k.Limit.Refilled(elapsed) + 1})
	}
	if len(f.Keys) == 0 {
		return nil
	}
	return f
}

// outages lists the outage steps.
func outages(steps []StepResult) []Outage {
	var os []Outage
	for _, st := range steps {
		if st.Outage && st.Err == "" {
			os = append(os, Outage{Step: st.Name, From: st.From, To: st.To, Nodes: st.Nodes})
		}
	}
	return os
}

// measure counts the records that match.
func measure(records []Record, match func(*Record) bool) Measured {
	var m Measured
	var lat []time.Duration
	for i := range records {
		rc := &records[i]
		if !match(rc) {
			continue
		}
		m.Checks++
		switch {
		case rc.Outcome == OutAllow && rc.Degraded:
			m.Degraded++
			m.Allows++
		case rc.Outcome == OutAllow:
			m.Allows++
		case rc.Outcome == OutDeny:
			m.Denies++
		case rc.Outcome == OutUnavailable:
			m.Unavailable++
		default:
			m.Errors++
		}
		if rc.Outcome != OutError {
			lat = append(lat, rc.Recv-rc.Sent)
		}
	}
	if len(lat) > 0 {
		slices.Sort(lat)
		m.P50, m.P99, m.Max = lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1]
	}
	return m
}

// keepLogs copies the processes' logs (and the agents' audit logs) to dst.
func keepLogs(src, dst string) {
	files, _ := filepath.Glob(filepath.Join(src, "*.log"))
	if len(files) == 0 || os.MkdirAll(dst, 0o755) != nil {
		return
	}
	for _, f := range files {
		if b, err := os.ReadFile(f); err == nil {
			_ = os.WriteFile(filepath.Join(dst, filepath.Base(f)), b, 0o644)
		}
	}
}
