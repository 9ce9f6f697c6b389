package agent

import (
	"errors"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
)

// Metrics are the agent's Prometheus metrics. Labels are bounded: rule names come from the policy,
// outcomes and call names are fixed, codes are gRPC's. No tenant ever becomes a label.
//
// The shells count what they do (decisions, calls); the Limiter's own counters are read at scrape
// time, so nothing is counted twice and the check path adds no metric work of its own. A nil
// *Metrics counts nothing.
type Metrics struct {
	decisions  *prometheus.CounterVec
	invalids   prometheus.Counter
	fallbacks  prometheus.Counter
	refill     prometheus.Histogram
	callErrors *prometheus.CounterVec
	// counters finds the decision and near-limit counters of a rule by its pointer, without
	// hashing labels per check (counters.go).
	counters ruleCounters

	nearLimit      *prometheus.CounterVec
	failureAnswers *prometheus.CounterVec
	replays        prometheus.Counter
	pending        prometheus.Counter
	batchChecks    *prometheus.HistogramVec
	streams        prometheus.Gauge
	envoyAnswers   *prometheus.CounterVec
	idem           atomic.Pointer[idempotency]
	quotaM         *quotaMetrics // the rate limit quota service (rlqs_metrics.go)
}

// nearLimitFraction: an allow that leaves less than this fraction of the rule's burst (as this
// agent sees it) is counted as near the limit: the tenant is about to be denied.
const nearLimitFraction = 10 // 1/10

// NewMetrics returns the agent's metrics, not registered yet (see Register).
func NewMetrics() *Metrics {
	return &Metrics{
		decisions: prometheus.NewCounterVec(counterOpts("decisions_total",
			"Checks answered, by rule and outcome (allow, deny, unavailable). Degraded and shadow answers are counted here too, and separately."),
			[]string{"rule", "outcome"}),
		invalids: prometheus.NewCounter(counterOpts("invalid_checks_total",
			"Checks rejected as malformed (INVALID_ARGUMENT): no decision, nothing charged.")),
		fallbacks: prometheus.NewCounter(counterOpts("wait_fallbacks_total",
			"Checks that waited for a refill past the bound (or the caller's deadline) and were answered by the rule's failure mode.")),
		refill: prometheus.NewHistogram(histogramOpts("refill_duration_seconds",
			"Latency of Acquire calls to the coordinators (each attempt), successful or not.",
			[]float64{.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1})),
		callErrors: prometheus.NewCounterVec(counterOpts("coordinator_errors_total",
			"Coordinator calls that failed as a whole, by call (acquire, return) and gRPC code."),
			[]string{"call", "code"}),
		nearLimit: prometheus.NewCounterVec(counterOpts("near_limit_allows_total",
			"Allows that left less than a tenth of the rule's burst, as this agent sees it, by rule."),
			[]string{"rule"}),
		failureAnswers: prometheus.NewCounterVec(counterOpts("failure_mode_answers_total",
			"Checks answered by the rule's failure mode (degraded mode): unavailable (fail closed), or allow/deny by the emergency bucket; by rule and outcome."),
			[]string{"rule", "outcome"}),
		replays: prometheus.NewCounter(counterOpts("idempotent_replays_total",
			"Idempotent repeats answered with the first decision, not charged again (not in decisions_total).")),
		pending: prometheus.NewCounter(counterOpts("idempotency_pending_total",
			"Repeats of an idempotency key answered ABORTED because the first check was still being decided after the wait bound.")),
		batchChecks: prometheus.NewHistogramVec(histogramOpts("batch_checks",
			"Checks per CheckBatch request or CheckStream message, by api (batch, stream).",
			[]float64{1, 4, 16, 64, 256, 1024}),
			[]string{"api"}),
		streams: prometheus.NewGauge(gaugeOpts("check_streams",
			"CheckStream calls open.")),
		envoyAnswers: prometheus.NewCounterVec(counterOpts("envoy_requests_total",
			"Envoy ShouldRateLimit requests by answer: ok, over_limit, invalid (INVALID_ARGUMENT), unavailable (a fail-closed descriptor: UNAVAILABLE), error."),
			[]string{"code"}),
		quotaM: newQuotaMetrics(),
	}
}

// counterOpts, gaugeOpts and histogramOpts name a metric leasebucket_agent_<name>, as desc does
// for the ones read at scrape time.
func counterOpts(name, help string) prometheus.CounterOpts {
	return prometheus.CounterOpts{Namespace: "leasebucket", Subsystem: "agent", Name: name, Help: help}
}

func gaugeOpts(name, help string) prometheus.GaugeOpts {
	return prometheus.GaugeOpts{Namespace: "leasebucket", Subsystem: "agent", Name: name, Help: help}
}

