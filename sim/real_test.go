package sim

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// The real counterpart of a scenario: the simulator's lease cores, but each agent with the
// Refresher the agent process runs (its senders, sweep and call timeout), one coordinator Service
// in process on Redis (a redis-server of the test's own, the bucket script), Go's scheduler and
// the wall clock instead of the event queue, and the scenario's own arrivals (the simulator's
// streams, drawn with its seed: the same checks at the same offsets). Fifty agent processes on
// two cores would measure the machine's scheduler; fifty lease cores in one process measure the
// limiter. What is measured is what the simulator reports: utilisation against an exact limiter
// per identity over the same arrivals, store operations per check, and the admission bound of
// every key from outside. An agent that crashes (at the simulator's own crash times) is cut off
// from the coordinator and stopped without handing anything back, as a process killed would be;
// its successor, a new core with a new id, starts when the simulator's would, and meanwhile its
// traffic goes to the next live agent.

// realRun is a scenario without faults other than crashes (one region, no outages, partitions or
// settled costs) run on real parts for duration, the figures after warmup read apart.
type realRun struct {
	sc       *Scenario
	duration time.Duration
	warmup   time.Duration // store operations per check (and waste) are counted after it
	maxWait  time.Duration // how long a check waits for its refill before its failure mode (the scenario's max_wait)
	// patience, if set, is how long the load waits for a check's refill instead of maxWait, and
	// the agents' call timeout (testRun's; the simulator's scenario keeps maxWait).
	patience time.Duration
	// wrap, if set, stands between the agents and the coordinator (a broken one, in a test).
	wrap func(agent.Coordinator) agent.Coordinator
}

// realResult is what a real run measured.
type realResult struct {
	requests, denied, unavailable, waited int64
	// lost: checks that went down with a crashed agent (waiting, or made on it as it died);
	// the oracle counts them, as the simulator's does its unanswered checks.
	lost                       int64
	allowedTokens, idealTokens int64
	crashes                    int
	stranded                   float64 // µ the crashed agents' cores held when they died
	steadyOps, steadyChecks    int64   // after the warm-up
	// On a scenario of one key without crashes, after the warm-up: µ admitted, µ the bucket
	// refilled, and µ held (in the agents' leases and in the bucket) when it ended and when the
	// load stopped.
	oneKey                                         bool
	tau                                            time.Duration // its lease lifetime
	steadyAllowed, steadyRefill, heldWarm, heldEnd float64
	// worstKey is the key whose admissions came closest to their bound: the largest excess, over
	// any window w, of the tokens admitted over r·w (µ), and the simulator's bound for the key,
	// C + r·(lag + 1 ms), plus r·realSlack.
	worstKey                string
	admitExcess, admitBound float64
	elapsed                 time.Duration
}

func (r realResult) utilisation() float64 { return ratio(r.allowedTokens, r.idealTokens) }

// waste is the share of the bucket's refill after the warm-up that nobody admitted and nobody
// holds: tokens that expired in idle leases or were refilled into a full bucket. What was held
// when the warm-up ended, plus the refill since, is what was admitted since, what is held at
// the end, and the waste. Each check refused while tokens were wasted (a false deny) stands
// for at least its cost of that waste. Only on a scenario of one key, overloaded: the full
// buckets of a long tail discard their refill by design.
func (r realResult) waste() float64 {
	return (r.heldWarm + r.steadyRefill - r.steadyAllowed - r.heldEnd) / r.steadyRefill
}

func (r realResult) opsPerCheck() float64 { return ratio(r.steadyOps, r.steadyChecks) }

// realSlack is how far a check's recorded time may be from the moment its tokens were spent,
// beyond the millisecond the simulator's bound allows for its store clock: the load reads the
// agents' millisecond clock before each check, and a check that waited is spent when its refill
// is applied, before the load sees it.
const realSlack = 5 * time.Millisecond

// newRealRun checks that sc has no faults but crashes at a rate, their traffic redirected, and
// returns its real run.
func newRealRun(sc *Scenario, d, warmup time.Duration) (realRun, error) {
	c := sc.Crashes
	if len(sc.Regions) > 1 || len(c.Schedule) > 0 || c.RatePerAgentHour > 0 && c.Traffic != "redirect" ||
		len(sc.Outages) > 0 || len(sc.Partitions) > 0 || sc.Faults.OvergrantFactor != 0 {
		return realRun{}, fmt.Errorf("sim: %s: a real run takes one region and no faults but crashes at a rate, their traffic redirected", sc.Name)
	}
	for _, t := range sc.Traffic {
		if t.Cost != nil {
			return realRun{}, fmt.Errorf("sim: %s: a real run does not settle costs", sc.Name)
		}
	}
	return realRun{sc: sc, duration: d, warmup: warmup, maxWait: sc.Agent.MaxWait.D()}, nil
}

