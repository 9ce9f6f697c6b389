package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/leasebucket/leasebucket/internal/tlsconfig"
)

const (
	// clientName is how the coordinator's connections show in Redis' CLIENT LIST.
	clientName = "leasebucket-coordinator"

	// dialAttempts is one: a node that refuses a connection, or does not accept one within
	// --redis-dial-timeout, fails its keys at once (go-redis' default of five attempts 100 ms
	// apart, each retried command dialing again, outlasts the store timeout, so a dead Cluster
	// master would fail whole batches instead of its own keys). Commands on a broken connection
	// are still retried (go-redis' MaxRetries).
	dialAttempts = 1
)

// redisOptions turns the configuration into go-redis options: go-redis picks a Sentinel
// (failover) client when MasterName is set, a Cluster client for several addresses or
// IsClusterMode, else a plain client.
func redisOptions(r redisConfig) (*redis.UniversalOptions, error) {
	o := &redis.UniversalOptions{
		Addrs:            r.addrs,
		IsClusterMode:    r.cluster,
		MasterName:       r.masterName,
		Username:         r.user,
		Password:         r.password,
		SentinelUsername: r.sentinelUser,
		SentinelPassword: r.sentinelPassword,
		DB:               r.db,
		ClientName:       clientName,
		DialTimeout:      r.dialTimeout,
		DialerRetries:    dialAttempts,
		ReadTimeout:      r.timeout,
		WriteTimeout:     r.timeout,
		PoolSize:         r.poolSize,
		// A batch's context (the store timeout, the caller's deadline) bounds its round trip.
		ContextTimeoutEnabled: true,
	}
	if r.tls {
		cfg, err := tlsconfig.Client(r.tlsCA, r.tlsCert, r.tlsKey, r.tlsServerName)
		if err != nil {
			return nil, fmt.Errorf("redis TLS: %w", err)
		}
		o.TLSConfig = cfg
	}
	return o, nil
}

// redisKind names the topology for logs.
func redisKind(c redis.UniversalClient, masterName string) string {
	switch {
	case masterName != "":
		return "sentinel"
	case isCluster(c):
		return "cluster"
	default:
		return "standalone"
	}
}

func isCluster(c redis.UniversalClient) bool {
	_, ok := c.(*redis.ClusterClient)
	return ok
}

// redisProbe is the health probe of a Redis store: a PING to the master (standalone, Sentinel),
// or to every master of a Cluster. A Cluster answers while at least one master does: the keys of
// a failed master fail item by item (STATUS_STORE_UNAVAILABLE), which agents handle per key, and
// reporting NOT_SERVING would fail every key of every coordinator sharing the cluster.
func redisProbe(c redis.UniversalClient) func(context.Context) error {
	cc, ok := c.(*redis.ClusterClient)
	if !ok {
		return func(ctx context.Context) error {
			if err := c.Ping(ctx).Err(); err != nil {
				return fmt.Errorf("redis PING: %w", err)
			}
			return nil
		}
	}
	return func(ctx context.Context) error {
		var up, down atomic.Int32
		var firstErr atomic.Pointer[error]
		err := cc.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
			if err := m.Ping(ctx).Err(); err != nil {
				down.Add(1)
				err = fmt.Errorf("%s: %w", m.Options().Addr, err)
				firstErr.CompareAndSwap(nil, &err)
				return nil
			}
			up.Add(1)
			return nil
		})
		switch {
		case err != nil:
			return fmt.Errorf("redis cluster: %w", err)
		case up.Load() == 0 && down.Load() == 0:
			return errors.New("redis cluster: no master known")
		case up.Load() == 0:
			return fmt.Errorf("redis cluster: no master answers PING: %w", *firstErr.Load())
		}
		return nil
	}
}

// redisMetrics is a go-redis hook counting round trips to Redis nodes, their latency and errors.
// On a Cluster it is installed on every node's client, so a batch spanning three masters counts
// three round trips.
type redisMetrics struct {
	trips   prometheus.Counter
	latency prometheus.Observer
	errs    *prometheus.CounterVec
}

func newRedisMetrics(reg prometheus.Registerer) (*redisMetrics, error) {
	const ns, sub = "leasebucket", "coordinator"
	trips := prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "redis_round_trips_total",
		Help: "Round trips to Redis nodes: one per pipeline or lone command sent to a node."})
	latency := prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Subsystem: sub, Name: "redis_round_trip_seconds",
		Help:    "Time of one round trip to a Redis node.",
		Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1}})
	errs := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "redis_errors_total",
		Help: "Failed Redis commands by kind: timeout, connection, reply (an error reply such as NOSCRIPT, READONLY or CLUSTERDOWN) or other."},
		[]string{"kind"})
	for _, k := range []string{"timeout", "connection", "reply", "other"} {
		errs.WithLabelValues(k)
	}
	for _, c := range []prometheus.Collector{trips, latency, errs} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register redis metrics: %w", err)
		}
	}
	return &redisMetrics{trips: trips, latency: latency, errs: errs}, nil
}

// install adds the hook where the round trips happen: the client, or each Cluster node's client.
func (m *redisMetrics) install(c redis.UniversalClient) {
	if cc, ok := c.(*redis.ClusterClient); ok {
		cc.OnNewNode(func(node *redis.Client) { node.AddHook(m) })
		return
	}
	c.AddHook(m)
}

func (m *redisMetrics) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := next(ctx, network, addr)
		if err != nil {
			m.errs.WithLabelValues(errKind(err)).Inc()
		}
		return conn, err
	}
}

func (m *redisMetrics) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		start := time.Now()
		err := next(ctx, cmd)
		m.observe(start, cmd)
		return err
	}
}

func (m *redisMetrics) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		start := time.Now()
		err := next(ctx, cmds)
		m.observe(start, cmds...)
		return err
	}
}

func (m *redisMetrics) observe(start time.Time, cmds ...redis.Cmder) {
	m.trips.Inc()
	m.latency.Observe(time.Since(start).Seconds())
	for _, c := range cmds {
		if err := c.Err(); err != nil && !errors.Is(err, redis.Nil) {
			m.errs.WithLabelValues(errKind(err)).Inc()
		}
	}
}

func errKind(err error) string {
	var reply redis.Error
	var ne net.Error
	switch {
	case errors.As(err, &reply):
		return "reply"
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	case errors.As(err, &ne), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, redis.ErrClosed):
		return "connection"
	default:
		return "other"
	}
}

// redisLog sends go-redis' own log lines (failed dials, Sentinel switches) to zap. go-redis has
// one logger per process.
type redisLog struct{ log *zap.Logger }

func (l redisLog) Printf(_ context.Context, format string, v ...any) {
	l.log.Warn(fmt.Sprintf(format, v...))
}
