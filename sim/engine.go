package sim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
)

// Options shape a run without changing what it computes.
type Options struct {
	// Context, if set, stops the run (with its error) once it is done; it is looked at once per
	// simulated second.
	Context context.Context
	// Progress, if set, is called about once per simulated second with the simulated time done
	// and the total (the caller draws a progress bar; the run never reads a wall clock).
	Progress func(done, total time.Duration)
}

// world is one run: the virtual clock, the event queue, the real lease cores, coordinator
// services and stores, and what is measured. Everything runs on the caller's goroutine.
//
// # The engine
//
// Events (network messages, timers, crashes) sit in a heap ordered by (time, class, seq); the
// virtual clock is the time of the event being processed. Arrivals are not events: each agent
// draws its arrivals from its streams in batches. A batch of agent A at time P checks, in time
// order, the arrivals in [P, h) where h is the earliest of the next tick boundary, the next second
// and the next event scheduled for A (an answer, a timer). That is exact, not an approximation:
// whatever another agent, a coordinator or a store does at time ≥ P reaches A only through a
// network message, at least one one-way delay later (the lookahead), and the tick is at most
// that delay; A's own events bound h. Stores act only in event order, at the virtual time of the
// event. The only reordering is between agents within one tick, which no agent can observe; the
// oracle and the admission check see those checks in agent order (refilling nothing for a time
// that runs backwards, which makes the checks stricter, never laxer).
type world struct {
	sc   *Scenario
	set  *policy.Set
	opts Options

	now int64 // ns: the virtual clock
	// checkAt is the time of the check an agent is deciding (a batch's arrivals are checked at
	// their own times, at or after now): the agents' exact clock (agent.Config.Exact).
	checkAt int64
	end     int64
	tick    int64
	seq     uint64
	heap    []event

	regions []*region
	stores  []*store
	nodes   []*node
	reqs    []request
	rules   []*policy.Rule // the rules requests resolve to
	groups  []*Group       // by rule × region
	idents  []identity
	keys    []*key
	keyIdx  map[string]*key
	byRef   map[refKey]*key
	net     *rand.Rand

	// The batch being run: own events scheduled for these nodes shorten it.
	horizon    int64
	batchNodes [2]*node

	res       Result
	timeline  []Second
	incs      []*incarnation // every agent process, in order of birth
	violSeen  map[string]bool
	nextTick  int64 // next progress report
	warm      bool  // the warm-up is over (key operations were noted)
	fatal     error
	overgrant float64
}

// region is one region's coordinator tier (a Service: replicas are stateless, so one instance
// answers for all of them; Coordinators only divides the load).
type region struct {
	idx          int
	name         string
	svc          *coordinator.Service
	coordinators int
	calls        int64
}

// request is one kind of check: a tenant of an identity group, resolved through the policy.
type request struct {
	query agent.Query
	ident int32
	rule  int32   // index in world.rules
	keys  []int32 // by region: the bucket key the agent's lease is of (-1: no slice there)
	cost  int64   // tokens
	micro int64   // µ
	// settle: the check is an estimate, its actual cost settled after the response.
	settle *SettledCost
}

type evKind uint8

const (
	evBatch evKind = iota
	evSweep
	evLinger
	evDeadline
	evServe
	evDeliver
	evCrash
	evRestart
	evSettle
)

// event is one entry of the queue. own events change the state of node's agent: they end the
// node's current batch of arrivals.
type event struct {
	at   int64
	seq  uint64
	kind evKind
	own  bool
	node *node
	inc  *incarnation
	call *call
	job  *settleJob
}

// before orders events by time; at the same time arrival batches come last (an answer applied at
// t serves the arrivals at t), then by scheduling order.
func (a *event) before(b *event) bool {
	if a.at != b.at {
		return a.at < b.at
	}
	if ab, bb := a.kind == evBatch, b.kind == evBatch; ab != bb {
		return bb
	}
	return a.seq < b.seq
}