// scenario is rr's scenario as the simulator runs it for the comparison: rr's duration,
// warm-up and wait for a refill (which is also the lag of a rule with lease: off), no sweep.
func (rr realRun) scenario() *Scenario {
	c := *rr.sc
	c.Duration, c.Warmup, c.Sweep = Duration(rr.duration), Duration(rr.warmup), nil
	c.Agent.MaxWait = Duration(rr.maxWait)
	return &c
}

// realArrival is one arrival of the scenario: its offset from the start and its request.
type realArrival struct {
	at  clock.Nanos
	req int32
}

// arrivals draws each agent's arrivals as the simulator's batches do, without running it.
func arrivals(w *world) [][]realArrival {
	out := make([][]realArrival, len(w.nodes))
	for i, n := range w.nodes {
		for len(n.streams) > 0 {
			t, r, ok := n.nextArrival(w.end)
			if !ok {
				break
			}
			out[i] = append(out[i], realArrival{at: clock.Nanos(t), req: r})
		}
	}
	return out
}

// agentChange is a crash of node's agent at the offset at, or the start of its successor.
type agentChange struct {
	at    clock.Nanos
	node  int
	crash bool
}

// crashPlan is the crashes and restarts the simulator runs for w, in time order (crashes at a
// rate; newRealRun takes no schedule): each node's first crash as its start scheduled it, its
// successor restart_after later unless that is past the end, and the next crash drawn from the
// node's own stream at each restart, as world.start draws it.
func crashPlan(w *world) []agentChange {
	rate := w.sc.Crashes.RatePerAgentHour
	if rate <= 0 {
		return nil
	}
	after := int64(w.sc.Crashes.RestartAfter)
	var plan []agentChange
	for _, e := range w.heap {
		if e.kind != evCrash {
			continue
		}
		for at := e.at; ; {
			plan = append(plan, agentChange{clock.Nanos(at), e.node.idx, true})
			restart := at + after
			if restart >= w.end {
				break
			}
			plan = append(plan, agentChange{clock.Nanos(restart), e.node.idx, false})
			next := float64(restart) + e.node.crashes.ExpFloat64()/rate*float64(time.Hour)
			if next >= float64(w.end) {
				break
			}
			at = int64(next)
		}
	}
	slices.SortStableFunc(plan, func(a, b agentChange) int { return cmp.Compare(a.at, b.at) })
	return plan
}

// realAgent is one agent process of a real run: its lease core, the Refresher the process runs,
// and whether it died (crashed: cut off from the coordinator).
type realAgent struct {
	lim  *agent.Limiter
	ref  *agent.Refresher
	dead atomic.Bool
}

// errCrashed is what a crashed agent's calls get: a dead process sends nothing.
var errCrashed = errors.New("sim: the agent crashed")

// cutOff is an agent's link to the coordinator, which sends nothing once the agent is dead. A
// call already sent still reaches the store; its answer goes to the dead core.
type cutOff struct {
	agent.Coordinator
	dead *atomic.Bool
}

func (c cutOff) Acquire(ctx context.Context, req *coordinatorv1.AcquireRequest) (*coordinatorv1.AcquireResponse, error) {
	if c.dead.Load() {
		return nil, errCrashed
	}
	return c.Coordinator.Acquire(ctx, req)
}

func (c cutOff) Return(ctx context.Context, req *coordinatorv1.ReturnRequest) (*coordinatorv1.ReturnResponse, error) {
	if c.dead.Load() {
		return nil, errCrashed
	}
	return c.Coordinator.Return(ctx, req)
}

// countingCoordinator counts the items that reach the service: each is one store operation. Its
// gate stops calls before the service while a reading of what the agents and the bucket hold
// (held, in run) has it closed.
type countingCoordinator struct {
	svc     *coordinator.Service
	ops     atomic.Int64
	gate    sync.RWMutex
	stopped atomic.Int64 // calls waiting at the gate
}

// pass lets a call through the gate, waiting while it is closed, and returns what the call
// does once it has left the service.
func (c *countingCoordinator) pass() (left func()) {
	c.stopped.Add(1)
	c.gate.RLock()
	c.stopped.Add(-1)
	return c.gate.RUnlock
}

