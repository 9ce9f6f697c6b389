// Command agent is the leasebucket agent: the node-local limiter every gateway on a node asks
// "may this identity do this operation on this route now?". It answers from leases of the global
// buckets over a Unix socket and refills them from the coordinators. Run it with --help for its
// flags; docs/agent.md describes it.
package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/user"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/agent/audit"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/cli"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/tlsconfig"
	"github.com/leasebucket/leasebucket/policy"
)

func main() {
	cli.Main("agent", func(ctx context.Context) error { return run(ctx, os.Args[1:], os.Getenv, os.Stderr) })
}

// newRegistry makes the registry run serves on /metrics. The tests that check the deployment
// files' metric names against what the agent exports wrap it to see that registry.
var newRegistry = prometheus.NewRegistry

// config is the agent's configuration: flags, each with an environment variable as its default.
type config struct {
	socket          string
	socketGroup     string
	listen          string
	coordinators    string
	policyFile      string
	policyInterval  time.Duration
	overridesEvery  time.Duration
	tlsCA           string
	tlsCert         string
	tlsKey          string
	tlsServerName   string
	maxWait         time.Duration
	callTimeout     time.Duration
	callsInFlight   int
	maxKeys         int
	region          string
	metricsListen   string
	healthListen    string
	shutdownTimeout time.Duration
	log             cli.Logging
	deprecated      []cli.Deprecation // old names used, logged at start

	idempotencyWindow time.Duration
	settleWindow      time.Duration
	maxSettleHolds    int
	idempotencyKeys   int
	auditLog          string
	auditSampleAllow  float64
	auditQueue        int
	debugListen       string
}

const usageHeader = `Usage: agent [flags]

The leasebucket agent answers rate-limit checks on a Unix socket (gRPC AgentService, Envoy's
envoy.service.ratelimit.v3.RateLimitService and grpc.health.v1) from leases of the global buckets,
refilled from the coordinators. Every flag can also be set by the environment variable shown in
parentheses; a flag on the command line wins. SIGINT or SIGTERM shuts it down gracefully: it stops
taking checks and returns its leases.

Flags:
`

func parseFlags(args []string, getenv func(string) string, stderr io.Writer) (config, error) {
	var c config
	f := newFlags(&c, getenv, stderr)
	if err := f.Parse(args); err != nil {
		return c, err
	}
	c.deprecated = f.Deprecated()
	return c, c.check(f)
}

