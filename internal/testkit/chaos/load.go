package chaos

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/internal/testkit/envoyquota"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// Outcome is what a check got.
type Outcome uint8

// Outcomes.
const (
	OutAllow Outcome = iota + 1
	OutDeny
	OutUnavailable
	OutError // a gRPC error: the agent is down, or rejected the check
)

func (o Outcome) String() string {
	switch o {
	case OutAllow:
		return "allow"
	case OutDeny:
		return "deny"
	case OutUnavailable:
		return "unavailable"
	case OutError:
		return "error"
	}
	return "unknown"
}

// Record is one check as the load generator saw it. Times are since the run's zero, on the
// monotonic clock every process of the machine shares.
type Record struct {
	Sent, Recv time.Duration
	RetryAfter time.Duration // DENY and UNAVAILABLE
	Key        int32         // index in Keys; -1 for churn keys (each used once)
	Cost       int32         // tokens charged if allowed (the rule's cost when the check said 0)
	Gen        int32         // the agent's generation when sent and answered; -1 if it changed or was odd
	Agent      int8
	Kind       Kind
	Outcome    Outcome
	Code       codes.Code // OutError
	Degraded   bool
	Replayed   bool // an idempotent repeat answered without a charge
	Retry      bool // the repeat of the previous check's idempotency key
	Envoy      bool // sent through envoy.service.ratelimit.v3
	Stream     bool // sent through the client package (a CheckStream batch with partial answers)
	// By names the bucket a refused check of several buckets was refused by, as the native
	// answer's rule says: 1 the key's own, 1 + i its i-th of Charges; 0 unknown or not refused.
	By int8
	// Quota: decided by an Envoy-faithful rate_limit_quota filter on the agent
	// (envoy.service.rate_limit_quota.v3): Sent and Recv are the moment it admitted or denied.
	Quota bool
	// A check of the settled rule allowed on its estimate (Cost) and settled with Actual tokens
	// between SettleSent and SettleRecv; Settled when the agent confirmed the settle's debt
	// debited, Forgiven tokens of it not (the bucket was at max_debt). Unconfirmed, only the
	// estimate counts.
	Actual, Forgiven       int32
	SettleSent, SettleRecv time.Duration
	Settled                bool
	settleID               uint64
}

// Spends reports whether the record spent tokens of the global bucket: an allow that is neither
// degraded (the emergency bucket) nor an idempotent replay.
func (r *Record) Spends() bool { return r.Outcome == OutAllow && !r.Degraded && !r.Replayed }

// LoadConfig is the offered load, in checks per second per agent for each kind.
type LoadConfig struct {
	Hot, Cold, Churn, Closed, Emergency, Ledger float64
	ColdTenants                                 int
	// Quota is the requests per second each agent's Envoy-faithful rate_limit_quota filter
	// decides (the quota rule, QuotaTenants tenants, far above its rate); 0: none.
	Quota        float64
	QuotaTenants int
	// Tail is the long tail: checks a second spread over TailTenants tenants of the tail rule,
	// each agent going through them in turn from a point of its own, so a tenant comes back to
	// an agent every TailTenants/Tail seconds, far longer than its lease lives; 0: none.
	Tail        float64
	TailTenants int
	// Direct is the checks a second on the one key of the direct rule (lease: off), offered
	// above its rate by the agents together; 0: none.
	Direct float64
	// Multi is the checks a second of the multi rule (two limits and a tenant budget, all or
	// nothing) over MultiTenants tenants, skewed n:n−1:…:1 (three tenants get a half, a third
	// and a sixth of the load); 0: none.
	Multi        float64
	MultiTenants int
	// Settled is the checks a second of the settled rule over SettledTenants tenants, each
	// settled after its response with a heavy-tailed cost; 0: none.
	Settled        float64
	SettledTenants int
	// DMulti is the checks a second of the dmulti rule (the multi rule in direct mode, under the
	// same tenant budget) over the MultiTenants tenants, skewed as Multi; 0: none.
	DMulti float64
	// EnvoyEvery sends every n-th hot, cold, closed and emergency check through Envoy's
	// ShouldRateLimit instead of Check (0: never).
	EnvoyEvery int
	// IdemEvery gives every n-th cold and ledger check an idempotency key and repeats it once
	// after its answer, as a client retrying would (0: never).
	IdemEvery int
	// StreamEvery sends every n-th check neither through Envoy nor with an idempotency key
	// (ledger and settled checks excepted) through the Go client package, which batches the
	// concurrent checks of all kinds on one CheckStream with partial answers (0: never).
	StreamEvery int
}