func (c *countingCoordinator) Acquire(ctx context.Context, req *coordinatorv1.AcquireRequest) (*coordinatorv1.AcquireResponse, error) {
	defer c.pass()()
	c.ops.Add(int64(len(req.Items) + len(req.Returns)))
	return c.svc.Acquire(ctx, req)
}

func (c *countingCoordinator) Return(ctx context.Context, req *coordinatorv1.ReturnRequest) (*coordinatorv1.ReturnResponse, error) {
	defer c.pass()()
	c.ops.Add(int64(len(req.Items)))
	return c.svc.Return(ctx, req)
}

// realCheck is one check as the load saw it: when it was made, when it was answered, its
// request and the answer.
type realCheck struct {
	at, done clock.Nanos
	req      int32
	outcome  agent.Outcome
	lost     bool // the agent crashed before it answered
}

// run runs rr and measures it. The store operations counted are those of the checks: the
// leases handed back when the agents stop come after.
func (rr realRun) run(tb testing.TB) realResult {
	tb.Helper()
	w, err := newWorld(rr.scenario(), Options{})
	if err != nil {
		tb.Fatal(err)
	}
	arr := arrivals(w)

	srv := redistest.Start(tb)
	store := redisstore.New(srv.Client(tb))
	if err := store.Load(context.Background()); err != nil { // as the coordinator does at start
		tb.Fatal(err)
	}
	cc := &countingCoordinator{svc: coordinator.NewService(store, w.set)}
	clk := clock.NewCoarse(time.Millisecond) // the agent process's clock
	defer clk.Close()
	plan := crashPlan(w)
	var (
		born    = make([]int, len(w.nodes))                       // agent processes each node started
		cur     = make([]atomic.Pointer[realAgent], len(w.nodes)) // each node's live one (nil: down)
		stopped sync.WaitGroup                                    // the crashed agents' Refreshers stopping
	)
	startAgent := func(i int) {
		born[i]++
		a := &realAgent{lim: agent.New(agent.Config{AgentID: fmt.Sprintf("real-%d.%d", i, born[i]), Region: w.nodes[i].region.name,
			Guard: clock.Guard, Exact: clk.Fresh}, w.set)} // as cmd/agent
		var c agent.Coordinator = cc
		if rr.wrap != nil {
			c = rr.wrap(c)
		}
		a.ref = agent.NewRefresher(agent.RefresherConfig{Coordinator: cutOff{c, &a.dead}, Clock: clk, CallTimeout: rr.patience})
		a.ref.Start(a.lim)
		cur[i].Store(a)
	}
	for i := range w.nodes {
		startAgent(i)
	}
	// target is the agent that serves node i's traffic: its own, or while it is down the next
	// live one (crashes.traffic: redirect, the simulator's world.target), or none.
	target := func(i int) *realAgent {
		for k := range len(w.nodes) {
			if a := cur[(i+k)%len(w.nodes)].Load(); a != nil {
				return a
			}
		}
		return nil
	}
	done := false
	stop := func() {
		if done {
			return
		}
		done = true
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		for i := range cur {
			if a := cur[i].Load(); a != nil {
				_ = a.ref.Stop(ctx)
			}
		}
		stopped.Wait()
	}
	defer stop()

	res := realResult{oneKey: len(w.keys) == 1 && len(plan) == 0, tau: w.keys[0].ttl}
	// What the agents and the bucket hold, µ, on a scenario of one key, the moment it was read
	// and the store operations counted by then. A grant on its way from the bucket to an agent,
	// or a hand-back on its way back, is in neither, and on a busy machine a few hundred tokens
	// can be (a call per agent of 50, each of a lease): so the reading closes the gate and waits
	// until every call in flight has either been applied or waits at the gate, its hand-backs in
	// Returning and nothing taken yet.
	held := func() (float64, clock.Nanos, int64) {
		cc.gate.Lock()
		defer cc.gate.Unlock()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Microsecond) {
			var flying int64
			for i := range cur {
				flying += int64(cur[i].Load().ref.InFlight())
			}
			if flying == cc.stopped.Load() {
				break
			}
			if time.Now().After(deadline) {
				tb.Errorf("%d calls in flight, %d of them at the gate, after 5 s", flying, cc.stopped.Load())
				break
			}
		}
		at, ops := clk.Fresh(), cc.ops.Load()
		var n bucket.Micro
		for i := range cur {
			a := cur[i].Load()
			n += a.lim.Outstanding() + bucket.Micro(a.ref.Returning())
		}
		k := w.keys[0]
		snap, err := store.Inspect(context.Background(), k.name, k.limit)
		if err != nil {
			tb.Error(err)
		}
		level := bucket.Full(k.limit, snap.Now)
		if snap.Stored {
			level = snap.State
			level.Refill(k.limit, snap.Now)
		}
		return float64(n + level.Tokens), at, ops
	}

	// A few load goroutines, each the arrivals of a share of the agents, woken every
	// millisecond: a goroutine per agent would spend the machine on timers.
	const loaders, pace = 10, time.Millisecond
	start := clk.Fresh()
	end := start + clock.Of(rr.duration)
	var (
		mu      sync.Mutex
		checks  []realCheck
		waits   sync.WaitGroup
		load    sync.WaitGroup
		warmOps int64
		warmAt  clock.Nanos
		waited  atomic.Int64
	)
	load.Add(1)
	go func() {
		defer load.Done()
		time.Sleep((start + clock.Of(rr.warmup) - clk.Fresh()).Duration())
		if res.oneKey {
			res.heldWarm, warmAt, warmOps = held()
		} else {
			warmAt, warmOps = clk.Fresh(), cc.ops.Load()
		}
	}()
	// The crashes and restarts, at their offsets. A crash cuts the agent off first, then reads
	// what its core holds (stranded: nobody spends or hands it back) and stops its Refresher at
	// once, as the process's end would.
	load.Add(1)
	go func() {
		defer load.Done()
		for _, c := range plan {
			time.Sleep((start + c.at - clk.Fresh()).Duration())
			if !c.crash {
				startAgent(c.node)
				continue
			}
			a := cur[c.node].Swap(nil)
			a.dead.Store(true)
			res.crashes++
			res.stranded += float64(a.lim.Outstanding())
			stopped.Add(1)
			go func() {
				defer stopped.Done()
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				_ = a.ref.Stop(ctx)
			}()
		}
	}()
	record := func(cs []realCheck) {
		mu.Lock()
		checks = append(checks, cs...)
		mu.Unlock()
	}
	wait := func(a *realAgent, t *agent.Ticket, at clock.Nanos, req int32) {
		defer waits.Done()
		l := a.lim
		timer := time.NewTimer(cmp.Or(rr.patience, rr.maxWait))
		defer timer.Stop()
		var v agent.Verdict
		select {
		case <-t.Ready():
			v = t.Verdict()
		case <-timer.C:
		}
		if v.Outcome == 0 || v.Outcome == agent.Wait {
			v = l.Fallback(clk.Now(), t)
		}
		record([]realCheck{{at: at, done: clk.Now(), req: req, outcome: v.Outcome, lost: a.dead.Load()}})
	}
	for lw := range min(loaders, len(w.nodes)) {
		load.Add(1)
		go func() {
			defer load.Done()
			var mine []int
			for i := lw; i < len(w.nodes); i += loaders {
				mine = append(mine, i)
			}
			next := make([]int, len(mine)) // each agent's next arrival
			var cs []realCheck
			for {
				now := clk.Now()
				if now >= end {
					break
				}
				for j, i := range mine {
					for ; next[j] < len(arr[i]) && start+arr[i][next[j]].at <= now; next[j]++ {
						req := arr[i][next[j]].req
						a := target(i)
						var (
							v   agent.Verdict
							err error
						)
						if a != nil {
							v, err = a.lim.Check(now, w.reqs[req].query)
						}
						if a == nil || a.dead.Load() { // no agent alive, or it died meanwhile: closed, or its answer never left
							cs = append(cs, realCheck{at: now, done: now, req: req, lost: true})
							continue
						}
						if err != nil {
							tb.Error(err)
							return
						}
						if v.Outcome != agent.Wait {
							cs = append(cs, realCheck{at: now, done: now, req: req, outcome: v.Outcome})
							continue
						}
						waited.Add(1)
						waits.Add(1)
						go wait(a, v.Ticket, now, req)
					}
				}
				time.Sleep(pace)
			}
			record(cs)
		}()
	}
	load.Wait()
	waits.Wait()
	var endAt clock.Nanos
	if res.oneKey {
		res.heldEnd, endAt, _ = held()
	} else {
		endAt = clk.Fresh()
	}
	res.steadyOps, res.waited, res.elapsed = cc.ops.Load()-warmOps, waited.Load(), (endAt - start).Duration()
	stop()
	tally(&res, w, checks, start, warmAt, endAt)
	return res
}

