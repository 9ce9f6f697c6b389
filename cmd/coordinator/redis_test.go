package main

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// aclRule is the least-privilege ACL rule docs/coordinator.md gives for the coordinator's Redis
// user, read from the docs so that what they say is what is tested, with password set.
func aclRule(t *testing.T, password string) []any {
	t.Helper()
	doc, err := os.ReadFile("../../docs/coordinator.md")
	if err != nil {
		t.Fatal(err)
	}
	const prefix = "ACL SETUSER leasebucket-coordinator "
	for line := range strings.SplitSeq(string(doc), "\n") {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		var args []any
		for _, w := range strings.Fields(line) {
			if w == ">PASSWORD" {
				w = ">" + password
			}
			args = append(args, w)
		}
		return args
	}
	t.Fatalf("docs/coordinator.md has no line starting %q", prefix)
	return nil
}

// addACLUser creates the documented user on every server (ACLs are per node).
func addACLUser(t *testing.T, password string, servers ...*redistest.Server) {
	t.Helper()
	for _, s := range servers {
		if err := s.Client(t).Do(ctxFor(t, 10*time.Second), aclRule(t, password)...).Err(); err != nil {
			t.Fatalf("%v on %s: %v", aclRule(t, password), s.Addr(), err)
		}
	}
}

// noACLDenials checks that Redis refused none of the coordinator's commands.
func noACLDenials(t *testing.T, servers ...*redistest.Server) {
	t.Helper()
	for _, s := range servers {
		if !s.Running() {
			continue
		}
		log, err := s.Client(t).Do(ctxFor(t, 10*time.Second), "ACL", "LOG").Slice()
		if err != nil || len(log) != 0 {
			t.Errorf("ACL LOG of %s: %v %v, want no denial", s.Addr(), log, err)
		}
	}
}

// metricValue reads one sample of the /metrics page; -1 if it is missing.
func metricValue(page, sample string) float64 {
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(sample) + ` (\S+)$`).FindStringSubmatch(page)
	if m == nil {
		return -1
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		return -1
	}
	return v
}

// TestRunRedisTLSACL: the coordinator reaches a TLS-only Redis as the least-privileged ACL user
// of docs/coordinator.md, whose password comes from a file, and counts its round trips.
func TestRunRedisTLSACL(t *testing.T) {
	srv := redistest.Start(t, redistest.WithTLS(), redistest.WithUser("admin", "admin-pw"), redistest.WithPassword("root-only"))
	addACLUser(t, "s3cret", srv)
	ca, err := srv.Client(t).ConfigGet(ctxFor(t, 10*time.Second), "tls-ca-cert-file").Result()
	if err != nil || ca["tls-ca-cert-file"] == "" {
		t.Fatalf("CONFIG GET tls-ca-cert-file: %v %v", ca, err)
	}
	dir := t.TempDir()
	pass := filepath.Join(dir, "redis-password")
	if err := os.WriteFile(pass, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "policy.yaml")
	writeFile(t, file, policyYAML("v1", "100/second"))
	c := start(t, map[string]string{"LEASEBUCKET_REDIS_ADDRS": srv.Addr()}, "--policy", file,
		"--redis-user", "leasebucket-coordinator", "--redis-password-file", pass, "--redis-tls-ca", ca["tls-ca-cert-file"])
	c.dial()
	c.waitHealth(healthpb.HealthCheckResponse_SERVING)
	resp, err := c.acquire("agent-1", 1, "v1", "acme", "bigcorp", "initech")
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range resp.Results {
		if r.Status != coordinatorv1.Status_STATUS_OK {
			t.Errorf("item %d: %v", i, r)
		}
	}
	ret, err := c.client.Return(ctxFor(t, 10*time.Second), &coordinatorv1.ReturnRequest{AgentId: "agent-1", Seq: 2, PolicyVersion: "v1",
		Items: []*coordinatorv1.ReturnItem{{Bucket: orders("acme"), UnspentMicro: tok, GrantedAtMs: resp.Results[0].GrantedAtMs}}})
	if err != nil || ret.Results[0].Status != coordinatorv1.Status_STATUS_OK {
		t.Errorf("Return: %v, %v", ret, err)
	}
	// The buckets are in this Redis, written by the ACL user, which Redis refused nothing.
	keys, err := srv.Client(t).Keys(ctxFor(t, 10*time.Second), "lb1:*").Result()
	if err != nil || len(keys) != 3 {
		t.Errorf("Redis holds keys %v (%v), want the 3 buckets", keys, err)
	}
	clients, err := srv.Client(t).ClientList(ctxFor(t, 10*time.Second)).Result()
	if err != nil || !strings.Contains(clients, "name="+clientName) || !strings.Contains(clients, "user=leasebucket-coordinator") {
		t.Errorf("CLIENT LIST shows no %s connection as user leasebucket-coordinator: %v\n%s", clientName, err, clients)
	}
	noACLDenials(t, srv)
	page := c.metrics()
	if v := metricValue(page, "leasebucket_coordinator_redis_round_trips_total"); v < 1 {
		t.Errorf("redis_round_trips_total = %v, want at least 1", v)
	}
	if v := metricValue(page, `leasebucket_coordinator_redis_round_trip_seconds_count`); v < 1 {
		t.Errorf("redis_round_trip_seconds_count = %v, want at least 1", v)
	}
}

