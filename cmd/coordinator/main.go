// Command coordinator runs the leasebucket coordinator: the stateless lease service in front of
// Redis. `coordinator --help` lists its flags and environment variables; docs/coordinator.md
// describes how to run it.
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime/debug"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/cli"
	"github.com/leasebucket/leasebucket/internal/tlsconfig"
	"github.com/leasebucket/leasebucket/policy"
)

func main() {
	cli.Main("coordinator", func(ctx context.Context) error { return run(ctx, os.Args[1:], os.Getenv, os.Stderr) })
}

// newRegistry makes the registry run serves on /metrics. The tests that check the deployment
// files' metric names against what the coordinator exports wrap it to see that registry.
var newRegistry = prometheus.NewRegistry

const (
	// sweepInterval is how often the memory store drops expired keys: memory stays bounded by
	// the keys used within their time to fill plus coordinator.ExpiryMargin (two minutes), and a
	// sweep of even a million keys takes milliseconds.
	sweepInterval = 30 * time.Second

	// loadTimeout bounds loading the bucket script into Redis at start. A failure is not fatal:
	// the first batch loads it.
	loadTimeout = 5 * time.Second

	// metricsShutdown bounds the metrics server's shutdown after the gRPC server stopped.
	metricsShutdown = 5 * time.Second

	// redisGCPercent is the garbage collector's target (GOGC) of a coordinator on Redis when the
	// environment sets none. Such a coordinator holds no buckets: its live heap is a few
	// megabytes and nearly all it allocates is a batch's garbage, so at Go's default of 100 the
	// collector runs tens of times a second under load, for a heap that would not grow; what 400
	// saves and costs: docs/coordinator.md#memory-and-garbage-collection. The memory store keeps
	// the buckets on the heap, so it stays at Go's default.
	redisGCPercent = 400
)

// setsGCPercent reports whether run sets the collector target to redisGCPercent: for a Redis
// store, unless GOGC is set in the environment (the operator's choice stands).
func setsGCPercent(store string, getenv func(string) string) bool {
	return store == storeRedis && getenv("GOGC") == ""
}

// run is the coordinator: it serves until ctx is done, then shuts down gracefully. Logs go to
// stderr as JSON lines; so do the usage and flag errors.
func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	cfg, err := parseConfig(args, getenv, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	log, err := newLogger(stderr, cfg.log)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	cli.WarnDeprecated(log, cfg.deprecated)
	if setsGCPercent(cfg.store, getenv) {
		defer debug.SetGCPercent(debug.SetGCPercent(redisGCPercent)) // put back when run returns (tests run it in process)
		log.Info("garbage collector target set for a coordinator on Redis (GOGC overrides it)", zap.Int("gc_percent", redisGCPercent))
	}

	reg := newRegistry()
	reg.MustRegister(cli.RuntimeCollectors()...)
	metrics, err := coordinator.NewMetrics(reg)
	if err != nil {
		return err
	}

	var policies *coordinator.Policies // set before the watcher starts
	watcher, err := policy.NewWatcher(cfg.policyFile, policy.WatchOptions{
		Interval: cfg.policyInterval, Logger: log, Registerer: reg,
		OnChange: func(_, set *policy.Set) { policies.SetFile(set) },
	})
	if err != nil {
		return err
	}
	defer watcher.Close()

	store, overrides, probe, closeStore, err := openStore(cfg, log, reg)
	if err != nil {
		return err
	}
	defer closeStore()

	// The Service answers for the policy file with the runtime overrides of the store applied.
	svc := coordinator.NewService(store, watcher.Current(), coordinator.WithMetrics(metrics),
		coordinator.WithLogger(log), coordinator.WithStoreTimeout(cfg.storeTimeout),
		coordinator.WithUnknownVersion(func(v string) bool { return policies.Miss(v) }))
	policies = coordinator.NewPolicies(svc, watcher.Current(), overrides, log, cfg.storeTimeout)
	rctx, cancel := context.WithTimeout(ctx, loadTimeout)
	if err := policies.Refresh(rctx); err != nil {
		log.Warn("could not read the runtime overrides at start; serving the policy file alone until a poll succeeds", zap.Error(err))
	}
	cancel()
	watcher.Start()
	pollCtx, stopPoll := context.WithCancel(context.Background())
	var polling sync.WaitGroup
	polling.Go(func() { policies.Run(pollCtx, cfg.overridesInterval) })
	defer func() { stopPoll(); polling.Wait() }()

	audit, closeAudit, err := openAudit(cfg.adminAuditLog, stderr)
	if err != nil {
		return err
	}
	defer closeAudit()
	admin := coordinator.NewAdminService(coordinator.AdminConfig{Store: store, Overrides: overrides, Policies: policies,
		Admins: cfg.admins, Audit: audit, Logger: log, StoreTimeout: cfg.storeTimeout})
	if len(cfg.admins) == 0 {
		log.Info("admin API off: no --admin-identities")
	}

	var serverTLS *tls.Config
	if cfg.tlsCert != "" {
		if serverTLS, err = tlsconfig.Server(cfg.tlsCert, cfg.tlsKey, cfg.tlsClientCA); err != nil {
			return err
		}
	}
	lis, err := net.Listen("tcp", cfg.listen)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	defer func() { _ = lis.Close() }() // on the early returns; Serve closes it otherwise

	if cfg.metricsListen != "" {
		stopMetrics, err := serveMetrics(cfg.metricsListen, reg, log)
		if err != nil {
			return err
		}
		defer stopMetrics()
	}
	var healthLis net.Listener
	if cfg.healthListen != "" {
		if healthLis, err = net.Listen("tcp", cfg.healthListen); err != nil {
			return fmt.Errorf("--health-listen: %w", err)
		}
	}

	srv := coordinator.NewServer(svc, coordinator.ServerOptions{
		TLS: serverTLS, Logger: log, Metrics: metrics, Probe: probe,
		ProbeInterval: cfg.healthInterval, ProbeTimeout: cfg.storeTimeout,
		ShutdownTimeout: cfg.shutdownTimeout,
		Overrides:       coordinator.NewOverridesServer(policies), Admin: admin,
	})
	if healthLis != nil {
		defer cli.ServeHealth(healthLis, srv.HealthServer(), log)()
	}
	return srv.Serve(ctx, lis)
}