// checkTimeout is a check's deadline: far above the agent's wait bound (50 ms), so a check
// that misses it means a stuck agent.
const checkTimeout = 2 * time.Second

// Load runs the load generators: per agent and kind, one goroutine paced at its rate.
type Load struct {
	s    *Stack
	keys *Keys
	cfg  LoadConfig
	seed uint64

	stop chan struct{}
	wg   sync.WaitGroup

	ledger []ledgerGate // per agent
	// multiGate pauses one agent's multi checks around its kill, so that what it holds of the
	// multi rule's ledger buckets can be read (the multi load runs through every other fault).
	multiGate []ledgerGate

	mu      sync.Mutex
	records [][]Record // one slice per worker, merged by Records

	hot, ledgerKey *Key
	cold           []*Key
	closed, emerg  []*Key
	quota          []*Key
	tail           []*Key
	direct         *Key
	multi          []*Key // the multi route's buckets (their Charges: multi#2 and the budget)
	settled        []*Key
	dmulti         []*Key // the dmulti route's buckets (their Charges: dmulti#2, dmulti#3 and the budget)
	churnSeq       []atomic.Int64
	filters        []*envoyquota.Filter // per agent, with Quota
}

// ledgerGate pauses one agent's ledger checks: the harness quiesces the ledger key before a
// fault whose outcome for a grant in flight it could not know (docs/reliability.md).
type ledgerGate struct {
	paused   atomic.Bool
	inflight atomic.Int64
}

// NewLoad registers the keys of the load in keys.
func NewLoad(s *Stack, keys *Keys, cfg LoadConfig, seed uint64) (*Load, error) {
	l := &Load{s: s, keys: keys, cfg: cfg, seed: seed, stop: make(chan struct{}),
		ledger: make([]ledgerGate, len(s.Agents)), multiGate: make([]ledgerGate, len(s.Agents)), churnSeq: make([]atomic.Int64, len(s.Agents))}
	var err error
	add := func(kind Kind, tenant, path, op string) *Key {
		if err != nil {
			return nil
		}
		var k *Key
		k, err = keys.Add(kind, tenant, path, op)
		return k
	}
	l.hot = add(KindHot, hotTenant(), hotPath(), "GET")
	l.ledgerKey = add(KindLedger, ledgerTenant(), ledgerPath(), "GET")
	for i := range cfg.ColdTenants {
		l.cold = append(l.cold, add(KindCold, coldTenant(i), coldPath(0), "GET"))
	}
	for i := range 4 {
		l.closed = append(l.closed, add(KindClosed, closedTenant(i), closedPath(0), "POST"))
		l.emerg = append(l.emerg, add(KindEmergency, emergencyTenant(i), emergencyPath(0), "GET"))
	}
	for i := range cfg.QuotaTenants {
		l.quota = append(l.quota, add(KindQuota, quotaTenant(i), quotaPath(0), "GET"))
	}
	for i := range cfg.TailTenants {
		l.tail = append(l.tail, add(KindTail, tailTenant(i), tailPath(0), "GET"))
	}
	if cfg.Direct > 0 {
		l.direct = add(KindDirect, directTenant(), directPath(0), "GET")
	}
	for i := range cfg.MultiTenants {
		l.multi = append(l.multi, add(KindMulti, multiTenant(i), multiPath(0), multiOp()))
	}
	if cfg.DMulti > 0 {
		for i := range cfg.MultiTenants {
			l.dmulti = append(l.dmulti, add(KindDMulti, multiTenant(i), dmultiPath(0), multiOp()))
		}
	}
	for i := range cfg.SettledTenants {
		l.settled = append(l.settled, add(KindSettled, settledTenant(i), settledPath(0), "GET"))
	}
	if err == nil && cfg.Settled > 0 && len(l.settled) == 0 {
		err = fmt.Errorf("chaos: a settled load of %g/s needs SettledTenants", cfg.Settled)
	}
	if err == nil && cfg.Multi > 0 && len(l.multi) == 0 {
		err = fmt.Errorf("chaos: a multi load of %g/s needs MultiTenants", cfg.Multi)
	}
	if err == nil && cfg.Tail > 0 && len(l.tail) == 0 {
		err = fmt.Errorf("chaos: a tail load of %g/s needs TailTenants", cfg.Tail)
	}
	if err != nil || cfg.Quota <= 0 {
		return l, err
	}
	qcfg, err := envoyquota.ParseConfig(envoyquota.FilterYAML("leasebucket", quotaReporting, time.Minute,
		envoyquota.Route{Prefix: "/quota/", Template: "/quota/{id}"}))
	if err != nil {
		return l, err
	}
	for _, a := range s.Agents {
		f, err := envoyquota.New(qcfg, a.conn, envoyquota.Options{Now: s.Since})
		if err != nil {
			return l, err
		}
		l.filters = append(l.filters, f)
	}
	return l, nil
}

