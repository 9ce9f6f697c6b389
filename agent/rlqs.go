package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"sync"
	"time"

	rlqsv3 "github.com/envoyproxy/go-control-plane/envoy/service/rate_limit_quota/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
)

// Bounds of a StreamRateLimitQuotas call. A message beyond them ends the stream with
// INVALID_ARGUMENT (RESOURCE_EXHAUSTED for too many buckets); nothing of that message is applied.
const (
	// MaxQuotaUsages bounds the bucket usages of one report message. Envoy reports every bucket it
	// holds in one message each reporting interval; a thousand is far beyond what a route table
	// with templates produces, and a message of them is answered within a millisecond.
	MaxQuotaUsages = 1024
	// MaxQuotaBuckets bounds the buckets one stream holds (about 500 bytes each): an Envoy whose
	// bucket ids carry raw paths or another unbounded value would otherwise grow the agent without
	// end. Bucket ids should name route templates (docs/gateway.md).
	MaxQuotaBuckets = 65536
)

// AssignmentMargin bounds the time from the moment the agent sends an assignment until Envoy
// applies it, plus how late Envoy's expiry timer may fire: an assignment sent at s with a time to
// live of ttl admits nothing after s + ttl + AssignmentMargin. Every assignment ends by then within
// its lease, and Envoy's token bucket may refill over ttl + AssignmentMargin
// (docs/leases.md, "Assignments"). A local socket delivers in microseconds and Envoy's main thread
// posts to its workers in about as long; a tenth of a second leaves room for a loaded machine.
const AssignmentMargin = 100 * time.Millisecond

const (
	// DefaultQuotaIdle is how long a bucket goes without a reported request before the agent
	// abandons it (Envoy forgets it and subscribes again at its next request): its assignments
	// cost a reservation each, and an idle bucket's are returned.
	// Abandoning has a price: Envoy applies its no_assignment_behavior to a bucket it subscribes
	// to again until the first assignment arrives (a fail-closed route denies that first request).
	DefaultQuotaIdle = time.Minute

	// quotaRefreshLead is how long before an assignment ends the agent sends the next one: the
	// margin for the assignment to reach Envoy, and as much again for a refill on the way.
	quotaRefreshLead = 2 * AssignmentMargin

	// quotaWaitBound bounds the wait of a bucket's reservation for a refill; past it the key is
	// treated as unreachable (the refresher's call timeout, 500 ms, and a retry fit within it).
	quotaWaitBound = 2 * time.Second

	// quotaRetryFloor is the soonest a refused or failing bucket is asked about again.
	quotaRetryFloor = 100 * time.Millisecond

	// quotaSlot is the grid a stream's buckets are looked at on: the buckets due within one slot
	// are refreshed together and their actions leave in one response, so a stream of a thousand
	// buckets writes a few dozen responses a second instead of one a bucket (each a write and a
	// wakeup of the stream's goroutine). An assignment's refresh moves to the slot before it
	// (never later: the refresh lead stays whole), a retry to the slot after it (never sooner than
	// asked). A quarter of the refresh lead: an assignment is refreshed at most that much sooner.
	quotaSlot = quotaRefreshLead / 4

	// quotaInvalidTTL is the life of the DENY_ALL assignment of a bucket the agent cannot map (it
	// is mapped again when it runs out, in case the policy changed).
	quotaInvalidTTL = time.Minute

	// quotaAllowTTL is the life of the ALLOW_ALL assignment of a shadow rule's bucket.
	quotaAllowTTL = 30 * time.Second

	// quotaRefillAllowance is what a refill's round trip may take off a fresh lease's life before
	// a reservation can be made from it.
	quotaRefillAllowance = 50 * time.Millisecond

	// quotaBurstAllowance is the burst an assignment gives beyond the pace of the requests Envoy
	// reported: a tenth of a second of them (a paced bucket replaced early loses at most its burst).
	quotaBurstAllowance = 100 * time.Millisecond

	// quotaSpread is the headroom an assignment gives for the spread of the requests' count, in
	// standard deviations: n requests expected over its life arrive as a Poisson count, whose
	// spread is √n, and a bucket sized to their mean runs dry about every other assignment. Two
	// deviations keep what the filters deny below 1 % (docs/gateway.md) for √n more reserved
	// tokens, which settle gives back when unused.
	quotaSpread = 2.0

	// maxAssignTokens bounds the requests one token bucket assignment may hold: max_tokens and
	// tokens_per_fill are 32-bit.
	maxAssignTokens = 1 << 31
)

