package redistest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// clusterTimeout bounds cluster creation and each wait for a healthy cluster.
const clusterTimeout = 60 * time.Second

// Cluster is a Redis Cluster of redis-server processes on 127.0.0.1, every node in its own
// directory. Node i keeps its port and identity across Kill and Restart.
type Cluster struct {
	t     testing.TB
	cfg   *config
	nodes []*Server
}

// StartCluster runs masters (at least 3, what redis-cli --cluster create accepts) masters, each
// with WithReplicas replicas (none by default), creates the cluster with redis-cli, and returns
// once every node reports cluster_state:ok with all 16384 slots covered and every replica is in
// sync. Nodes keep serving their slots while another master is down
// (cluster-require-full-coverage no).
func StartCluster(t testing.TB, masters int, opts ...Option) *Cluster {
	t.Helper()
	Require(t, "redis-cli")
	if masters < 3 {
		t.Fatalf("redistest: a cluster needs at least 3 masters, got %d", masters)
	}
	c := &Cluster{t: t, cfg: newConfig(opts)}
	if c.cfg.replicas < 0 {
		t.Fatalf("redistest: %d replicas per master", c.cfg.replicas)
	}
	total := masters * (1 + c.cfg.replicas)
	args := []string{"--cluster", "create"}
	for range total {
		n := startServer(t, c.cfg, modeCluster, nil, "")
		c.nodes = append(c.nodes, n)
		args = append(args, n.Addr())
	}
	args = append(args, "--cluster-replicas", strconv.Itoa(c.cfg.replicas), "--cluster-yes")
	if c.cfg.user != "" {
		args = append(args, "--user", c.cfg.user)
	}
	if c.cfg.tls {
		args = append(args, "--tls", "--cacert", c.cfg.tlsMat.CA)
	}
	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "redis-cli", args...)
	if _, pass := c.cfg.credentials(); pass != "" {
		cmd.Env = append(os.Environ(), "REDISCLI_AUTH="+pass) // not on the command line
	}
	cmd.SysProcAttr = procAttr()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("redistest: redis-cli --cluster create: %v\n%s", err, lastLines(string(out), 30))
	}
	c.WaitHealthy()
	return c
}

// Nodes returns every node, in the order given to redis-cli --cluster create.
func (c *Cluster) Nodes() []*Server { return append([]*Server(nil), c.nodes...) }

// Node returns node i.
func (c *Cluster) Node(i int) *Server { return c.nodes[i] }

// Addrs returns the address of every node.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		addrs[i] = n.Addr()
	}
	return addrs
}

// Options returns fresh go-redis cluster options: every node as a seed, credentials and TLS.
func (c *Cluster) Options() *redis.ClusterOptions {
	o := &redis.ClusterOptions{Addrs: c.Addrs()}
	o.Username, o.Password = c.cfg.credentials()
	o.TLSConfig = c.cfg.clientTLS()
	return o
}

// Client returns a cluster client, closed when t ends.
func (c *Cluster) Client(t testing.TB) *redis.ClusterClient {
	cc := redis.NewClusterClient(c.Options())
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// WaitHealthy waits until every running node reports cluster_state:ok, all 16384 slots ok and
// every node known, and every running replica has its link to its master up. With a master
// down and no replica to replace it, slots are uncovered and it fails: restart the master first.
func (c *Cluster) WaitHealthy() {
	c.t.Helper()
	deadline := time.Now().Add(clusterTimeout)
	for {
		problem := c.health()
		if problem == "" {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("redistest: cluster not healthy after %v: %s", clusterTimeout, problem)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// health describes the first problem found, or returns "".
func (c *Cluster) health() string {
	ctx := context.Background()
	for _, n := range c.nodes {
		if !n.Running() {
			continue
		}
		problem := func() string {
			cl := redis.NewClient(n.Options())
			defer func() { _ = cl.Close() }()
			info, err := cl.ClusterInfo(ctx).Result()
			if err != nil {
				return err.Error()
			}
			for _, want := range []string{
				"cluster_state:ok", "cluster_slots_ok:16384", "cluster_known_nodes:" + strconv.Itoa(len(c.nodes)),
			} {
				if !strings.Contains(info, want+"\r\n") {
					return "no " + want
				}
			}
			repl, err := cl.Info(ctx, "replication").Result()
			if err != nil {
				return err.Error()
			}
			if strings.Contains(repl, "role:slave") && !strings.Contains(repl, "master_link_status:up") {
				return "replica link down"
			}
			return ""
		}()
		if problem != "" {
			return fmt.Sprintf("node %s: %s", n.Addr(), problem)
		}
	}
	return ""
}

// MasterForKey returns the node that currently serves key, asking the live nodes (CLUSTER KEYSLOT
// and CLUSTER SLOTS), so it follows failovers.
func (c *Cluster) MasterForKey(key string) *Server {
	c.t.Helper()
	ctx := context.Background()
	var lastErr error
	for _, n := range c.nodes {
		if !n.Running() {
			continue
		}
		addr, err := func() (string, error) {
			cl := redis.NewClient(n.Options())
			defer func() { _ = cl.Close() }()
			slot, err := cl.ClusterKeySlot(ctx, key).Result()
			if err != nil {
				return "", err
			}
			shards, err := cl.ClusterShards(ctx).Result()
			if err != nil {
				return "", err
			}
			for _, sh := range shards {
				for _, r := range sh.Slots {
					if r.Start > slot || slot > r.End {
						continue
					}
					for _, node := range sh.Nodes {
						if node.Role == "master" {
							port := node.Port
							if port == 0 { // a TLS-only node
								port = node.TLSPort
							}
							return net.JoinHostPort(node.IP, strconv.FormatInt(port, 10)), nil
						}
					}
				}
			}
			return "", fmt.Errorf("slot %d not served", slot)
		}()
		if err != nil {
			lastErr = err
			continue
		}
		for _, m := range c.nodes {
			if m.Addr() == addr {
				return m
			}
		}
		lastErr = fmt.Errorf("slot served by %s, not a node of this cluster", addr)
	}
	c.t.Fatalf("redistest: master for key %q: %v", key, lastErr)
	return nil
}

// Masters returns the running nodes whose role is master now.
func (c *Cluster) Masters() []*Server {
	c.t.Helper()
	var ms []*Server
	for _, n := range c.nodes {
		if n.Running() && n.role() == "master" {
			ms = append(ms, n)
		}
	}
	return ms
}

// replicaInSync reports whether the server is a replica whose link to its master is up.
func (s *Server) replicaInSync() bool {
	cl := redis.NewClient(s.Options())
	defer func() { _ = cl.Close() }()
	repl, err := cl.Info(context.Background(), "replication").Result()
	return err == nil && strings.Contains(repl, "role:slave\r\n") && strings.Contains(repl, "master_link_status:up\r\n")
}

// role is the first element of ROLE ("master", "slave", "sentinel"), or "" if unreachable.
func (s *Server) role() string {
	cl := redis.NewClient(s.Options())
	defer func() { _ = cl.Close() }()
	v, err := cl.Do(context.Background(), "role").Slice()
	if err != nil || len(v) == 0 {
		return ""
	}
	r, _ := v[0].(string)
	return r
}