// quotaReporting is the Envoy-faithful filters' reporting_interval.
const quotaReporting = 250 * time.Millisecond

// Start starts every generator.
func (l *Load) Start() {
	for ai := range l.s.Agents {
		for _, w := range []struct {
			kind Kind
			rate float64
		}{{KindHot, l.cfg.Hot}, {KindCold, l.cfg.Cold}, {KindChurn, l.cfg.Churn}, {KindClosed, l.cfg.Closed},
			{KindEmergency, l.cfg.Emergency}, {KindLedger, l.cfg.Ledger}, {KindQuota, l.cfg.Quota},
			{KindTail, l.cfg.Tail}, {KindDirect, l.cfg.Direct}, {KindMulti, l.cfg.Multi}, {KindDMulti, l.cfg.DMulti}, {KindSettled, l.cfg.Settled}} {
			if w.rate <= 0 {
				continue
			}
			l.mu.Lock()
			slot := len(l.records)
			l.records = append(l.records, nil)
			l.mu.Unlock()
			rng := rand.New(rand.NewPCG(l.seed, uint64(ai)<<8|uint64(w.kind)))
			l.wg.Go(func() { l.run(ai, w.kind, w.rate, rng, slot) })
		}
	}
}

// Stop stops every generator and waits for the checks in flight; the quota filters close their
// streams.
func (l *Load) Stop() {
	select {
	case <-l.stop:
	default:
		close(l.stop)
	}
	l.wg.Wait()
	for _, f := range l.filters {
		f.Close()
	}
}

// Records returns every record, in no particular order. Call it after Stop.
func (l *Load) Records() []Record {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, rs := range l.records {
		n += len(rs)
	}
	all := make([]Record, 0, n)
	for _, rs := range l.records {
		all = append(all, rs...)
	}
	return all
}

// PauseLedger stops agent i's ledger checks and waits until none is in flight.
func (l *Load) PauseLedger(i int) {
	l.ledger[i].paused.Store(true)
	for l.ledger[i].inflight.Load() > 0 {
		time.Sleep(5 * time.Millisecond)
	}
}

// ResumeLedger lets agent i's ledger checks go on.
func (l *Load) ResumeLedger(i int) { l.ledger[i].paused.Store(false) }

