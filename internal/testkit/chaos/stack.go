package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// Settings of the processes a run starts. They are the production defaults where the harness
// has no reason to differ; the differences make faults visible within a short run.
const (
	// coordinatorHealthInterval: a coordinator notices its store is gone within this, and agents
	// stop sending it calls (the default is 1 s).
	coordinatorHealthInterval = "200ms"
	// coordinatorStoreTimeout is the production default, below the agents' call timeout (500 ms).
	coordinatorStoreTimeout = "300ms"
	// shutdownTimeout bounds a graceful shutdown of any process of the run.
	shutdownTimeout = 5 * time.Second
	// readyTimeout bounds a process's start on a loaded 2-core machine.
	readyTimeout = 30 * time.Second
)

// Binaries are the programs a run starts (the tests build them with proctest.Binaries).
type Binaries struct {
	Agent, Coordinator string
}

// StackConfig shapes a Stack.
type StackConfig struct {
	Dir          string // sockets, logs and the policy file
	Bin          Binaries
	Cluster      bool // a 3-master Redis Cluster instead of one standalone server
	Coordinators int
	Agents       int
	MaxKeys      int // agents' --max-keys
	// WrapStore, if set, runs the coordinators in this process as coordinator.Service over
	// WrapStore(the Redis store) instead of as cmd/coordinator processes: the over-granting
	// grant rule of the negative test. Coordinator faults need processes and are not available.
	WrapStore func(coordinator.Store) coordinator.Store
}

// Stack is a running system: Redis, coordinators, agents, and the proxies between them.
//
//	agents ──(agent proxy per coordinator)──▶ coordinators ──(redis proxy per node)──▶ Redis
type Stack struct {
	t      testing.TB
	cfg    StackConfig
	Start  time.Time // the run's zero: every time the harness records is measured from it
	Policy string    // the policy file

	Redis        *redistest.Server  // standalone
	Cluster      *redistest.Cluster // cluster
	RedisNodes   []*redistest.Server
	RedisProxies []*Proxy
	Coordinators []*Coordinator
	Agents       []*Agent
}

// Coordinator is one coordinator: a process (or, with WrapStore, a server in this process) and
// the proxy agents reach it through.
type Coordinator struct {
	Index   int
	Addr    string // its own listen address (the proxy's target)
	Metrics string // host:port of /metrics
	Proxy   *Proxy

	mu   sync.Mutex
	proc *Process
	stop func() // in-process server
}

// Agent is one agent process on its Unix socket, with the clients the load uses.
type Agent struct {
	Index  int
	Socket string
	Audit  string
	// gen counts the agent's starts and stops: even while a process serves, odd while it is down
	// or starting. A check is attributed to a process only if gen was the same even number when
	// it was sent and when it was answered.
	gen atomic.Int64

	Client agentv1.AgentServiceClient
	Envoy  ratelimitv3.RateLimitServiceClient
	conn   *grpc.ClientConn
	// Stream is the Go client package on the agent's socket: concurrent checks go as CheckStream
	// batches with partial answers (unary while the stream is down).
	Stream *client.Client

	mu      sync.Mutex
	proc    *Process
	metrics string // host:port of /metrics
	debug   string // host:port of the debug endpoint
	// shutdownLost is what the last graceful shutdown could not return (its log), in tokens.
	shutdownLost float64
	args         []string
}

// fastReconnect makes the harness's clients reconnect to a restarted process within half a
// second (gRPC's default waits 1 s after a failed connection, growing to 2 minutes).
var fastReconnect = grpc.WithConnectParams(grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 500 * time.Millisecond},
	MinConnectTimeout: time.Second,
})

