package sim

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/internal/clock"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// call is one coordinator call of an agent on its way: the agent core's Call, the attempt, and
// the answer or the error that ends it.
type call struct {
	inc     *incarnation
	c       *agent.Call
	tried   int64 // when the current attempt was sent: its timeout runs from there
	attempt int
	stores  uint64 // stores its items live in, a bit each
	acq     *coordinatorv1.AcquireResponse
	ret     *coordinatorv1.ReturnResponse
	err     error
	granted int64 // µ granted in the answer
}

// pump sends the calls the agent's core has due while fewer than max_in_flight are out, as the
// Refresher does.
func (w *world) pump(inc *incarnation) {
	defer w.scheduleLinger(inc)
	for inc.inFlight < w.sc.Agent.MaxInFlight {
		c := inc.lim.NextCall(clock.Nanos(w.now))
		w.released(inc)
		w.forfeits(inc)
		if c == nil {
			return
		}
		if f := w.sc.Agent.WantFactor; f != 1 && c.Acquire != nil {
			for _, it := range c.Acquire.Items {
				it.NeededMicro = int64(float64(it.NeededMicro) * f)
			}
		}
		w.handedBack(inc, c)
		w.send(&call{inc: inc, c: c})
	}
}

// scheduleLinger makes sure a pump comes for leases waiting to be handed back alone.
func (w *world) scheduleLinger(inc *incarnation) {
	if _, backs := inc.lim.Pending(); backs == 0 || inc.lingerAt != 0 {
		return
	}
	if t := w.now + int64(agent.ReturnLinger); t < w.end {
		inc.lingerAt = t
		w.schedule(event{at: t, kind: evLinger, own: true, node: inc.node, inc: inc})
	}
}

// handedBack books the leases c hands back: they leave the agent.
func (w *world) handedBack(inc *incarnation, c *agent.Call) {
	book := func(ref *coordinatorv1.BucketRef, amount int64) {
		if amount <= 0 {
			return
		}
		inc.returned += amount
		w.res.Loss.Returned += amount
		k := w.keyOf(ref)
		k.leased -= amount
		k.returned += amount
	}
	if c.Acquire != nil {
		for _, it := range c.Acquire.Items {
			book(it.Bucket, it.ReturnMicro)
		}
		for _, it := range c.Acquire.Returns {
			book(it.Bucket, it.UnspentMicro)
		}
		return
	}
	for _, it := range c.Return.Items {
		book(it.Bucket, it.UnspentMicro)
	}
}

