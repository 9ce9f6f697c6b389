package redistest_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// childEnv makes a test run as the child that a test of the same name started from the test
// binary, for behaviour that needs its own process: dying abruptly, or Require's verdict.
const childEnv = "REDISTEST_CHILD"

// runChild runs the test binary again, only test, as a child with childEnv=role.
func runChild(t *testing.T, role string, env ...string) ([]byte, error) {
	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v")
	cmd.Env = append(append(os.Environ(), childEnv+"="+role), env...)
	return cmd.CombinedOutput()
}

func serverPID(c *redis.Client) (int, error) {
	info, err := c.Info(context.Background(), "server").Result()
	if err != nil {
		return 0, err
	}
	for line := range strings.SplitSeq(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "process_id:"); ok {
			return strconv.Atoi(v)
		}
	}
	return 0, errors.New("no process_id in INFO server")
}

func alive(pid int) bool { return syscall.Kill(pid, 0) == nil }

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

func TestStartServes(t *testing.T) {
	s := redistest.Start(t)
	if s.Port() == 6379 || s.Port() <= 0 {
		t.Fatalf("Port() = %d, want a free port other than 6379", s.Port())
	}
	c := s.Client(t)
	if err := c.Set(ctx(t), "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if got, err := c.Get(ctx(t), "k").Result(); err != nil || got != "v" {
		t.Fatalf("GET k = %q, %v, want \"v\"", got, err)
	}
	cfg, err := c.ConfigGet(ctx(t), "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]string{
		"save": "", "appendonly": "no", "bind": "127.0.0.1", "dir": s.Dir(), "port": strconv.Itoa(s.Port()),
	} {
		if cfg[k] != want {
			t.Errorf("CONFIG GET %s = %q, want %q", k, cfg[k], want)
		}
	}
}

func TestParallelStartsGetDistinctPorts(t *testing.T) {
	var mu sync.Mutex
	ports := map[int]bool{}
	t.Run("group", func(t *testing.T) {
		for i := range 6 {
			t.Run(strconv.Itoa(i), func(t *testing.T) {
				t.Parallel()
				s := redistest.Start(t)
				if err := s.Client(t).Ping(ctx(t)).Err(); err != nil {
					t.Fatalf("PING: %v", err)
				}
				mu.Lock()
				defer mu.Unlock()
				if ports[s.Port()] {
					t.Errorf("port %d handed out twice", s.Port())
				}
				ports[s.Port()] = true
			})
		}
	})
}

func TestKillRestartKeepsPort(t *testing.T) {
	s := redistest.Start(t)
	o := s.Options()
	o.MaxRetries = -1
	c := redis.NewClient(o)
	defer c.Close()
	pid1, err := serverPID(c)
	if err != nil {
		t.Fatal(err)
	}
	port := s.Port()
	s.Kill()
	if alive(pid1) {
		t.Fatalf("redis-server %d alive after Kill", pid1)
	}
	if s.Running() {
		t.Fatal("Running() = true after Kill")
	}
	if err := c.Ping(ctx(t)).Err(); err == nil {
		t.Fatal("PING succeeded after Kill")
	}
	s.Restart()
	if s.Port() != port {
		t.Fatalf("Port() after Restart = %d, want %d", s.Port(), port)
	}
	pid2, err := serverPID(c)
	if err != nil {
		t.Fatalf("INFO after Restart: %v", err)
	}
	if pid2 == pid1 {
		t.Fatalf("same pid %d after Restart", pid2)
	}
}

func TestStopIsGraceful(t *testing.T) {
	s := redistest.Start(t)
	s.Stop()
	log, err := os.ReadFile(s.Dir() + "/redis.log")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(log), "ready to exit, bye bye") {
		t.Fatalf("log after Stop lacks the shutdown message:\n%s", log)
	}
	if s.Running() {
		t.Fatal("Running() = true after Stop")
	}
}

func TestPauseHangsUntilResume(t *testing.T) {
	s := redistest.Start(t)
	o := s.Options()
	o.ReadTimeout, o.MaxRetries = 200*time.Millisecond, -1
	c := redis.NewClient(o)
	defer c.Close()
	if err := c.Ping(ctx(t)).Err(); err != nil {
		t.Fatal(err)
	}
	s.Pause()
	err := c.Ping(ctx(t)).Err()
	var ne interface{ Timeout() bool }
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("PING on a paused server: %v, want a timeout", err)
	}
	s.Resume()
	if err := c.Ping(ctx(t)).Err(); err != nil {
		t.Fatalf("PING after Resume: %v", err)
	}
}

