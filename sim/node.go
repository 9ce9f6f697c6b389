package sim

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
)

// node is one agent host: its traffic streams and the agent process running on it (nil while it
// is down after a crash).
type node struct {
	idx     int
	region  *region
	streams []*stream
	rng     *rand.Rand // arrivals
	crashes *rand.Rand // crash times: a crash-rate sweep keeps the traffic identical
	settles *rand.Rand // actual costs and response times of settled checks
	inc     *incarnation
	born    int     // agent processes started on this node
	own     []int64 // times of the pending events that change this node's agent
	batched bool    // an arrival batch is scheduled
}

// ownMin is the earliest pending own event, or never.
func (n *node) ownMin() int64 {
	m := int64(never)
	for _, t := range n.own {
		m = min(m, t)
	}
	return m
}

func (n *node) dropOwn(t int64) {
	if i := slices.Index(n.own, t); i >= 0 {
		n.own[i] = n.own[len(n.own)-1]
		n.own = n.own[:len(n.own)-1]
	}
}

// nextArrival draws n's next arrival if it comes before horizon: its time and request.
func (n *node) nextArrival(horizon int64) (t int64, req int32, ok bool) {
	s := n.nextStream()
	if t = s.next(); t >= horizon {
		return 0, 0, false
	}
	req = s.pick.pick(n.rng)
	s.advance(n.rng)
	return t, req, true
}

// nextStream is the stream with the earliest arrival.
func (n *node) nextStream() *stream {
	best := n.streams[0]
	for _, s := range n.streams[1:] {
		if s.pos < best.pos {
			best = s
		}
	}
	return best
}

// incarnation is one agent process: a real agent.Limiter and the shell around it (the calls in
// flight, the checks waiting for a refill, the expiry sweep), plus the ledger the loss checks
// read.
type incarnation struct {
	node     *node
	id       string
	lim      *agent.Limiter
	dead     bool
	diedAt   int64
	inFlight int
	released uint64 // the core's Stats.Released when its waiters were last looked at
	// Checks waiting for a refill: by key (a refill's answer wakes the waiters of its keys) and
	// in deadline order (fifo[head:], answered ones skipped), recycled through free.
	byKey    map[int32][]*waiter
	fifo     []*waiter
	head     int
	free     []*waiter
	deadline int64 // the pending deadline event, 0 if none
	lingerAt int64 // the pending linger event, 0 if none

	// Ledger, µ. Conservation: applied = spent + returned + expired + held, for every process at
	// its death or at the end; a dead process stranded granted − spent − returned − expired.
	granted  int64 // granted to it by coordinators (answers it may never have seen)
	applied  int64 // granted in answers it applied
	spent    int64 // admitted from its leases
	returned int64 // handed back in calls
	expired  int64 // given up without a return (the refill since the grant covers it)
	held     int64 // what its lease core held when it died or the run ended
}

// waiter is a check that got Wait: its ticket is decided when its refill's answer is applied
// (or it is told to check again), else Limiter.Fallback answers it at its deadline (the agent
// server's max wait).
type waiter struct {
	req      int32
	key      int32
	at       int64
	deadline int64
	ticket   *agent.Ticket
	done     bool
}

func (w *world) start(n *node) {
	n.born++
	inc := &incarnation{node: n, id: fmt.Sprintf("%s/agent-%d.%d", n.region.name, n.idx, n.born), byKey: map[int32][]*waiter{}}
	// The guard is cmd/agent's: its leases end clock.Guard before τ for its coarse clock's lag, and
	// a check in that last stretch reads the exact clock (Config.Exact) and is served if the lease
	// is still within its lifetime. The virtual clock does not lag: its exact reading is the
	// check's own time.
	inc.lim = agent.New(agent.Config{AgentID: inc.id, Region: n.region.name, RecordForfeits: true, Guard: clock.Guard,
		Exact: func() clock.Nanos { return clock.Nanos(w.checkAt) }}, w.set)
	n.inc = inc
	w.incs = append(w.incs, inc)
	if t := w.now + int64(w.sc.Agent.SweepEvery); t < w.end {
		w.schedule(event{at: t, kind: evSweep, own: true, node: n, inc: inc})
	}
	if rate := w.sc.Crashes.RatePerAgentHour; rate > 0 {
		gap := n.crashes.ExpFloat64() / rate * float64(time.Hour)
		if t := float64(w.now) + gap; t < float64(w.end) {
			w.schedule(event{at: int64(t), kind: evCrash, own: true, node: n, inc: inc})
		}
	}
}