// quotaService is Envoy's rate limit quota service (envoy.service.rate_limit_quota.v3) over the
// agent's leases: Envoy holds quota assignments and enforces them itself, so a request never
// leaves the proxy; the agent backs every assignment with tokens reserved from a lease
// (Limiter.Reserve). One quotaStream serves each StreamRateLimitQuotas call; the service keeps
// what the streams share: the demand each key's buckets report.
type quotaService struct {
	rlqsv3.UnimplementedRateLimitQuotaServiceServer
	s    *Server
	idle time.Duration

	mu     sync.Mutex
	demand map[string]*keyDemand // bucket key → what its buckets on every stream offer
}

// keyDemand is what the buckets of one key offer, and what of it was last fed into the key's
// demand.
type keyDemand struct {
	rates map[*quotaBucket]float64 // each bucket's offered requests per second
	fed   float64                  // their sum when last fed
	fedAt clock.Nanos
}

// Feeding a key's demand costs a lookup of the key and its lock. Every bucket of the key reports
// it each reporting interval, and the demand is an average of what it is fed: it is fed the sum
// when that moved by more than quotaDemandStep of what was fed, or quotaDemandEvery after the last.
const (
	quotaDemandStep  = 1.0 / 8
	quotaDemandEvery = time.Second
)

func newQuotaService(s *Server, idle time.Duration) *quotaService {
	if idle <= 0 {
		idle = DefaultQuotaIdle
	}
	return &quotaService{s: s, idle: idle, demand: map[string]*keyDemand{}}
}

// StreamRateLimitQuotas implements envoy.service.rate_limit_quota.v3.RateLimitQuotaService.
func (qs *quotaService) StreamRateLimitQuotas(stream grpc.BidiStreamingServer[rlqsv3.RateLimitQuotaUsageReports, rlqsv3.RateLimitQuotaResponse]) error {
	st := &quotaStream{qs: qs, s: qs.s, stream: stream, ctx: stream.Context(), buckets: map[string]*quotaBucket{},
		ready: make(chan *quotaBucket), done: make(chan struct{})}
	qs.s.metrics.quota().stream(1)
	defer qs.s.metrics.quota().stream(-1)
	err := st.run()
	if c := status.Code(err); c == codes.InvalidArgument || c == codes.ResourceExhausted {
		qs.s.log.Warn("rate limit quota stream refused", zap.Error(err))
	}
	return err
}

// observeAll observes the rate of each of buckets (but those abandoned meanwhile) under its key,
// taking the service's lock once for a message's worth; feeds is scratch space, returned for the
// next call.
func (qs *quotaService) observeAll(now clock.Nanos, buckets []*quotaBucket, feeds []demandFeed) []demandFeed {
	if len(buckets) == 0 {
		return feeds
	}
	qs.mu.Lock()
	for _, b := range buckets {
		if !b.gone {
			if sum, ok := qs.observeLocked(now, b, b.keyOf, b.rate); ok {
				feeds = append(feeds, demandFeed{b, sum})
			}
		}
	}
	qs.mu.Unlock()
	for _, f := range feeds {
		qs.feed(f.b, f.sum)
	}
	clear(feeds)
	return feeds[:0]
}

// demandFeed is a key's demand to feed, the sum of its buckets' rates, found through one of them.
type demandFeed struct {
	b   *quotaBucket
	sum float64
}

// observe records bucket b's offered rate (requests per second) for key at now, and feeds the sum
// over the key's buckets on every stream into the key's demand (when it moved, or a while after it
// was last fed); rate < 0 forgets b.
func (qs *quotaService) observe(now clock.Nanos, b *quotaBucket, key string, rate float64) {
	qs.mu.Lock()
	sum, feed := qs.observeLocked(now, b, key, rate)
	qs.mu.Unlock()
	if feed {
		qs.feed(b, sum)
	}
}

