package sim

import (
	"math/bits"
	"time"
)

// Counts are the decisions of a run, of one identity or of one second. Tokens are whole tokens
// weighted by cost; the other fields count requests.
type Counts struct {
	Requests       int64 // checks that arrived (and reached an agent, or found none alive)
	DemandTokens   int64 // tokens the requests asked for
	AllowedTokens  int64 // tokens admitted from leases (the global quota)
	IdealTokens    int64 // tokens the ideal limiter admitted
	Allowed        int64 // requests admitted from leases
	Denied         int64 // 429 from leases or the deny cache
	FalseDenied    int64 // of Denied: tokens of the key sat unused and were wasted meanwhile (falsedeny.go)
	HeldElsewhere  int64 // of Denied: tokens of the key sat in its bucket or another agent's lease
	Unavailable    int64 // 503: a fail-closed rule without its global state
	Degraded       int64 // admitted by an emergency bucket
	DegradedDenied int64 // 429 from an empty emergency bucket
	Shadow         int64 // admitted although a shadow rule would have denied
	Unanswered     int64 // lost with a crashed agent, or no agent alive
	Waited         int64 // answered after waiting for a refill (or the max wait)
}

func (c *Counts) add(o *Counts) {
	c.Requests += o.Requests
	c.DemandTokens += o.DemandTokens
	c.AllowedTokens += o.AllowedTokens
	c.IdealTokens += o.IdealTokens
	c.Allowed += o.Allowed
	c.Denied += o.Denied
	c.FalseDenied += o.FalseDenied
	c.HeldElsewhere += o.HeldElsewhere
	c.Unavailable += o.Unavailable
	c.Degraded += o.Degraded
	c.DegradedDenied += o.DegradedDenied
	c.Shadow += o.Shadow
	c.Unanswered += o.Unanswered
	c.Waited += o.Waited
}

// Second is one second of a run: its decisions and the load it put on coordinators and stores.
type Second struct {
	Counts
	CoordinatorCalls int64 // Acquire and Return calls that reached a coordinator
	StoreOps         int64 // Take and Return items that reached a store
	// Costs settled after the response (settle.go), µ: actual costs settled, debt the stores
	// debited and forgave, and the deepest level a store answered as a share of its key's
	// max_debt (1: at -max_debt).
	SettledActual int64
	DebtCharged   int64
	DebtForgiven  int64
	DebtDepth     float64
}

// Loss accounts for every µ the buckets granted (docs/simulator.md, "Where the tokens went").
// Granted = Spent + Returned + Expired + Stranded + HeldAtEnd; Returned = Credited + Decayed + Lost.
type Loss struct {
	Granted   int64 // µ granted to agents
	Spent     int64 // µ admitted from leases
	Returned  int64 // µ sent back in Returns
	Credited  int64 // µ the buckets credited back
	Decayed   int64 // µ returned but not credited: refill the bucket had while they were out, or its cap
	Lost      int64 // µ of Returns that failed (outages): out of the bucket until it refills
	Expired   int64 // µ of expired leases not returned: the refill since their grant covers them
	Stranded  int64 // µ in leases of crashed agents: never spent, never returned
	HeldAtEnd int64 // µ live agents held when the run ended
	// Outstanding is what the crashed agents held when they died, by their lease core's own
	// account, plus the grants of their calls in flight. Loss bound: Stranded ≤ Outstanding.
	Outstanding int64
}

// Crash is one agent death.
type Crash struct {
	Agent       int
	ID          string // the agent id that died
	At          time.Duration
	Outstanding int64 // µ: held at death + grants of calls in flight
	Stranded    int64 // µ: granted to it, never spent nor returned
}

// Backend is what the run asked of coordinators and stores.
type Backend struct {
	AcquireCalls int64
	AcquireItems int64
	ReturnCalls  int64
	ReturnItems  int64
	FailedCalls  int64 // calls that failed as a whole (outage, timeout, store down)
	// StaleBacks are hand-backs the store answered STALE: a newer operation of their agent on the
	// key got there first, so nothing was credited, and the agent hands them back again.
	StaleBacks int64
	StoreOps   int64 // items that reached a store: one Redis script call each
	Stores     []StoreLoad
	Regions    []RegionLoad
	HotKey     string // the key with the most store operations
	HotKeyOps  int64
}