// tally reads the checks: each identity's exact limiter over the same arrivals, the outcomes,
// each key's admissions against its bound, and what was admitted after the warm-up.
func tally(res *realResult, w *world, checks []realCheck, start, warmAt, endAt clock.Nanos) {
	ms := func(t clock.Nanos) bucket.Millis { return bucket.Millis(t / clock.Nanos(time.Millisecond)) }
	slices.SortFunc(checks, func(a, b realCheck) int { return cmp.Compare(a.at, b.at) })
	ideal := make([]bucket.State, len(w.idents))
	for i := range ideal {
		ideal[i] = bucket.Full(w.idents[i].limit, ms(start))
	}
	type spend struct {
		at    clock.Nanos
		micro float64
	}
	allows := map[int32][]spend{} // by key
	for _, c := range checks {
		rq := &w.reqs[c.req]
		res.requests++
		if c.at >= warmAt {
			res.steadyChecks++
		}
		m := bucket.Micro(rq.micro)
		if ideal[rq.ident].Take(w.idents[rq.ident].limit, ms(c.at), m, m).Granted > 0 {
			res.idealTokens += rq.cost
		}
		switch {
		case c.lost:
			res.lost++
		case c.outcome == agent.Allow:
			res.allowedTokens += rq.cost
			allows[rq.keys[0]] = append(allows[rq.keys[0]], spend{c.done, float64(rq.micro)})
			if c.done >= warmAt {
				res.steadyAllowed += float64(rq.micro)
			}
		case c.outcome == agent.Deny:
			res.denied++
		default:
			res.unavailable++
		}
	}
	// The admission bound from outside: over every window, what a key admitted less what its
	// bucket refilled meanwhile stays within the simulator's bound for the key (lag: τ, or the
	// longest wait of a rule with lease: off) and the load's slack.
	for ki, ss := range allows {
		k := w.keys[ki]
		slices.SortFunc(ss, func(a, b spend) int { return cmp.Compare(a.at, b.at) })
		var u drawup
		excess := 0.0
		for _, s := range ss {
			excess = max(excess, u.add(int64(s.at), s.micro, k.rate))
		}
		bound := k.admitBound + k.rate*float64(realSlack)
		if res.worstKey == "" || excess/bound > res.admitExcess/res.admitBound {
			res.worstKey, res.admitExcess, res.admitBound = k.name, excess, bound
		}
	}
	if res.oneKey {
		res.steadyRefill = w.keys[0].rate * float64(endAt-warmAt)
	}
}

