// Command gateway is an example API gateway with the leasebucket rate-limit filter: a small
// reverse proxy that authenticates requests by bearer token, asks the node's agent about each
// one (package httplimit), and forwards only the allowed ones to its upstream. Run it with --help
// for its flags; docs/gateway.md describes it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/httplimit"
	"github.com/leasebucket/leasebucket/internal/cli"
	"github.com/leasebucket/leasebucket/policy"
)

func main() {
	cli.Main("gateway", func(ctx context.Context) error { return run(ctx, os.Args[1:], os.Getenv, os.Stderr) })
}

type config struct {
	listen            string
	upstream          string
	socket            string
	policyFile        string
	policyInterval    time.Duration
	tokensFile        string
	anonymous         string
	region            string
	checkTimeout      time.Duration
	idempotencyHeader string
	degradedHeader    string
	unary             bool
	metricsListen     string
	shutdownTimeout   time.Duration
	log               cli.Logging
}

const usageHeader = `Usage: gateway [flags]

An example API gateway with the leasebucket rate-limit filter: a reverse proxy to --upstream that
authenticates each request by its bearer token (--tokens maps tokens to tenants), asks the node's
agent whether the tenant may do the request now, and forwards it only if allowed: 429 over the
limit, 503 when the route fails closed, responses marked degraded while an emergency bucket
decides. Every flag can also be set by the environment variable shown in parentheses; a flag on the
command line wins. SIGINT or SIGTERM shuts it down gracefully.

Flags:
`

func parseFlags(args []string, getenv func(string) string, stderr io.Writer) (config, error) {
	var c config
	f := cli.NewFlags("gateway", usageHeader, getenv, stderr)
	f.EnvString(&c.listen, "listen", "LEASEBUCKET_GATEWAY_LISTEN", "127.0.0.1:8080", "HTTP address to serve on")
	f.EnvString(&c.upstream, "upstream", "LEASEBUCKET_GATEWAY_UPSTREAM", "", "upstream base URL, such as http://127.0.0.1:8081 (required)")
	f.EnvString(&c.socket, "agent-socket", "LEASEBUCKET_AGENT_SOCKET", client.DefaultSocket, "the agent's Unix socket")
	f.EnvString(&c.policyFile, "policy", "LEASEBUCKET_POLICY", "", "policy file, the one the agent reads; reloaded when it changes (required)")
	f.EnvDuration(&c.policyInterval, "policy-interval", "LEASEBUCKET_POLICY_INTERVAL", policy.DefaultPollInterval,
		"how often the policy file is checked for changes")
	f.EnvString(&c.tokensFile, "tokens", "LEASEBUCKET_GATEWAY_TOKENS", "",
		`bearer tokens: a file of "TOKEN TENANT" lines (required)`)
	f.EnvString(&c.anonymous, "anonymous-tenant", "LEASEBUCKET_GATEWAY_ANONYMOUS_TENANT", "",
		"limit requests without an Authorization header as this tenant (default: answer them 401)")
	f.EnvString(&c.region, "region", "LEASEBUCKET_REGION", "", "this node's region, as the agent's --region")
	f.EnvDuration(&c.checkTimeout, "check-timeout", "LEASEBUCKET_GATEWAY_CHECK_TIMEOUT", httplimit.DefaultTimeout,
		"longest wait for the agent's decision; past it the route's failure mode applies")
	f.EnvString(&c.idempotencyHeader, "idempotency-header", "LEASEBUCKET_GATEWAY_IDEMPOTENCY_HEADER", "",
		"request header passed to the agent as the idempotency key, such as Idempotency-Key (default: off; see docs/gateway.md)")
	f.EnvString(&c.degradedHeader, "degraded-header", "LEASEBUCKET_GATEWAY_DEGRADED_HEADER", httplimit.DefaultDegradedHeader,
		"response header marking responses decided by an emergency bucket")
	f.EnvBool(&c.unary, "unary", "LEASEBUCKET_GATEWAY_UNARY", false, "check with unary calls only, never the agent's CheckStream")
	f.EnvString(&c.metricsListen, "metrics-listen", "LEASEBUCKET_GATEWAY_METRICS_LISTEN", "",
		"HTTP address serving Prometheus /metrics, liveness /livez and readiness /readyz (ready while the agent answers; default: off)")
	f.EnvDuration(&c.shutdownTimeout, "shutdown-timeout", "LEASEBUCKET_GATEWAY_SHUTDOWN_TIMEOUT", 10*time.Second,
		"bound on a graceful shutdown: requests in flight finish")
	f.LogFlags(&c.log)
	if err := f.Parse(args); err != nil {
		return c, err
	}
	switch {
	case f.NArg() > 0:
		return c, fmt.Errorf("unexpected arguments %q (see --help)", f.Args())
	case c.upstream == "":
		return c, errors.New("--upstream is required (see --help)")
	case c.policyFile == "":
		return c, errors.New("--policy is required (see --help)")
	case c.tokensFile == "":
		return c, errors.New("--tokens is required (see --help)")
	case c.checkTimeout <= 0 || c.shutdownTimeout <= 0:
		return c, errors.New("--check-timeout and --shutdown-timeout must be positive")
	}
	return c, nil
}