// observeLocked is observe with qs.mu held: it returns the sum to feed, if it is to be fed.
func (qs *quotaService) observeLocked(now clock.Nanos, b *quotaBucket, key string, rate float64) (float64, bool) {
	if b.key != "" && b.key != key {
		qs.forgetLocked(b)
	}
	if rate < 0 || key == "" {
		qs.forgetLocked(b)
		return 0, false
	}
	b.key = key
	d := qs.demand[key]
	if d == nil {
		d = &keyDemand{rates: map[*quotaBucket]float64{}}
		qs.demand[key] = d
	}
	d.rates[b] = rate
	var sum float64
	for _, r := range d.rates {
		sum += r
	}
	feed := math.Abs(sum-d.fed) > quotaDemandStep*d.fed || now-d.fedAt >= clock.Of(quotaDemandEvery)
	if feed {
		d.fed, d.fedAt = sum, now
	}
	return sum, feed
}

// feed feeds sum, requests per second, into the demand of b's key.
func (qs *quotaService) feed(b *quotaBucket, sum float64) {
	if unit := b.unit; unit > 0 && sum > 0 {
		qs.s.lim.observeDemandResolved(&b.res, b.q.Tenant, bucket.Micro(min(sum*float64(unit), float64(bucket.MaxExact))))
	}
}

func (qs *quotaService) forgetLocked(b *quotaBucket) {
	if d := qs.demand[b.key]; d != nil {
		delete(d.rates, b)
		if len(d.rates) == 0 {
			delete(qs.demand, b.key)
		}
	}
	b.key = ""
}

// quotaStream is one StreamRateLimitQuotas call: one goroutine (run) owns its buckets and sends
// its answers; a receiver goroutine hands it the reports, and a goroutine per reservation waiting
// for a refill tells it when the refill came.
type quotaStream struct {
	qs     *quotaService
	s      *Server
	stream grpc.BidiStreamingServer[rlqsv3.RateLimitQuotaUsageReports, rlqsv3.RateLimitQuotaResponse]
	ctx    context.Context

	domain  string // from the first report
	buckets map[string]*quotaBucket
	due     dueHeap
	out     []byte // the bucket actions to send when the event is handled, encoded (appendAction)
	warned  bool   // an unmappable bucket was logged

	// From validate to onReports: the message (decoded in place: its slices point into it), and
	// one per usage: its bucket if the stream holds it, else its signature (appendEntriesSig).
	// sigBuf is where validate builds a signature to look it up.
	reports quotaReports
	found   []*quotaBucket
	sigs    []string
	sigBuf  []byte
	// What onReports gathers of a message's usages: the buckets whose rates count in their keys'
	// demand, and the requests reported.
	observed          []*quotaBucket
	feeds             []demandFeed
	allowedN, deniedN uint64

	ready chan *quotaBucket // a reservation's wait ended
	done  chan struct{}     // closed when run ends: waiters give up
	wg    sync.WaitGroup    // waiters
}

func (st *quotaStream) run() error {
	defer st.close()
	msgs := make(chan *emptypb.Empty)
	recvErr := make(chan error, 1)
	go func() {
		for {
			m := new(emptypb.Empty) // the report, all of it as unknown fields (decodeQuotaReports)
			err := st.stream.RecvMsg(m)
			if err != nil {
				recvErr <- err
				return
			}
			select {
			case msgs <- m:
			case <-st.done:
				return
			}
		}
	}()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		select {
		case m := <-msgs:
			if err := st.onReports(m); err != nil {
				return err
			}
		case err := <-recvErr:
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		case b := <-st.ready:
			st.onReady(b)
		case <-timer.C:
			st.onDue()
		case <-st.s.draining:
			_ = st.flush()
			return status.Error(codes.Unavailable, "agent: shutting down")
		case <-st.ctx.Done():
			return status.FromContextError(st.ctx.Err()).Err()
		}
		st.drainReady()
		if err := st.flush(); err != nil {
			return err
		}
		wait := time.Hour
		if len(st.due) > 0 {
			wait = max(0, (st.due[0].at - st.s.clk.Now()).Duration())
		}
		timer.Reset(wait)
	}
}

// drainReady completes the reservations whose waits have ended: a refill completes many at once,
// and they are answered in the same response.
func (st *quotaStream) drainReady() {
	for {
		select {
		case b := <-st.ready:
			st.onReady(b)
		default:
			return
		}
	}
}