// simRun runs rr's scenario in the simulator, for as long and with the same warm-up.
func (rr realRun) simRun(tb testing.TB) *Result {
	tb.Helper()
	res, err := runScenario(rr.scenario(), Options{})
	if err != nil {
		tb.Fatal(err)
	}
	if res.Failed() {
		tb.Fatal(res.Violations)
	}
	return res
}

// testRun is sc's real run for the test suite, for its duration: where the tokens go is the
// question, not how fast, so under the race detector on a busy machine, where a refill can take
// longer than the agent's 50 ms, the simulator's checks wait as long as an agent's call may take
// by default, and the real ones up to testPatience, each call as long: a machine whose hypervisor
// takes half its CPU has held a refill past 500 ms. A refill that never comes still shows as an
// unavailable answer.
func testRun(t *testing.T, sc *Scenario, warmup time.Duration) realRun {
	t.Helper()
	rr, err := newRealRun(sc, sc.Duration.D(), warmup)
	if err != nil {
		t.Fatal(err)
	}
	rr.maxWait, rr.patience = agent.DefaultCallTimeout, testPatience
	return rr
}

// testPatience is how long a real check of the test suite waits for its refill.
const testPatience = 2 * time.Second

// realTest runs testRun and fails on what no real run may show: admissions beyond a key's bound
// from outside, an unavailable answer, a load that fell behind.
func realTest(t *testing.T, sc *Scenario, warmup time.Duration) realResult {
	t.Helper()
	rr := testRun(t, sc, warmup)
	res := rr.run(t)
	t.Logf("%d agents, %d checks in %v, %.2f%% denied, utilisation %.2f%%, %.2f store operations per 1,000 checks after %v, admission excess %.0f of %.0f µ (%s)",
		sc.numAgents(), res.requests, res.elapsed, 100*ratio(res.denied, res.requests), 100*res.utilisation(),
		1000*res.opsPerCheck(), rr.warmup, res.admitExcess, res.admitBound, res.worstKey)
	if res.admitExcess > res.admitBound {
		t.Errorf("%s admitted %.0f µ over r·w in a window, above C + r·(τ + 1 ms + %v) = %.0f", res.worstKey, res.admitExcess, realSlack, res.admitBound)
	}
	if res.unavailable != 0 {
		t.Errorf("%d checks unavailable, want none", res.unavailable)
	}
	var offered float64
	for _, tr := range sc.Traffic {
		offered += float64(tr.Rate) * sc.Duration.D().Seconds()
	}
	if float64(res.requests) < offered/2 {
		t.Fatalf("only %d checks of about %.0f offered: the load fell behind", res.requests, offered)
	}
	return res
}