// NewStack starts Redis, the proxies, the coordinators and the agents, and waits until each is
// ready. Everything stops when t ends.
func NewStack(t testing.TB, cfg StackConfig) *Stack {
	t.Helper()
	s := &Stack{t: t, cfg: cfg, Start: time.Now()}
	s.Policy = filepath.Join(cfg.Dir, "policy.yaml")
	if err := os.WriteFile(s.Policy, []byte(PolicyText), 0o644); err != nil {
		t.Fatal(err)
	}
	// Append-only file with an fsync per write: a Redis killed and restarted keeps every write a
	// client was told about, so a restart never refills a bucket (docs/leases.md, "Failover").
	opts := []redistest.Option{redistest.WithConfig("appendonly", "yes"), redistest.WithConfig("appendfsync", "always")}
	if cfg.Cluster {
		s.Cluster = redistest.StartCluster(t, 3, opts...)
		s.RedisNodes = s.Cluster.Nodes()
	} else {
		s.Redis = redistest.Start(t, opts...)
		s.RedisNodes = []*redistest.Server{s.Redis}
	}
	for i, n := range s.RedisNodes {
		p, err := NewProxy(fmt.Sprintf("redis-%d", i), n.Addr())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		s.RedisProxies = append(s.RedisProxies, p)
	}
	if cfg.Cluster {
		s.announceProxies()
	}
	for i := range cfg.Coordinators {
		c := &Coordinator{Index: i, Addr: proctest.FreeAddr(t), Metrics: proctest.FreeAddr(t)}
		p, err := NewProxy(fmt.Sprintf("coordinator-%d", i), c.Addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		c.Proxy = p
		s.Coordinators = append(s.Coordinators, c)
		s.StartCoordinator(i)
	}
	for i := range cfg.Agents {
		a := &Agent{Index: i, Socket: filepath.Join(cfg.Dir, fmt.Sprintf("a%d.sock", i)),
			Audit: filepath.Join(cfg.Dir, fmt.Sprintf("audit-%d.log", i))}
		a.gen.Store(-1) // odd: not started
		conn, err := grpc.NewClient("unix:"+a.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()), fastReconnect)
		if err != nil {
			t.Fatal(err)
		}
		a.conn = conn
		a.Client = agentv1.NewAgentServiceClient(conn)
		a.Envoy = ratelimitv3.NewRateLimitServiceClient(conn)
		if a.Stream, err = client.New(client.Options{Socket: a.Socket, DialOptions: []grpc.DialOption{fastReconnect}}); err != nil {
			t.Fatal(err)
		}
		s.Agents = append(s.Agents, a)
		s.StartAgent(i)
	}
	t.Cleanup(s.stopAll)
	return s
}

// Since is the time since the run's zero.
func (s *Stack) Since() time.Duration { return time.Since(s.Start) }