// newLogger writes to w as --log-level and --log-format say, sampled so that an outage logging
// every failed batch does not flood it (per message and second: the first 100, then every 100th).
func newLogger(w io.Writer, l cli.Logging) (*zap.Logger, error) {
	return l.NewLogger(w, zap.AddCaller(), zap.WrapCore(func(core zapcore.Core) zapcore.Core {
		return zapcore.NewSamplerWithOptions(core, time.Second, 100, 100)
	}))
}

// adminStore is a store with the admin operations: both stores are.
type adminStore interface {
	coordinator.Store
	coordinator.AdminStore
}

// openStore opens the configured store and the runtime overrides beside it (the same Redis, or
// this process's memory). probe is nil for the memory store (it always answers); closeStore
// releases the store's connections or goroutine.
func openStore(cfg *config, log *zap.Logger, reg prometheus.Registerer) (store adminStore, overrides coordinator.OverridesStore, probe func(context.Context) error, closeStore func(), err error) {
	if cfg.store == storeMemory {
		mem := memstore.New()
		done := make(chan struct{})
		var wg sync.WaitGroup
		wg.Go(func() {
			t := time.NewTicker(sweepInterval)
			defer t.Stop()
			for {
				select {
				case <-done:
					return
				case now := <-t.C:
					if n := mem.Sweep(bucket.Millis(now.UnixMilli())); n > 0 {
						log.Debug("memory store swept expired keys", zap.Int("keys", n), zap.Int("held", mem.Len()))
					}
				}
			}
		})
		log.Info("store: memory (this coordinator holds the buckets; run a single replica)")
		return mem, memstore.NewOverrides(), nil, func() { close(done); wg.Wait() }, nil
	}

	opts, err := redisOptions(cfg.redis)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	redis.SetLogger(redisLog{log.Named("go-redis")})
	client := redis.NewUniversalClient(opts)
	rm, err := newRedisMetrics(reg)
	if err != nil {
		_ = client.Close()
		return nil, nil, nil, nil, err
	}
	rm.install(client)
	rs := redisstore.New(client, redisstore.WithInFlight(cfg.redis.inFlight))
	ctx, cancel := context.WithTimeout(context.Background(), loadTimeout)
	defer cancel()
	if err := rs.Load(ctx); err != nil {
		log.Warn("could not load the bucket script into Redis at start; the first batch will", zap.Error(err))
	}
	log.Info("store: redis", zap.String("topology", redisKind(client, cfg.redis.masterName)), zap.Strings("addrs", cfg.redis.addrs),
		zap.String("master_name", cfg.redis.masterName), zap.Bool("tls", opts.TLSConfig != nil),
		zap.String("user", cfg.redis.user))
	return rs, rs, redisProbe(client), func() { _ = client.Close() }, nil
}

// openAudit returns the admin audit logger: JSON lines, never sampled, on stderr or appended to
// a file.
func openAudit(dest string, stderr io.Writer) (*zap.Logger, func(), error) {
	var ws zapcore.WriteSyncer
	closeFile := func() {}
	if dest == "stderr" {
		ws = zapcore.Lock(zapcore.AddSync(stderr))
	} else {
		f, err := os.OpenFile(dest, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640)
		if err != nil {
			return nil, nil, fmt.Errorf("--admin-audit-log: %w", err)
		}
		ws = zapcore.Lock(f)
		closeFile = func() { _ = f.Close() }
	}
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	log := zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(enc), ws, zapcore.InfoLevel)).Named("audit")
	return log, func() { _ = log.Sync(); closeFile() }, nil
}

// serveMetrics serves Prometheus /metrics on addr until the returned function stops it.
func serveMetrics(addr string, reg *prometheus.Registry, log *zap.Logger) (stop func(), err error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics listen: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(lis); !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server stopped", zap.Error(err))
		}
	}()
	log.Info("metrics serving", zap.String("addr", lis.Addr().String()))
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), metricsShutdown)
		defer cancel()
		_ = srv.Shutdown(ctx)
		<-done
	}, nil
}