// Steady is the load after the scenario's warm-up: what a fleet in steady state asks of
// coordinators and stores (the capacity plan scales it).
type Steady struct {
	From      time.Duration
	Seconds   float64
	Requests  int64
	Calls     int64
	StoreOps  int64
	HotKey    string
	HotKeyOps int64
}

// StoreLoad is one store's operations.
type StoreLoad struct {
	Name string
	Ops  int64
	Keys int
}

// RegionLoad is one region's coordinator calls and replicas.
type RegionLoad struct {
	Name         string
	Calls        int64
	Coordinators int
}

// KeyBound is the admission and budget check of one bucket key.
type KeyBound struct {
	Key           string
	CapacityMicro int64
	RatePerSecond float64       // µ per second
	TTL           time.Duration // the lease lifetime τ; 0 for a rule with lease: off
	// Lag is the longest a spend may come after its take, which the admission bound allows for: τ,
	// or with lease: off the longest a check waits (agent.max_wait).
	Lag            time.Duration
	Spent          int64   // µ
	Granted        int64   // µ
	Returned       int64   // µ sent back
	Grants         int64   // leases granted
	Ops            int64   // store operations
	AdmitExcess    float64 // µ: the largest admitted amount in a window minus r·w
	AdmitBound     float64 // µ: C + r·(Lag + 1 ms)
	BudgetExcess   float64 // µ: the largest net grant in a window minus r·w
	BudgetBound    float64 // µ: C + r·1 ms + max_debt
	PeakBurstShare float64 // AdmitExcess / C: 1 is what an exact bucket can reach
	// Costs settled after the response: the rule's max_debt, µ debited as debt, the largest
	// charge (spent + debited) in a window minus r·w against C + r·(τ + 1 ms) + max_debt, and the
	// lowest level the store answered (µ, ≤ 0).
	Settled       bool // settled traffic uses the key
	MaxDebt       int64
	Debited       int64
	Charged       int64 // µ spent from leases (net of estimates given back) plus debited
	ChargedExcess float64
	DebtBound     float64
	Lowest        int64
}

// Violation is a bound that broke: the run fails.
type Violation struct {
	Kind   string // admission, budget, debt, loss, conservation, policy
	Key    string
	At     time.Duration
	Detail string
}

// histogram counts durations in buckets of 1/128 of an octave; a quantile is its bucket's
// middle (relative error under 0.4%).
type histogram struct {
	counts [64 << subBits]int64
	n      int64
}

const subBits = 7

func histIndex(v int64) int {
	if v < 1<<subBits {
		return int(max(v, 0))
	}
	e := bits.Len64(uint64(v)) - subBits // v >> (e-1) has subBits+1 bits
	return e<<subBits + int(v>>(e-1))&(1<<subBits-1)
}

// histMiddle is the middle of bucket i.
func histMiddle(i int) int64 {
	if i < 1<<subBits {
		return int64(i)
	}
	e, m := i>>subBits, int64(i&(1<<subBits-1))
	lo := (1<<subBits + m) << (e - 1)
	return lo + (int64(1)<<(e-1))/2
}

func (h *histogram) add(v int64) {
	h.counts[histIndex(v)]++
	h.n++
}

// quantile is the middle of the bucket holding quantile q, counting zeros extra zero values.
func (h *histogram) quantile(q float64, zeros int64) time.Duration {
	total := h.n + zeros
	if total == 0 {
		return 0
	}
	rank := int64(q*float64(total-1)) + 1
	if rank <= zeros {
		return 0
	}
	rank -= zeros
	var seen int64
	for i, c := range h.counts {
		if seen += c; seen >= rank {
			return time.Duration(histMiddle(i))
		}
	}
	return 0
}

// Latency is the modelled check latency: a check answered from a lease (or a cached denial, a
// failure mode) is local and takes no modelled time; a check that waited is answered when its
// refill's answer is applied, or at the agent's max wait.
type Latency struct {
	Local     int64 // checks answered at once
	Waited    int64
	AllP50    time.Duration
	AllP99    time.Duration
	AllP999   time.Duration
	WaitP50   time.Duration
	WaitP99   time.Duration
	WaitP999  time.Duration
	WaitMax   time.Duration
	FellBack  int64 // waits that ended at the max wait (Limiter.Fallback)
	waitHist  histogram
	maxWaited int64
}