// newFlags defines the agent's flags, which set c.
func newFlags(c *config, getenv func(string) string, stderr io.Writer) *cli.Flags {
	f := cli.NewFlags("agent", usageHeader, getenv, stderr)
	f.EnvString(&c.socket, "socket", "LEASEBUCKET_AGENT_SOCKET", agent.DefaultSocket,
		"Unix socket to serve checks on (mode 0660; a stale socket is removed, a live one is never taken)")
	f.EnvString(&c.socketGroup, "socket-group", "LEASEBUCKET_AGENT_SOCKET_GROUP", "",
		"group (name or id) given the socket, so gateways in that group may connect; default: the agent's group")
	f.EnvString(&c.listen, "listen", "LEASEBUCKET_AGENT_LISTEN", "",
		"also serve checks on this TCP address, plaintext and unauthenticated (for gateways that cannot reach the socket); default: off")
	f.EnvString(&c.coordinators, "coordinators", "LEASEBUCKET_COORDINATORS", "",
		"coordinators: a comma-separated list of host:port, or one host:port or dns:///name:port resolved to all its addresses (required)")
	f.EnvString(&c.policyFile, "policy", "LEASEBUCKET_POLICY", "",
		"policy file, the same file the coordinators read; reloaded when it changes (required)")
	f.EnvDuration(&c.policyInterval, "policy-interval", "LEASEBUCKET_POLICY_INTERVAL", policy.DefaultPollInterval,
		"how often the policy file is checked for changes")
	f.EnvDuration(&c.overridesEvery, "overrides-interval", "LEASEBUCKET_AGENT_OVERRIDES_INTERVAL", agent.DefaultOverridesInterval,
		"how often the coordinators are asked for the runtime tenant overrides (applied over the policy file); 0: never, the file alone")
	f.EnvString(&c.tlsCA, "tls-ca", "LEASEBUCKET_AGENT_TLS_CA", "",
		"CA file to verify coordinators with; any tls-* flag turns TLS on (default: plaintext)")
	f.EnvString(&c.tlsCert, "tls-cert", "LEASEBUCKET_AGENT_TLS_CERT", "", "client certificate for mutual TLS with the coordinators")
	f.EnvString(&c.tlsKey, "tls-key", "LEASEBUCKET_AGENT_TLS_KEY", "", "client key for mutual TLS with the coordinators")
	f.EnvString(&c.tlsServerName, "tls-server-name", "LEASEBUCKET_AGENT_TLS_SERVER_NAME", "",
		"name to verify in the coordinators' certificates (default: the host of the address)")
	f.EnvDuration(&c.maxWait, "max-wait", "LEASEBUCKET_AGENT_MAX_WAIT", agent.DefaultMaxWait,
		"longest a check waits for a refill before the route's failure mode answers (never past the caller's deadline)")
	f.EnvDuration(&c.callTimeout, "call-timeout", "LEASEBUCKET_AGENT_CALL_TIMEOUT", agent.DefaultCallTimeout,
		"timeout of one Acquire or Return call to a coordinator (a timed-out call is retried once)")
	f.EnvInt(&c.callsInFlight, "calls-in-flight", "LEASEBUCKET_AGENT_CALLS_IN_FLIGHT", agent.DefaultMaxInFlight,
		"most Acquire and Return calls out to the coordinators at once; refills queued while all are out go together in the next call")
	f.EnvInt(&c.maxKeys, "max-keys", "LEASEBUCKET_AGENT_MAX_KEYS", agent.DefaultMaxKeys,
		"most keys in the lease table; the least recently used are evicted and their leases returned")
	f.EnvString(&c.region, "region", "LEASEBUCKET_REGION", "", "this node's region, for rules with regional scope")
	f.EnvString(&c.metricsListen, "metrics-listen", "LEASEBUCKET_AGENT_METRICS_LISTEN", ":7072",
		"HTTP address serving Prometheus /metrics; empty: off")
	f.EnvString(&c.healthListen, "health-listen", "LEASEBUCKET_AGENT_HEALTH_LISTEN", "",
		"TCP address serving grpc.health.v1 alone, plaintext, for probes that cannot use the socket (a kubelet's grpc probe); default: off")
	f.EnvDuration(&c.shutdownTimeout, "shutdown-timeout", "LEASEBUCKET_AGENT_SHUTDOWN_TIMEOUT", 5*time.Second,
		"bound on a graceful shutdown: checks in flight finish, then leases are returned")
	f.EnvDuration(&c.idempotencyWindow, "idempotency-window", "LEASEBUCKET_AGENT_IDEMPOTENCY_WINDOW", agent.DefaultIdempotencyWindow,
		"how long a repeat of a check's idempotency key on the same bucket gets the first allow without a charge; 0: off (every repeat is charged)")
	f.EnvInt(&c.idempotencyKeys, "idempotency-keys", "LEASEBUCKET_AGENT_IDEMPOTENCY_KEYS", agent.DefaultIdempotencyKeys,
		"most idempotency keys remembered; the oldest are forgotten first")
	f.EnvDuration(&c.settleWindow, "settle-window", "LEASEBUCKET_AGENT_SETTLE_WINDOW", agent.DefaultSettleWindow,
		"how long a check allowed on an estimate (settle: true) can be settled with its actual cost; unsettled, the estimate stands")
	f.EnvInt(&c.maxSettleHolds, "max-settle-holds", "LEASEBUCKET_AGENT_MAX_SETTLE_HOLDS", agent.DefaultMaxHolds,
		"most checks waiting to be settled (about 200 bytes each); beyond, the oldest keep their estimate")
	f.EnvString(&c.auditLog, "audit-log", "LEASEBUCKET_AGENT_AUDIT_LOG", "stdout",
		`audit events (JSON lines): "stdout", a file (appended to), or "off"`)
	f.EnvFloat64(&c.auditSampleAllow, "audit-sample-allow", "LEASEBUCKET_AGENT_AUDIT_SAMPLE_ALLOW", audit.DefaultSampleAllow,
		"fraction of allows audited (0..1); denies, unavailable, degraded and shadow-would-deny answers are always audited")
	f.EnvInt(&c.auditQueue, "audit-queue", "LEASEBUCKET_AGENT_AUDIT_QUEUE", audit.DefaultCapacity,
		"audit events queued at most; beyond, events are dropped (sampled allows first) and counted")
	f.EnvString(&c.debugListen, "debug-listen", "LEASEBUCKET_AGENT_DEBUG_LISTEN", "",
		"loopback address (127.0.0.1:7073) of the read-only debug endpoint: live leases and explain; default: off")
	f.LogFlags(&c.log)
	return f
}