// target is the agent that serves n's traffic now: its own, or while it is down the next live
// agent of its region (crashes.traffic: redirect), or none.
func (w *world) target(n *node) *incarnation {
	if n.inc != nil || w.sc.Crashes.Traffic == "drop" {
		return n.inc
	}
	for i := 1; i < len(w.nodes); i++ {
		m := w.nodes[(n.idx+i)%len(w.nodes)]
		if m.region == n.region && m.inc != nil {
			return m.inc
		}
	}
	return nil
}

func (w *world) scheduleBatch(n *node) {
	if n.batched || len(n.streams) == 0 {
		return
	}
	if t := n.nextStream().next(); t < w.end {
		n.batched = true
		w.schedule(event{at: t, kind: evBatch, node: n})
	}
}

// batch checks n's arrivals from now up to the earliest of the next tick, the next second, the
// end and the next event of the agents involved (see world).
func (w *world) batch(n *node) {
	n.batched = false
	inc := w.target(n)
	h := min((w.now/w.tick+1)*w.tick, (w.now/int64(time.Second)+1)*int64(time.Second), w.end, n.ownMin())
	w.batchNodes = [2]*node{n, nil}
	if inc != nil && inc.node != n {
		h = min(h, inc.node.ownMin())
		w.batchNodes[1] = inc.node
	}
	w.horizon = h
	sec := w.second(w.now)
	for w.fatal == nil {
		t, r, ok := n.nextArrival(w.horizon)
		if !ok {
			break
		}
		w.arrive(n, inc, r, t, sec)
	}
	w.batchNodes = [2]*node{}
	w.horizon = never
	w.scheduleBatch(n)
}

// counts are the tallies a decision on rq in region g at t goes to: its identity's in that
// region (rules and regions are summed from them at the end) and the second's.
func (w *world) counts(rq *request, g int, sec *Second) [2]*Counts {
	return [2]*Counts{&w.idents[rq.ident].counts[g], &sec.Counts}
}

func (w *world) group(rq *request, g int) *Group { return w.groups[int(rq.rule)*len(w.regions)+g] }

// arrive is one request at t on node n (served by inc, nil if none): the ideal limiter sees it,
// the agent checks it.
func (w *world) arrive(n *node, inc *incarnation, ri int32, t int64, sec *Second) {
	rq := &w.reqs[ri]
	if inc == nil && w.sc.Crashes.Traffic == "drop" {
		w.res.Dropped++
		return
	}
	ideal := w.idents[rq.ident].admit(bucket.Millis(t/int64(time.Millisecond)), bucket.Micro(rq.micro))
	for _, c := range w.counts(rq, n.region.idx, sec) {
		c.Requests++
		c.DemandTokens += rq.cost
		if ideal {
			c.IdealTokens += rq.cost
		}
		if inc == nil {
			c.Unanswered++
		}
	}
	if inc == nil {
		return
	}
	w.check(inc, ri, t, t, nil)
	w.pumpIfDue(inc)
}

// pumpIfDue pumps when the agent's core signalled that a call may be due (Limiter.Wake).
func (w *world) pumpIfDue(inc *incarnation) {
	select {
	case <-inc.lim.Wake():
		w.pump(inc)
	default:
	}
}