// manyAgentsSmall is the shipped many-agents scenario at a tenth of its rates: 50 agents on one
// key at twice its rate, light enough for the test suite's race detector on a busy machine.
const manyAgentsSmall = `
name: many-agents-small
seed: 13
duration: 3s
agents: 50
policy: |
  version: "many-agents-small"
  rules:
    - name: api
      routes: ["/api/{resource}/*"]
      operations: [read]
      limit: 2000/s
      burst: 2000
  default:
    limit: 60/minute
    burst: 10
identities:
  - name: bigcorp
    tenants: [bigcorp]
    path: /api/orders/1
    operation: GET
traffic:
  - identities: bigcorp
    rate: 4000/s
`

// TestManyAgentsReal runs 50 agents on one key at twice its rate (manyAgentsSmall) on real parts
// for three seconds: the admission bound holds from outside, nothing is unavailable, each agent
// refills about once a lease lifetime, and nothing is wasted: what the agents and the bucket
// held when the warm-up ended, plus the refill since, was admitted or is still held. A run this
// short ends with part of the stock not yet spent, which is why the test does not read
// utilisation itself: the target figure (99 % over ten seconds at the shipped rates) is
// BenchmarkReal's.
func TestManyAgentsReal(t *testing.T) {
	sc := parse(t, manyAgentsSmall)
	res := realTest(t, sc, time.Second)
	w := res.waste()
	t.Logf("%.2f%% of the refill after the warm-up wasted", 100*w)
	if w > 0.02 || w < -0.02 {
		t.Errorf("%.2f%% of the refill after the warm-up wasted, want at most 2 %% (and no more admitted than refilled; the readings are good to about half a per cent)", 100*w)
	}
	// About one take per agent and lease lifetime (docs/leases.md): twice that at most.
	tau := res.tau.Seconds()
	if ops, most := res.opsPerCheck(), 2*float64(sc.numAgents())/tau/float64(sc.Traffic[0].Rate); ops > most {
		t.Errorf("%.4f store operations per check after the warm-up, want at most %.4f (two per agent and lifetime)", ops, most)
	}
}

// overgranting tells agents they got twice what the store debited: the broken grant rule the
// admission check must catch.
type overgranting struct{ agent.Coordinator }

func (o overgranting) Acquire(ctx context.Context, req *coordinatorv1.AcquireRequest) (*coordinatorv1.AcquireResponse, error) {
	resp, err := o.Coordinator.Acquire(ctx, req)
	for _, r := range resp.GetResults() {
		r.GrantedMicro *= 2
	}
	return resp, err
}

// TestRealOvergrantCaught: with grants doubled between the coordinator and the agents, the
// real run of manyAgentsSmall admits beyond C + r·(w + τ), and the check from outside says so.
func TestRealOvergrantCaught(t *testing.T) {
	rr := testRun(t, parse(t, manyAgentsSmall), time.Second)
	rr.wrap = func(c agent.Coordinator) agent.Coordinator { return overgranting{c} }
	res := rr.run(t)
	t.Logf("admission excess %.0f of %.0f µ", res.admitExcess, res.admitBound)
	if res.admitExcess <= res.admitBound {
		t.Fatalf("grants doubled, yet admissions stayed within the bound (excess %.0f of %.0f µ)", res.admitExcess, res.admitBound)
	}
}

// TestLongTailReal runs the shipped long-tail scenario (the card's policy, 500 tenants Zipf-skewed
// over 20 agents, the busiest over their quota, the tail a few checks a minute) on real parts
// for five seconds: every key's admissions within its bound from outside, nothing unavailable,
// and leases cost at most a store operation per check on a tail spread thin over many agents.
func TestLongTailReal(t *testing.T) {
	sc := loadExample(t, "long-tail")
	sc.Duration = Duration(5 * time.Second)
	res := realTest(t, sc, 2*time.Second)
	if ops := res.opsPerCheck(); ops > 1 {
		t.Errorf("%.3f store operations per check after the warm-up: more than without leases", ops)
	}
}