// check rejects missing, contradictory and out-of-range settings once f parsed.
func (c *config) check(f *cli.Flags) error {
	switch {
	case f.NArg() > 0:
		return fmt.Errorf("unexpected arguments %q (see --help)", f.Args())
	case c.coordinators == "":
		return errors.New("--coordinators is required (see --help)")
	case c.policyFile == "":
		return errors.New("--policy is required (see --help)")
	case c.maxWait <= 0 || c.callTimeout <= 0 || c.shutdownTimeout <= 0:
		return errors.New("--max-wait, --call-timeout and --shutdown-timeout must be positive")
	case c.overridesEvery < 0:
		return errors.New("--overrides-interval must not be negative (0 turns runtime overrides off)")
	case c.maxKeys <= 0:
		return errors.New("--max-keys must be positive")
	case c.callsInFlight <= 0:
		return errors.New("--calls-in-flight must be positive")
	case c.settleWindow <= 0 || c.maxSettleHolds <= 0:
		return errors.New("--settle-window and --max-settle-holds must be positive")
	case c.idempotencyWindow < 0 || (c.idempotencyWindow > 0 && c.idempotencyWindow < max(time.Second, 2*c.maxWait)):
		// A repeat must find the first check's record while that check is still being decided.
		return errors.New("--idempotency-window must be 0 (off) or at least 1s and twice --max-wait")
	case c.idempotencyKeys <= 0 || c.auditQueue <= 0:
		return errors.New("--idempotency-keys and --audit-queue must be positive")
	case !(c.auditSampleAllow >= 0 && c.auditSampleAllow <= 1):
		return errors.New("--audit-sample-allow must be between 0 and 1")
	}
	return nil
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
	cli.WarnDeprecated(log, cfg.deprecated)
	id, err := agentID()
	if err != nil {
		return err
	}
	log = log.With(zap.String("agent_id", id))

	reg := newRegistry()
	reg.MustRegister(cli.RuntimeCollectors()...)

	// The Limiter follows the policy source: the file (a reload that parses and validates
	// replaces the policy, leases of the old version are returned; a broken file keeps the last
	// good one) with the runtime overrides the coordinators serve applied.
	var (
		lim *agent.Limiter
		src *agent.PolicySource // set before the watcher starts
	)
	watcher, err := policy.NewWatcher(cfg.policyFile, policy.WatchOptions{
		Interval: cfg.policyInterval, Logger: log, Registerer: reg,
		OnChange: func(_, set *policy.Set) { src.SetFile(set) },
	})
	if err != nil {
		return err
	}
	defer watcher.Close()
	warnRegion(log, watcher.Current(), cfg.region)

	tlsCfg, err := clientTLS(cfg)
	if err != nil {
		return err
	}
	if tlsCfg == nil {
		log.Warn("talking to the coordinators in plaintext; set --tls-ca (and --tls-cert/--tls-key for mutual TLS) outside a local setup")
	}
	conn, err := agent.DialCoordinators(strings.Split(cfg.coordinators, ","), tlsCfg)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	// Connect now rather than on the first refill: the first check on a key then waits for one
	// round trip, not for a connection's set-up as well.
	conn.Connect()

	var overrides agent.OverridesClient
	if cfg.overridesEvery > 0 {
		overrides = agent.NewOverridesClient(conn)
	}
	src = agent.NewPolicySource(agent.PolicySourceConfig{
		File: watcher.Current(), Client: overrides, CallTimeout: cfg.callTimeout, Logger: log,
		Apply: func(set *policy.Set) {
			if lim != nil {
				lim.SetPolicy(set)
			}
		},
	})
	// Start with the coordinators' overrides if they answer now; if not, the first refill they
	// refuse for its version, or the next poll, fetches them.
	if err := refreshOverrides(ctx, src, cfg.callTimeout); err != nil {
		log.Warn("runtime overrides not fetched at start", zap.Error(err))
	}

	clk := clock.NewCoarse(time.Millisecond)
	defer clk.Close()
	metrics := agent.NewMetrics()
	lim = agent.New(agent.Config{
		AgentID: id, Region: cfg.region, MaxKeys: cfg.maxKeys, Guard: clock.Guard, Exact: clk.Fresh,
		SettleWindow: cfg.settleWindow, MaxHolds: cfg.maxSettleHolds,
	}, src.Current())
	ref := agent.NewRefresher(agent.RefresherConfig{
		Coordinator: agent.CoordinatorClient(conn),
		Clock:       clk,
		CallTimeout: cfg.callTimeout,
		MaxInFlight: cfg.callsInFlight,
		ReloadPolicy: func() {
			_, _ = watcher.Reload() // OnChange installs a new policy; errors are logged by the watcher
			if err := refreshOverrides(context.Background(), src, cfg.callTimeout); err != nil {
				log.Warn("runtime overrides not fetched", zap.Error(err))
			}
		},
		Metrics: metrics,
		Logger:  log,
	})
	if err := metrics.Register(reg, lim, ref); err != nil {
		return err
	}
	auditQ, closeAudit, err := startAudit(cfg, id, clk, reg, log)
	if err != nil {
		return err
	}
	defer closeAudit()

	// Listen before starting anything: a socket in use (another agent) stops here.
	listeners, mln, dln, hln, err := listen(cfg)
	if err != nil {
		return err
	}
	ref.Start(lim)
	watcher.Start()
	pollCtx, stopPoll := context.WithCancel(context.Background())
	var polling sync.WaitGroup
	polling.Go(func() { src.Run(pollCtx, cfg.overridesEvery) })
	stopOverrides := sync.OnceFunc(func() { stopPoll(); polling.Wait() })
	defer stopOverrides()

	idemWindow := cfg.idempotencyWindow
	if idemWindow == 0 {
		idemWindow = -1 // off
	}
	srv := agent.NewServer(agent.ServerConfig{Limiter: lim, Clock: clk, MaxWait: cfg.maxWait, Metrics: metrics, Logger: log,
		IdempotencyWindow: idemWindow, IdempotencyKeys: cfg.idempotencyKeys, Audit: auditQ})
	g := grpc.NewServer(agent.GRPCServerOptions()...)
	hs := srv.Register(g)
	stopHealth := func() {}
	if hln != nil {
		stopHealth = cli.ServeHealth(hln, hs, log)
	}

	errc := make(chan error, len(listeners)+2)
	for _, ln := range listeners {
		go func() { errc <- g.Serve(ln) }()
	}
	var metricsSrv *http.Server
	if mln != nil {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
		metricsSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() { errc <- metricsSrv.Serve(mln) }()
		log.Info("metrics", zap.String("addr", mln.Addr().String()))
	}
	var debugSrv *http.Server
	if dln != nil {
		debugSrv = &http.Server{Handler: agent.DebugHandler(lim, clk), ReadHeaderTimeout: 5 * time.Second}
		go func() { errc <- debugSrv.Serve(dln) }()
		log.Info("debug endpoint", zap.String("addr", dln.Addr().String()))
	}
	addrs := make([]string, len(listeners))
	for i, ln := range listeners {
		addrs[i] = ln.Addr().String()
	}
	log.Info("agent serving", zap.Strings("listen", addrs), zap.String("coordinators", cfg.coordinators),
		zap.String("policy_version", watcher.Current().Version()), zap.String("region", cfg.region),
		zap.Duration("max_wait", cfg.maxWait), zap.Int("max_keys", cfg.maxKeys))

	var serveErr error
	select {
	case <-ctx.Done():
		log.Info("shutting down")
	case serveErr = <-errc:
		log.Error("server failed; shutting down", zap.Error(serveErr))
	}

	// Stop taking checks (health says NOT_SERVING at once; checks in flight finish, waiting at
	// most --max-wait each; streams answer what they read and end), then retire every lease and
	// return it.
	stopOverrides()
	hs.Shutdown()
	srv.Drain()
	graceful := make(chan struct{})
	go func() { g.GracefulStop(); close(graceful) }()
	select {
	case <-graceful:
	case <-time.After(cfg.shutdownTimeout / 2):
		g.Stop()
		<-graceful
	}
	closeAudit() // every check is answered: write what is queued
	stopRefresher(log, ref, cfg.shutdownTimeout/2)
	stopHealth()
	for _, hsrv := range []*http.Server{metricsSrv, debugSrv} {
		if hsrv != nil {
			sctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_ = hsrv.Shutdown(sctx)
			cancel()
		}
	}
	for _, ln := range listeners {
		_ = ln.Close() // GracefulStop closed them; this removes nothing twice
	}
	log.Info("agent stopped")
	if errors.Is(serveErr, http.ErrServerClosed) || errors.Is(serveErr, grpc.ErrServerStopped) {
		serveErr = nil
	}
	return serveErr
}