// check asks the agent about request ri (arrived at arrival) at t. A Wait makes it a waiter;
// wt is the waiter being checked again, nil for a new check.
func (w *world) check(inc *incarnation, ri int32, t, arrival int64, wt *waiter) {
	rq := &w.reqs[ri]
	w.checkAt = t
	v, err := inc.lim.Check(clock.Nanos(t), rq.query)
	w.res.Checks++
	if err != nil {
		w.fatal = fmt.Errorf("sim: %s: check %+v: %w", w.sc.Name, rq.query, err)
		return
	}
	w.released(inc) // an insert may have evicted a key others wait for
	if v.Outcome != agent.Wait {
		if wt != nil {
			wt.done = true
		}
		w.decided(inc, rq, v, t, arrival)
		return
	}
	if wt != nil {
		wt.ticket = v.Ticket
		return
	}
	if n := len(inc.free); n > 0 {
		wt, inc.free = inc.free[n-1], inc.free[:n-1]
	} else {
		wt = &waiter{}
	}
	*wt = waiter{req: ri, key: rq.keys[inc.node.region.idx], at: arrival, deadline: arrival + int64(w.sc.Agent.MaxWait), ticket: v.Ticket}
	inc.byKey[wt.key] = append(inc.byKey[wt.key], wt)
	inc.fifo = append(inc.fifo, wt)
	if inc.deadline == 0 {
		inc.deadline = wt.deadline
		w.schedule(event{at: wt.deadline, kind: evDeadline, own: true, node: inc.node, inc: inc})
	}
}

// decided records a verdict on request rq, which arrived at arrival and was answered at t.
func (w *world) decided(inc *incarnation, rq *request, v agent.Verdict, t, arrival int64) {
	g := inc.node.region.idx
	cs := w.counts(rq, g, w.second(t))
	k := w.keys[rq.keys[g]]
	switch {
	case v.Outcome == agent.Allow && v.Degraded:
		for _, c := range cs {
			c.Degraded++
		}
	case v.Outcome == agent.Allow && v.ShadowDeny:
		for _, c := range cs {
			c.Shadow++
		}
	case v.Outcome == agent.Allow:
		for _, c := range cs {
			c.Allowed++
			c.AllowedTokens += rq.cost
		}
		inc.spent += rq.micro
		k.spent += rq.micro
		k.leased -= rq.micro
		w.spend(k, t, float64(rq.micro))
		if rq.settle != nil {
			w.settleLater(inc, rq, k, v, t)
		}
	case v.Outcome == agent.Deny && v.Degraded:
		for _, c := range cs {
			c.DegradedDenied++
		}
	case v.Outcome == agent.Deny:
		ms := bucket.Millis(t / int64(time.Millisecond))
		held := k.available(ms, rq.micro)
		for _, c := range cs {
			c.Denied++
			if held {
				c.HeldElsewhere++
			}
		}
		k.denied(t, rq, g, k.bucketFull(ms))
	case v.Outcome == agent.Unavailable:
		for _, c := range cs {
			c.Unavailable++
		}
	}
	l := &w.res.Latency
	if t == arrival {
		l.Local++
		return
	}
	for _, c := range cs {
		c.Waited++
	}
	l.Waited++
	l.waitHist.add(t - arrival)
	w.group(rq, g).hist.add(t - arrival)
	l.maxWaited = max(l.maxWaited, t-arrival)
}

// wakeKey answers the waiters of key k whose tickets are decided (checking again those told to).
func (w *world) wakeKey(inc *incarnation, k int32) {
	list := inc.byKey[k]
	if len(list) == 0 {
		return
	}
	kept := list[:0]
	for _, wt := range list {
		if w.fatal == nil {
			select {
			case <-wt.ticket.Ready():
				w.settled(inc, wt)
			default:
			}
		}
		if !wt.done {
			kept = append(kept, wt)
		}
	}
	clear(list[len(kept):])
	if len(kept) == 0 {
		delete(inc.byKey, k)
	} else {
		inc.byKey[k] = kept
	}
}