// LedgerKey is the ledger's key.
func (l *Load) LedgerKey() *Key { return l.ledgerKey }

// PauseMulti stops agent i's multi checks and waits until none is in flight.
func (l *Load) PauseMulti(i int) {
	l.multiGate[i].paused.Store(true)
	for l.multiGate[i].inflight.Load() > 0 {
		time.Sleep(5 * time.Millisecond)
	}
}

// ResumeMulti lets agent i's multi checks go on.
func (l *Load) ResumeMulti(i int) { l.multiGate[i].paused.Store(false) }

// DebtKeys are the buckets the load may take into debt (the settled rule's).
func (l *Load) DebtKeys() []*Key { return l.settled }

// MultiKeys are the ledger buckets of the multi and dmulti routes, per tenant: each route's own
// bucket, its rule's first limit (each Key's Charges are the check's other buckets), and the
// dmulti rule's third limit (dmultiLedger), a ledger among the charges of a direct check.
func (l *Load) MultiKeys() []*Key {
	ks := append(append([]*Key(nil), l.multi...), l.dmulti...)
	for _, k := range l.dmulti {
		for _, c := range k.Charges {
			if b := l.keys.List[c]; b.Rule.Name == dmultiLedger {
				ks = append(ks, b)
			}
		}
	}
	return ks
}

// dmultiLedger is the dmulti rule's ledger among its charges (PolicyText).
const dmultiLedger = "dmulti#3"

// request is one check to send.
type request struct {
	kind   Kind
	key    *Key // nil for churn
	tenant string
	path   string
	op     string
	cost   int64 // 0: the rule's
	idem   string
	envoy  bool
	stream bool // through the client package
	settle bool // the cost is an estimate, settled after the response
}

func (l *Load) run(ai int, kind Kind, rate float64, rng *rand.Rand, slot int) {
	a := l.s.Agents[ai]
	every := time.Duration(float64(time.Second) / rate)
	// Start at a random phase so agents do not send in lockstep.
	next := time.Now().Add(time.Duration(rng.Int64N(int64(every))))
	var local []Record
	defer func() {
		l.mu.Lock()
		l.records[slot] = append(l.records[slot], local...)
		l.mu.Unlock()
	}()
	for n := 0; ; n++ {
		t := time.NewTimer(time.Until(next))
		select {
		case <-l.stop:
			t.Stop()
			return
		case <-t.C:
		}
		next = next.Add(every)
		if late := time.Until(next); late < -every { // fell behind (a slow check): do not catch up in a burst
			next = time.Now().Add(every)
		}
		if kind == KindQuota {
			local = append(local, l.decide(a, rng))
			continue
		}
		req := l.next(ai, kind, n, rng)
		var gate *ledgerGate
		switch kind {
		case KindLedger:
			gate = &l.ledger[ai]
		case KindMulti, KindDMulti:
			gate = &l.multiGate[ai]
		}
		if gate != nil {
			gate.inflight.Add(1)
			if gate.paused.Load() {
				gate.inflight.Add(-1)
				continue
			}
		}
		rec := l.send(a, req)
		if rec.settleID != 0 {
			l.settle(a, &rec, rng)
		}
		local = append(local, rec)
		if req.idem != "" && rec.Outcome != OutError {
			retry := l.send(a, req)
			retry.Retry = true
			local = append(local, retry)
		}
		if gate != nil {
			gate.inflight.Add(-1)
		}
	}
}