func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	cfg, err := parseFlags(args, getenv, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	log, err := cfg.log.NewLogger(stderr)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	upstream, err := url.Parse(cfg.upstream)
	if err != nil || (upstream.Scheme != "http" && upstream.Scheme != "https") || upstream.Host == "" {
		return fmt.Errorf("--upstream %q: want an http:// or https:// URL", cfg.upstream)
	}
	toks, err := loadTokens(cfg.tokensFile)
	if err != nil {
		return err
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(cli.RuntimeCollectors()...)
	watcher, err := policy.NewWatcher(cfg.policyFile, policy.WatchOptions{Interval: cfg.policyInterval, Logger: log, Registerer: reg})
	if err != nil {
		return err
	}
	defer watcher.Close()
	metrics, err := httplimit.NewMetrics(reg)
	if err != nil {
		return err
	}
	agentClient, err := client.New(client.Options{Socket: cfg.socket, Unary: cfg.unary, Logger: log})
	if err != nil {
		return err
	}
	defer func() { _ = agentClient.Close() }()
	reg.MustRegister(
		prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "leasebucket", Subsystem: "gateway", Name: "agent_stream_checks_total",
			Help: "Checks answered on the agent's CheckStream."}, func() float64 { return float64(agentClient.Stats().StreamChecks) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "leasebucket", Subsystem: "gateway", Name: "agent_unary_checks_total",
			Help: "Unary Check calls to the agent (no stream, or a retry of a check a broken stream lost)."},
			func() float64 { return float64(agentClient.Stats().UnaryChecks) }),
	)
	filter, err := httplimit.New(httplimit.Config{
		Checker:           agentClient,
		Policy:            watcher,
		Identity:          httplimit.FromContext,
		Anonymous:         cfg.anonymous,
		Region:            cfg.region,
		Timeout:           cfg.checkTimeout,
		IdempotencyHeader: cfg.idempotencyHeader,
		DegradedHeader:    cfg.degradedHeader,
		Metrics:           metrics,
		Logger:            log,
	})
	if err != nil {
		return err
	}

	proxy := &httputil.ReverseProxy{
		// Rewrite (unlike Director) starts from a request without the client's X-Forwarded-*
		// headers; SetXForwarded then names only the real peer.
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(upstream)
			pr.SetXForwarded()
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if r.Context().Err() == nil {
				log.Warn("upstream failed", zap.Error(err))
			}
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			w.WriteHeader(http.StatusBadGateway)
			_, _ = w.Write([]byte(http.StatusText(http.StatusBadGateway) + "\n"))
		},
	}
	handler := toks.authenticate(filter.Handler(proxy), cfg.anonymous != "")

	ln, err := net.Listen("tcp", cfg.listen)
	if err != nil {
		return fmt.Errorf("listen %s: %w", cfg.listen, err)
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute,
		ErrorLog: zap.NewStdLog(log.Named("http"))}
	errc := make(chan error, 2)
	go func() { errc <- srv.Serve(ln) }()
	health := newHealth(agentClient, cfg.checkTimeout, log)
	var metricsSrv *http.Server
	if cfg.metricsListen != "" {
		mln, err := net.Listen("tcp", cfg.metricsListen)
		if err != nil {
			_ = srv.Close()
			return fmt.Errorf("metrics listen %s: %w", cfg.metricsListen, err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
		health.register(mux)
		metricsSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() { errc <- metricsSrv.Serve(mln) }()
		log.Info("metrics", zap.String("addr", mln.Addr().String()))
	}
	watcher.Start()
	log.Info("gateway serving", zap.String("addr", ln.Addr().String()), zap.String("upstream", upstream.String()),
		zap.String("agent_socket", cfg.socket), zap.String("policy_version", watcher.Current().Version()),
		zap.Bool("anonymous", cfg.anonymous != ""), zap.Bool("unary", cfg.unary))

	var serveErr error
	select {
	case <-ctx.Done():
		log.Info("shutting down")
	case serveErr = <-errc:
		log.Error("server failed; shutting down", zap.Error(serveErr))
	}
	health.stop() // /readyz answers 503 while requests in flight finish
	sctx, cancel := context.WithTimeout(context.Background(), cfg.shutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		log.Warn("requests still in flight at the shutdown bound", zap.Error(err))
	}
	if metricsSrv != nil {
		_ = metricsSrv.Shutdown(sctx)
	}
	log.Info("gateway stopped")
	if errors.Is(serveErr, http.ErrServerClosed) {
		serveErr = nil
	}
	return serveErr
}