// settled answers a waiter whose ticket is decided, or checks it again if the ticket says so.
func (w *world) settled(inc *incarnation, wt *waiter) {
	v := wt.ticket.Verdict()
	if v.Outcome == agent.Wait {
		w.check(inc, wt.req, w.now, wt.at, wt)
		return
	}
	wt.done = true
	w.decided(inc, &w.reqs[wt.req], v, w.now, wt.at)
}

// released looks at every waiter when the core told some to check again (Stats.Released moved):
// their key was retired (evicted) while they waited.
func (w *world) released(inc *incarnation) {
	r := inc.lim.Stats().Released.Load()
	if r == inc.released {
		return
	}
	inc.released = r
	keys := make([]int32, 0, len(inc.byKey))
	for k := range inc.byKey {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		w.wakeKey(inc, k)
	}
}

// unwait removes an answered waiter from its key's list.
func (inc *incarnation) unwait(wt *waiter) {
	list := inc.byKey[wt.key]
	if i := slices.Index(list, wt); i >= 0 {
		list = slices.Delete(list, i, i+1)
	}
	if len(list) == 0 {
		delete(inc.byKey, wt.key)
	} else {
		inc.byKey[wt.key] = list
	}
}

// deadline answers the waiters whose max wait is over by the rule's failure mode.
func (w *world) deadline(inc *incarnation) {
	inc.deadline = 0
	if inc.dead {
		return
	}
	for inc.head < len(inc.fifo) && w.fatal == nil {
		wt := inc.fifo[inc.head]
		if !wt.done && wt.deadline > w.now {
			break
		}
		if !wt.done {
			rq := &w.reqs[wt.req]
			v := inc.lim.Fallback(clock.Nanos(w.now), wt.ticket)
			w.res.Checks++
			w.res.Latency.FellBack++
			w.decided(inc, rq, v, w.now, wt.at)
			wt.done = true
			inc.unwait(wt)
		}
		inc.fifo[inc.head] = nil
		inc.head++
		inc.free = append(inc.free, wt)
	}
	if inc.head > len(inc.fifo)/2 {
		n := copy(inc.fifo, inc.fifo[inc.head:])
		clear(inc.fifo[n:])
		inc.fifo, inc.head = inc.fifo[:n], 0
	}
	if inc.head < len(inc.fifo) {
		inc.deadline = inc.fifo[inc.head].deadline
		w.schedule(event{at: inc.deadline, kind: evDeadline, own: true, node: inc.node, inc: inc})
	}
	w.pumpIfDue(inc)
}

// sweep retires the expired leases of the whole table (Limiter.ExpireAll) every sweep_every and
// sends the calls that are due. The production Refresher sweeps 4 of the
// 64 shards every 25 ms; keys land in shards by a hash with a random seed, so a partial sweep
// would make runs differ.
func (w *world) sweep(inc *incarnation) {
	if inc.dead {
		return
	}
	inc.lim.ExpireAll(clock.Nanos(w.now))
	w.forfeits(inc)
	w.pump(inc)
	if t := w.now + int64(w.sc.Agent.SweepEvery); t < w.end {
		w.schedule(event{at: t, kind: evSweep, own: true, node: inc.node, inc: inc})
	}
}

// linger pumps inc once the leases waiting to be handed back alone have waited
// agent.ReturnLinger (the Refresher's tick).
func (w *world) linger(inc *incarnation) {
	inc.lingerAt = 0
	if !inc.dead {
		w.pump(inc)
	}
}