// close ends the stream's business with the Limiter: waiting reservations are dropped, and each
// bucket's assignments are settled with what Envoy may still admit of them (nothing is known of
// it after the last report), the rest released.
func (st *quotaStream) close() {
	close(st.done)
	st.wg.Wait()
	now := st.s.now()
	for _, b := range st.buckets {
		st.forget(now, b)
	}
}

// flush sends the actions the last event produced, as one response: their encoding, carried as
// the message's unknown fields (which a marshal copies as they are; the buffer is reused once
// Send has encoded it).
func (st *quotaStream) flush() error {
	if len(st.out) == 0 {
		return nil
	}
	resp := &rlqsv3.RateLimitQuotaResponse{}
	resp.ProtoReflect().SetUnknown(st.out)
	err := st.stream.Send(resp)
	st.out = st.out[:0]
	return err
}

// onReports handles one message: it is decoded and validated as a whole (nothing of a malformed
// message is applied), then each usage is a report of its bucket.
func (st *quotaStream) onReports(m *emptypb.Empty) error {
	set := st.s.lim.Policy()
	if err := st.validate(set, m.ProtoReflect().GetUnknown()); err != nil {
		st.s.metrics.quota().refused()
		return err
	}
	now := st.s.now()
	r := &st.reports
	for i, u := range r.usages {
		b := st.found[i]
		if b == nil || b.gone { // new, or abandoned by an earlier usage of this message
			sig := st.sigs[i]
			if b != nil {
				sig = b.sig
			}
			if b = st.buckets[sig]; b == nil {
				id := &rlqsv3.BucketId{Bucket: idMap(r.entries[u.from:u.to])}
				b = &quotaBucket{sig: sig, id: id, echo: echoField(id), activeAt: now, index: -1}
				st.buckets[sig] = b
				st.s.metrics.quota().bucket(1)
			}
		}
		st.report(now, b, u.allowed, u.denied)
	}
	clear(st.found)
	clear(r.entries)
	r.domain = nil
	st.feeds = st.qs.observeAll(now, st.observed, st.feeds)
	clear(st.observed)
	st.observed = st.observed[:0]
	st.s.metrics.quota().usage(st.allowedN, st.deniedN)
	st.allowedN, st.deniedN = 0, 0
	return nil
}

// validate decodes a message into st.reports and checks it against the stream's bounds and
// domain.
func (st *quotaStream) validate(set *policy.Set, raw []byte) error {
	m := &st.reports
	err := decodeQuotaReports(raw, m)
	switch {
	case errors.Is(err, errTooManyEntries):
		return status.Errorf(codes.InvalidArgument, "agent: usage %d: bucket_id of more than %d entries", len(m.usages), MaxEnvoyEntries)
	case err != nil:
		return status.Errorf(codes.InvalidArgument, "agent: malformed usage report: %v", err)
	}
	domain := set.Envoy().Domain
	switch {
	case len(m.domain) > MaxEnvoyValue:
		return status.Errorf(codes.InvalidArgument, "agent: domain of %d bytes, at most %d", len(m.domain), MaxEnvoyValue)
	case st.domain == "" && len(m.domain) == 0:
		return status.Error(codes.InvalidArgument, "agent: the first report of a stream names no domain")
	case st.domain == "" && string(m.domain) != domain:
		return status.Errorf(codes.InvalidArgument, "agent: domain %q is not served here; the policy's envoy.domain is %q", m.domain, domain)
	case st.domain != "" && len(m.domain) > 0 && string(m.domain) != st.domain:
		return status.Errorf(codes.InvalidArgument, "agent: domain %q after %q: a stream serves one domain", m.domain, st.domain)
	case len(m.usages) > MaxQuotaUsages:
		return status.Errorf(codes.InvalidArgument, "agent: %d bucket usages in one message, at most %d", len(m.usages), MaxQuotaUsages)
	}
	if st.domain == "" {
		st.domain = string(m.domain)
	}
	var added map[string]bool // the new buckets' signatures
	st.found, st.sigs = st.found[:0], st.sigs[:0]
	for i, u := range m.usages {
		id := m.entries[u.from:u.to]
		if len(id) == 0 {
			return status.Errorf(codes.InvalidArgument, "agent: usage %d has no bucket_id", i)
		}
		for _, e := range id {
			if len(e.k) > MaxEnvoyValue || len(e.v) > MaxEnvoyValue {
				return status.Errorf(codes.InvalidArgument, "agent: usage %d: bucket_id entry of a %d-byte key and a %d-byte value, at most %d each",
					i, len(e.k), len(e.v), MaxEnvoyValue)
			}
		}
		st.sigBuf = appendEntriesSig(st.sigBuf[:0], id)
		b, sig := st.buckets[string(st.sigBuf)], "" // a known bucket's signature is not copied
		if b == nil {
			sig = string(st.sigBuf)
			if added == nil {
				added = map[string]bool{}
			}
			added[sig] = true
		}
		st.found, st.sigs = append(st.found, b), append(st.sigs, sig)
	}
	if n := len(st.buckets) + len(added); n > MaxQuotaBuckets {
		return status.Errorf(codes.ResourceExhausted, "agent: %d buckets on one stream, at most %d: bucket ids should name route templates, not raw paths",
			n, MaxQuotaBuckets)
	}
	return nil
}

