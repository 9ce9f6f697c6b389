package cli

import (
	"errors"
	"net"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// ServeHealth serves hs, the command's grpc.health.v1 service, alone and in plaintext on ln:
// the --health-listen port of probes that cannot use the command's main port (a kubelet's grpc
// probe dials TCP without a client certificate, while the agent answers on a Unix socket and a
// coordinator with mutual TLS only to agents). The status is the command's own. stop ends the
// server, cutting health watches.
func ServeHealth(ln net.Listener, hs healthpb.HealthServer, log *zap.Logger) (stop func()) {
	g := grpc.NewServer()
	healthpb.RegisterHealthServer(g, hs)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := g.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			log.Error("health server stopped", zap.Error(err))
		}
	}()
	log.Info("health serving", zap.String("addr", ln.Addr().String()))
	return func() {
		g.Stop()
		<-done
	}
}
