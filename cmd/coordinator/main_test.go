package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/internal/tlsconfig"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// TestMain checks for leaked goroutines, except go-redis' dial probe: after dials to a dead server
// fail, a pool probes the server once a second until it answers or the pool is closed, so a probe
// may outlive its client's Close by up to a second.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"))
}

const tok = int64(bucket.PerToken)

// policyYAML is a small policy under version; limit is the rule's.
func policyYAML(version, limit string) string {
	return fmt.Sprintf(`version: %q
rules:
  - name: orders
    routes: [/orders]
    operations: [read]
    limit: %s
    burst: 100
default:
  limit: 60/minute
  burst: 10
`, version, limit)
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	// Write and rename, as a deployment would, so the watcher never reads half a file.
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// coord is one run of the command.
type coord struct {
	t           *testing.T
	logs        *proctest.Buffer
	grpcAddr    string
	metricsAddr string
	conn        *grpc.ClientConn
	client      coordinatorv1.CoordinatorServiceClient
	stop        func() error
}

// start runs the command with args and env (plus loopback listeners on free ports) and waits
// until it serves; the run ends with the test.
func start(t *testing.T, env map[string]string, args ...string) *coord {
	t.Helper()
	args = append([]string{"--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--health-interval", "50ms"}, args...)
	c := &coord{t: t, logs: &proctest.Buffer{}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, func(k string) string { return env[k] }, c.logs) }()
	var once sync.Once
	var runErr error
	c.stop = func() error {
		once.Do(func() {
			cancel()
			runErr = <-done
		})
		return runErr
	}
	t.Cleanup(func() {
		if c.conn != nil {
			_ = c.conn.Close()
		}
		if err := c.stop(); err != nil {
			t.Errorf("run: %v", err)
		}
		if t.Failed() {
			t.Logf("coordinator logs:\n%s", c.logs)
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for c.grpcAddr == "" || c.metricsAddr == "" {
		select {
		case err := <-done:
			t.Fatalf("run returned %v before serving; logs:\n%s", err, c.logs)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("not serving after 30 s; logs:\n%s", c.logs)
		}
		for _, e := range c.logs.Records() {
			switch e["msg"] {
			case "coordinator serving":
				c.grpcAddr, _ = e["addr"].(string)
			case "metrics serving":
				c.metricsAddr, _ = e["addr"].(string)
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	return c
}

// dial connects a client (plaintext unless creds are given).
func (c *coord) dial(creds ...grpc.DialOption) {
	c.t.Helper()
	if len(creds) == 0 {
		creds = []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	}
	conn, err := grpc.NewClient(c.grpcAddr, creds...)
	if err != nil {
		c.t.Fatal(err)
	}
	c.conn = conn
	c.client = coordinatorv1.NewCoordinatorServiceClient(conn)
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func orders(tenant string) *coordinatorv1.BucketRef {
	return &coordinatorv1.BucketRef{Rule: "orders", Route: "/orders", Operation: "read", Tenant: tenant}
}

// acquire asks for one token of each tenant's orders bucket.
func (c *coord) acquire(agent string, seq uint64, version string, tenants ...string) (*coordinatorv1.AcquireResponse, error) {
	req := &coordinatorv1.AcquireRequest{AgentId: agent, Seq: seq, PolicyVersion: version}
	for _, tn := range tenants {
		req.Items = append(req.Items, &coordinatorv1.AcquireItem{Bucket: orders(tn), NeededMicro: tok, MinMicro: tok})
	}
	return c.client.Acquire(ctxFor(c.t, 30*time.Second), req)
}

// metrics returns the /metrics page.
func (c *coord) metrics() string {
	c.t.Helper()
	resp, err := http.Get("http://" + c.metricsAddr + "/metrics")
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatal(err)
	}
	return string(b)
}

// health is the current status of the coordinator service.
func (c *coord) health() healthpb.HealthCheckResponse_ServingStatus {
	resp, err := healthpb.NewHealthClient(c.conn).Check(ctxFor(c.t, 10*time.Second),
		&healthpb.HealthCheckRequest{Service: coordinator.HealthService})
	if err != nil {
		return healthpb.HealthCheckResponse_UNKNOWN
	}
	return resp.Status
}

func (c *coord) waitHealth(want healthpb.HealthCheckResponse_ServingStatus) {
	c.t.Helper()
	proctest.WaitFor(c.t, 30*time.Second, fmt.Sprintf("health %v", want), func() bool { return c.health() == want })
}

func TestHelp(t *testing.T) {
	for _, arg := range []string{"--help", "-h"} {
		var out bytes.Buffer
		if err := run(context.Background(), []string{arg}, func(string) string { return "" }, &out); err != nil {
			t.Fatalf("run %s: %v", arg, err)
		}
		help := out.String()
		if !strings.HasPrefix(help, "Usage: coordinator ") {
			t.Errorf("%s does not start with the usage line:\n%s", arg, help)
		}
		flags := newFlags(func(string) string { return "" }, io.Discard)
		flags.VisitAll(func(f *flag.Flag) {
			if f.Name == "policy-poll" {
				if !strings.Contains(help, "\n  --policy-poll ") || !strings.Contains(help, "use --policy-interval\n") {
					t.Errorf("%s does not list --policy-poll among the deprecated names", arg)
				}
				return
			}
			if !strings.Contains(help, "\n  --"+f.Name+" ") {
				t.Errorf("%s does not list --%s", arg, f.Name)
			}
			if env := flags.Env(f.Name); env == "" || !strings.Contains(help, "("+env) {
				t.Errorf("%s does not name the variable of --%s (%q)", arg, f.Name, env)
			}
		})
		for _, s := range []string{envRedisPassword, envRedisSentinelPassword, coordinator.HealthService,
			"LEASEBUCKET_COORDINATOR_LISTEN, default :7070", "LEASEBUCKET_REDIS_ADDRS", "--log-format", "LEASEBUCKET_LISTEN  "} {
			if !strings.Contains(help, s) {
				t.Errorf("%s does not mention %s", arg, s)
			}
		}
	}
}

func TestConfig(t *testing.T) {
	dir := t.TempDir()
	pass := filepath.Join(dir, "pass")
	if err := os.WriteFile(pass, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		args  []string
		env   map[string]string
		err   string             // a substring of the error, or "" for none
		check func(*config) bool // when there is no error
	}{
		{name: "defaults: memory", args: []string{"--policy", "p.yaml"},
			check: func(c *config) bool {
				return c.store == storeMemory && c.listen == ":7070" && c.metricsListen == ":7071" && c.storeTimeout == 300*time.Millisecond
			}},
		{name: "addrs select redis", args: []string{"--policy", "p", "--redis-addrs", "a:1, b:2"},
			check: func(c *config) bool {
				return c.store == storeRedis && len(c.redis.addrs) == 2 && c.redis.addrs[1] == "b:2"
			}},
		{name: "in-flight: the store's default", args: []string{"--policy", "p", "--redis-addrs", "r:1"},
			check: func(c *config) bool { return c.redis.inFlight == redisstore.DefaultInFlight }},
		{name: "in-flight from the environment", args: []string{"--policy", "p", "--redis-addrs", "r:1"},
			env:   map[string]string{"LEASEBUCKET_REDIS_IN_FLIGHT": "0"},
			check: func(c *config) bool { return c.redis.inFlight == 0 }},
		{name: "env sets, flags win", args: []string{"--listen", "127.0.0.1:9"},
			env: map[string]string{"LEASEBUCKET_POLICY": "p", "LEASEBUCKET_COORDINATOR_LISTEN": ":1", "LEASEBUCKET_REDIS_ADDRS": "r:6379",
				"LEASEBUCKET_REDIS_USER": "coord", envRedisPassword: "pw", "LEASEBUCKET_COORDINATOR_STORE_TIMEOUT": "250ms"},
			check: func(c *config) bool {
				return c.listen == "127.0.0.1:9" && c.policyFile == "p" && c.redis.user == "coord" && c.redis.password == "pw" &&
					c.storeTimeout == 250*time.Millisecond && c.store == storeRedis
			}},
		{name: "password file", args: []string{"--policy", "p", "--redis-addrs", "r:1", "--redis-password-file", pass},
			check: func(c *config) bool { return c.redis.password == "s3cret" }},
		{name: "sentinel password", args: []string{"--policy", "p", "--redis-addrs", "s:1", "--redis-master-name", "m"},
			env:   map[string]string{envRedisSentinelPassword: "sp"},
			check: func(c *config) bool { return c.redis.sentinelPassword == "sp" && c.redis.password == "" }},
		{name: "redis tls implied", args: []string{"--policy", "p", "--redis-addrs", "r:1", "--redis-tls-ca", "ca.pem"},
			check: func(c *config) bool { return c.redis.tls }},
		{name: "no policy", args: nil, err: "--policy is required"},
		{name: "both password sources", args: []string{"--policy", "p", "--redis-addrs", "r:1", "--redis-password-file", pass},
			env: map[string]string{envRedisPassword: "pw"}, err: "both set"},
		{name: "empty password file", args: []string{"--policy", "p", "--redis-addrs", "r:1", "--redis-password-file", empty}, err: "is empty"},
		{name: "missing password file", args: []string{"--policy", "p", "--redis-addrs", "r:1", "--redis-password-file", filepath.Join(dir, "nope")}, err: "--redis-password-file"},
		{name: "memory with redis settings", args: []string{"--policy", "p", "--store", "memory", "--redis-addrs", "r:1"}, err: "does not use Redis"},
		{name: "redis without addrs", args: []string{"--policy", "p", "--store", "redis"}, err: "needs --redis-addrs"},
		{name: "unknown store", args: []string{"--policy", "p", "--store", "disk"}, err: "want redis or memory"},
		{name: "sentinel and cluster", args: []string{"--policy", "p", "--redis-addrs", "r:1", "--redis-master-name", "m", "--redis-cluster"}, err: "exclude each other"},
		{name: "db on a cluster", args: []string{"--policy", "p", "--redis-addrs", "a:1,b:2", "--redis-db", "2"}, err: "only database 0"},
		{name: "cert without key", args: []string{"--policy", "p", "--tls-cert", "c.pem"}, err: "go together"},
		{name: "client CA without cert", args: []string{"--policy", "p", "--tls-client-ca", "ca.pem"}, err: "needs --tls-cert"},
		{name: "redis cert without key", args: []string{"--policy", "p", "--redis-addrs", "r:1", "--redis-tls-cert", "c"}, err: "go together"},
		{name: "negative in-flight", args: []string{"--policy", "p", "--redis-addrs", "r:1", "--redis-in-flight", "-1"}, err: "--redis-in-flight=-1 must not be negative"},
		{name: "zero timeout", args: []string{"--policy", "p", "--store-timeout", "0s"}, err: "must be positive"},
		{name: "bad env value", args: []string{"--policy", "p"}, env: map[string]string{"LEASEBUCKET_COORDINATOR_STORE_TIMEOUT": "soon"}, err: "LEASEBUCKET_COORDINATOR_STORE_TIMEOUT"},
		{name: "bad log format", args: []string{"--policy", "p", "--log-format", "xml"}, err: "--log-format"},
		{name: "bad log level", args: []string{"--policy", "p", "--log-level", "loud"}, err: "--log-level"},
		{name: "stray argument", args: []string{"--policy", "p", "extra"}, err: "unexpected arguments"},
		{name: "unknown flag", args: []string{"--policy", "p", "--redis-adrs", "r:1"}, err: "flag provided but not defined"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := parseConfig(tc.args, func(k string) string { return tc.env[k] }, io.Discard)
			switch {
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Fatalf("parseConfig(%q) error = %v, want one containing %q", tc.args, err, tc.err)
			case tc.err == "" && err != nil:
				t.Fatalf("parseConfig(%q): %v", tc.args, err)
			case tc.err == "" && !tc.check(c):
				t.Fatalf("parseConfig(%q) = %+v", tc.args, c)
			}
		})
	}
}

func TestRunFailsEarly(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "policy.yaml")
	writeFile(t, good, policyYAML("v1", "100/second"))
	bad := filepath.Join(dir, "bad.yaml")
	writeFile(t, bad, "version: v1\nrules: [{name: x}]\n")
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	for _, tc := range []struct {
		name string
		args []string
		err  string
	}{
		{"invalid policy", []string{"--policy", bad}, "bad.yaml"},
		{"missing policy", []string{"--policy", filepath.Join(dir, "nope.yaml")}, "nope.yaml"},
		{"address in use", []string{"--policy", good, "--listen", busy.Addr().String()}, "listen"},
		{"metrics address in use", []string{"--policy", good, "--listen", "127.0.0.1:0", "--metrics-listen", busy.Addr().String()}, "metrics listen"},
		{"missing certificate", []string{"--policy", good, "--tls-cert", filepath.Join(dir, "c.pem"), "--tls-key", filepath.Join(dir, "k.pem")}, "tlsconfig"},
		{"missing redis CA", []string{"--policy", good, "--redis-addrs", "127.0.0.1:1", "--redis-tls-ca", filepath.Join(dir, "ca.pem")}, "redis TLS"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := run(context.Background(), append([]string{"--metrics-listen", ""}, tc.args...), func(string) string { return "" }, io.Discard)
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("run: %v, want an error mentioning %q", err, tc.err)
			}
		})
	}
}

// TestRunMemory runs the command on the memory store: it serves Acquire and health, exposes
// metrics, reloads its policy when the file changes (keeping the previous version and the last
// good policy when the file breaks), and stops cleanly.
func TestRunMemory(t *testing.T) {
	file := filepath.Join(t.TempDir(), "policy.yaml")
	writeFile(t, file, policyYAML("v1", "100/second"))
	c := start(t, nil, "--policy", file, "--policy-interval", "20ms")
	c.dial()
	if h := c.health(); h != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health %v, want SERVING", h)
	}
	resp, err := c.acquire("agent-1", 1, "v1", "acme", "bigcorp")
	if err != nil || resp.Results[0].Status != coordinatorv1.Status_STATUS_OK || resp.Results[1].Status != coordinatorv1.Status_STATUS_OK {
		t.Fatalf("Acquire: %v, %v", resp, err)
	}
	if _, err := c.acquire("agent-1", 2, "v2", "acme"); coordinatorv1.Reason(err) != coordinatorv1.ReasonUnknownPolicyVersion {
		t.Fatalf("Acquire under v2 before the reload: %v", err)
	}
	page := c.metrics()
	for _, want := range []string{
		"leasebucket_coordinator_grants_total 2",
		"leasebucket_coordinator_granted_tokens_total 2",
		`leasebucket_coordinator_requests_total{code="OK",method="Acquire"} 1`,
		`leasebucket_coordinator_requests_total{code="FailedPrecondition",method="Acquire"} 1`,
		`leasebucket_coordinator_batch_items_count{method="acquire"} 1`,
		`leasebucket_coordinator_policy_info{version="v1"} 1`,
		"leasebucket_coordinator_store_up 1",
		`leasebucket_policy_reloads_total{result="ok"} 0`,
		"go_goroutines",
	} {
		if !strings.Contains(page, want+"\n") && !strings.Contains(page, want+" ") {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	if strings.Contains(page, "acme") {
		t.Error("/metrics names a tenant")
	}

	writeFile(t, file, policyYAML("v2", "200/second"))
	proctest.WaitFor(t, 10*time.Second, "reload to v2", func() bool {
		_, err := c.acquire("agent-1", 3, "v2", "acme")
		return err == nil
	})
	if resp, err := c.acquire("agent-1", 4, "v1", "acme"); err != nil || resp.Results[0].Status != coordinatorv1.Status_STATUS_OK {
		t.Errorf("Acquire under v1 after the reload: %v, %v", resp, err)
	}
	writeFile(t, file, "version: v3\nrules: [")
	proctest.WaitFor(t, 10*time.Second, "rejected reload", func() bool {
		return strings.Contains(c.metrics(), `leasebucket_policy_reloads_total{result="error"} 1`)
	})
	if _, err := c.acquire("agent-1", 5, "v2", "acme"); err != nil {
		t.Errorf("Acquire under v2 after a broken file: %v", err)
	}

	if err := c.stop(); err != nil {
		t.Fatalf("run after cancel: %v", err)
	}
	if _, err := net.DialTimeout("tcp", c.grpcAddr, time.Second); err == nil {
		t.Error("the gRPC port still accepts connections after run returned")
	}
	if _, err := net.DialTimeout("tcp", c.metricsAddr, time.Second); err == nil {
		t.Error("the metrics port still accepts connections after run returned")
	}
	logs := c.logs.String()
	for _, want := range []string{"policy reloaded", "coordinator stopped"} {
		if !strings.Contains(logs, want) {
			t.Errorf("logs lack %q:\n%s", want, logs)
		}
	}
}

// TestRunMutualTLS: with --tls-client-ca only agents with a certificate of that CA are served.
func TestRunMutualTLS(t *testing.T) {
	dir := t.TempDir()
	pki, err := tlsconfig.WriteTestPKI(dir)
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "policy.yaml")
	writeFile(t, file, policyYAML("v1", "100/second"))
	c := start(t, map[string]string{"LEASEBUCKET_COORDINATOR_TLS_CLIENT_CA": pki.CA},
		"--policy", file, "--tls-cert", pki.ServerCert, "--tls-key", pki.ServerKey, "--health-listen", "127.0.0.1:0")
	creds := func(cert, key string) grpc.DialOption {
		cfg, err := tlsconfig.Client(pki.CA, cert, key, "")
		if err != nil {
			t.Fatal(err)
		}
		return grpc.WithTransportCredentials(credentials.NewTLS(cfg))
	}
	c.dial(creds(pki.ClientCert, pki.ClientKey))
	if _, err := c.acquire("a", 1, "v1", "acme"); err != nil {
		t.Fatalf("agent with a client certificate: %v", err)
	}
	// The health port answers the same status in plaintext, and serves nothing else.
	var healthAddr string
	for _, r := range c.logs.Records() {
		if r["msg"] == "health serving" {
			healthAddr, _ = r["addr"].(string)
		}
	}
	hconn, err := grpc.NewClient(healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer hconn.Close()
	hresp, err := healthpb.NewHealthClient(hconn).Check(ctxFor(t, 10*time.Second), &healthpb.HealthCheckRequest{Service: coordinator.HealthService})
	if err != nil || hresp.Status != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("plaintext health on --health-listen %q: %v, %v; want SERVING", healthAddr, hresp, err)
	}
	_, err = coordinatorv1.NewCoordinatorServiceClient(hconn).Acquire(ctxFor(t, 10*time.Second),
		&coordinatorv1.AcquireRequest{AgentId: "x", Seq: 1, PolicyVersion: "v1"})
	if status.Code(err) != codes.Unimplemented {
		t.Errorf("Acquire on the health port: %v, want Unimplemented", err)
	}
	for name, cr := range map[string]grpc.DialOption{"no certificate": creds("", ""), "foreign CA": creds(pki.OtherCert, pki.OtherKey)} {
		conn, err := grpc.NewClient(c.grpcAddr, cr)
		if err != nil {
			t.Fatal(err)
		}
		_, err = coordinatorv1.NewCoordinatorServiceClient(conn).Acquire(ctxFor(t, 10*time.Second),
			&coordinatorv1.AcquireRequest{AgentId: "x", Seq: 1, PolicyVersion: "v1"})
		_ = conn.Close()
		if status.Code(err) != codes.Unavailable {
			t.Errorf("%s: %v, want the connection refused", name, err)
		}
	}
}

// TestRedisTopology: go-redis picks the client the flags describe.
func TestRedisTopology(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--redis-addrs", "r:6379"}, "standalone"},
		{[]string{"--redis-addrs", "r:6379", "--redis-cluster"}, "cluster"},
		{[]string{"--redis-addrs", "a:6379,b:6379,c:6379"}, "cluster"},
		{[]string{"--redis-addrs", "s1:26379,s2:26379", "--redis-master-name", "m"}, "sentinel"},
	} {
		cfg, err := parseConfig(append([]string{"--policy", "p"}, tc.args...), func(string) string { return "" }, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		opts, err := redisOptions(cfg.redis)
		if err != nil {
			t.Fatal(err)
		}
		c := redis.NewUniversalClient(opts)
		if got := redisKind(c, cfg.redis.masterName); got != tc.want {
			t.Errorf("%q: %s client, want %s", tc.args, got, tc.want)
		}
		if (tc.want == "cluster") != isCluster(c) {
			t.Errorf("%q: client %T", tc.args, c)
		}
		_ = c.Close()
	}
}
