package coordinator

import (
	"fmt"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"

	"github.com/leasebucket/leasebucket/internal/bucket"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// Metrics are the coordinator's Prometheus metrics. Labels are bounded sets (method, status,
// code, scope); no label names a tenant, key or store node. A nil *Metrics records nothing.
type Metrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec

	items           [numMethods][numStatus]prometheus.Counter
	replays         [numMethods]prometheus.Counter
	batch           [numMethods]prometheus.Observer
	storeSeconds    [numMethods]prometheus.Observer
	storeBatchErrs  [numMethods]prometheus.Counter
	storeItemErrs   [numMethods]prometheus.Counter
	grants          prometheus.Counter
	returns         prometheus.Counter
	grantedTokens   prometheus.Counter
	returnedTokens  prometheus.Counter
	forfeitedTokens prometheus.Counter
	debtTokens      prometheus.Counter
	forgivenTokens  prometheus.Counter
	storeUp         prometheus.Gauge
	policy          *prometheus.GaugeVec
}

// method indexes the per-method children.
type method int

const (
	methodAcquire method = iota
	methodReturn
	numMethods
)

func (m method) String() string { return [...]string{"acquire", "return"}[m] }

// numStatus is one past the largest coordinatorv1.Status.
const numStatus = int(coordinatorv1.Status_STATUS_STALE) + 1

// batchBuckets are the batch-size histogram's buckets (items per call), up to MaxItems.
var batchBuckets = []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, MaxItems}

// latencyBuckets cover a store round trip within a region (sub-millisecond) up to the store
// timeout (seconds).
var latencyBuckets = []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5}

// NewMetrics creates the coordinator's metrics and registers them on reg (nil registers nothing).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	const ns, sub = "leasebucket", "coordinator"
	counter := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: name, Help: help})
	}
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "requests_total",
			Help: "gRPC calls handled, by method and status code."}, []string{"method", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Subsystem: sub, Name: "request_duration_seconds",
			Help: "Time to handle a gRPC call, by method.", Buckets: latencyBuckets}, []string{"method"}),
		grants:          counter("grants_total", "Leases granted (new grants only: replays of a retried Acquire are not counted)."),
		returns:         counter("returns_total", "Lease returns applied (new returns only)."),
		grantedTokens:   counter("granted_tokens_total", "Tokens debited from global buckets by grants."),
		returnedTokens:  counter("returned_tokens_total", "Tokens credited back to global buckets by returns."),
		forfeitedTokens: counter("return_forfeited_tokens_total", "Unspent tokens of returned leases not credited back (decayed by the refill since the grant, or above capacity)."),
		debtTokens:      counter("debt_tokens_total", "Tokens of costs settled after the fact debited from global buckets (even below zero, down to the rule's max_debt)."),
		forgivenTokens:  counter("debt_forgiven_tokens_total", "Tokens of costs settled after the fact not charged: the bucket was at its max_debt below zero."),
		storeUp: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "store_up",
			Help: "1 while the store answers the health probe (the gRPC health status is SERVING), else 0."}),
		policy: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "policy_info",
			Help: "The policy version in use (value 1)."}, []string{"version"}),
	}
	items := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "items_total",
		Help: "Items of Acquire and Return calls, by method and result status."}, []string{"method", "status"})
	replays := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "replays_total",
		Help: "Items answered from an idempotency record (a retried call), by method."}, []string{"method"})
	batch := prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Subsystem: sub, Name: "batch_items",
		Help: "Items per Acquire or Return call.", Buckets: batchBuckets}, []string{"method"})
	store := prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Subsystem: sub, Name: "store_duration_seconds",
		Help:    "Time of one store batch (with Redis: one pipelined round trip per node involved), by method.",
		Buckets: latencyBuckets}, []string{"method"})
	storeErrs := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "store_errors_total",
		Help: "Store failures by method and scope: batch (the whole call failed) or item (one key failed)."},
		[]string{"method", "scope"})
	for md := range numMethods {
		for st := range numStatus {
			if st == int(coordinatorv1.Status_STATUS_UNSPECIFIED) {
				continue
			}
			m.items[md][st] = items.WithLabelValues(md.String(), statusLabel(coordinatorv1.Status(st)))
		}
		m.replays[md] = replays.WithLabelValues(md.String())
		m.batch[md] = batch.WithLabelValues(md.String())
		m.storeSeconds[md] = store.WithLabelValues(md.String())
		m.storeBatchErrs[md] = storeErrs.WithLabelValues(md.String(), "batch")
		m.storeItemErrs[md] = storeErrs.WithLabelValues(md.String(), "item")
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.requests, m.duration, items, replays, batch, store, storeErrs,
		m.grants, m.returns, m.grantedTokens, m.returnedTokens, m.forfeitedTokens, m.debtTokens, m.forgivenTokens, m.storeUp, m.policy} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("coordinator: register metrics: %w", err)
		}
	}
	return m, nil
}

