package redistest

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// MasterName is the name under which the sentinels of StartSentinel monitor their master.
const MasterName = "leasebucket"

const (
	// downAfter is the sentinels' down-after-milliseconds: how long a master may be silent before
	// a sentinel considers it down. Short so failover tests take seconds; long enough that a
	// loaded test machine does not fail over a live master.
	downAfter = 1000

	// sentinelTimeout bounds the wait for the sentinels to find each other and the replica.
	sentinelTimeout = 60 * time.Second
)

// Sentinel is a master, one replica and three sentinels monitoring them with quorum 2: killing
// the master makes the sentinels promote the replica within seconds.
type Sentinel struct {
	t         testing.TB
	cfg       *config
	nodes     []*Server // [0] the first master, [1] its replica
	sentinels []*Server
}

// StartSentinel runs the data nodes and the sentinels and returns once every sentinel sees the
// master, the replica and the two other sentinels. WithTLS and WithReplicas are not supported.
func StartSentinel(t testing.TB, opts ...Option) *Sentinel {
	t.Helper()
	Require(t)
	cfg := newConfig(opts)
	if cfg.tls || cfg.replicas != 0 {
		t.Fatal("redistest: StartSentinel supports neither WithTLS nor WithReplicas")
	}
	s := &Sentinel{t: t, cfg: cfg}
	master := startServer(t, cfg, modePlain, nil, "")
	replica := startServer(t, cfg, modePlain, []string{"--replicaof", "127.0.0.1", strconv.Itoa(master.Port())}, "")
	s.nodes = []*Server{master, replica}

	conf := fmt.Sprintf("sentinel monitor %s 127.0.0.1 %d 2\n"+
		"sentinel down-after-milliseconds %s %d\n"+
		"sentinel failover-timeout %s 10000\n"+
		"sentinel parallel-syncs %s 1\n",
		MasterName, master.Port(), MasterName, downAfter, MasterName, MasterName)
	user, pass := cfg.credentials()
	if user != "" {
		conf += fmt.Sprintf("sentinel auth-user %s %s\n", MasterName, user)
	}
	if pass != "" {
		conf += fmt.Sprintf("sentinel auth-pass %s %s\n", MasterName, pass)
	}
	for range 3 {
		s.sentinels = append(s.sentinels, startServer(t, cfg, modeSentinel, nil, conf))
	}
	s.waitSettled(master.Addr())
	return s
}

// Nodes returns the data nodes: the first master and its replica (roles swap after a failover).
func (s *Sentinel) Nodes() []*Server { return append([]*Server(nil), s.nodes...) }

// Node returns data node i: 0 is the first master, 1 its replica.
func (s *Sentinel) Node(i int) *Server { return s.nodes[i] }

// Sentinels returns the three sentinels.
func (s *Sentinel) Sentinels() []*Server { return append([]*Server(nil), s.sentinels...) }

// SentinelAddrs returns the sentinels' addresses.
func (s *Sentinel) SentinelAddrs() []string {
	addrs := make([]string, len(s.sentinels))
	for i, n := range s.sentinels {
		addrs[i] = n.Addr()
	}
	return addrs
}

// Options returns fresh go-redis failover options: the master name, the sentinels and the data
// nodes' credentials.
func (s *Sentinel) Options() *redis.FailoverOptions {
	o := &redis.FailoverOptions{MasterName: MasterName, SentinelAddrs: s.SentinelAddrs()}
	o.Username, o.Password = s.cfg.credentials()
	return o
}

// Client returns a failover client that follows the master the sentinels name, closed when t ends.
func (s *Sentinel) Client(t testing.TB) *redis.Client {
	c := redis.NewFailoverClient(s.Options())
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Master returns the data node the sentinels currently name as master (asking each running
// sentinel until one answers).
func (s *Sentinel) Master() *Server {
	s.t.Helper()
	addr, err := s.masterAddr()
	if err != nil {
		s.t.Fatalf("redistest: %v", err)
	}
	for _, n := range s.nodes {
		if n.Addr() == addr {
			return n
		}
	}
	s.t.Fatalf("redistest: sentinels name %s, not a data node of this setup", addr)
	return nil
}

func (s *Sentinel) masterAddr() (string, error) {
	var lastErr error
	for _, sn := range s.sentinels {
		if !sn.Running() {
			continue
		}
		sc := redis.NewSentinelClient(&redis.Options{Addr: sn.Addr()})
		hp, err := sc.GetMasterAddrByName(context.Background(), MasterName).Result()
		_ = sc.Close()
		if err != nil {
			lastErr = err
			continue
		}
		return net.JoinHostPort(hp[0], hp[1]), nil
	}
	return "", fmt.Errorf("no sentinel names the master: %w", lastErr)
}

// WaitMaster waits until every running sentinel names node as master and sees its replica (if
// running) and the other running sentinels, and returns node.
func (s *Sentinel) WaitMaster(node *Server) *Server {
	s.t.Helper()
	s.waitSettled(node.Addr())
	return node
}

func (s *Sentinel) waitSettled(masterAddr string) {
	s.t.Helper()
	deadline := time.Now().Add(sentinelTimeout)
	for {
		problem := s.settled(masterAddr)
		if problem == "" {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("redistest: sentinels not settled after %v: %s", sentinelTimeout, problem)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (s *Sentinel) settled(masterAddr string) string {
	ctx := context.Background()
	running := 0
	for _, sn := range s.sentinels {
		if sn.Running() {
			running++
		}
	}
	replicas := 0
	for _, n := range s.nodes {
		if n.Running() && n.Addr() != masterAddr {
			replicas++
			if !n.replicaInSync() {
				return n.Addr() + " is not a replica in sync yet"
			}
		}
	}
	for _, sn := range s.sentinels {
		if !sn.Running() {
			continue
		}
		sc := redis.NewSentinelClient(&redis.Options{Addr: sn.Addr()})
		m, err := sc.Master(ctx, MasterName).Result()
		_ = sc.Close()
		if err != nil {
			return fmt.Sprintf("sentinel %s: %v", sn.Addr(), err)
		}
		addr := net.JoinHostPort(m["ip"], m["port"])
		switch {
		case addr != masterAddr:
			return fmt.Sprintf("sentinel %s names master %s, want %s", sn.Addr(), addr, masterAddr)
		case m["flags"] != "master":
			return fmt.Sprintf("sentinel %s: master flags %q", sn.Addr(), m["flags"])
		case atoi(m["num-other-sentinels"]) < running-1: // a stopped sentinel stays known
			return fmt.Sprintf("sentinel %s sees %s other sentinels", sn.Addr(), m["num-other-sentinels"])
		case atoi(m["num-slaves"]) < replicas:
			return fmt.Sprintf("sentinel %s sees %s replicas", sn.Addr(), m["num-slaves"])
		}
	}
	return ""
}

func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}
