package coordinator

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	adminv1 "github.com/leasebucket/leasebucket/proto/leasebucket/admin/v1"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

const (
	// DefaultProbeInterval is how often a Server asks its store whether it answers: an agent's
	// health watch learns within about a second that a coordinator lost its store, while a PING a
	// second per replica costs the store nothing.
	DefaultProbeInterval = time.Second

	// DefaultShutdownTimeout bounds a graceful shutdown. Batches in flight take milliseconds, or at
	// most the store timeout when the store hangs; ten seconds is well above both and well below
	// the grace period orchestrators give a process before they kill it (30 s in Kubernetes).
	DefaultShutdownTimeout = 10 * time.Second

	// keepaliveMinTime is the most often an agent may ping an idle connection: agents that keep
	// their connections warm must not be disconnected for pinging (gRPC's default is 5 minutes).
	keepaliveMinTime = 10 * time.Second

	// streamWorkers is how many long-lived goroutines handle the coordinator's calls (a call that
	// finds them all busy gets a goroutine of its own).
	streamWorkers = 64
)

// HealthService is the service name whose health the Server reports (as well as the server's
// overall health, the empty name).
var HealthService = coordinatorv1.CoordinatorService_ServiceDesc.ServiceName

// ServerOptions configure a Server. Every field is optional.
type ServerOptions struct {
	// TLS is the server's TLS configuration (internal/tlsconfig.Server). With ClientCAs set and
	// ClientAuth at RequireAndVerifyClientCert, only agents with a certificate of that CA get in
	// (mutual TLS). Nil serves plaintext.
	TLS *tls.Config
	// Logger receives the server's events; nil logs nothing.
	Logger *zap.Logger
	// Metrics records calls by method and code, and the store's health.
	Metrics *Metrics
	// Probe reports whether the store answers (a Redis PING). The health status is SERVING only
	// while it does, so agents' client-side health checks route around a coordinator that lost
	// its store. Nil: the store is in process and always answers.
	Probe func(ctx context.Context) error
	// ProbeInterval is the time between probes (DefaultProbeInterval if zero); ProbeTimeout
	// bounds one probe (ProbeInterval if zero).
	ProbeInterval, ProbeTimeout time.Duration
	// ShutdownTimeout bounds the graceful shutdown (DefaultShutdownTimeout if zero): calls still
	// running after it are cancelled.
	ShutdownTimeout time.Duration
	// Overrides, if set, serves agents the runtime overrides (OverridesService).
	Overrides coordinatorv1.OverridesServiceServer
	// Admin, if set, serves the operators' AdminService (it authorises each call itself).
	Admin adminv1.AdminServiceServer
}

// Server is the coordinator's gRPC server: the CoordinatorService of a Service and the standard
// grpc.health.v1 service, whose status follows a store probe.
type Server struct {
	svc    *Service
	opts   ServerOptions
	log    *zap.Logger
	grpc   *grpc.Server
	health *health.Server

	// drain ends the health Watch streams at shutdown: they never end on their own, and
	// GracefulStop waits for every stream.
	drain     context.Context
	drainNow  context.CancelFunc
	serveOnce sync.Once

	mu sync.Mutex
	up *bool // the last probe's verdict; nil before the first
}

// NewServer returns a Server for svc. Serve starts it.
func NewServer(svc *Service, opts ServerOptions) *Server {
	if opts.ProbeInterval <= 0 {
		opts.ProbeInterval = DefaultProbeInterval
	}
	if opts.ProbeTimeout <= 0 {
		opts.ProbeTimeout = opts.ProbeInterval
	}
	if opts.ShutdownTimeout <= 0 {
		opts.ShutdownTimeout = DefaultShutdownTimeout
	}
	s := &Server{svc: svc, opts: opts, log: opts.Logger, health: health.NewServer()}
	if s.log == nil {
		s.log = zap.NewNop()
	}
	s.drain, s.drainNow = context.WithCancel(context.Background())
	gopts := []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(s.unary),
		grpc.ChainStreamInterceptor(s.stream),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: keepaliveMinTime, PermitWithoutStream: true}),
		// Long-lived goroutines handle the calls: a goroutine per call grows its stack through
		// gRPC's server and the store's client on every call.
		grpc.NumStreamWorkers(streamWorkers),
	}
	if opts.TLS != nil {
		gopts = append(gopts, grpc.Creds(credentials.NewTLS(opts.TLS)))
	}
	s.grpc = grpc.NewServer(gopts...)
	coordinatorv1.RegisterCoordinatorServiceServer(s.grpc, svc)
	if opts.Overrides != nil {
		coordinatorv1.RegisterOverridesServiceServer(s.grpc, opts.Overrides)
	}
	if opts.Admin != nil {
		adminv1.RegisterAdminServiceServer(s.grpc, opts.Admin)
	}
	healthpb.RegisterHealthServer(s.grpc, s.health)
	// Not serving until the first probe says the store answers.
	s.setHealth(healthpb.HealthCheckResponse_NOT_SERVING)
	return s
}

