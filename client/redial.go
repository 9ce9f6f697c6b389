package client

import (
	"context"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
)

const (
	// redialFloor is how old the last connection attempt must be before a check retries an
	// unreachable agent. Between its attempts gRPC waits out a backoff (about a second, up to
	// reconnectMax) and fails every call at once: an agent that started after the gateway, or
	// came back from a restart, would be ignored for up to a second of failure-mode answers.
	// Checks retry instead, but at most once per floor, so a missing socket costs one failed
	// dial per 50 ms, not one per check.
	redialFloor = 50 * time.Millisecond

	// redialKick is how often a redial that found the agent answering wakes gRPC's connection
	// attempt again while it waits for the connection: the attempt it first woke may have
	// failed just before the agent was there, and gone back into its backoff.
	redialKick = 10 * time.Millisecond
)

// redialer retries the connection of an unreachable agent when a check arrives, instead of
// leaving it to gRPC's reconnect backoff.
type redialer struct {
	conn *grpc.ClientConn
	// network and addr are dialed to learn whether the agent answers now; network is empty
	// when the target names nothing to dial (a resolver other than unix, dns or passthrough).
	network, addr string

	// down is set when a call found the agent unreachable and cleared when one was answered:
	// while it is clear, checks skip the redialer (one atomic load).
	down atomic.Bool

	mu       sync.Mutex
	last     time.Time     // when the last redial started
	inflight chan struct{} // closed when the redial in flight ends; nil when none is
}

func newRedialer(conn *grpc.ClientConn, target string) *redialer {
	r := &redialer{conn: conn}
	r.network, r.addr = dialAddr(target)
	return r
}

// dialAddr is the address a target's connection dials: a Unix socket for "unix:path" and
// "unix:///abs/path", host:port (a numeric port) for "host:port", "dns:///host:port" and
// "passthrough:///host:port". network is empty for anything else.
func dialAddr(target string) (network, addr string) {
	if path, ok := strings.CutPrefix(target, "unix://"); ok {
		return "unix", path
	}
	if path, ok := strings.CutPrefix(target, "unix:"); ok {
		return "unix", path
	}
	hostport := target
	for _, scheme := range []string{"dns:", "passthrough:"} {
		if rest, ok := strings.CutPrefix(target, scheme); ok {
			if rest, ok = strings.CutPrefix(rest, "//"); ok {
				_, rest, _ = strings.Cut(rest, "/") // drop the authority (a DNS server)
			}
			hostport = rest
		}
	}
	_, port, err := net.SplitHostPort(hostport)
	if err != nil || strings.Contains(hostport, "/") || !numeric(port) {
		return "", "" // another resolver's target ("xds:///name", "unix-abstract:name")
	}
	return "tcp", hostport
}

// failed records whether a call found the agent unreachable.
func (r *redialer) failed(unreachable bool) {
	if r.down.Load() != unreachable {
		r.down.Store(unreachable)
	}
}

// await readies the connection for a call about to be sent, if the agent is there. When the
// connection is in TRANSIENT_FAILURE (gRPC waiting out its backoff, failing every call) and the
// last redial is at least redialFloor old, it dials the agent's address; if that answers, it
// wakes gRPC's connection attempt and waits, until ctx ends, for the connection to be ready. A
// call arriving during a redial waits for it too. Otherwise await returns at once, and the call
// fails fast as before.
func (r *redialer) await(ctx context.Context) {
	if r.conn.GetState() != connectivity.TransientFailure {
		return // ready, or connecting (a call waits for the attempt's outcome by itself)
	}
	r.mu.Lock()
	if ch := r.inflight; ch != nil {
		r.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
		}
		return
	}
	now := time.Now()
	if now.Sub(r.last) < redialFloor {
		r.mu.Unlock()
		return
	}
	r.last = now
	ch := make(chan struct{})
	r.inflight = ch
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.inflight = nil
		r.mu.Unlock()
		close(ch)
	}()
	r.redial(ctx)
}

// redial dials the agent's address and, if it answers, gets gRPC's connection ready.
func (r *redialer) redial(ctx context.Context) {
	if r.network == "" {
		// Nothing to dial here: wake gRPC's attempt without waiting for it; a later call
		// finds the connection ready if the agent is back.
		r.conn.ResetConnectBackoff()
		return
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, r.network, r.addr)
	if err != nil {
		return // still unreachable
	}
	_ = c.Close()
	for {
		s := r.conn.GetState()
		if s == connectivity.Ready || s == connectivity.Shutdown {
			return
		}
		r.conn.ResetConnectBackoff()
		r.conn.Connect() // from IDLE
		wctx, cancel := context.WithTimeout(ctx, redialKick)
		r.conn.WaitForStateChange(wctx, s)
		cancel()
		if ctx.Err() != nil {
			return
		}
	}
}

func numeric(s string) bool {
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return s != ""
}