// statusLabel is "ok" for STATUS_OK, "store_unavailable" for STATUS_STORE_UNAVAILABLE.
func statusLabel(s coordinatorv1.Status) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "STATUS_"))
}

func tokens(µ bucket.Micro) float64 { return float64(µ) / float64(bucket.PerToken) }

func (m *Metrics) item(md method, s coordinatorv1.Status) {
	if m == nil || int(s) <= 0 || int(s) >= numStatus {
		return
	}
	m.items[md][s].Inc()
}

func (m *Metrics) batchSize(md method, n int) {
	if m != nil {
		m.batch[md].Observe(float64(n))
	}
}

func (m *Metrics) store(md method, d time.Duration, err error) {
	if m == nil {
		return
	}
	m.storeSeconds[md].Observe(d.Seconds())
	if err != nil {
		m.storeBatchErrs[md].Inc()
	}
}

func (m *Metrics) storeItemError(md method) {
	if m != nil {
		m.storeItemErrs[md].Inc()
	}
}

func (m *Metrics) granted(r TakeResult) {
	switch {
	case m == nil:
	case r.Replayed:
		m.replays[methodAcquire].Inc()
	case r.Granted > 0:
		m.grants.Inc()
		m.grantedTokens.Add(tokens(r.Granted))
	}
}

// debt counts what a take charged of its debt and what it forgave (new takes only).
func (m *Metrics) debt(r TakeResult, debt bucket.Micro) {
	if m == nil || debt <= 0 || r.Err != nil || r.Replayed || r.Stale {
		return
	}
	m.debtTokens.Add(tokens(r.Debited))
	m.forgivenTokens.Add(tokens(max(0, debt-r.Debited)))
}

func (m *Metrics) returned(r ReturnResult, unspent bucket.Micro) {
	switch {
	case m == nil:
	case r.Replayed:
		m.replays[methodReturn].Inc()
	default:
		m.returns.Inc()
		m.returnedTokens.Add(tokens(r.Granted))
		m.forfeitedTokens.Add(tokens(max(0, unspent-r.Granted)))
	}
}

// request counts one handled gRPC call.
func (m *Metrics) request(fullMethod string, code codes.Code, d time.Duration) {
	if m == nil {
		return
	}
	name := fullMethod[strings.LastIndexByte(fullMethod, '/')+1:]
	m.requests.WithLabelValues(name, code.String()).Inc()
	m.duration.WithLabelValues(name).Observe(d.Seconds())
}

// SetStoreUp records the store health probe's verdict.
func (m *Metrics) SetStoreUp(up bool) {
	if m == nil {
		return
	}
	if up {
		m.storeUp.Set(1)
	} else {
		m.storeUp.Set(0)
	}
}

func (m *Metrics) setPolicy(version string) {
	if m == nil {
		return
	}
	m.policy.Reset()
	m.policy.WithLabelValues(version).Set(1)
}