// listen opens the Unix socket, the optional TCP listener, the metrics listener, the debug
// listener and the health listener (nil when off); on an error it closes what it opened.
func listen(cfg config) (checks []net.Listener, metrics, debug, health net.Listener, err error) {
	defer func() {
		if err != nil {
			for _, ln := range append(checks, metrics, debug) {
				if ln != nil {
					_ = ln.Close()
				}
			}
		}
	}()
	gid, err := lookupGroup(cfg.socketGroup)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	sock, err := agent.ListenUnix(cfg.socket, agent.SocketMode, gid)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	checks = append(checks, sock)
	if cfg.listen != "" {
		tcp, err := net.Listen("tcp", cfg.listen)
		if err != nil {
			return checks, nil, nil, nil, fmt.Errorf("listen %s: %w", cfg.listen, err)
		}
		checks = append(checks, tcp)
	}
	if cfg.metricsListen != "" {
		if metrics, err = net.Listen("tcp", cfg.metricsListen); err != nil {
			return checks, nil, nil, nil, fmt.Errorf("metrics listen %s: %w", cfg.metricsListen, err)
		}
	}
	if cfg.debugListen != "" {
		if debug, err = agent.ListenDebug(cfg.debugListen); err != nil {
			return checks, metrics, nil, nil, fmt.Errorf("--debug-listen: %w", err)
		}
	}
	if cfg.healthListen != "" {
		if health, err = net.Listen("tcp", cfg.healthListen); err != nil {
			return checks, metrics, debug, nil, fmt.Errorf("--health-listen %s: %w", cfg.healthListen, err)
		}
	}
	return checks, metrics, debug, health, nil
}