// TestRunRedisLost: health follows Redis: NOT_SERVING while it is down (and Acquire fails with
// the distinct store error), SERVING again when it is back.
func TestRunRedisLost(t *testing.T) {
	srv := redistest.Start(t)
	file := filepath.Join(t.TempDir(), "policy.yaml")
	writeFile(t, file, policyYAML("v1", "100/second"))
	c := start(t, nil, "--policy", file, "--redis-addrs", srv.Addr(), "--redis-dial-timeout", "200ms",
		"--redis-timeout", "500ms", "--store-timeout", "1s")
	c.dial()
	c.waitHealth(healthpb.HealthCheckResponse_SERVING)
	if _, err := c.acquire("a", 1, "v1", "acme"); err != nil {
		t.Fatal(err)
	}
	srv.Kill()
	c.waitHealth(healthpb.HealthCheckResponse_NOT_SERVING)
	_, err := c.acquire("a", 2, "v1", "acme")
	if status.Code(err) != codes.Unavailable || coordinatorv1.Reason(err) != coordinatorv1.ReasonStoreUnavailable {
		t.Errorf("Acquire with Redis down: %v, want UNAVAILABLE with reason STORE_UNAVAILABLE", err)
	} else if strings.Contains(err.Error(), srv.Addr()) {
		t.Errorf("the client sees Redis' address: %v", err)
	}
	page := c.metrics()
	if v := metricValue(page, "leasebucket_coordinator_store_up"); v != 0 {
		t.Errorf("store_up = %v with Redis down, want 0", v)
	}
	if v := metricValue(page, `leasebucket_coordinator_redis_errors_total{kind="connection"}`); v < 1 {
		t.Errorf(`redis_errors_total{kind="connection"} = %v, want at least 1`, v)
	}
	srv.Restart()
	c.waitHealth(healthpb.HealthCheckResponse_SERVING)
	if _, err := c.acquire("a", 3, "v1", "acme"); err != nil {
		t.Errorf("Acquire after Redis restarted: %v", err)
	}
	if !strings.Contains(c.logs.String(), "store does not answer: not serving") {
		t.Error("the outage was not logged")
	}
}

// TestRunRedisCluster: the coordinator on a three-master Cluster, as the documented ACL user; with
// one master down it stays SERVING, the keys of that master fail per item, the others are granted.
func TestRunRedisCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	addACLUser(t, "s3cret", cluster.Nodes()...)
	file := filepath.Join(t.TempDir(), "policy.yaml")
	writeFile(t, file, policyYAML("v1", "100/second"))
	c := start(t, map[string]string{envRedisPassword: "s3cret"}, "--policy", file, "--redis-user", "leasebucket-coordinator",
		"--redis-addrs", strings.Join(cluster.Addrs(), ","),
		"--redis-dial-timeout", "200ms", "--redis-timeout", "500ms", "--store-timeout", "2s")
	c.dial()
	c.waitHealth(healthpb.HealthCheckResponse_SERVING)
	var tenants []string
	for i := range 12 {
		tenants = append(tenants, "tenant-"+strconv.Itoa(i))
	}
	resp, err := c.acquire("a", 1, "v1", tenants...)
	if err != nil {
		t.Fatal(err)
	}
	// Which master holds each bucket, from the keys Redis now has.
	cc := cluster.Client(t)
	master := map[string]*redistest.Server{}
	for _, tn := range tenants {
		keys, err := keysOf(cc, tn)
		if err != nil || len(keys) != 1 {
			t.Fatalf("bucket of %s: %v %v", tn, keys, err)
		}
		master[tn] = cluster.MasterForKey(keys[0])
	}
	for i, r := range resp.Results {
		if r.Status != coordinatorv1.Status_STATUS_OK {
			t.Fatalf("item %d: %v", i, r)
		}
	}
	down := master[tenants[0]]
	down.Kill()
	time.Sleep(300 * time.Millisecond) // several probes
	if h := c.health(); h != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health %v with one master of three down, want SERVING", h)
	}
	resp, err = c.acquire("a", 2, "v1", tenants...)
	if err != nil {
		t.Fatalf("Acquire with one master down: %v", err)
	}
	for i, r := range resp.Results {
		want := coordinatorv1.Status_STATUS_OK
		if master[tenants[i]] == down {
			want = coordinatorv1.Status_STATUS_STORE_UNAVAILABLE
		}
		if r.Status != want {
			t.Errorf("%s on %s: %v, want %v", tenants[i], master[tenants[i]].Addr(), r.Status, want)
		}
	}
	noACLDenials(t, cluster.Nodes()...)
	down.Restart()
	addACLUser(t, "s3cret", down) // a restarted node forgot its users
	cluster.WaitHealthy()
	proctest.WaitFor(t, 30*time.Second, "every key served again", func() bool {
		resp, err := c.acquire("a", 3, "v1", tenants...)
		if err != nil {
			return false
		}
		for _, r := range resp.Results {
			if r.Status != coordinatorv1.Status_STATUS_OK && r.Status != coordinatorv1.Status_STATUS_STALE {
				return false
			}
		}
		return true
	})
}