// echoField is the bucket_id field of every action of bucket id: encoded once (its map's entries
// in a fixed order), copied into each action (appendAction). A map is the costliest field to size
// and encode, and each bucket's id goes back to Envoy about once a second.
func echoField(id *rlqsv3.BucketId) []byte {
	raw, err := proto.MarshalOptions{Deterministic: true}.Marshal(id)
	if err != nil {
		raw = nil // not reached: a valid message encodes
	}
	return protowire.AppendBytes(protowire.AppendTag(nil, actionBucketIDField, protowire.BytesType), raw)
}

// quotaQuery maps a bucket id to a check, as the policy's envoy section maps a descriptor: its
// tenant_key entry is the tenant, route_key the path (a request path or a route template of the
// policy, /orders/{id}), operation_key the operation. Any other key is refused.
func quotaQuery(m policy.Envoy, id map[string]string) (Query, error) {
	var q Query
	var tenant, path bool
	for k, v := range id {
		switch k {
		case m.TenantKey:
			q.Tenant, tenant = v, true
		case m.RouteKey:
			q.Path, path = v, true
		case m.OperationKey:
			q.Operation = v
		default:
			return Query{}, fmt.Errorf("%w: unknown bucket_id key %q; this agent reads %q, %q and %q",
				ErrInvalidRoute, k, m.TenantKey, m.RouteKey, m.OperationKey)
		}
	}
	switch {
	case !tenant:
		return Query{}, fmt.Errorf("%w: no %q entry in the bucket_id", ErrInvalidTenant, m.TenantKey)
	case !path:
		return Query{}, fmt.Errorf("%w: no %q entry in the bucket_id", ErrInvalidRoute, m.RouteKey)
	}
	return q, nil
}

// action queues bucket action a (its bucket_id unset) of b for the next response.
func (st *quotaStream) action(b *quotaBucket, a *rlqsv3.RateLimitQuotaResponse_BucketAction) {
	body, err := proto.Marshal(a)
	if err != nil {
		return // not reached: the agent's actions encode
	}
	st.out = appendAction(st.out, b.echo, body)
}

// schedule sets when b is next looked at (at most one time per bucket): at, or the end of its
// slot (never sooner).
func (st *quotaStream) schedule(b *quotaBucket, at clock.Nanos) {
	st.setDue(b, at+(clock.Of(quotaSlot)-at%clock.Of(quotaSlot))%clock.Of(quotaSlot))
}

// scheduleBy sets b to be looked at by at: at the start of at's slot (never later), or at itself
// if that slot has begun by now.
func (st *quotaStream) scheduleBy(b *quotaBucket, now, at clock.Nanos) {
	if s := at - at%clock.Of(quotaSlot); s > now {
		at = s
	}
	st.setDue(b, at)
}

func (st *quotaStream) setDue(b *quotaBucket, at clock.Nanos) {
	if b.index >= 0 {
		st.due[b.index].at = at
		st.due.fix(b.index)
		return
	}
	st.due.push(dueEntry{at: at, b: b})
}