// announceProxies makes every cluster node announce its proxy's port, so that the coordinators'
// cluster clients, which follow the addresses the cluster announces, reach every node through
// its proxy. It waits until every node sees every other one by its proxy port.
func (s *Stack) announceProxies() {
	s.t.Helper()
	ctx := context.Background()
	for i, n := range s.RedisNodes {
		c := redis.NewClient(n.Options())
		err := c.ConfigSet(ctx, "cluster-announce-port", strconv.Itoa(s.RedisProxies[i].Port())).Err()
		_ = c.Close()
		if err != nil {
			s.t.Fatalf("chaos: announce the proxy of %s: %v", n.Addr(), err)
		}
	}
	deadline := time.Now().Add(readyTimeout)
	for {
		ok := true
		for i := range s.RedisNodes {
			if !s.RedisNodes[i].Running() {
				continue
			}
			ports, err := s.shardPorts(i)
			if err != nil || len(ports) != len(s.RedisNodes) {
				ok = false
				break
			}
			for _, p := range s.RedisProxies {
				ok = ok && ports[p.Port()]
			}
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatal("chaos: the cluster does not announce the proxies' ports")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// shardPorts is the set of ports node i's CLUSTER SHARDS names.
func (s *Stack) shardPorts(i int) (map[int]bool, error) {
	c := redis.NewClient(s.RedisNodes[i].Options())
	defer func() { _ = c.Close() }()
	shards, err := c.ClusterShards(context.Background()).Result()
	if err != nil {
		return nil, err
	}
	ports := map[int]bool{}
	for _, sh := range shards {
		for _, n := range sh.Nodes {
			ports[int(n.Port)] = true
		}
	}
	return ports, nil
}

// NodeOf is the index of the Redis node that holds key (always 0 for a standalone Redis). For a
// cluster it asks a live node for the key's slot and the shard that serves it (nodes announce
// their proxies' ports, so redistest's Cluster.MasterForKey cannot match them to its nodes).
func (s *Stack) NodeOf(key string) (int, error) {
	if !s.cfg.Cluster {
		return 0, nil
	}
	var lastErr error
	for i, n := range s.RedisNodes {
		if !n.Running() {
			continue
		}
		c := redis.NewClient(n.Options())
		slot, err := c.ClusterKeySlot(context.Background(), key).Result()
		var shards []redis.ClusterShard
		if err == nil {
			shards, err = c.ClusterShards(context.Background()).Result()
		}
		_ = c.Close()
		if err != nil {
			lastErr = err
			continue
		}
		for _, sh := range shards {
			for _, r := range sh.Slots {
				if slot < r.Start || slot > r.End {
					continue
				}
				for _, nd := range sh.Nodes {
					if nd.Role != "master" {
						continue
					}
					for j, p := range s.RedisProxies {
						if int(nd.Port) == p.Port() || nd.Port == int64(s.RedisNodes[j].Port()) {
							return j, nil
						}
					}
				}
			}
		}
		lastErr = fmt.Errorf("chaos: node %d does not know who serves slot %d", i, slot)
	}
	return 0, fmt.Errorf("chaos: node of %q: %w", key, lastErr)
}

// RedisClient is a client of node i, directly (never through its proxy): the harness reads the
// state of keys with it while faults act on the coordinators' path.
func (s *Stack) RedisClient(i int) *redis.Client {
	o := s.RedisNodes[i].Options()
	o.DialTimeout, o.ReadTimeout = time.Second, 2*time.Second
	return redis.NewClient(o)
}

// HGetAll reads a bucket key's hash from the node that holds it.
func (s *Stack) HGetAll(key string) (map[string]string, error) {
	i, err := s.NodeOf(key)
	if err != nil {
		return nil, err
	}
	c := s.RedisClient(i)
	defer func() { _ = c.Close() }()
	return c.HGetAll(context.Background(), key).Result()
}

// RestartRedis restarts node i on its port (its append-only file restores its data) and, in a
// cluster, announces its proxy again.
func (s *Stack) RestartRedis(i int) {
	s.t.Helper()
	s.RedisNodes[i].Restart()
	if s.cfg.Cluster {
		s.announceProxies()
		s.Cluster.WaitHealthy()
	}
}

// StartCoordinator starts coordinator i and waits until it reports SERVING.
func (s *Stack) StartCoordinator(i int) {
	s.t.Helper()
	c := s.Coordinators[i]
	if s.cfg.WrapStore != nil {
		s.startInProcessCoordinator(c)
		return
	}
	addrs := make([]string, len(s.RedisProxies))
	for j, p := range s.RedisProxies {
		addrs[j] = p.Addr()
	}
	args := []string{"--listen", c.Addr, "--metrics-listen", c.Metrics, "--policy", s.Policy,
		"--redis-addrs", strings.Join(addrs, ","), "--health-interval", coordinatorHealthInterval,
		"--store-timeout", coordinatorStoreTimeout, "--redis-timeout", coordinatorStoreTimeout,
		"--redis-dial-timeout", "200ms", "--shutdown-timeout", shutdownTimeout.String(), "--log-level", "warn"}
	p, err := startProcess(fmt.Sprintf("coordinator-%d", i), filepath.Join(s.cfg.Dir, fmt.Sprintf("coordinator-%d.log", i)),
		s.cfg.Bin.Coordinator, args, nil)
	if err != nil {
		s.t.Fatal(err)
	}
	c.mu.Lock()
	c.proc = p
	c.mu.Unlock()
	if err := waitServing(c.Addr, p); err != nil {
		s.t.Fatalf("chaos: coordinator %d: %v\n%s", i, err, p.Tail())
	}
}

func (s *Stack) startInProcessCoordinator(c *Coordinator) {
	s.t.Helper()
	var client redis.UniversalClient
	if s.cfg.Cluster {
		o := s.Cluster.Options()
		addrs := make([]string, len(s.RedisProxies))
		for j, p := range s.RedisProxies {
			addrs[j] = p.Addr()
		}
		o.Addrs = addrs
		o.ContextTimeoutEnabled, o.MaxRetries = true, -1
		client = redis.NewClusterClient(o)
	} else {
		o := s.Redis.Options()
		o.Addr = s.RedisProxies[0].Addr()
		o.ContextTimeoutEnabled, o.MaxRetries = true, -1
		client = redis.NewClient(o)
	}
	svc := coordinator.NewService(s.cfg.WrapStore(redisstore.New(client)), mustKeys(s.t).Set,
		coordinator.WithStoreTimeout(300*time.Millisecond))
	srv := coordinator.NewServer(svc, coordinator.ServerOptions{
		Probe:         func(ctx context.Context) error { return client.Ping(ctx).Err() },
		ProbeInterval: 200 * time.Millisecond,
	})
	ln, err := net.Listen("tcp", c.Addr)
	if err != nil {
		s.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() { _ = srv.Serve(ctx, ln); close(served) }()
	c.mu.Lock()
	c.stop = sync.OnceFunc(func() { cancel(); <-served; _ = client.Close() })
	c.mu.Unlock()
	if err := waitServing(c.Addr, nil); err != nil {
		s.t.Fatalf("chaos: coordinator %d: %v", c.Index, err)
	}
}

func mustKeys(t testing.TB) *Keys {
	ks, err := NewKeys()
	if err != nil {
		t.Fatal(err)
	}
	return ks
}

// StopCoordinator stops coordinator i: SIGKILL, or SIGTERM and a graceful exit.
func (s *Stack) StopCoordinator(i int, graceful bool) error {
	c := s.Coordinators[i]
	c.mu.Lock()
	p, stop := c.proc, c.stop
	c.mu.Unlock()
	switch {
	case stop != nil:
		stop()
		return nil
	case graceful:
		return p.Terminate(shutdownTimeout + 5*time.Second)
	default:
		p.Kill()
		return nil
	}
}

// CoordinatorProcess is coordinator i's current process (nil for an in-process one).
func (s *Stack) CoordinatorProcess(i int) *Process {
	c := s.Coordinators[i]
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.proc
}

// waitServing waits until the gRPC server at addr reports SERVING for CoordinatorService.
func waitServing(addr string, p *Process) error {
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()), fastReconnect)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	h := healthpb.NewHealthClient(conn)
	deadline := time.Now().Add(readyTimeout)
	var last error
	for time.Now().Before(deadline) {
		if p != nil && !p.Running() {
			if p.Err() != nil {
				return fmt.Errorf("%w: %w", errExited, p.Err())
			}
			return errExited
		}
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		resp, err := h.Check(ctx, &healthpb.HealthCheckRequest{Service: coordinatorv1.CoordinatorService_ServiceDesc.ServiceName})
		cancel()
		if err == nil && resp.Status == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		last = err
		if err == nil {
			last = fmt.Errorf("health %v", resp.Status)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("not serving after %v: %w", readyTimeout, last)
}

// StartAgent starts agent i and waits until it serves on its socket.
func (s *Stack) StartAgent(i int) {
	s.t.Helper()
	a := s.Agents[i]
	addrs := make([]string, len(s.Coordinators))
	for j, c := range s.Coordinators {
		addrs[j] = c.Proxy.Addr()
	}
	args := []string{"--socket", a.Socket, "--coordinators", strings.Join(addrs, ","), "--policy", s.Policy,
		"--metrics-listen", "127.0.0.1:0", "--debug-listen", "127.0.0.1:0", "--max-keys", strconv.Itoa(s.cfg.MaxKeys),
		"--audit-log", a.Audit, "--shutdown-timeout", shutdownTimeout.String(), "--log-level", "info"}
	type ready struct{ metrics, debug string }
	readyc := make(chan ready, 1)
	var r ready
	var once sync.Once
	watch := func(line string) {
		var rec struct {
			Msg   string `json:"msg"`
			Addr  string `json:"addr"`
			Error string `json:"error"`
		}
		if !strings.HasPrefix(line, "{") || json.Unmarshal([]byte(line), &rec) != nil {
			return
		}
		switch rec.Msg {
		case "metrics":
			r.metrics = rec.Addr
		case "debug endpoint":
			r.debug = rec.Addr
		case "agent serving":
			got := r
			once.Do(func() { readyc <- got })
		case "leases not returned at shutdown":
			a.mu.Lock()
			a.shutdownLost += parseLost(rec.Error)
			a.mu.Unlock()
		}
	}
	p, err := startProcess(fmt.Sprintf("agent-%d", i), filepath.Join(s.cfg.Dir, fmt.Sprintf("agent-%d.log", i)),
		s.cfg.Bin.Agent, args, watch)
	if err != nil {
		s.t.Fatal(err)
	}
	select {
	case r := <-readyc:
		a.mu.Lock()
		a.proc, a.metrics, a.debug, a.args = p, r.metrics, r.debug, args
		a.mu.Unlock()
	case <-p.Exited():
		s.t.Fatalf("chaos: agent %d exited at start: %v\n%s", i, p.Err(), p.Tail())
	case <-time.After(readyTimeout):
		p.Kill()
		s.t.Fatalf("chaos: agent %d not ready after %v\n%s", i, readyTimeout, p.Tail())
	}
	a.gen.Add(1) // even: serving
}

// parseLost reads the tokens of "agent: shutdown could not return N tokens of unspent leases".
func parseLost(msg string) float64 {
	_, rest, ok := strings.Cut(msg, "could not return ")
	if !ok {
		return 0
	}
	f, err := strconv.ParseFloat(strings.Fields(rest + " x")[0], 64)
	if err != nil {
		return 0
	}
	return f
}

// StopAgent stops agent i (SIGKILL, or SIGTERM and a graceful exit that returns its leases).
func (s *Stack) StopAgent(i int, graceful bool) error {
	a := s.Agents[i]
	a.gen.Add(1) // odd: down
	p := a.process()
	if graceful {
		return p.Terminate(shutdownTimeout + 5*time.Second)
	}
	p.Kill()
	return nil
}

func (a *Agent) process() *Process {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.proc
}

// Gen is the agent's generation (even while a process serves).
func (a *Agent) Gen() int64 { return a.gen.Load() }

// MetricsAddr is the current process's /metrics address.
func (a *Agent) MetricsAddr() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.metrics
}

// DebugAddr is the current process's debug endpoint.
func (a *Agent) DebugAddr() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.debug
}

// ShutdownLost is what graceful shutdowns of this agent could not return, in tokens.
func (a *Agent) ShutdownLost() float64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.shutdownLost
}

// Process is the agent's current process.
func (a *Agent) Process() *Process { return a.process() }

// Processes lists every process of the stack that runs now, by name, with the /metrics address
// of the Go ones.
func (s *Stack) Processes() []ProcInfo {
	var ps []ProcInfo
	for i, n := range s.RedisNodes {
		if pid := redisPid(n); pid > 0 {
			ps = append(ps, ProcInfo{Name: fmt.Sprintf("redis-%d", i), Pid: pid})
		}
	}
	for i, c := range s.Coordinators {
		if p := s.CoordinatorProcess(i); p != nil && p.Running() {
			ps = append(ps, ProcInfo{Name: p.Name, Pid: p.Pid(), Metrics: c.Metrics})
		}
	}
	for _, a := range s.Agents {
		if p := a.process(); p != nil && p.Running() {
			ps = append(ps, ProcInfo{Name: p.Name, Pid: p.Pid(), Metrics: a.MetricsAddr()})
		}
	}
	return ps
}

// ProcInfo names a running process.
type ProcInfo struct {
	Name    string
	Pid     int
	Metrics string // "" for Redis
}

// redisPid asks a Redis node for its process id (0 if it does not answer).
func redisPid(n *redistest.Server) int {
	if !n.Running() {
		return 0
	}
	o := n.Options()
	o.DialTimeout, o.ReadTimeout = 200*time.Millisecond, 500*time.Millisecond
	c := redis.NewClient(o)
	defer func() { _ = c.Close() }()
	info, err := c.Info(context.Background(), "server").Result()
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "process_id:"); ok {
			pid, _ := strconv.Atoi(v)
			return pid
		}
	}
	return 0
}

// stopAll stops the agents and coordinators still running (the end of a run stops them
// gracefully first; this is for a run that failed half-way).
func (s *Stack) stopAll() {
	for _, a := range s.Agents {
		if p := a.process(); p != nil {
			p.Kill()
		}
		_ = a.conn.Close()
		_ = a.Stream.Close()
	}
	for i := range s.Coordinators {
		c := s.Coordinators[i]
		c.mu.Lock()
		p, stop := c.proc, c.stop
		c.mu.Unlock()
		if stop != nil {
			stop()
		}
		if p != nil {
			p.Kill()
		}
	}
}