func TestCrashedTestBinaryLeavesNoServer(t *testing.T) {
	if os.Getenv(childEnv) == "orphan" {
		// Start a server, report its pid and die without running any cleanup.
		pid, err := serverPID(redistest.Start(t).Client(t))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Printf("pid=%d\n", pid)
		os.Exit(2)
	}
	out, err := runChild(t, "orphan")
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 {
		t.Fatalf("child: %v\n%s", err, out)
	}
	_, after, ok := strings.Cut(string(out), "pid=")
	if !ok {
		t.Fatalf("child printed no pid:\n%s", out)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(after, "\n", 2)[0]))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for alive(pid) && !isZombie(pid) {
		if time.Now().After(deadline) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("redis-server %d outlived its test binary", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// isZombie reports a dead process not yet reaped by its new parent.
func isZombie(pid int) bool {
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return true
	}
	_, rest, _ := strings.Cut(string(stat), ") ")
	return strings.HasPrefix(rest, "Z")
}

func TestRequireMissingBinary(t *testing.T) {
	if os.Getenv(childEnv) == "require" {
		redistest.Require(t, "leasebucket-no-such-binary")
		t.Log("Require returned")
		return
	}
	for _, tc := range []struct {
		ci   string
		want string // go test's verdict line
	}{{"true", "--- FAIL"}, {"", "--- SKIP"}} {
		out, _ := runChild(t, "require", "CI="+tc.ci)
		s := string(out)
		if !strings.Contains(s, tc.want) || strings.Contains(s, "Require returned") {
			t.Errorf("CI=%q: Require on a missing binary: want %q and no return, got:\n%s", tc.ci, tc.want, s)
		}
		if !strings.Contains(s, "leasebucket-no-such-binary not found: install it with `apt-get install -y redis-server`") {
			t.Errorf("CI=%q: message lacks the install hint:\n%s", tc.ci, s)
		}
	}
}

func TestPassword(t *testing.T) {
	s := redistest.Start(t, redistest.WithPassword("sesame"))
	anon := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
	defer anon.Close()
	if err := anon.Ping(ctx(t)).Err(); err == nil || !strings.Contains(err.Error(), "NOAUTH") {
		t.Fatalf("PING without password: %v, want NOAUTH", err)
	}
	if err := s.Client(t).Ping(ctx(t)).Err(); err != nil {
		t.Fatalf("PING with password: %v", err)
	}
}

func TestACLUser(t *testing.T) {
	s := redistest.Start(t, redistest.WithUser("coordinator", "s3cret"), redistest.WithPassword("root"))
	c := s.Client(t)
	who, err := c.Do(ctx(t), "acl", "whoami").Text()
	if err != nil || who != "coordinator" {
		t.Fatalf("ACL WHOAMI = %q, %v, want coordinator", who, err)
	}
	if err := c.Eval(ctx(t), "return redis.call('set', KEYS[1], 'x')", []string{"k"}).Err(); err != nil {
		t.Fatalf("EVAL as ACL user: %v", err)
	}
}

func TestTLS(t *testing.T) {
	s := redistest.Start(t, redistest.WithTLS())
	plain := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1, ReadTimeout: time.Second})
	defer plain.Close()
	if err := plain.Ping(ctx(t)).Err(); err == nil {
		t.Fatal("PING without TLS succeeded on a TLS-only server")
	}
	if err := s.Client(t).Ping(ctx(t)).Err(); err != nil {
		t.Fatalf("PING over TLS: %v", err)
	}
}

func TestWithConfigOverrides(t *testing.T) {
	s := redistest.Start(t, redistest.WithConfig("maxmemory", "10mb"), redistest.WithConfig("appendonly", "yes"))
	cfg, err := s.Client(t).ConfigGet(ctx(t), "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	if cfg["maxmemory"] != "10485760" || cfg["appendonly"] != "yes" {
		t.Fatalf("maxmemory = %q, appendonly = %q, want 10485760, yes", cfg["maxmemory"], cfg["appendonly"])
	}
}

func TestCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3)
	cc := c.Client(t)
	if n := len(c.Masters()); n != 3 {
		t.Fatalf("%d masters, want 3", n)
	}
	// Keys spread over the masters, and MasterForKey names the node that holds each.
	seen := map[*redistest.Server]bool{}
	for i := range 30 {
		key := "key-" + strconv.Itoa(i)
		if err := cc.Set(ctx(t), key, i, 0).Err(); err != nil {
			t.Fatalf("SET %s: %v", key, err)
		}
		m := c.MasterForKey(key)
		seen[m] = true
		got, err := m.Client(t).Get(ctx(t), key).Int()
		if err != nil || got != i {
			t.Fatalf("GET %s on MasterForKey %s = %d, %v, want %d", key, m.Addr(), got, err, i)
		}
	}
	if len(seen) != 3 {
		t.Fatalf("30 keys landed on %d masters, want 3", len(seen))
	}

	// One master down: its keys fail, the others' keys are served; after a restart it serves again.
	down := c.MasterForKey("key-0")
	down.Kill()
	var other string
	for i := range 30 {
		if k := "key-" + strconv.Itoa(i); c.MasterForKey(k) != down {
			other = k
			break
		}
	}
	if err := cc.Set(ctx(t), other, "still", 0).Err(); err != nil {
		t.Fatalf("SET %s with another master down: %v", other, err)
	}
	down.Restart()
	c.WaitHealthy()
	if err := cc.Set(ctx(t), "key-0", "back", 0).Err(); err != nil {
		t.Fatalf("SET key-0 after its master restarted: %v", err)
	}
}

// TestClusterReplicasACLTLS starts a cluster with replicas that authenticate as an ACL user over
// TLS, the way a production coordinator would connect.
func TestClusterReplicasACLTLS(t *testing.T) {
	c := redistest.StartCluster(t, 3, redistest.WithReplicas(1), redistest.WithUser("coordinator", "s3cret"), redistest.WithTLS())
	if n, m := len(c.Nodes()), len(c.Masters()); n != 6 || m != 3 {
		t.Fatalf("%d nodes with %d masters, want 6 with 3", n, m)
	}
	cc := c.Client(t)
	if err := cc.Set(ctx(t), "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	who, err := c.MasterForKey("k").Client(t).Do(ctx(t), "acl", "whoami").Text()
	if err != nil || who != "coordinator" {
		t.Fatalf("ACL WHOAMI = %q, %v, want coordinator", who, err)
	}
	plain := redis.NewClient(&redis.Options{Addr: c.Node(0).Addr(), MaxRetries: -1, ReadTimeout: time.Second})
	defer plain.Close()
	if err := plain.Ping(ctx(t)).Err(); err == nil {
		t.Fatal("PING without TLS succeeded on a TLS cluster node")
	}
}

func TestSentinelFailover(t *testing.T) {
	s := redistest.StartSentinel(t, redistest.WithPassword("sesame"))
	c := s.Client(t)
	if err := c.Set(ctx(t), "before", "1", 0).Err(); err != nil {
		t.Fatalf("SET through the failover client: %v", err)
	}
	old := s.Master()
	if old != s.Node(0) {
		t.Fatalf("master is %s, want node 0 %s", old.Addr(), s.Node(0).Addr())
	}
	// The replica must hold the write before the master dies, or the failover loses it.
	if err := c.Do(ctx(t), "wait", 1, 5000).Err(); err != nil {
		t.Fatal(err)
	}
	old.Kill()
	deadline := time.Now().Add(45 * time.Second)
	for {
		err := c.Set(ctx(t), "after", "1", 0).Err()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no write accepted 45 s after the master was killed: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Every sentinel names the old replica (the one that led the failover first, the others as they
	// hear of it).
	s.WaitMaster(s.Node(1))
	if m := s.Master(); m != s.Node(1) {
		t.Fatalf("master after failover is %s, want the old replica %s", m.Addr(), s.Node(1).Addr())
	}
	if v, err := c.Get(ctx(t), "before").Result(); err != nil || v != "1" {
		t.Fatalf("GET before on the new master = %q, %v, want \"1\"", v, err)
	}
	role, err := s.Node(1).Client(t).Do(ctx(t), "role").Slice()
	if err != nil || role[0] != "master" {
		t.Fatalf("ROLE of the old replica = %v, %v, want master", role, err)
	}
}