// decide has agent a's Envoy-faithful filter decide one request of a quota tenant, as Envoy's
// rate_limit_quota filter would: locally, from its assignment or its fallback.
func (l *Load) decide(a *Agent, rng *rand.Rand) Record {
	k := l.quota[rng.IntN(len(l.quota))]
	g1 := a.Gen()
	d := l.filters[a.Index].Decide(envoyquota.HTTP(k.Tenant, "GET", quotaPath(rng.IntN(1000))))
	rec := Record{Sent: d.At, Recv: d.At, Key: int32(k.ID), Cost: int32(k.Cost), Agent: int8(a.Index), Kind: KindQuota,
		Quota: true, Outcome: OutDeny, Gen: -1}
	if d.Allowed {
		// An allow of a fallback (the no-assignment or expired behaviour) is Envoy's emergency
		// bucket, degraded; the quota rule's fallbacks allow nothing, so any is a finding.
		rec.Outcome, rec.Degraded = OutAllow, d.Source == envoyquota.NoAssigned || d.Source == envoyquota.Expired
	}
	if g2 := a.Gen(); g1 == g2 && g1%2 == 0 {
		rec.Gen = int32(g1)
	}
	return rec
}

// next builds the n-th check of a generator.
func (l *Load) next(ai int, kind Kind, n int, rng *rand.Rand) request {
	r := request{kind: kind}
	switch kind {
	case KindHot:
		r.key, r.path, r.op = l.hot, hotPath(), "GET"
	case KindCold:
		// Skewed: the first tenants get most of the load (u³ puts 15 % of 300 tenants' checks on
		// the first one), so some cold keys run at their limit and most idle.
		u := rng.Float64()
		r.key = l.cold[int(float64(len(l.cold))*u*u*u)]
		r.path, r.op = coldPath(rng.IntN(1000)), "GET"
		if rng.IntN(5) > 0 {
			r.cost = 1 + rng.Int64N(3)
		}
	case KindChurn:
		seq := l.churnSeq[ai].Add(1)
		r.tenant, r.path, r.op = churnTenant(ai, int(seq)), churnPath(int(seq)), "GET"
	case KindClosed:
		r.key, r.path, r.op = l.closed[rng.IntN(len(l.closed))], closedPath(rng.IntN(100)), "POST"
	case KindEmergency:
		r.key, r.path, r.op = l.emerg[rng.IntN(len(l.emerg))], emergencyPath(rng.IntN(100)), "GET"
	case KindLedger:
		r.key, r.path, r.op = l.ledgerKey, ledgerPath(), "GET"
	case KindTail:
		// In turn from the agent's own first tenant: agent ai is at tenant (ai·T/agents + n) mod T
		// after n checks, so each tenant comes back to it every T checks and the agents are spread
		// over the tail.
		i := (ai*len(l.tail)/len(l.s.Agents) + n) % len(l.tail)
		r.key, r.path, r.op = l.tail[i], tailPath(rng.IntN(1000)), "GET"
	case KindDirect:
		// Mixed costs: a take for several waiting checks of different costs, cut in whole
		// requests when the bucket holds less.
		r.key, r.path, r.op = l.direct, directPath(rng.IntN(1000)), "GET"
		if rng.IntN(4) == 0 {
			r.cost = 2
		}
	case KindMulti, KindDMulti:
		// Tenant i with weight n − i: with three, a half, a third and a sixth of the load.
		n := len(l.multi)
		w := rng.IntN(n * (n + 1) / 2)
		i := 0
		for w >= n-i {
			w -= n - i
			i++
		}
		r.key, r.path, r.op = l.multi[i], multiPath(rng.IntN(1000)), multiOp()
		if kind == KindDMulti {
			r.key, r.path = l.dmulti[i], dmultiPath(rng.IntN(1000))
		}
	case KindSettled:
		r.key, r.path, r.op = l.settled[rng.IntN(len(l.settled))], settledPath(rng.IntN(1000)), "GET"
		r.cost, r.settle = 1+rng.Int64N(2), true
	}
	if r.key != nil {
		r.tenant = r.key.Tenant
	}
	if l.cfg.IdemEvery > 0 && (kind == KindCold || kind == KindLedger) && n%l.cfg.IdemEvery == 0 {
		r.idem = fmt.Sprintf("%s-%d-%d-%d", kind, ai, n, rng.Uint32())
	} else if l.cfg.EnvoyEvery > 0 && kind != KindLedger && kind != KindChurn && n%l.cfg.EnvoyEvery == 1 {
		r.envoy = true
	} else if l.cfg.StreamEvery > 0 && kind != KindLedger && kind != KindSettled && n%l.cfg.StreamEvery == 2 {
		r.stream = true
	}
	return r
}