// crash kills n's agent (victim, if that process is still the one running; any for a scheduled
// crash): its Limiter is dropped without Close, its waiting checks are lost, its calls in flight
// still reach the coordinator (their answers are dropped).
func (w *world) crash(n *node, victim *incarnation) {
	inc := n.inc
	if inc == nil || victim != nil && victim != inc {
		return
	}
	w.autopsy(inc, w.now, true)
	inc.dead, inc.diedAt = true, w.now
	n.inc = nil
	for _, wt := range inc.fifo[inc.head:] {
		if !wt.done {
			for _, c := range w.counts(&w.reqs[wt.req], n.region.idx, w.second(w.now)) {
				c.Unanswered++
			}
		}
	}
	inc.fifo, inc.byKey, inc.free = nil, nil, nil
	after := w.sc.Crashes.RestartAfter
	for _, s := range w.sc.Crashes.Schedule {
		if s.Agent == n.idx && int64(s.At) == w.now && s.RestartAfter != nil {
			after = *s.RestartAfter
		}
	}
	if t := w.now + int64(after); t < w.end {
		w.schedule(event{at: t, kind: evRestart, own: true, node: n})
	}
}

// autopsy reads what inc's lease core holds — its current and prefetched leases and the leases
// waiting to be handed back — by closing it and collecting what it would hand back or give up.
// Nothing is sent: for a crash this only measures what the process took down with it. It
// checks that the core's own account (Limiter.Outstanding) is that much, and that the core
// conserved every token it applied.
func (w *world) autopsy(inc *incarnation, now int64, crashed bool) int64 {
	w.forfeits(inc)
	outstanding := int64(inc.lim.Outstanding())
	inc.lim.Close()
	var held int64
	// What a crashed agent held is stranded: wasted from its grant to the crash.
	hold := func(k *key, amount, grantedAt int64) {
		held += amount
		k.leased -= amount
		if crashed {
			k.wasted(grantNs(grantedAt), now, amount)
		}
	}
	for c := inc.lim.NextCall(clock.Nanos(now)); c != nil; c = inc.lim.NextCall(clock.Nanos(now)) {
		for _, it := range c.Return.Items {
			hold(w.keyOf(it.Bucket), it.UnspentMicro, it.GrantedAtMs)
		}
	}
	for _, f := range inc.lim.Forfeits() {
		hold(w.keyOf(f.Ref()), int64(f.Amount), int64(f.GrantedAt))
	}
	// Hand-backs held up by a call in flight, which a crash never answers.
	for _, f := range inc.lim.Withheld() {
		hold(w.keyOf(f.Ref()), int64(f.Amount), int64(f.GrantedAt))
	}
	inc.held = held
	if held != outstanding {
		w.violate("conservation", inc.id, now, "agent %s holds %s tokens by its own account, %s by what it hands back",
			inc.id, tokens(outstanding), tokens(held))
	}
	if inc.applied != inc.spent+inc.returned+inc.expired+held {
		w.violate("conservation", inc.id, now,
			"agent %s applied grants of %s tokens but spent %s, returned %s, let %s expire and held %s",
			inc.id, tokens(inc.applied), tokens(inc.spent), tokens(inc.returned), tokens(inc.expired), tokens(held))
	}
	return held
}

func (w *world) restart(n *node) {
	if n.inc == nil {
		w.start(n)
	}
}

// outage is the outage of kind on name active at t, if any.
func (w *world) outage(kind, name string, t int64) *Outage {
	for i := range w.sc.Outages {
		o := &w.sc.Outages[i]
		if o.Kind == kind && int64(o.From) <= t && t < int64(o.To) &&
			(kind == "coordinator" && o.Region == name || kind == "redis" && o.Store == name) {
			return o
		}
	}
	return nil
}

func (w *world) storeOutage(s int, t int64) *Outage {
	return w.outage("redis", w.stores[s].outageName, t)
}

// partitioned reports whether region g is cut off from the others at t.
func (w *world) partitioned(g int, t int64) bool {
	for _, p := range w.sc.Partitions {
		if p.Region == w.regions[g].name && int64(p.From) <= t && t < int64(p.To) {
			return true
		}
	}
	return false
}
