package sim

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// node is one agent host: its traffic streams and the agent process running on it (nil while it
// is down after a crash).
type node struct {
	idx     int
	region  *region
	streams []*stream
	rng     *rand.Rand // arrivals
	crashes *rand.Rand // crash times: a crash-rate sweep keeps the traffic identical
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
	notified bool // the Limiter queued a refill or a return
	inFlight int
	shards   int // of the Limiter's table, for a whole sweep
	// Checks waiting for a refill: by key (a refill's answer wakes the waiters of its keys) and
	// in deadline order (fifo[head:], answered ones skipped), recycled through free.
	byKey    map[int32][]*waiter
	fifo     []*waiter
	head     int
	free     []*waiter
	deadline int64 // the pending deadline event, 0 if none

	// Ledger, µ. Conservation: applied = spent + returned + held, for every process at its death
	// or at the end; a dead process stranded granted − spent − returned.
	granted  int64 // granted to it by coordinators (answers it may never have seen)
	applied  int64 // granted in answers it applied
	spent    int64 // admitted from its leases
	returned int64 // sent back in Returns
	expired  int64 // expired and not returned (the refill since the grant covers it)
	held     int64 // what its lease core held when it died or the run ended
}

// waiter is a check that got Wait: it is checked again when its refill's answer is applied, or
// answered by Limiter.Fallback at its deadline (the agent server's max wait).
type waiter struct {
	req      int32
	key      int32
	at       int64
	deadline int64
	ready    <-chan struct{}
	done     bool
}

func (w *world) start(n *node) {
	n.born++
	inc := &incarnation{node: n, id: fmt.Sprintf("%s/agent-%d.%d", n.region.name, n.idx, n.born), byKey: map[int32][]*waiter{}}
	inc.lim = agent.New(agent.Config{
		AgentID: inc.id,
		Region:  n.region.name,
		Notify:  func() { inc.notified = true },
		Skipped: func(ref *coordinatorv1.BucketRef, unspent bucket.Micro) {
			inc.expired += int64(unspent)
			w.res.Loss.Expired += int64(unspent)
			w.keyOf(ref).leased -= int64(unspent)
		},
	}, w.set)
	// Expire(now, from, 0) sweeps nothing and returns from modulo the table's shard count (a power
	// of two): from = MaxInt32 yields shards − 1.
	inc.shards = inc.lim.Expire(0, math.MaxInt32, 0) + 1
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
		s := n.nextStream()
		t := s.next()
		if t >= w.horizon {
			break
		}
		r := s.pick.pick(n.rng)
		s.advance(n.rng)
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
	if inc.notified {
		w.pump(inc)
	}
}

