package main

import (
	"context"
	"net/http"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// agentReadiness is what the gateway's readiness needs of the agent client (*client.Client).
type agentReadiness interface {
	Ready(ctx context.Context) error
}

// health serves the gateway's liveness (/livez) and readiness (/readyz) endpoints.
//
// Live: the process serves HTTP. It never depends on the agent: restarting a gateway does not
// bring its agent back. Ready: the agent answers and serves checks, asked afresh on every probe
// (an idle connection is not a broken one), and the gateway is not shutting down. A gateway that
// is live but not ready would answer each request with the route's failure mode; a load balancer
// should send its traffic to another.
type health struct {
	agent   agentReadiness
	timeout time.Duration // bound on one readiness probe of the agent
	log     *zap.Logger

	stopping atomic.Bool
	verdict  atomic.Int32 // the last readiness answered: verdictUnknown, verdictReady or verdictNotReady
}

const (
	verdictUnknown int32 = iota
	verdictReady
	verdictNotReady
)

func newHealth(agent agentReadiness, timeout time.Duration, log *zap.Logger) *health {
	return &health{agent: agent, timeout: timeout, log: log}
}

// register adds /livez and /readyz to mux.
func (h *health) register(mux *http.ServeMux) {
	mux.HandleFunc("GET /livez", h.livez)
	mux.HandleFunc("GET /readyz", h.readyz)
}

// stop turns readiness off for good: the gateway is shutting down.
func (h *health) stop() { h.stopping.Store(true) }

func (h *health) livez(w http.ResponseWriter, _ *http.Request) {
	writeStatus(w, http.StatusOK, "live")
}

func (h *health) readyz(w http.ResponseWriter, r *http.Request) {
	if h.stopping.Load() {
		writeStatus(w, http.StatusServiceUnavailable, "not ready: shutting down")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.timeout)
	defer cancel()
	err := h.agent.Ready(ctx)
	if r.Context().Err() != nil {
		return // the prober gave up
	}
	if err != nil {
		if h.verdict.Swap(verdictNotReady) != verdictNotReady {
			h.log.Warn("not ready: the agent does not answer", zap.Error(err))
		}
		writeStatus(w, http.StatusServiceUnavailable, "not ready: the agent does not answer")
		return
	}
	if h.verdict.Swap(verdictReady) != verdictReady {
		h.log.Info("ready: the agent answers")
	}
	writeStatus(w, http.StatusOK, "ready")
}

func writeStatus(w http.ResponseWriter, code int, text string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_, _ = w.Write([]byte(text + "\n"))
}