func (l *Latency) finish() {
	h := &l.waitHist
	l.AllP50, l.AllP99, l.AllP999 = h.quantile(0.5, l.Local), h.quantile(0.99, l.Local), h.quantile(0.999, l.Local)
	l.WaitP50, l.WaitP99, l.WaitP999 = h.quantile(0.5, 0), h.quantile(0.99, 0), h.quantile(0.999, 0)
	l.WaitMax = time.Duration(l.maxWaited)
}

// Result is everything one run measured. Runs with the same scenario and seed give identical
// Results.
type Result struct {
	Scenario    string
	Description string
	Question    string
	Seed        uint64
	Duration    time.Duration
	Agents      int
	Param       string  // the swept parameter, if this run is a sweep point
	Value       float64 // its value

	Totals     Counts
	Identities []IdentityResult
	Keys       []KeyBound
	Loss       Loss
	Crashes    []Crash
	Backend    Backend
	Steady     Steady
	Groups     []*Group // by rule, then region; those with requests
	Latency    Latency
	Timeline   []Second
	Violations []Violation
	Dropped    int64 // requests lost with a down agent under crashes.traffic: drop
	// ViolationCount counts every violation; Violations keeps the first of each kind and key.
	ViolationCount int64
	// Checks is the number of Limiter.Check calls (re-checks of waiting requests included).
	Checks int64
	// Settled is what costs settled after the response did (zero without such traffic).
	Settled Settled
	// RuleOps are the store operations the agents' calls asked for, by rule name (the agent's
	// Stats.StoreOps, its leasebucket_agent_store_operations_total): calls that failed count too.
	RuleOps map[string]int64
}

// Group is the decisions on one rule's keys of the checks that arrived in one region, and how
// long those that waited waited.
type Group struct {
	Rule    string
	Region  string
	Scope   string
	Counts  Counts
	WaitP50 time.Duration
	WaitP99 time.Duration
	hist    histogram
}

// IdentityResult is one identity's decisions.
type IdentityResult struct {
	Name   string
	Tenant string
	Rule   string
	Counts
}

// Utilisation is admitted tokens over what the ideal limiter admitted.
func (r *Result) Utilisation() float64 { return ratio(r.Totals.AllowedTokens, r.Totals.IdealTokens) }

// Underuse is the share of the ideal admissions the agents did not admit (negative: they
// admitted more, within the admission bound).
func (r *Result) Underuse() float64 {
	return ratio(r.Totals.IdealTokens-r.Totals.AllowedTokens, r.Totals.IdealTokens)
}

// FalseDenyShare is the share of requests denied while tokens of their key sat unused and were
// wasted.
func (r *Result) FalseDenyShare() float64 { return ratio(r.Totals.FalseDenied, r.Totals.Requests) }

// StrandedPerCrash is the mean µ stranded by one crash.
func (r *Result) StrandedPerCrash() float64 { return ratio(r.Loss.Stranded, int64(len(r.Crashes))) }

// PerSecond converts a count over the run into a rate.
func (r *Result) PerSecond(n int64) float64 { return float64(n) / r.Duration.Seconds() }

// CallsPerCheck is coordinator calls per check request.
func (r *Result) CallsPerCheck() float64 {
	return ratio(r.Backend.AcquireCalls+r.Backend.ReturnCalls, r.Totals.Requests)
}

// StoreOpsPerCheck is store (Redis) operations per check request.
func (r *Result) StoreOpsPerCheck() float64 { return ratio(r.Backend.StoreOps, r.Totals.Requests) }

// ChecksByRule is the check requests by the name of the rule their identity resolves to: what
// RuleOps counts per check.
func (r *Result) ChecksByRule() map[string]int64 {
	checks := map[string]int64{}
	for _, id := range r.Identities {
		checks[id.Rule] += id.Requests
	}
	return checks
}

// PeakBurstShare is the largest window excess over a key's burst (1 = what an exact bucket reaches).
func (r *Result) PeakBurstShare() float64 {
	m := 0.0
	for _, k := range r.Keys {
		m = max(m, k.PeakBurstShare)
	}
	return m
}

// Failed reports whether a bound broke.
func (r *Result) Failed() bool { return r.ViolationCount > 0 }

func ratio(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}