// check asks the agent about request ri (arrived at arrival) at t. A Wait makes it a waiter;
// wt is the waiter being checked again, nil for a new check.
func (w *world) check(inc *incarnation, ri int32, t, arrival int64, wt *waiter) {
	rq := &w.reqs[ri]
	v, err := inc.lim.Check(clock.Nanos(t), rq.query)
	w.res.Checks++
	if err != nil {
		w.fatal = fmt.Errorf("sim: %s: check %+v: %w", w.sc.Name, rq.query, err)
		return
	}
	if v.Outcome != agent.Wait {
		if wt != nil {
			wt.done = true
		}
		w.decided(inc, rq, v, t, arrival)
		return
	}
	if wt != nil {
		wt.ready = v.Ready()
		return
	}
	if n := len(inc.free); n > 0 {
		wt, inc.free = inc.free[n-1], inc.free[:n-1]
	} else {
		wt = &waiter{}
	}
	*wt = waiter{req: ri, key: rq.keys[inc.node.region.idx], at: arrival, deadline: arrival + int64(w.sc.Agent.MaxWait), ready: v.Ready()}
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
		if e := k.admitted.add(t, float64(rq.micro), k.rate); e > k.admitBound+tolerance {
			w.violate("admission", k.name, t,
				"agents spent %s tokens in [%s, %s]: more than C + r·(w + τ) allows by %s tokens (C = %s, τ = %s)",
				tokens(int64(e+k.rate*float64(t-k.admitted.start))), time.Duration(k.admitted.start), time.Duration(t),
				tokens(int64(e-k.admitBound)), tokens(int64(k.limit.Capacity())), k.ttl)
		}
	case v.Outcome == agent.Deny && v.Degraded:
		for _, c := range cs {
			c.DegradedDenied++
		}
	case v.Outcome == agent.Deny:
		falseDeny := k.available(bucket.Millis(t/int64(time.Millisecond)), rq.micro)
		for _, c := range cs {
			c.Denied++
			if falseDeny {
				c.FalseDenied++
			}
		}
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

// wake checks again the waiters of the keys a refill carried whose Ready is closed.
func (w *world) wake(inc *incarnation, r *agent.Refill) {
	for _, it := range r.Req.Items {
		w.wakeKey(inc, w.keyOf(it.Bucket).idx)
	}
}

func (w *world) wakeKey(inc *incarnation, k int32) {
	list := inc.byKey[k]
	if len(list) == 0 {
		return
	}
	kept := list[:0]
	for _, wt := range list {
		if w.fatal == nil {
			select {
			case <-wt.ready:
				w.check(inc, wt.req, w.now, wt.at, wt)
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

// wakeAll checks again every waiter whose Ready is closed, key by key in key order.
func (w *world) wakeAll(inc *incarnation) {
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
			v, err := inc.lim.Fallback(clock.Nanos(w.now), rq.query)
			w.res.Checks++
			if err != nil {
				w.fatal = fmt.Errorf("sim: %s: fallback %+v: %w", w.sc.Name, rq.query, err)
				return
			}
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
	if inc.notified {
		w.pump(inc)
	}
}

// sweep retires the expired leases of the whole table. The production Refresher sweeps 4 of the
// 64 shards every 25 ms; the simulator sweeps all of them every 400 ms (sweep_every): keys land in
// shards by a hash with a random seed, so a partial sweep would make runs differ.
func (w *world) sweep(inc *incarnation) {
	if inc.dead {
		return
	}
	inc.lim.Expire(clock.Nanos(w.now), 0, inc.shards)
	if inc.notified {
		w.pump(inc)
	}
	if t := w.now + int64(w.sc.Agent.SweepEvery); t < w.end {
		w.schedule(event{at: t, kind: evSweep, own: true, node: inc.node, inc: inc})
	}
}

// call is one Acquire or Return on its way.
type call struct {
	inc     *incarnation
	refill  *agent.Refill
	ret     *agent.Return
	tried   int64 // when the current attempt was sent: its timeout runs from there
	attempt int
	stores  uint64 // stores its items live in, a bit each
	acq     *coordinatorv1.AcquireResponse
	retResp *coordinatorv1.ReturnResponse
	err     error
	granted int64 // µ granted in the answer
}

// pump sends queued refills, then returns, while fewer than max_in_flight calls are out (as the
// Refresher does: refills queued meanwhile join the next batch).
func (w *world) pump(inc *incarnation) {
	inc.notified = false
	for inc.inFlight < w.sc.Agent.MaxInFlight {
		queued := 0
		if len(inc.byKey) > 0 {
			queued, _ = inc.lim.Pending()
		}
		r := inc.lim.NextAcquire(clock.Nanos(w.now))
		if sent := 0; queued > 0 {
			if r != nil {
				sent = len(r.Req.Items)
			}
			if sent < min(queued, agent.MaxBatch) {
				// The core dropped queued refills it no longer needs and released their
				// waiters: they check again now, as the agent server's waiting checks would.
				w.wakeAll(inc)
			}
		}
		if r != nil {
			if f := w.sc.Agent.WantFactor; f != 1 {
				for _, it := range r.Req.Items {
					it.WantMicro = max(it.MinMicro, int64(float64(it.WantMicro)*f))
				}
			}
			w.send(&call{inc: inc, refill: r})
			continue
		}
		if r := inc.lim.NextReturn(); r != nil {
			for _, it := range r.Req.Items {
				inc.returned += it.UnspentMicro
				w.res.Loss.Returned += it.UnspentMicro
				k := w.keyOf(it.Bucket)
				k.leased -= it.UnspentMicro
				k.returned += it.UnspentMicro
			}
			w.send(&call{inc: inc, ret: r})
			continue
		}
		return
	}
}

func (w *world) send(c *call) {
	c.inc.inFlight++
	if c.refill != nil {
		w.res.Backend.AcquireCalls++
		w.res.Backend.AcquireItems += int64(len(c.refill.Req.Items))
		for _, it := range c.refill.Req.Items {
			c.stores |= 1 << w.keyOf(it.Bucket).store
		}
	} else {
		w.res.Backend.ReturnCalls++
		w.res.Backend.ReturnItems += int64(len(c.ret.Req.Items))
		for _, it := range c.ret.Req.Items {
			c.stores |= 1 << w.keyOf(it.Bucket).store
		}
	}
	w.transmit(c)
}

// refKey identifies a bucket as an agent names it on the wire.
type refKey struct{ rule, route, op, tenant, region string }

// keyOf is the key of a bucket ref the agent sent (every ref comes from a request of the
// scenario, so it is known).
func (w *world) keyOf(ref *coordinatorv1.BucketRef) *key {
	return w.byRef[refKey{ref.Rule, ref.Route, ref.Operation, ref.Tenant, ref.Region}]
}

// transmit sends c now: it reaches the coordinator, which asks the stores; the store acts when
// the request reaches it (evServe).
func (w *world) transmit(c *call) {
	n := &w.sc.Network
	g := c.inc.node.region
	c.tried = w.now
	toCoordinator := w.delay(n.AgentCoordinator)
	if o := w.outage("coordinator", g.name, w.now+toCoordinator); o != nil {
		if o.Mode == "blackhole" {
			c.err = status.Error(codes.DeadlineExceeded, "sim: coordinator unreachable (blackhole)")
			w.answer(c, c.tried+int64(w.sc.Agent.CallTimeout))
		} else {
			c.err = status.Error(codes.Unavailable, "sim: coordinator unreachable (connection refused)")
			w.answer(c, w.now+toCoordinator+w.delay(n.AgentCoordinator))
		}
		return
	}
	var toStore int64
	for s := range w.stores {
		if c.stores&(1<<s) != 0 {
			toStore = max(toStore, w.storeDelay(g, s))
		}
	}
	w.schedule(event{at: w.now + toCoordinator + toStore, kind: evServe, call: c})
}

// delay is a one-way delay: base × (1 + U(0, jitter)).
func (w *world) delay(base Duration) int64 {
	if j := w.sc.Network.Jitter; j > 0 {
		return int64(float64(base) * (1 + j*w.net.Float64()))
	}
	return int64(base)
}

func (w *world) storeDelay(g *region, s int) int64 {
	d := w.delay(w.sc.Network.CoordinatorStore)
	if w.stores[s].region != g.idx {
		d += w.delay(w.sc.Network.CrossRegion)
	}
	return d
}

// answer schedules c's answer to reach its agent at t.
func (w *world) answer(c *call, t int64) {
	w.schedule(event{at: max(t, w.now), kind: evDeliver, own: true, node: c.inc.node, inc: c.inc, call: c})
}

// serve runs c through its region's coordinator Service (the real handler: policy resolution,
// the grant rule, the store) at the time it reaches the store.
func (w *world) serve(c *call) {
	g := c.inc.node.region
	for s := range w.stores {
		if o := w.storeOutage(s, w.now); c.stores&(1<<s) != 0 && o != nil && o.Mode == "blackhole" {
			c.err = status.Error(codes.DeadlineExceeded, "sim: store unreachable (blackhole)")
			w.answer(c, c.tried+int64(w.sc.Agent.CallTimeout))
			return
		}
	}
	g.calls++
	w.second(w.now).CoordinatorCalls++
	ctx := context.Background()
	if c.refill != nil {
		c.acq, c.err = g.svc.Acquire(ctx, c.refill.Req)
		c.granted = 0
		if c.err == nil {
			for _, r := range c.acq.Results {
				if r.Status == coordinatorv1.Status_STATUS_OK {
					c.granted += r.GrantedMicro
				}
			}
			c.inc.granted += c.granted
		}
	} else {
		c.retResp, c.err = g.svc.Return(ctx, c.ret.Req)
		if c.err == nil && len(c.retResp.Results) == len(c.ret.Req.Items) {
			l := &w.res.Loss
			for i, r := range c.retResp.Results {
				unspent := c.ret.Req.Items[i].UnspentMicro
				if r.Status == coordinatorv1.Status_STATUS_OK {
					l.Credited += r.CreditedMicro
					l.Decayed += unspent - r.CreditedMicro
				} else {
					l.Lost += unspent
				}
			}
		}
	}
	back := w.delay(w.sc.Network.AgentCoordinator)
	var fromStore int64
	for s := range w.stores {
		if c.stores&(1<<s) != 0 {
			fromStore = max(fromStore, w.storeDelay(g, s))
		}
	}
	w.answer(c, w.now+fromStore+back)
}

// retryable is the Refresher's rule: an Acquire is sent again once after a timeout, a Return
// after a timeout or an unavailable coordinator.
func (c *call) retryable() bool {
	if c.attempt > 0 || c.err == nil {
		return false
	}
	code := status.Code(c.err)
	return code == codes.DeadlineExceeded || (c.ret != nil && code == codes.Unavailable)
}

// deliver applies c's answer (or failure) to its agent, if the agent still lives.
func (w *world) deliver(c *call) {
	inc := c.inc
	if !inc.dead && c.retryable() {
		c.attempt++
		c.err = nil
		w.transmit(c)
		return
	}
	inc.inFlight--
	if c.err != nil {
		w.res.Backend.FailedCalls++
		if c.ret != nil {
			for _, it := range c.ret.Req.Items {
				w.res.Loss.Lost += it.UnspentMicro
			}
		}
	}
	if inc.dead {
		return
	}
	if c.refill != nil {
		if c.err == nil {
			inc.applied += c.granted
			for i, r := range c.acq.Results {
				if r.Status == coordinatorv1.Status_STATUS_OK && i < len(c.refill.Req.Items) {
					w.keyOf(c.refill.Req.Items[i].Bucket).leased += r.GrantedMicro
				}
			}
		}
		if err := inc.lim.ApplyAcquire(clock.Nanos(w.now), c.refill, c.acq, c.err); errors.Is(err, agent.ErrUnknownPolicy) {
			w.violate("policy", inc.id, w.now, "the coordinator did not know the agent's policy: %v", c.err)
		}
		w.wake(inc, c.refill)
	} else {
		inc.lim.ApplyReturn(c.ret, c.retResp, c.err)
	}
	w.pump(inc)
}

// crash kills n's agent (victim, if that process is still the one running; any for a scheduled
// crash): its Limiter is dropped without Close, its waiting checks are lost, its calls in flight
// still reach the coordinator (their answers are dropped).
func (w *world) crash(n *node, victim *incarnation) {
	inc := n.inc
	if inc == nil || victim != nil && victim != inc {
		return
	}
	w.autopsy(inc, w.now)
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

// autopsy reads what inc's lease core holds — its current and prefetched leases and the retired
// leases not yet returned — by retiring everything and collecting the Returns it would send.
// Nothing is sent: for a crash this only measures what the process took down with it (the
// agent's Outstanding accessor, once it exists, is the same figure without retiring). It checks
// that the core conserved every token it applied.
func (w *world) autopsy(inc *incarnation, now int64) int64 {
	inc.lim.Close()
	var held int64
	for r := inc.lim.NextReturn(); r != nil; r = inc.lim.NextReturn() {
		for _, it := range r.Req.Items {
			held += it.UnspentMicro
			w.keyOf(it.Bucket).leased -= it.UnspentMicro
		}
	}
	inc.held = held
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
