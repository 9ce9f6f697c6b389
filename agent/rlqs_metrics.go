package agent

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

// quotaMetrics are the metrics of the rate limit quota service (rlqs.go). A nil *quotaMetrics
// counts nothing.
type quotaMetrics struct {
	streams   prometheus.Gauge
	buckets   prometheus.Gauge
	requests  *prometheus.CounterVec
	actions   *prometheus.CounterVec
	allowed   prometheus.Counter // requests{outcome="allowed"}, resolved once: every usage counts
	denied    prometheus.Counter
	byAction  map[string]prometheus.Counter // actions by label, resolved once
	invalids  prometheus.Counter
	refusals  prometheus.Counter
	held      prometheus.Gauge
	releasedT prometheus.Counter
}

func newQuotaMetrics() *quotaMetrics {
	m := &quotaMetrics{
		streams: prometheus.NewGauge(gaugeOpts("quota_streams",
			"StreamRateLimitQuotas calls open (Envoy's rate limit quota service).")),
		buckets: prometheus.NewGauge(gaugeOpts("quota_buckets",
			"Buckets the open quota streams hold.")),
		requests: prometheus.NewCounterVec(counterOpts("quota_reported_requests_total",
			"Requests Envoy reported for its quota buckets, by outcome (allowed, denied): Envoy's own decisions, made locally."),
			[]string{"outcome"}),
		actions: prometheus.NewCounterVec(counterOpts("quota_actions_total",
			"Bucket actions sent to Envoy, by action: token_bucket (an assignment backed by a reservation), deny_all, expire (expired at once: Envoy's expired_assignment_behavior), allow_all (shadow rules), abandon."),
			[]string{"action"}),
		invalids: prometheus.NewCounter(counterOpts("quota_invalid_buckets_total",
			"Quota buckets whose bucket_id maps to no policy key (answered DENY_ALL).")),
		refusals: prometheus.NewCounter(counterOpts("quota_refused_messages_total",
			"Quota report messages refused as a whole (the stream ended with INVALID_ARGUMENT or RESOURCE_EXHAUSTED); nothing of them applied.")),
		held: prometheus.NewGauge(gaugeOpts("quota_reserved_tokens",
			"Tokens reserved from leases for quota assignments that Envoy may still admit from: spent as far as the bounds go, settled from Envoy's reports.")),
		releasedT: prometheus.NewCounter(counterOpts("quota_released_tokens_total",
			"Tokens of quota assignments given back once Envoy's reports showed it could no longer admit them (to the lease, or handed back to the coordinators).")),
	}
	m.allowed, m.denied = m.requests.WithLabelValues("allowed"), m.requests.WithLabelValues("denied")
	m.byAction = map[string]prometheus.Counter{}
	for _, a := range []string{"token_bucket", "deny_all", "expire", "allow_all", "abandon"} {
		m.byAction[a] = m.actions.WithLabelValues(a)
	}
	return m
}

func (m *quotaMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.streams, m.buckets, m.requests, m.actions, m.invalids, m.refusals, m.held, m.releasedT}
}

// quota is m's quota metrics (nil for a nil m).
func (m *Metrics) quota() *quotaMetrics {
	if m == nil {
		return nil
	}
	return m.quotaM
}

func (m *quotaMetrics) stream(delta float64) {
	if m != nil {
		m.streams.Add(delta)
	}
}

func (m *quotaMetrics) bucket(delta float64) {
	if m != nil {
		m.buckets.Add(delta)
	}
}

func (m *quotaMetrics) usage(allowed, denied uint64) {
	if m != nil {
		m.allowed.Add(float64(allowed))
		m.denied.Add(float64(denied))
	}
}

func (m *quotaMetrics) assigned(action string) {
	if m != nil {
		if c := m.byAction[action]; c != nil {
			c.Inc()
			return
		}
		m.actions.WithLabelValues(action).Inc()
	}
}

func (m *quotaMetrics) invalid() {
	if m != nil {
		m.invalids.Inc()
	}
}

func (m *quotaMetrics) refused() {
	if m != nil {
		m.refusals.Inc()
	}
}

func (m *quotaMetrics) reserved(micro int64) {
	if m != nil {
		m.held.Add(float64(micro) / float64(bucket.PerToken))
	}
}

func (m *quotaMetrics) released(micro int64) {
	if m != nil && micro > 0 {
		m.releasedT.Add(float64(micro) / float64(bucket.PerToken))
	}
}