// startAudit opens the sink --audit-log names and starts the audit queue; the queue is nil
// when audit is off. The returned function writes what is queued and closes the sink; it is
// idempotent.
func startAudit(cfg config, agentID string, clk clock.Clock, reg prometheus.Registerer, log *zap.Logger) (*audit.Queue, func(), error) {
	var (
		ws   zapcore.WriteSyncer
		file *os.File
	)
	switch cfg.auditLog {
	case "", "off":
		log.Warn("audit is off (--audit-log off): denies and degraded answers leave no trace")
		return nil, func() {}, nil
	case "stdout", "-":
		ws = zapcore.Lock(os.Stdout)
	default:
		f, err := os.OpenFile(cfg.auditLog, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640)
		if err != nil {
			return nil, nil, fmt.Errorf("--audit-log: %w", err)
		}
		ws, file = f, f
	}
	// Buffered: one write system call per 256 KiB or per second, not per event.
	buffered := &zapcore.BufferedWriteSyncer{WS: ws, Size: 256 << 10, FlushInterval: time.Second}
	q, err := audit.New(audit.Config{
		Capacity: cfg.auditQueue, SampleAllow: cfg.auditSampleAllow, Sink: audit.NewJSONSink(buffered, agentID),
		Clock: clk, Registerer: reg, Logger: log,
	})
	if err != nil {
		if file != nil {
			_ = file.Close()
		}
		return nil, nil, err
	}
	q.Start()
	log.Info("audit", zap.String("log", cfg.auditLog), zap.Float64("sample_allow", cfg.auditSampleAllow))
	return q, sync.OnceFunc(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if err := q.Close(ctx); err != nil {
			log.Error("audit events not written at shutdown", zap.Error(err))
		}
		if err := buffered.Stop(); err != nil {
			log.Error("audit log", zap.Error(err))
		}
		if file != nil {
			if err := file.Close(); err != nil {
				log.Error("audit log", zap.Error(err))
			}
		}
	}), nil
}