// keysOf finds the bucket keys of a tenant on every master.
func keysOf(cc *redis.ClusterClient, tenant string) ([]string, error) {
	var keys []string
	var mu sync.Mutex
	err := cc.ForEachMaster(context.Background(), func(ctx context.Context, m *redis.Client) error {
		ks, err := m.Keys(ctx, "lb1:"+tenant+"|*").Result()
		mu.Lock()
		defer mu.Unlock()
		keys = append(keys, ks...)
		return err
	})
	return keys, err
}

// TestRunRedisSentinel: the coordinator finds the master through the Sentinels and logs in as the
// documented ACL user, its password from the environment.
func TestRunRedisSentinel(t *testing.T) {
	s := redistest.StartSentinel(t, redistest.WithPassword("root-only"))
	addACLUser(t, "s3cret", s.Nodes()...)
	file := filepath.Join(t.TempDir(), "policy.yaml")
	writeFile(t, file, policyYAML("v1", "100/second"))
	c := start(t, map[string]string{envRedisPassword: "s3cret"}, "--policy", file, "--redis-user", "leasebucket-coordinator",
		"--redis-master-name", redistest.MasterName, "--redis-addrs", strings.Join(s.SentinelAddrs(), ","))
	c.dial()
	c.waitHealth(healthpb.HealthCheckResponse_SERVING)
	resp, err := c.acquire("a", 1, "v1", "acme")
	if err != nil || resp.Results[0].Status != coordinatorv1.Status_STATUS_OK {
		t.Fatalf("Acquire through Sentinel: %v, %v", resp, err)
	}
	keys, err := s.Master().Client(t).Keys(ctxFor(t, 10*time.Second), "lb1:acme|*").Result()
	if err != nil || len(keys) != 1 {
		t.Errorf("the master holds %v (%v), want acme's bucket", keys, err)
	}
	noACLDenials(t, s.Nodes()...)
}

// TestRunGCPercent: a coordinator on Redis runs its collector at redisGCPercent and says so,
// unless GOGC is set; on the memory store the target is left alone. run puts the target back when
// it returns.
func TestRunGCPercent(t *testing.T) {
	srv := redistest.Start(t)
	file := filepath.Join(t.TempDir(), "policy.yaml")
	writeFile(t, file, policyYAML("v1", "100/second"))
	current := func() int { p := debug.SetGCPercent(100); debug.SetGCPercent(p); return p }
	before := current()
	if before == redisGCPercent {
		t.Fatalf("the test process already runs at %d: the test could not tell", before)
	}
	for _, tc := range []struct {
		name string
		env  map[string]string
		args []string
		want int
	}{
		{"redis", nil, []string{"--redis-addrs", srv.Addr()}, redisGCPercent},
		{"redis, GOGC set", map[string]string{"GOGC": "150"}, []string{"--redis-addrs", srv.Addr()}, before},
		{"memory", nil, nil, before},
	} {
		c := start(t, tc.env, append([]string{"--policy", file}, tc.args...)...)
		c.dial()
		c.waitHealth(healthpb.HealthCheckResponse_SERVING)
		if got := current(); got != tc.want {
			t.Errorf("%s: the collector runs at %d, want %d", tc.name, got, tc.want)
		}
		if logged := strings.Contains(c.logs.String(), `"gc_percent":400`); logged != (tc.want == redisGCPercent) {
			t.Errorf("%s: logged the target: %t\n%s", tc.name, logged, c.logs)
		}
		if err := c.stop(); err != nil {
			t.Fatal(err)
		}
		if got := current(); got != before {
			t.Errorf("%s: the collector runs at %d after run returned, want %d back", tc.name, got, before)
		}
	}
}