func histogramOpts(name, help string, buckets []float64) prometheus.HistogramOpts {
	return prometheus.HistogramOpts{Namespace: "leasebucket", Subsystem: "agent", Name: name, Help: help, Buckets: buckets}
}

// Register registers the metrics with reg, with the counters of lim and, if ref is not nil, the
// calls in flight of ref, read at scrape time.
func (m *Metrics) Register(reg prometheus.Registerer, lim *Limiter, ref *Refresher) error {
	idemKeys := prometheus.NewGaugeFunc(gaugeOpts("idempotency_keys",
		"Idempotency keys remembered (allows answered to a check with a key, within the window)."), func() float64 {
		if i := m.idem.Load(); i != nil {
			return float64(i.len())
		}
		return 0
	})
	for _, c := range append([]prometheus.Collector{m.decisions, m.invalids, m.fallbacks, m.refill, m.callErrors,
		m.nearLimit, m.failureAnswers, m.replays, m.pending, m.batchChecks, m.streams, m.envoyAnswers, idemKeys,
		&coreCollector{lim: lim, ref: ref}}, m.quotaM.collectors()...) {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

func (m *Metrics) decision(v Verdict) {
	if m == nil {
		return
	}
	m.counters.of(v.Rule, int(v.Outcome), func() prometheus.Counter {
		return m.decisions.WithLabelValues(ruleName(v.Rule), v.Outcome.String())
	}).Inc()
	switch {
	case v.Degraded || v.Outcome == Unavailable:
		m.failureAnswers.WithLabelValues(ruleName(v.Rule), v.Outcome.String()).Inc()
	case v.Outcome == Allow && !v.ShadowDeny && v.Limits != nil && v.Remaining*nearLimitFraction < v.Limits.Bucket.Capacity():
		m.counters.of(v.Rule, nearLimitSlot, func() prometheus.Counter { return m.nearLimit.WithLabelValues(ruleName(v.Rule)) }).Inc()
	}
}

// ruleName is r's name, "" for none.
func ruleName(r *policy.Rule) string {
	if r == nil {
		return ""
	}
	return r.Name
}

func (m *Metrics) invalid(err error) {
	if m == nil || errors.Is(err, ErrClosed) {
		return
	}
	switch {
	case invalidCheck(err):
		m.invalids.Inc()
	case errors.Is(err, ErrIdempotencyPending):
		m.pending.Inc()
	}
}

// invalidRequest counts a request rejected as a whole (an oversized batch), with the malformed
// checks.
func (m *Metrics) invalidRequest() {
	if m != nil {
		m.invalids.Inc()
	}
}

func (m *Metrics) replay() {
	if m != nil {
		m.replays.Inc()
	}
}

func (m *Metrics) batch(api string, n int) {
	if m != nil {
		m.batchChecks.WithLabelValues(api).Observe(float64(n))
	}
}

func (m *Metrics) stream(delta float64) {
	if m != nil {
		m.streams.Add(delta)
	}
}

func (m *Metrics) envoy(code string) {
	if m != nil {
		m.envoyAnswers.WithLabelValues(code).Inc()
	}
}

func (m *Metrics) watchIdempotency(i *idempotency) {
	if m != nil {
		m.idem.Store(i)
	}
}

func (m *Metrics) fallback() {
	if m != nil {
		m.fallbacks.Inc()
	}
}

func (m *Metrics) refillDone(d time.Duration, err error) {
	if m == nil {
		return
	}
	m.refill.Observe(d.Seconds())
	m.callError("acquire", err)
}

func (m *Metrics) callError(call string, err error) {
	if m == nil || err == nil {
		return
	}
	m.callErrors.WithLabelValues(call, status.Code(err).String()).Inc()
}

// coreCollector exports the Limiter's counters and the Refresher's state at scrape time.
type coreCollector struct {
	lim *Limiter
	ref *Refresher
}

var coreDescs = struct {
	grants, grantedTokens, refillDenials, itemFailures, acquires, resends, refillsDropped, returns, returnedTokens,
	creditedTokens, lostTokens, skippedReturns, skippedTokens, expiries, grace, evictions, degraded, shadow, mismatches,
	settleHolds, settleDropped, settles, settleCredited, settleUncredited, settleSpent *prometheus.Desc
	debtTokens, debtCharged, debtForgiven, debtLost, holdsWaiting                                      *prometheus.Desc
	refunds, refundsLost, refundsLostTokens, outstanding, keys, inflight, queuedRefills, queuedReturns *prometheus.Desc
}{
	grants:            desc("lease_grants_total", "Leases granted by the coordinators."),
	grantedTokens:     desc("lease_granted_tokens_total", "Tokens granted in leases."),
	refillDenials:     desc("refill_denials_total", "Refills denied by the global bucket (the key answers deny locally until the Retry-After)."),
	itemFailures:      desc("refill_item_failures_total", "Refill items the coordinator could not serve (the store failed for the key, or it did not know the route)."),
	acquires:          desc("acquire_calls_total", "Acquire calls built (each carries up to 256 keys)."),
	resends:           desc("acquire_resends_total", "Acquire calls sent again with the seq of a call whose outcome was unknown (timed out, connection lost, store timed out), so the coordinator answers what Redis applied from its record."),
	refillsDropped:    desc("refills_dropped_total", "Queued refills not sent because every check that asked for them had stopped waiting (answered by the rule's failure mode after --max-wait) and the key does not refill ahead of need: under overload the queue holds only refills some check still waits for."),
	returns:           desc("lease_returns_total", "Leases handed back in Return calls (expired, evicted, replaced by a policy change, or at shutdown)."),
	returnedTokens:    desc("lease_returned_tokens_total", "Unspent tokens handed back in Return calls."),
	creditedTokens:    desc("lease_credited_tokens_total", "Tokens the coordinators credited back (returned tokens less the refill since their grant, capped at capacity)."),
	lostTokens:        desc("tokens_lost_total", "Unspent tokens whose Return failed: out of the global bucket until it refills them."),
	skippedReturns:    desc("lease_skipped_returns_total", "Expired leases not returned because the refill since their grant covers their unspent tokens (a Return would credit nothing)."),
	skippedTokens:     desc("lease_skipped_tokens_total", "Unspent tokens of the expired leases not returned (lease_skipped_returns_total)."),
	expiries:          desc("lease_expiries_total", "Leases that expired with tokens left."),
	grace:             desc("lease_grace_checks_total", "Checks served from a lease in its last clock guard: past its deadline by the coarse clock, within its lifetime by the exact clock."),
	evictions:         desc("evictions_total", "Keys evicted from the lease table by its size bound (their leases are returned)."),
	degraded:          desc("degraded_admissions_total", "Checks allowed by a local emergency bucket while the global state was unreachable."),
	shadow:            desc("shadow_denials_total", "Checks a shadow rule would have denied (answered allow)."),
	mismatches:        desc("policy_mismatches_total", "Refills a coordinator refused because it did not know this agent's policy version or a route."),
	refunds:           desc("charge_refunds_total", "Costs given back to their lease by a check of several buckets that another bucket refused."),
	refundsLost:       desc("charge_refunds_lost_total", "Of those, costs whose lease was retired in between: they stay spent (never moved into another lease)."),
	refundsLostTokens: desc("charge_refunds_lost_tokens_total", "Tokens of the refunds lost: spent without an admitted check."),
	settleHolds:       desc("settle_holds_total", "Checks allowed on an estimate, kept for Settle."),
	settleDropped:     desc("settle_holds_dropped_total", "Of those, dropped unsettled (past the settle window, or to make room): their estimate stays charged."),
	settles:           desc("settles_total", "Settle calls applied."),
	settleCredited:    desc("settle_credited_tokens_total", "Tokens of estimates given back by Settle (per bucket)."),
	settleUncredited:  desc("settle_uncredited_tokens_total", "Tokens of estimates Settle could not give back: no lease held them (lease: off, emergency answers, a lease changed under the check)."),
	settleSpent:       desc("settle_spent_tokens_total", "Tokens settled beyond estimates and spent from leases (per bucket)."),
	debtTokens:        desc("debt_tokens_total", "Tokens settled beyond estimates that no lease held: debt sent to the global buckets."),
	debtCharged:       desc("debt_charged_tokens_total", "Tokens of debt the global buckets were debited."),
	debtForgiven:      desc("debt_forgiven_tokens_total", "Tokens of debt not debited: the bucket was at its max_debt below zero."),
	debtLost:          desc("debt_lost_tokens_total", "Tokens of debt never debited: its bucket went with a replaced policy, or its call failed and may have been applied."),
	holdsWaiting:      desc("settle_holds", "Checks waiting for Settle."),
	outstanding:       desc("outstanding_lease_tokens", "Tokens this agent holds of the global buckets: unspent leases, and retired leases not yet credited back. At most this is lost if the agent dies."),
	keys:              desc("keys", "Keys in the lease table."),
	inflight:          desc("coordinator_calls_in_flight", "Acquire and Return calls in flight."),
	queuedRefills:     desc("queued_refills", "Keys waiting for a refill call."),
	queuedReturns:     desc("queued_returns", "Retired leases waiting for a Return call."),
}

func desc(name, help string) *prometheus.Desc {
	return prometheus.NewDesc("leasebucket_agent_"+name, help, nil, nil)
}

// storeOpsDesc counts the Limiter's store operations by rule (Stats.StoreOps).
var storeOpsDesc = prometheus.NewDesc("leasebucket_agent_store_operations_total",
	"Store operations this agent's coordinator calls asked for, by rule and call: each Acquire item (a refill, the key's own lease handed back in the same operation) is one (acquire), and each lease handed back on its own (return); resent calls count again. Over decisions_total of the rule: its store operations per check, about 1 where its keys are checked less often than a lease lives.",
	[]string{"rule", "call"}, nil)

func (c *coreCollector) Describe(ch chan<- *prometheus.Desc) {
	d := coreDescs
	for _, x := range []*prometheus.Desc{d.grants, d.grantedTokens, d.refillDenials, d.itemFailures, d.acquires, d.resends, d.refillsDropped,
		d.returns, d.returnedTokens, d.creditedTokens, d.lostTokens, d.skippedReturns, d.skippedTokens, d.expiries, d.grace, d.evictions, d.degraded, d.shadow,
		d.mismatches, d.refunds, d.refundsLost, d.refundsLostTokens, d.outstanding, d.keys, d.inflight, d.queuedRefills, d.queuedReturns,
		d.settleHolds, d.settleDropped, d.settles, d.settleCredited, d.settleUncredited, d.settleSpent,
		d.debtTokens, d.debtCharged, d.debtForgiven, d.debtLost, d.holdsWaiting, storeOpsDesc} {
		ch <- x
	}
}

func (c *coreCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.lim.Stats()
	d := coreDescs
	counter := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v)
	}
	gauge := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v)
	}
	counter(d.grants, float64(s.Grants.Load()))
	counter(d.grantedTokens, tokens(s.GrantedMicro.Load()))
	counter(d.refillDenials, float64(s.Denials.Load()))
	counter(d.itemFailures, float64(s.ItemFailures.Load()))
	counter(d.acquires, float64(s.Acquires.Load()))
	counter(d.resends, float64(s.Resends.Load()))
	counter(d.refillsDropped, float64(s.RefillsDropped.Load()))
	counter(d.returns, float64(s.Returns.Load()))
	counter(d.returnedTokens, tokens(s.ReturnedMicro.Load()))
	counter(d.creditedTokens, tokens(s.CreditedMicro.Load()))
	counter(d.lostTokens, tokens(s.LostMicro.Load()))
	counter(d.skippedReturns, float64(s.ReturnsSkipped.Load()))
	counter(d.skippedTokens, tokens(s.SkippedMicro.Load()))
	counter(d.expiries, float64(s.Expired.Load()))
	counter(d.grace, float64(s.Grace.Load()))
	counter(d.evictions, float64(s.Evicted.Load()))
	counter(d.degraded, float64(s.Degraded.Load()))
	counter(d.shadow, float64(s.ShadowDenied.Load()))
	counter(d.mismatches, float64(s.PolicyMismatch.Load()))
	counter(d.refunds, float64(s.Refunds.Load()))
	counter(d.refundsLost, float64(s.RefundsLost.Load()))
	counter(d.refundsLostTokens, tokens(s.RefundsLostMicro.Load()))
	counter(d.settleHolds, float64(s.Holds.Load()))
	counter(d.settleDropped, float64(s.HoldsDropped.Load()))
	counter(d.settles, float64(s.Settles.Load()))
	counter(d.settleCredited, tokens(s.SettleCredited.Load()))
	counter(d.settleUncredited, tokens(s.SettleUncredited.Load()))
	counter(d.settleSpent, tokens(s.SettleSpent.Load()))
	counter(d.debtTokens, tokens(s.DebtMicro.Load()))
	counter(d.debtCharged, tokens(s.DebtCharged.Load()))
	counter(d.debtForgiven, tokens(s.DebtForgiven.Load()))
	counter(d.debtLost, tokens(s.DebtLost.Load()))
	s.StoreOps(func(rule string, acquires, returns uint64) {
		ch <- prometheus.MustNewConstMetric(storeOpsDesc, prometheus.CounterValue, float64(acquires), rule, "acquire")
		ch <- prometheus.MustNewConstMetric(storeOpsDesc, prometheus.CounterValue, float64(returns), rule, "return")
	})
	gauge(d.holdsWaiting, float64(c.lim.holds.Len()))
	held := int64(c.lim.Outstanding())
	inflight := 0
	if c.ref != nil {
		held += c.ref.Returning()
		inflight = c.ref.InFlight()
	}
	gauge(d.outstanding, tokens(uint64(held)))
	gauge(d.keys, float64(c.lim.Keys()))
	gauge(d.inflight, float64(inflight))
	refills, returns := c.lim.Pending()
	gauge(d.queuedRefills, float64(refills))
	gauge(d.queuedReturns, float64(returns))
}

func tokens(micro uint64) float64 { return float64(micro) / float64(bucket.PerToken) }

// microString shows µ as tokens with up to six decimals ("2.5", "0.000001").
func microString(micro int64) string {
	return strconv.FormatFloat(float64(micro)/float64(bucket.PerToken), 'f', -1, 64)
}