// stopRefresher closes the Limiter and returns its leases within d.
func stopRefresher(log *zap.Logger, ref *agent.Refresher, d time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	if err := ref.Stop(ctx); err != nil {
		log.Error("leases not returned at shutdown", zap.Error(err))
		return
	}
	log.Info("leases returned")
}

// refreshOverrides fetches the runtime overrides once, within timeout.
func refreshOverrides(ctx context.Context, src *agent.PolicySource, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return src.Refresh(ctx)
}

// agentID names this process to the coordinators: unique per process (a restarted agent must not
// be answered from its predecessor's idempotency records), readable in their logs.
func agentID() (string, error) {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "agent"
	}
	if len(host) > 64 {
		host = host[:64]
	}
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("agent id: %w", err)
	}
	id := host + "-" + strconv.Itoa(os.Getpid()) + "-" + hex.EncodeToString(b[:])
	if len(id) > coordinator.MaxAgentID {
		id = id[len(id)-coordinator.MaxAgentID:]
	}
	return id, nil
}

func clientTLS(cfg config) (*tls.Config, error) {
	if cfg.tlsCA == "" && cfg.tlsCert == "" && cfg.tlsKey == "" && cfg.tlsServerName == "" {
		return nil, nil
	}
	return tlsconfig.Client(cfg.tlsCA, cfg.tlsCert, cfg.tlsKey, cfg.tlsServerName)
}

// lookupGroup resolves --socket-group; -1 keeps the agent's own group.
func lookupGroup(name string) (int, error) {
	if name == "" {
		return -1, nil
	}
	if gid, err := strconv.Atoi(name); err == nil {
		return gid, nil
	}
	g, err := user.LookupGroup(name)
	if err != nil {
		return 0, fmt.Errorf("--socket-group: %w", err)
	}
	return strconv.Atoi(g.Gid)
}

// warnRegion logs the regional rules this agent cannot serve: their checks are rejected until
// --region names one of their regions.
func warnRegion(log *zap.Logger, set *policy.Set, region string) {
	for _, r := range set.Rules() {
		if r.Scope != policy.Regional {
			continue
		}
		known := false
		for _, rq := range r.Regions {
			known = known || rq.Region == region
		}
		if !known {
			log.Warn("this agent's region is not one of a regional rule's regions; its checks will be rejected",
				zap.String("rule", r.Name), zap.String("region", region))
		}
	}
}