// thinKeysSmall is the shipped thin-keys scenario at a tenth of its tenants and twice its
// overload: 10 tenants of 100 a second, each sending 200 a second over 20 agents (2.5 requests per
// agent and lease lifetime: thin on every agent, every bucket short), light enough for the race
// detector.
const thinKeysSmall = `
name: thin-keys-small
seed: 17
duration: 6s
agents: 20
policy: |
  version: "thin-keys-small"
  rules:
    - name: api
      routes: ["/api/{resource}/*"]
      operations: [read]
      limit: 100/second
      burst: 100
  default:
    limit: 60/minute
    burst: 10
identities:
  - name: tenants
    tenants: 10
    prefix: tenant-
    path: /api/orders/1
    operation: GET
traffic:
  - identities: tenants
    rate: 2000/s
`

// TestThinKeysReal runs tenants twice over their quota, thin on each of 20 agents, on real parts
// (the store's share of the rule runs in Redis' script): every key's admissions stay within their
// bound from outside, nothing is unavailable, the agents admit at least 95 % of what an exact
// limiter admits over the same arrivals (96.6 % in its runs, the simulator 96.8 %: a run this
// short stops with refill still in leases and buckets; leases of such keys lapsing partly unspent
// held them to 92.2 % before thin agents took per check on a contended bucket), and the simulator
// on the same arrivals agrees within 2 points.
func TestThinKeysReal(t *testing.T) {
	sc := parse(t, thinKeysSmall)
	res := realTest(t, sc, time.Second)
	simulated := testRun(t, sc, time.Second).simRun(t)
	t.Logf("utilisation %.2f%% (simulator %.2f%%)", 100*res.utilisation(), 100*simulated.Utilisation())
	if u := res.utilisation(); u < 0.95 {
		t.Errorf("the agents admitted %.2f%% of what an exact limiter admits, want at least 95 %%", 100*u)
	}
	if d := res.utilisation() - simulated.Utilisation(); d > 0.02 || d < -0.02 {
		t.Errorf("utilisation %.2f%% on real parts, %.2f%% in the simulator: want within 2 points", 100*res.utilisation(), 100*simulated.Utilisation())
	}
}

// TestCrashLossReal runs the shipped crash-loss scenario (20 agents, 20 services Zipf-skewed at
// 90 % of their quota, leases of 5 s) on real parts for eight seconds at 135 crashes per agent and
// hour, each agent back after 2 s: the crashes the simulator draws for its seed, five. Every
// key's admissions stay within their bound from outside, crashes and new agent ids included; a crashed agent's traffic is served by the next live one (nothing unavailable, at
// most 1 % lost with the dying agents); and the real run agrees with the simulator's on the same
// arrivals and crashes: what a crashed agent's core held when it died within half of the
// simulator's figure either way, utilisation within 3 points. (By utilisation a run this short
// barely tells stranded leases from handed-back ones: with the crashed agents handing theirs back
// it read 98.37 %, against 98.15–98.55 % with them stranded.)
func TestCrashLossReal(t *testing.T) {
	sc := loadExample(t, "crash-loss")
	sc.Duration = Duration(8 * time.Second)
	sc.Crashes.RatePerAgentHour, sc.Crashes.RestartAfter = 135, Duration(2*time.Second)
	res := realTest(t, sc, 2*time.Second)
	simulated := testRun(t, sc, 2*time.Second).simRun(t)
	t.Logf("%d crashes (simulator %d) stranding %.0f tokens each (simulator %.0f), %d checks lost; utilisation %.2f%% (simulator %.2f%%)",
		res.crashes, len(simulated.Crashes), res.stranded/float64(max(1, res.crashes))/float64(bucket.PerToken),
		simulated.StrandedPerCrash()/float64(bucket.PerToken), res.lost, 100*res.utilisation(), 100*simulated.Utilisation())
	if res.crashes == 0 || res.crashes != len(simulated.Crashes) {
		t.Fatalf("%d crashes on real parts, %d in the simulator: the plan must be the simulator's, and crash", res.crashes, len(simulated.Crashes))
	}
	if r := res.stranded / float64(res.crashes) / simulated.StrandedPerCrash(); r < 2.0/3 || r > 1.5 {
		t.Errorf("a crash stranded %.0f tokens on real parts, %.0f in the simulator: want within half either way",
			res.stranded/float64(res.crashes)/float64(bucket.PerToken), simulated.StrandedPerCrash()/float64(bucket.PerToken))
	}
	if lost := ratio(res.lost, res.requests); lost > 0.01 {
		t.Errorf("%.2f%% of the checks lost with crashed agents, want at most 1 %%: their traffic goes to the next live agent", 100*lost)
	}
	if d := res.utilisation() - simulated.Utilisation(); d > 0.03 || d < -0.03 {
		t.Errorf("utilisation %.2f%% on real parts, %.2f%% in the simulator: want within 3 points", 100*res.utilisation(), 100*simulated.Utilisation())
	}
}

