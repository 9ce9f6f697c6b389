package httplimit

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the Filter's Prometheus metrics. Labels are bounded: rule names and outcomes,
// never a tenant or a path.
type Metrics struct {
	requests    *prometheus.CounterVec
	unreachable prometheus.Counter
	duration    prometheus.Histogram
	settles     *prometheus.CounterVec
}

// NewMetrics registers the Filter's metrics on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "leasebucket", Subsystem: "http", Name: "requests_total",
			Help: "Requests by rule and outcome: allow, deny (429), unavailable (503), degraded_allow, degraded_deny, " +
				"shadow_deny (a shadow rule would have denied), no_identity (503), bad_request (400), conflict (409: the " +
				"first request of its idempotency key is still being decided).",
		}, []string{"rule", "outcome"}),
		unreachable: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "leasebucket", Subsystem: "http", Name: "agent_unreachable_total",
			Help: "Checks the agent did not answer; the route's failure mode was applied by the filter.",
		}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "leasebucket", Subsystem: "http", Name: "check_duration_seconds",
			Help:    "Time to get the agent's decision (or give up on it).",
			Buckets: []float64{50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3},
		}),
		settles: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "leasebucket", Subsystem: "http", Name: "settles_total",
			Help: "Requests with Config.SettleCosts after their handler, by outcome: ok (the reported cost settled), " +
				"estimate (no cost reported: the estimate stands), error (the agent could not settle it).",
		}, []string{"outcome"}),
	}
	for _, c := range []prometheus.Collector{m.requests, m.unreachable, m.duration, m.settles} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *Metrics) outcome(rule, outcome string) {
	if m != nil {
		m.requests.WithLabelValues(rule, outcome).Inc()
	}
}

func (m *Metrics) checked(d time.Duration) {
	if m != nil {
		m.duration.Observe(d.Seconds())
	}
}

func (m *Metrics) agentUnreachable() {
	if m != nil {
		m.unreachable.Inc()
	}
}

func (m *Metrics) settled(outcome string) {
	if m != nil {
		m.settles.WithLabelValues(outcome).Inc()
	}
}