// send makes one check and records its outcome.
func (l *Load) send(a *Agent, req request) Record {
	rec := Record{Key: -1, Agent: int8(a.Index), Kind: req.kind, Envoy: req.envoy, Stream: req.stream}
	if req.key != nil {
		rec.Key = int32(req.key.ID)
		rec.Cost = int32(req.key.Cost)
	} else {
		rec.Cost = 1
	}
	if req.cost > 0 {
		rec.Cost = int32(req.cost)
	}
	ctx, cancel := context.WithTimeout(context.Background(), checkTimeout)
	defer cancel()
	g1 := a.Gen()
	rec.Sent = l.s.Since()
	var rule string // the native answer's rule
	switch {
	case req.envoy:
		resp, err := a.Envoy.ShouldRateLimit(ctx, envoyRequest(req))
		rec.Recv = l.s.Since()
		envoyOutcome(&rec, resp, err)
	case req.stream:
		// Brief, as the gateway sends a check of a rule without headers: the decision is the same.
		res, err := a.Stream.Check(ctx, client.Request{Tenant: req.tenant, Route: req.path, Operation: req.op, Cost: req.cost, Brief: true})
		rec.Recv = l.s.Since()
		streamOutcome(&rec, res, err)
		rule = res.Rule
	default:
		resp, err := a.Client.Check(ctx, &agentv1.CheckRequest{Tenant: req.tenant, Route: req.path, Operation: req.op,
			Cost: req.cost, IdempotencyKey: req.idem, Settle: req.settle})
		rec.Recv = l.s.Since()
		checkOutcome(&rec, resp, err)
		if rec.Outcome == OutAllow && !rec.Degraded {
			rec.settleID = resp.GetSettleId()
		}
		rule = resp.GetRule()
	}
	if rule != "" && req.key != nil && len(req.key.Charges) > 0 && rec.Outcome != OutAllow && rec.Outcome != OutError {
		for i, b := range req.key.Buckets(l.keys) {
			if b.Rule.Name == rule {
				rec.By = int8(i + 1)
			}
		}
	}
	if g2 := a.Gen(); g1 == g2 && g1%2 == 0 {
		rec.Gen = int32(g1)
	} else {
		rec.Gen = -1
	}
	return rec
}

func checkOutcome(rec *Record, resp *agentv1.CheckResponse, err error) {
	if err != nil {
		rec.Outcome, rec.Code = OutError, status.Code(err)
		return
	}
	switch resp.Decision {
	case agentv1.Decision_DECISION_ALLOW:
		rec.Outcome = OutAllow
	case agentv1.Decision_DECISION_DENY:
		rec.Outcome = OutDeny
	case agentv1.Decision_DECISION_UNAVAILABLE:
		rec.Outcome = OutUnavailable
	default:
		rec.Outcome, rec.Code = OutError, codes.Unknown
	}
	rec.Degraded, rec.Replayed = resp.Degraded, resp.Replayed
	rec.RetryAfter = time.Duration(resp.RetryAfterMs) * time.Millisecond
}

// streamOutcome records the client package's answer: a failed call (the agent unreachable, a
// check it refused as malformed) as an error with the gRPC code it stands for.
func streamOutcome(rec *Record, res client.Result, err error) {
	var invalid *client.InvalidError
	switch {
	case errors.As(err, &invalid):
		rec.Outcome, rec.Code = OutError, codes.InvalidArgument
		return
	case err != nil:
		rec.Outcome, rec.Code = OutError, codes.Unavailable
		return
	}
	o, ok := clientOutcomes[res.Decision]
	if !ok {
		rec.Outcome, rec.Code = OutError, codes.Unknown
		return
	}
	rec.Outcome, rec.Degraded, rec.Replayed, rec.RetryAfter = o, res.Degraded, res.Replayed, res.RetryAfter
}