func (w *world) schedule(e event) {
	if e.at < w.now {
		panic(fmt.Sprintf("sim: event at %d scheduled in the past (now %d)", e.at, w.now))
	}
	w.seq++
	e.seq = w.seq
	if e.own {
		e.node.own = append(e.node.own, e.at)
		for _, n := range w.batchNodes {
			if n == e.node {
				w.horizon = min(w.horizon, e.at)
			}
		}
	}
	h := append(w.heap, e)
	i := len(h) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !h[i].before(&h[p]) {
			break
		}
		h[i], h[p] = h[p], h[i]
		i = p
	}
	w.heap = h
}

func (w *world) pop() event {
	h := w.heap
	top := h[0]
	last := len(h) - 1
	h[0] = h[last]
	h[last] = event{}
	h = h[:last]
	i := 0
	for {
		l := 2*i + 1
		if l >= len(h) {
			break
		}
		m := l
		if r := l + 1; r < len(h) && h[r].before(&h[l]) {
			m = r
		}
		if !h[m].before(&h[i]) {
			break
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
	w.heap = h
	return top
}

// runScenario simulates sc once. The error is for a scenario the core rejects (a malformed check); a
// broken bound is not an error but a Violation in the Result.
func runScenario(sc *Scenario, opts Options) (*Result, error) {
	w, err := newWorld(sc, opts)
	if err != nil {
		return nil, err
	}
	w.run()
	if w.fatal != nil {
		return nil, w.fatal
	}
	return w.finish(), nil
}

func (w *world) run() {
	for len(w.heap) > 0 && w.fatal == nil {
		e := w.pop()
		w.now = e.at
		if e.own {
			e.node.dropOwn(e.at)
		}
		switch e.kind {
		case evBatch:
			w.batch(e.node)
		case evSweep:
			w.sweep(e.inc)
		case evLinger:
			w.linger(e.inc)
		case evDeadline:
			w.deadline(e.inc)
		case evServe:
			w.serve(e.call)
		case evDeliver:
			w.deliver(e.call)
		case evCrash:
			w.crash(e.node, e.inc)
		case evRestart:
			w.restart(e.node)
		case evSettle:
			w.settle(e.job)
		}
		if !w.warm && w.now >= int64(w.sc.Warmup) {
			w.warm = true
			for _, k := range w.keys {
				k.opsWarm = k.ops
			}
		}
		if w.now >= w.nextTick {
			w.nextTick = w.now + int64(time.Second)
			if ctx := w.opts.Context; ctx != nil && ctx.Err() != nil {
				w.fatal = fmt.Errorf("sim: %s: %w", w.sc.Name, ctx.Err())
			}
			if w.opts.Progress != nil && w.now <= w.end {
				w.opts.Progress(time.Duration(w.now), time.Duration(w.end))
			}
		}
	}
	if w.opts.Progress != nil && w.fatal == nil {
		w.opts.Progress(time.Duration(w.end), time.Duration(w.end))
	}
}

// second is the timeline entry of t (answers after the end count in the last second).
func (w *world) second(t int64) *Second {
	return &w.timeline[min(t/int64(time.Second), int64(len(w.timeline)-1))]
}

// violate records a broken bound: every one is counted, the first of each kind and key kept.
func (w *world) violate(kind, key string, at int64, format string, args ...any) {
	w.res.ViolationCount++
	id := kind + "\x00" + key
	if w.violSeen[id] {
		return
	}
	w.violSeen[id] = true
	w.res.Violations = append(w.res.Violations, Violation{
		Kind: kind, Key: key, At: time.Duration(at), Detail: fmt.Sprintf(format, args...),
	})
}

func (w *world) finish() *Result {
	r := &w.res
	for _, n := range w.nodes {
		if n.inc != nil {
			held := w.autopsy(n.inc, w.now, false)
			r.Loss.HeldAtEnd += held
		}
	}
	for _, k := range w.keys {
		w.matchFalseDenies(k)
	}
	for _, inc := range w.incs {
		r.Loss.Granted += inc.granted
		r.Loss.Spent += inc.spent
		if !inc.dead {
			continue
		}
		stranded := inc.granted - inc.spent - inc.returned - inc.expired
		outstanding := inc.held + inc.granted - inc.applied
		r.Loss.Stranded += stranded
		r.Loss.Outstanding += outstanding
		r.Crashes = append(r.Crashes, Crash{
			Agent: inc.node.idx, ID: inc.id, At: time.Duration(inc.diedAt),
			Outstanding: outstanding, Stranded: stranded,
		})
		if stranded > outstanding {
			w.violate("loss", inc.id, inc.diedAt,
				"agent %s stranded %s tokens, more than the %s it held and had in flight when it died",
				inc.id, tokens(stranded), tokens(outstanding))
		}
	}
	for i := range w.idents {
		id := &w.idents[i]
		ir := IdentityResult{Name: id.name, Tenant: id.tenant, Rule: id.rule}
		for g := range id.counts {
			ir.Counts.add(&id.counts[g])
			w.groups[int(id.rule32)*len(w.regions)+g].Counts.add(&id.counts[g])
		}
		r.Totals.add(&ir.Counts)
		r.Identities = append(r.Identities, ir)
	}
	for _, k := range w.keys {
		num, den := k.limit.Rate()
		c := float64(k.limit.Capacity())
		r.Keys = append(r.Keys, KeyBound{
			Key: k.name, CapacityMicro: int64(k.limit.Capacity()), RatePerSecond: float64(num) / float64(den) * 1000,
			TTL: k.ttl, Lag: k.lag, Spent: k.spent, Granted: k.granted, Returned: k.returned, Grants: k.grants, Ops: k.ops,
			AdmitExcess: k.admitted.max, AdmitBound: k.admitBound,
			BudgetExcess: k.budget.max, BudgetBound: k.budgetBound,
			PeakBurstShare: k.admitted.max / c,
			Settled:        k.settled, MaxDebt: k.maxDebt, Debited: k.debited, Charged: k.chargedTotal, ChargedExcess: k.charged.max, DebtBound: k.debtBound,
			Lowest: k.lowest,
		})
		if k.ops > r.Backend.HotKeyOps {
			r.Backend.HotKey, r.Backend.HotKeyOps = k.name, k.ops
		}
	}
	for _, s := range w.stores {
		if s.keys > 0 || s.ops > 0 {
			r.Backend.Stores = append(r.Backend.Stores, StoreLoad{Name: s.name, Ops: s.ops, Keys: s.keys})
		}
	}
	for _, g := range w.regions {
		r.Backend.Regions = append(r.Backend.Regions, RegionLoad{Name: g.name, Calls: g.calls, Coordinators: g.coordinators})
	}
	st := &r.Steady
	st.From = w.sc.Warmup.D()
	from := int(int64(w.sc.Warmup) / int64(time.Second))
	for _, s := range w.timeline[from:] {
		st.Requests += s.Requests
		st.Calls += s.CoordinatorCalls
		st.StoreOps += s.StoreOps
	}
	st.Seconds = (w.sc.Duration.D() - time.Duration(from)*time.Second).Seconds()
	for _, k := range w.keys {
		if ops := k.ops - k.opsWarm; ops > st.HotKeyOps {
			st.HotKey, st.HotKeyOps = k.name, ops
		}
	}
	r.RuleOps = map[string]int64{}
	for _, inc := range w.incs {
		inc.lim.Stats().StoreOps(func(rule string, acquires, returns uint64) {
			r.RuleOps[rule] += int64(acquires + returns)
		})
	}
	w.finishSettled()
	r.Latency.finish()
	for _, g := range w.groups {
		if g.Counts.Requests > 0 {
			g.WaitP50, g.WaitP99 = g.hist.quantile(0.5, 0), g.hist.quantile(0.99, 0)
			r.Groups = append(r.Groups, g)
		}
	}
	r.Timeline = w.timeline
	slices.SortStableFunc(r.Violations, func(a, b Violation) int { return int(a.At - b.At) })
	return r
}

// tokens formats µ as tokens.
func tokens(micro int64) string {
	return fmt.Sprintf("%.6g", float64(micro)/float64(bucket.PerToken))
}