func loadExample(tb testing.TB, name string) *Scenario {
	tb.Helper()
	sc, err := Load("../examples/sim/" + name + ".yaml")
	if err != nil {
		tb.Fatal(err)
	}
	return sc
}

// BenchmarkReal runs shipped scenarios on real parts and in the simulator, in the same run,
// and reports both and their ratios (docs/simulator.md, *Against the real stack*):
// many-agents for ten seconds, two of them warm-up; long-tail for thirty, ten of warm-up (its
// tenants' leases live 3 s); hot-key for thirty-five, five of warm-up, its two bursts included;
// crash-loss for sixty, ten of warm-up, at the top of its sweep's crash rates (60 per agent and
// hour: about twenty crashes in the minute, each stranding leases that live 5 s).
func BenchmarkReal(b *testing.B) {
	for _, c := range []struct {
		name      string
		d, warmup time.Duration
		crashRate float64 // per agent and hour; 0: the scenario's
	}{
		{"many-agents", 10 * time.Second, 2 * time.Second, 0},
		{"long-tail", 30 * time.Second, 10 * time.Second, 0},
		{"hot-key", 35 * time.Second, 5 * time.Second, 0},
		{"crash-loss", 60 * time.Second, 10 * time.Second, 60},
		{"thin-keys", 30 * time.Second, 5 * time.Second, 0},
	} {
		b.Run(c.name, func(b *testing.B) {
			sc := loadExample(b, c.name)
			if c.crashRate > 0 {
				sc.Crashes.RatePerAgentHour = c.crashRate
			}
			rr, err := newRealRun(sc, c.d, c.warmup)
			if err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				real := rr.run(b)
				simulated := rr.simRun(b)
				if real.admitExcess > real.admitBound || real.unavailable != 0 {
					b.Fatalf("admission excess %.0f of %.0f µ (%s), %d unavailable", real.admitExcess, real.admitBound, real.worstKey, real.unavailable)
				}
				simOps := ratio(simulated.Steady.StoreOps, simulated.Steady.Requests)
				b.ReportMetric(100*real.utilisation(), "real-util-%")
				b.ReportMetric(100*simulated.Utilisation(), "sim-util-%")
				b.ReportMetric(1000*real.opsPerCheck(), "real-ops/1k")
				b.ReportMetric(1000*simOps, "sim-ops/1k")
				b.ReportMetric(real.opsPerCheck()/simOps, "real/sim-ops")
				b.ReportMetric(100*ratio(real.denied, real.requests), "real-denied-%")
				b.ReportMetric(100*ratio(simulated.Totals.Denied, simulated.Totals.Requests), "sim-denied-%")
				b.ReportMetric(100*simulated.FalseDenyShare(), "sim-false-deny-%")
				b.ReportMetric(100*ratio(real.waited, real.requests), "real-waited-%")
				if real.oneKey {
					b.ReportMetric(100*real.waste(), "real-waste-%")
				}
				if real.crashes > 0 || len(simulated.Crashes) > 0 {
					b.ReportMetric(float64(real.crashes), "real-crashes")
					b.ReportMetric(float64(len(simulated.Crashes)), "sim-crashes")
					b.ReportMetric(real.stranded/float64(max(1, real.crashes))/float64(bucket.PerToken), "real-stranded/crash")
					b.ReportMetric(simulated.StrandedPerCrash()/float64(bucket.PerToken), "sim-stranded/crash")
					b.ReportMetric(100*ratio(real.lost, real.requests), "real-lost-%")
					b.ReportMetric(100*ratio(simulated.Totals.Unanswered, simulated.Totals.Requests), "sim-lost-%")
				}
			}
		})
	}
}