func (w *world) send(c *call) {
	c.inc.inFlight++
	if a := c.c.Acquire; a != nil {
		w.res.Backend.AcquireCalls++
		w.res.Backend.AcquireItems += int64(len(a.Items))
		w.res.Backend.ReturnItems += int64(len(a.Returns))
		for _, it := range a.Items {
			c.stores |= 1 << w.keyOf(it.Bucket).store
		}
		for _, it := range a.Returns {
			c.stores |= 1 << w.keyOf(it.Bucket).store
		}
	} else {
		w.res.Backend.ReturnCalls++
		w.res.Backend.ReturnItems += int64(len(c.c.Return.Items))
		for _, it := range c.c.Return.Items {
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
	if a := c.c.Acquire; a != nil {
		c.acq, c.err = g.svc.Acquire(ctx, a)
		c.granted = 0
		if c.err == nil {
			for i, r := range c.acq.Results {
				if r.Status == coordinatorv1.Status_STATUS_OK {
					c.granted += r.GrantedMicro
				}
				if back := a.Items[i].ReturnMicro; back > 0 {
					w.credited(back, r.CreditedMicro, r.Status, r.Status == coordinatorv1.Status_STATUS_OK || r.Status == coordinatorv1.Status_STATUS_DENIED)
				}
			}
			for i, r := range c.acq.Returns {
				w.credited(a.Returns[i].UnspentMicro, r.CreditedMicro, r.Status, r.Status == coordinatorv1.Status_STATUS_OK)
			}
			c.inc.granted += c.granted
		}
	} else {
		c.ret, c.err = g.svc.Return(ctx, c.c.Return)
		if c.err == nil && len(c.ret.Results) == len(c.c.Return.Items) {
			for i, r := range c.ret.Results {
				w.credited(c.c.Return.Items[i].UnspentMicro, r.CreditedMicro, r.Status, r.Status == coordinatorv1.Status_STATUS_OK)
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

// credited books what a bucket credited for unspent µ handed back (ok: the store applied it). A
// hand-back answered STALE did nothing: the agent hands it back again (unhandedBack), or, dead
// by the time the answer comes, loses it (deliver).
func (w *world) credited(unspent, credited int64, st coordinatorv1.Status, ok bool) {
	l := &w.res.Loss
	if st == coordinatorv1.Status_STATUS_STALE {
		w.res.Backend.StaleBacks++
		return
	}
	if !ok {
		l.Lost += unspent
		return
	}
	l.Credited += credited
	l.Decayed += unspent - credited
}

// handedBackAmounts lists the µ of every lease c hands back.
func handedBackAmounts(c *agent.Call) []int64 {
	var out []int64
	if c.Acquire != nil {
		for _, it := range c.Acquire.Items {
			if it.ReturnMicro > 0 {
				out = append(out, it.ReturnMicro)
			}
		}
		for _, it := range c.Acquire.Returns {
			out = append(out, it.UnspentMicro)
		}
		return out
	}
	for _, it := range c.Return.Items {
		out = append(out, it.UnspentMicro)
	}
	return out
}

// deliver applies c's answer (or failure) to its agent, if the agent still lives; a failure the
// agent's retry rule (agent.Retry) retries is sent again first.
func (w *world) deliver(c *call) {
	inc := c.inc
	if !inc.dead && agent.Retry(c.c, c.attempt, c.err) {
		c.attempt++
		c.err = nil
		w.transmit(c)
		return
	}
	inc.inFlight--
	f := agent.Classify(c.err)
	if c.err != nil {
		w.res.Backend.FailedCalls++
		if f == agent.MaybeApplied {
			for _, amount := range handedBackAmounts(c.c) {
				w.res.Loss.Lost += amount
			}
		}
	}
	if inc.dead {
		w.unhandedBack(inc, c, f, true)
		return
	}
	if c.c.Acquire != nil && c.err == nil {
		inc.applied += c.granted
		for i, r := range c.acq.Results {
			if r.Status == coordinatorv1.Status_STATUS_OK && i < len(c.c.Acquire.Items) {
				w.keyOf(c.c.Acquire.Items[i].Bucket).leased += r.GrantedMicro
			}
		}
	}
	reply := agent.Reply{Failure: f, Acquire: c.acq, Return: c.ret}
	if err := inc.lim.Apply(clock.Nanos(w.now), c.c, reply); errors.Is(err, agent.ErrUnknownPolicy) {
		w.violate("policy", inc.id, w.now, "the coordinator did not know the agent's policy: %v", c.err)
	}
	w.unhandedBack(inc, c, f, false)
	for _, ref := range c.c.Refs() {
		w.wakeKey(inc, w.keyOf(ref).idx)
	}
	w.released(inc)
	w.forfeits(inc)
	w.pump(inc)
}

// unhandedBack books the leases a call handed back that were not applied, which the agent keeps
// to hand back again (agent.Limiter.Apply): all of them when the call was not applied, and
// those answered STALE in a call that was (a newer operation of the agent on the key overtook
// the hand-back at the store, which then did nothing). With dead, the agent is gone and they
// are lost.
func (w *world) unhandedBack(inc *incarnation, call *call, f agent.Failure, dead bool) {
	whole := f == agent.NotApplied || f == agent.UnknownPolicy
	if !whole && f != agent.Answered {
		return
	}
	undo := func(ref *coordinatorv1.BucketRef, amount int64, st coordinatorv1.Status) {
		if amount <= 0 || !whole && st != coordinatorv1.Status_STATUS_STALE {
			return
		}
		if dead {
			w.res.Loss.Lost += amount
			return
		}
		inc.returned -= amount
		w.res.Loss.Returned -= amount
		k := w.keyOf(ref)
		k.leased += amount
		k.returned -= amount
	}
	// An answer of another length than the call's items is one the agent trusts nothing of
	// (MaybeApplied), returns included: no hand-back of it goes again.
	c := call.c
	if c.Acquire != nil {
		results, returns := call.acq.GetResults(), call.acq.GetReturns()
		if !whole && len(results) != len(c.Acquire.Items) {
			return
		}
		for i, it := range c.Acquire.Items {
			undo(it.Bucket, it.ReturnMicro, statusOf(whole, i, results))
		}
		if !whole && len(returns) != len(c.Acquire.Returns) {
			return
		}
		for i, it := range c.Acquire.Returns {
			undo(it.Bucket, it.UnspentMicro, statusOf(whole, i, returns))
		}
		return
	}
	results := call.ret.GetResults()
	if !whole && len(results) != len(c.Return.Items) {
		return
	}
	for i, it := range c.Return.Items {
		undo(it.Bucket, it.UnspentMicro, statusOf(whole, i, results))
	}
}

// forfeits books the leases inc's core gave up instead of handing them back.
func (w *world) forfeits(inc *incarnation) {
	for _, f := range inc.lim.Forfeits() {
		inc.expired += int64(f.Amount)
		w.res.Loss.Expired += int64(f.Amount)
		w.keyOf(f.Ref()).leased -= int64(f.Amount)
	}
}

// statusOf is the status of the i-th of answers, none when the call was not applied (whole).
func statusOf[R interface{ GetStatus() coordinatorv1.Status }](whole bool, i int, answers []R) coordinatorv1.Status {
	if whole {
		return coordinatorv1.Status_STATUS_UNSPECIFIED
	}
	return answers[i].GetStatus()
}