// clientOutcomes are the client package's decisions as records' outcomes.
var clientOutcomes = map[client.Decision]Outcome{client.Allow: OutAllow, client.Deny: OutDeny, client.Unavailable: OutUnavailable}

// envoyRequest is req as Envoy's rate limit filter sends it: one descriptor with the policy's
// tenant, path and method entries (PolicyText's envoy section); hits_addend is the cost.
func envoyRequest(req request) *ratelimitv3.RateLimitRequest {
	return &ratelimitv3.RateLimitRequest{
		Domain: "leasebucket",
		Descriptors: []*commonv3.RateLimitDescriptor{{Entries: []*commonv3.RateLimitDescriptor_Entry{
			{Key: "tenant", Value: req.tenant}, {Key: "path", Value: req.path}, {Key: "method", Value: req.op},
		}}},
		HitsAddend: uint32(req.cost),
	}
}

// envoyOutcome reads an Envoy answer: OK is an allow, OVER_LIMIT a deny, and an UNAVAILABLE
// error naming a fail-closed rule the agent's 503 (Envoy's failure_mode_deny turns it into one).
func envoyOutcome(rec *Record, resp *ratelimitv3.RateLimitResponse, err error) {
	if err != nil {
		st := status.Convert(err)
		if st.Code() == codes.Unavailable && strings.Contains(st.Message(), "fails closed") {
			rec.Outcome = OutUnavailable
			if _, s, ok := strings.Cut(st.Message(), "retry after "); ok {
				if n, err := strconv.Atoi(strings.TrimSuffix(s, "s")); err == nil {
					rec.RetryAfter = time.Duration(n) * time.Second
				}
			}
			return
		}
		rec.Outcome, rec.Code = OutError, st.Code()
		return
	}
	switch resp.OverallCode {
	case ratelimitv3.RateLimitResponse_OK:
		rec.Outcome = OutAllow
	case ratelimitv3.RateLimitResponse_OVER_LIMIT:
		rec.Outcome = OutDeny
		if len(resp.Statuses) == 1 && resp.Statuses[0].DurationUntilReset != nil {
			rec.RetryAfter = resp.Statuses[0].DurationUntilReset.AsDuration()
		}
	default:
		rec.Outcome, rec.Code = OutError, codes.Unknown
	}
	rec.Degraded = hasHeader(resp.ResponseHeadersToAdd, "x-ratelimit-degraded", "true")
}

func hasHeader(hs []*corev3.HeaderValue, k, v string) bool {
	for _, h := range hs {
		if strings.EqualFold(h.Key, k) && h.Value == v {
			return true
		}
	}
	return false
}

// settle answers an allowed check of the settled rule after a response time (5..40 ms) with a
// heavy-tailed actual cost: Pareto with α 1.3 from 1 token, capped at the bucket's capacity plus
// its max_debt (the most a settle may carry).
func (l *Load) settle(a *Agent, rec *Record, rng *rand.Rand) {
	time.Sleep(time.Duration(5+rng.IntN(36)) * time.Millisecond)
	k := l.keys.List[rec.Key]
	most := tokensOf(k.Limit.Capacity()) + k.MaxDebt
	rec.Actual = int32(min(most, math.Floor(1/math.Pow(1-rng.Float64(), 1/1.3))))
	ctx, cancel := context.WithTimeout(context.Background(), checkTimeout)
	defer cancel()
	rec.SettleSent = l.s.Since()
	resp, err := a.Client.Settle(ctx, &agentv1.SettleRequest{SettleId: rec.settleID, Cost: int64(rec.Actual)})
	rec.SettleRecv = l.s.Since()
	if err == nil && !resp.Pending {
		rec.Settled, rec.Forgiven = true, int32(resp.Forgiven)
	}
}