func (st *quotaStream) unschedule(b *quotaBucket) {
	if b.index >= 0 {
		st.due.remove(b.index)
	}
}

// onDue looks at every bucket whose time came.
func (st *quotaStream) onDue() {
	now := st.s.now()
	for len(st.due) > 0 && st.due[0].at <= now {
		b := st.due.remove(0)
		if b.polling {
			st.poll(now, b)
			continue
		}
		st.refresh(now, b, false)
	}
}

// wait makes b wait for its reservation's refill. A bucket with an action in force looks at its
// refill on the grid, with the buckets due then (the refresh lead leaves room for a refill and a
// slot): no goroutine, and its answer leaves with theirs. A bucket waiting for its first
// assignment, which Envoy answers with its no_assignment_behavior meanwhile, is answered the
// moment the refill comes.
func (st *quotaStream) wait(now clock.Nanos, b *quotaBucket, t *Ticket) {
	b.ticket = t
	if b.state != quotaNone {
		b.polling, b.waitFrom = true, now
		st.schedule(b, now+1)
		return
	}
	st.wg.Go(func() {
		timer := time.NewTimer(quotaWaitBound)
		defer timer.Stop()
		select {
		case <-t.Ready():
		case <-timer.C:
		case <-st.done:
			return
		}
		select {
		case st.ready <- b:
		case <-st.done:
		}
	})
}

// poll looks at the refill a polling bucket waits for: the reservation is completed once the
// refill came or the wait bound passed, else looked at again in the next slot.
func (st *quotaStream) poll(now clock.Nanos, b *quotaBucket) {
	select {
	case <-b.ticket.Ready():
	default:
		if now-b.waitFrom < clock.Of(quotaWaitBound) {
			st.schedule(b, now+1)
			return
		}
	}
	st.onReady(b)
}

// onReady completes the reservation b waited for (or gives up on it past the wait bound).
func (st *quotaStream) onReady(b *quotaBucket) {
	t := b.ticket
	if t == nil || b.gone {
		return // abandoned meanwhile: the ticket was dropped then
	}
	b.ticket, b.polling = nil, false
	now := st.s.now()
	select {
	case <-t.Ready():
	default:
		st.s.lim.Unreserve(now, t)
		st.failing(now, b, Verdict{Outcome: Unavailable, RetryAfter: quotaRetryFloor, Degraded: b.emergency})
		return
	}
	r, v := st.s.lim.Reserved(now, t, b.ask)
	if v.Outcome == Wait {
		st.refresh(now, b, false)
		return
	}
	st.decided(now, b, r, v)
}

// dueHeap orders buckets by when they are next looked at: a binary min-heap on at. An entry
// holds its time, so that ordering reads the heap's array only; each bucket knows its index.
// Written out rather than through container/heap, whose interface boxes every entry pushed and
// popped: an allocation per bucket and assignment.
type dueHeap []dueEntry

type dueEntry struct {
	at clock.Nanos
	b  *quotaBucket
}

func (h *dueHeap) push(e dueEntry) {
	e.b.index = len(*h)
	*h = append(*h, e)
	h.up(e.b.index)
}

// remove takes the entry at i out of the heap and returns its bucket.
func (h *dueHeap) remove(i int) *quotaBucket {
	old := *h
	b, n := old[i].b, len(old)-1
	if i != n {
		old[i] = old[n]
		old[i].b.index = i
	}
	old[n] = dueEntry{}
	*h = old[:n]
	if i != n {
		h.fix(i)
	}
	b.index = -1
	return b
}

// fix restores the order after the entry at i changed its time.
func (h dueHeap) fix(i int) {
	if !h.down(i) {
		h.up(i)
	}
}

func (h dueHeap) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if h[p].at <= h[i].at {
			return
		}
		h.swap(i, p)
		i = p
	}
}

// down sifts the entry at i down; it reports whether it moved.
func (h dueHeap) down(i int) bool {
	i0 := i
	for {
		c := 2*i + 1
		if c >= len(h) {
			break
		}
		if r := c + 1; r < len(h) && h[r].at < h[c].at {
			c = r
		}
		if h[i].at <= h[c].at {
			break
		}
		h.swap(i, c)
		i = c
	}
	return i > i0
}

func (h dueHeap) swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].b.index, h[j].b.index = i, j
}