// Serve serves on lis until ctx is done, then shuts down gracefully: the health status turns
// NOT_SERVING, new connections and calls are refused, calls in flight finish (each a whole
// batch), and after ShutdownTimeout whatever still runs is cancelled. It returns nil after a
// shutdown, or the error that stopped the server. A Server serves once.
func (s *Server) Serve(ctx context.Context, lis net.Listener) error {
	err := errors.New("coordinator: server already served")
	s.serveOnce.Do(func() { err = s.serve(ctx, lis) })
	return err
}

func (s *Server) serve(ctx context.Context, lis net.Listener) error {
	probeCtx, stopProbe := context.WithCancel(context.Background())
	s.probe(probeCtx) // the first verdict before the first call
	probed := make(chan struct{})
	go s.probeLoop(probeCtx, probed)
	defer func() {
		stopProbe()
		<-probed
	}()

	served := make(chan error, 1)
	go func() { served <- s.grpc.Serve(lis) }()
	s.log.Info("coordinator serving", zap.String("addr", lis.Addr().String()),
		zap.Bool("tls", s.opts.TLS != nil), zap.Bool("mtls", s.opts.TLS != nil && s.opts.TLS.ClientCAs != nil),
		zap.String("policy_version", s.svc.Policy().Version()))
	select {
	case err := <-served:
		s.drainNow()
		s.grpc.Stop()
		return fmt.Errorf("coordinator: serve %s: %w", lis.Addr(), err)
	case <-ctx.Done():
	}
	s.shutdown()
	if err := <-served; err != nil { // nil once GracefulStop or Stop was called
		s.log.Warn("coordinator: serve ended with an error during shutdown", zap.Error(err))
	}
	return nil
}

// shutdown is the graceful stop with a bounded wait.
func (s *Server) shutdown() {
	s.log.Info("coordinator shutting down: finishing calls in flight", zap.Duration("timeout", s.opts.ShutdownTimeout))
	s.health.Shutdown() // NOT_SERVING to every watcher; later probes change nothing
	s.drainNow()
	stopped := make(chan struct{})
	go func() {
		s.grpc.GracefulStop()
		close(stopped)
	}()
	t := time.NewTimer(s.opts.ShutdownTimeout)
	defer t.Stop()
	select {
	case <-stopped:
		s.log.Info("coordinator stopped")
	case <-t.C:
		s.log.Warn("coordinator shutdown timed out: cancelling the calls still in flight")
		s.grpc.Stop()
		<-stopped
	}
}

func (s *Server) probeLoop(ctx context.Context, done chan<- struct{}) {
	defer close(done)
	t := time.NewTicker(s.opts.ProbeInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.probe(ctx)
		}
	}
}

// probe asks the store once and publishes the verdict.
func (s *Server) probe(ctx context.Context) {
	var err error
	if s.opts.Probe != nil {
		pctx, cancel := context.WithTimeout(ctx, s.opts.ProbeTimeout)
		err = s.opts.Probe(pctx)
		cancel()
	}
	if ctx.Err() != nil {
		return // stopping: the probe was cancelled, the store did not fail
	}
	up := err == nil
	s.mu.Lock()
	changed := s.up == nil || *s.up != up
	s.up = &up
	s.mu.Unlock()
	s.opts.Metrics.SetStoreUp(up)
	if !changed {
		return
	}
	if up {
		s.log.Info("store answers: serving")
		s.setHealth(healthpb.HealthCheckResponse_SERVING)
	} else {
		s.log.Warn("store does not answer: not serving", zap.Error(err))
		s.setHealth(healthpb.HealthCheckResponse_NOT_SERVING)
	}
}

func (s *Server) setHealth(st healthpb.HealthCheckResponse_ServingStatus) {
	s.health.SetServingStatus("", st)
	s.health.SetServingStatus(HealthService, st)
}

// unary counts and times every call.
func (s *Server) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	resp, err := handler(ctx, req)
	s.opts.Metrics.request(info.FullMethod, status.Code(err), time.Since(start))
	return resp, err
}

// stream ends streams (health watches) when the server drains.
func (s *Server) stream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	ctx, cancel := context.WithCancel(ss.Context())
	defer cancel()
	stop := context.AfterFunc(s.drain, cancel)
	defer stop()
	return handler(srv, &drainingStream{ServerStream: ss, ctx: ctx})
}

type drainingStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (d *drainingStream) Context() context.Context { return d.ctx }

// HealthServer is the Server's grpc.health.v1 service, to serve on another listener as well: a
// plaintext port for probes that cannot present a client certificate (a kubelet's grpc probe).
// Its status is the Server's.
func (s *Server) HealthServer() healthpb.HealthServer { return s.health }
