// Package redistest starts throwaway redis-server processes for tests: a standalone server
// (Start), a Redis Cluster (StartCluster) and a Sentinel setup (StartSentinel).
//
// Every server listens on 127.0.0.1 on a port chosen free at start (never the machine's own Redis
// on 6379), keeps its files in a test temporary directory, persists nothing, and is killed when
// the test ends. The child runs in its own process group and is killed by the kernel if the test
// binary dies, so no server outlives a crashed test. Packages run in parallel by go test cannot
// collide: a start that loses a race for its port picks another one and tries again.
//
// Methods that can fail call t.Fatal on the test that started the server, so they must run on that
// test's goroutine (not in a subtest of it, nor in another goroutine).
package redistest

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	// startTimeout bounds how long a server may take to answer its first PING. A server starts in
	// milliseconds; the margin is for a loaded 2-core machine running the race detector.
	startTimeout = 20 * time.Second

	// stopTimeout bounds a graceful shutdown before Stop falls back to SIGKILL.
	stopTimeout = 15 * time.Second

	// portAttempts bounds how often a start picks a new port after losing the one it chose to
	// another process between choosing and binding it.
	portAttempts = 20

	// busOffset is the distance from a cluster node's client port to its cluster bus port.
	busOffset = 10000

	pollEvery = 20 * time.Millisecond
)

// errAddrInUse means the chosen port was taken before redis-server could bind it.
var errAddrInUse = errors.New("redistest: address already in use")

// Require fails the test under CI=true, and skips it otherwise, when redis-server or one of the
// other named binaries (such as redis-cli) is not on PATH.
func Require(t testing.TB, binaries ...string) {
	t.Helper()
	for _, bin := range append([]string{"redis-server"}, binaries...) {
		if _, err := exec.LookPath(bin); err == nil {
			continue
		}
		msg := bin + " not found: install it with `apt-get install -y redis-server` " +
			"(the Makefile's test target does this when run as root)"
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
}

// Option configures the servers that Start, StartCluster and StartSentinel run.
type Option func(*config)

type config struct {
	password       string   // requirepass of the default user
	user, userPass string   // an ACL user with every permission, used by clients when set
	tls            bool     // clients speak TLS only; the plain port is closed
	extra          []string // further command-line configuration, already in --directive form
	replicas       int      // StartCluster: replicas per master

	tlsOnce sync.Once
	tlsMat  *tlsMaterial // shared by every server of one Start call (one CA for a cluster)
	tlsErr  error
}

// WithPassword sets requirepass (and masterauth, so replicas of a cluster can sync).
func WithPassword(password string) Option {
	return func(c *config) { c.password = password }
}

// WithUser adds an ACL user allowed every command, key and channel, and makes clients log in as
// that user. Replicas authenticate as that user too.
func WithUser(name, password string) Option {
	return func(c *config) { c.user, c.userPass = name, password }
}

// WithTLS makes the servers accept TLS connections only, with a certificate for 127.0.0.1 signed
// by a throwaway CA that Options and Client trust. Cluster nodes also talk TLS to each other.
// StartSentinel does not support it.
func WithTLS() Option {
	return func(c *config) { c.tls = true }
}

// WithConfig adds one configuration directive, as on redis-server's command line:
// WithConfig("maxmemory", "10mb"). It overrides the harness's own settings of the same directive.
// It applies to data nodes, not to sentinels.
func WithConfig(directive string, values ...string) Option {
	return func(c *config) {
		c.extra = append(c.extra, "--"+directive)
		c.extra = append(c.extra, values...)
	}
}

// WithReplicas gives every master of a StartCluster cluster n replicas. Start rejects it.
func WithReplicas(n int) Option {
	return func(c *config) { c.replicas = n }
}

func newConfig(opts []Option) *config {
	c := &config{}
	for _, o := range opts {
		o(c)
	}
	return c
}

// mode is what kind of redis-server a Server runs.
type mode int

const (
	modePlain mode = iota
	modeCluster
	modeSentinel
)

// Server is one redis-server process on a fixed port. Kill, Stop, Restart, Pause and Resume act on
// the same port and directory, so a restarted cluster node rejoins with its identity.
type Server struct {
	t     testing.TB
	cfg   *config
	mode  mode
	dir   string
	conf  string   // sentinel: the config file sentinel rewrites, the first argument
	extra []string // per-server directives, before cfg.extra so a test can override them

	mu   sync.Mutex
	port int
	proc *process // nil when stopped
}

type process struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once the process has exited and been reaped
}

// Start runs a standalone redis-server and returns once it answers. The server is killed when the
// test ends.
func Start(t testing.TB, opts ...Option) *Server {
	t.Helper()
	Require(t)
	cfg := newConfig(opts)
	if cfg.replicas != 0 {
		t.Fatal("redistest: WithReplicas is an option of StartCluster")
	}
	return startServer(t, cfg, modePlain, nil, "")
}

// startServer creates, starts and registers the cleanup of one server. conf is the content of the
// config file of a sentinel, which rewrites it as it learns the topology.
func startServer(t testing.TB, cfg *config, m mode, extra []string, conf string) *Server {
	t.Helper()
	s := &Server{t: t, cfg: cfg, mode: m, dir: t.TempDir(), extra: extra}
	t.Cleanup(s.cleanup)
	if m == modeSentinel {
		s.conf = filepath.Join(s.dir, "sentinel.conf")
		if err := os.WriteFile(s.conf, []byte(conf), 0o600); err != nil {
			t.Fatalf("redistest: %v", err)
		}
	}
	if cfg.tls {
		cfg.tlsOnce.Do(func() { cfg.tlsMat, cfg.tlsErr = newTLSMaterial(t.TempDir()) })
		if cfg.tlsErr != nil {
			t.Fatalf("redistest: %v", cfg.tlsErr)
		}
	}
	for attempt := 0; ; attempt++ {
		port, err := freePort(m == modeCluster)
		if err != nil {
			t.Fatalf("redistest: %v", err)
		}
		err = s.launch(port)
		if err == nil {
			return s
		}
		if !errors.Is(err, errAddrInUse) || attempt+1 == portAttempts {
			t.Fatalf("redistest: start redis-server on port %d: %v", port, err)
		}
	}
}

// freePort returns a port that was free on 127.0.0.1 a moment ago; with bus, port+busOffset was
// free too. Another process may take it before redis-server binds it: launch reports that as
// errAddrInUse and the caller picks again.
func freePort(bus bool) (int, error) {
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, fmt.Errorf("find a free port: %w", err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		if !bus {
			_ = l.Close()
			return port, nil
		}
		if port+busOffset > 65535 {
			_ = l.Close()
			continue
		}
		lb, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port+busOffset))
		_ = l.Close()
		if err != nil {
			continue
		}
		_ = lb.Close()
		return port, nil
	}
	return 0, errors.New("find a free port pair for a cluster node: none after 100 tries")
}

// args is redis-server's command line for port.
func (s *Server) args(port int) []string {
	var a []string
	if s.conf != "" {
		a = append(a, s.conf, "--sentinel")
	}
	a = append(a, "--bind", "127.0.0.1", "--dir", s.dir, "--logfile", "", "--daemonize", "no")
	if s.mode != modeSentinel {
		// Persist nothing; replicas sync at once instead of waiting 5 s for more replicas to
		// join the same diskless transfer.
		a = append(a, "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0")
	}
	if t := s.cfg.tlsMat; s.cfg.tls {
		a = append(a, "--port", "0", "--tls-port", strconv.Itoa(port),
			"--tls-cert-file", t.ServerCert, "--tls-key-file", t.ServerKey, "--tls-ca-cert-file", t.CA,
			"--tls-client-cert-file", t.ClientCert, "--tls-client-key-file", t.ClientKey,
			"--tls-auth-clients", "no", "--tls-replication", "yes")
		if s.mode == modeCluster {
			a = append(a, "--tls-cluster", "yes")
		}
	} else {
		a = append(a, "--port", strconv.Itoa(port))
	}
	if s.mode != modeSentinel {
		if s.cfg.password != "" {
			a = append(a, "--requirepass", s.cfg.password, "--masterauth", s.cfg.password)
		}
		if s.cfg.user != "" {
			a = append(a, "--user", s.cfg.user, "on", ">"+s.cfg.userPass, "~*", "&*", "+@all",
				"--masteruser", s.cfg.user, "--masterauth", s.cfg.userPass)
		}
	}
	if s.mode == modeCluster {
		a = append(a, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			// Long enough that a loaded test machine does not mark a live node failed, short
			// enough that a failover test sees a killed master replaced within seconds.
			"--cluster-node-timeout", "3000",
			// Keep serving the slots of live masters when one master is down, so a test sees the
			// failure of one node as an error of that node's keys only.
			"--cluster-require-full-coverage", "no")
	}
	a = append(a, s.extra...)
	if s.mode == modeSentinel {
		return a
	}
	return append(a, s.cfg.extra...)
}

// launch starts redis-server on port and waits until it answers as the process it started.
func (s *Server) launch(port int) error {
	logPath := filepath.Join(s.dir, "redis.log")
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	logStart, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		_ = f.Close()
		return err
	}
	cmd := exec.Command("redis-server", s.args(port)...)
	cmd.Dir = s.dir
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = procAttr()
	if err := cmd.Start(); err != nil {
		_ = f.Close()
		return err
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		_ = f.Close()
		close(p.done)
	}()
	s.mu.Lock()
	s.port, s.proc = port, p
	s.mu.Unlock()

	if err := s.waitReady(p); err != nil {
		s.signal(syscall.SIGKILL)
		<-p.done
		s.mu.Lock()
		s.proc = nil
		s.mu.Unlock()
		log := readFrom(logPath, logStart)
		if strings.Contains(log, "Address already in use") {
			return errAddrInUse
		}
		return fmt.Errorf("%w; log:\n%s", err, lastLines(log, 20))
	}
	return nil
}

// waitReady polls INFO until the server answers with p's process id: an answer from another
// process that holds the port (a race lost to a parallel test) does not count.
func (s *Server) waitReady(p *process) error {
	o := s.Options()
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout = 500*time.Millisecond, time.Second, time.Second
	o.MaxRetries, o.PoolSize = -1, 1
	c := redis.NewClient(o)
	defer func() { _ = c.Close() }()
	want := "process_id:" + strconv.Itoa(p.cmd.Process.Pid) + "\r\n"
	ctx := context.Background()
	deadline := time.Now().Add(startTimeout)
	var last error
	for time.Now().Before(deadline) {
		select {
		case <-p.done:
			return fmt.Errorf("redis-server exited (%v)", p.cmd.ProcessState)
		default:
		}
		info, err := c.Info(ctx, "server").Result()
		switch {
		case err == nil && strings.Contains(info, want):
			return nil
		case err == nil:
			last = errors.New("port answered by another process")
		default:
			last = err
		}
		time.Sleep(pollEvery)
	}
	return fmt.Errorf("no answer within %v: %w", startTimeout, last)
}

func readFrom(path string, offset int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer func() { _ = f.Close() }()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return ""
	}
	b, _ := io.ReadAll(f)
	return string(b)
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.Port()) }

// Port is the server's port, the same across restarts.
func (s *Server) Port() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.port
}

// Pid is the process id of the running server (it changes across restarts), 0 when stopped.
func (s *Server) Pid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return 0
	}
	return s.proc.cmd.Process.Pid
}

// Dir is the server's working directory (its log is redis.log there).
func (s *Server) Dir() string { return s.dir }

// Running reports whether the server process is alive (paused counts as alive).
func (s *Server) Running() bool {
	s.mu.Lock()
	p := s.proc
	s.mu.Unlock()
	if p == nil {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// Options returns fresh go-redis options for this server: address, credentials and TLS. Tests
// change timeouts or pool sizes on the copy.
func (s *Server) Options() *redis.Options {
	o := &redis.Options{Addr: s.Addr()}
	if s.mode != modeSentinel { // the credentials are the data nodes'; sentinels have none
		o.Username, o.Password = s.cfg.credentials()
	}
	o.TLSConfig = s.cfg.clientTLS()
	return o
}

func (c *config) credentials() (user, password string) {
	if c.user != "" {
		return c.user, c.userPass
	}
	return "", c.password
}

func (c *config) clientTLS() *tls.Config {
	if !c.tls || c.tlsMat == nil {
		return nil
	}
	return c.tlsMat.clientConfig()
}

// Client returns a client of this server, closed when t ends.
func (s *Server) Client(t testing.TB) *redis.Client {
	c := redis.NewClient(s.Options())
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// signal sends sig to the server's process group; false if it is not running.
func (s *Server) signal(sig syscall.Signal) (*process, bool) {
	s.mu.Lock()
	p := s.proc
	s.mu.Unlock()
	if p == nil {
		return nil, false
	}
	select {
	case <-p.done:
		return p, false
	default:
	}
	// The child leads its own group (procAttr), so -pid reaches it and anything it forked.
	_ = syscall.Kill(-p.cmd.Process.Pid, sig)
	return p, true
}

// Kill stops the server with SIGKILL, as a crash would, and waits until it is gone.
func (s *Server) Kill() {
	if p, _ := s.signal(syscall.SIGKILL); p != nil {
		<-p.done
	}
	s.mu.Lock()
	s.proc = nil
	s.mu.Unlock()
}

// Stop shuts the server down gracefully (SIGTERM) and waits until it is gone.
func (s *Server) Stop() {
	s.t.Helper()
	p, ok := s.signal(syscall.SIGCONT) // a paused server cannot act on SIGTERM
	if ok {
		s.signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(stopTimeout):
			s.Kill()
			s.t.Fatalf("redistest: redis-server on %s ignored SIGTERM for %v", s.Addr(), stopTimeout)
		}
	}
	s.mu.Lock()
	s.proc = nil
	s.mu.Unlock()
}

// Restart starts the server again on the same port and directory, killing it first if it runs,
// and waits until it answers.
func (s *Server) Restart() {
	s.t.Helper()
	s.Kill()
	port := s.Port()
	deadline := time.Now().Add(startTimeout)
	for {
		err := s.launch(port)
		if err == nil {
			return
		}
		// The port is ours, but a parallel test may have taken it while the server was down; it
		// may also give it back. Waiting is all we can do.
		if !errors.Is(err, errAddrInUse) || time.Now().After(deadline) {
			s.t.Fatalf("redistest: restart redis-server on port %d: %v", port, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Pause stops the server with SIGSTOP: it keeps its connections but answers nothing, like a hung
// Redis. Resume continues it.
func (s *Server) Pause() {
	s.t.Helper()
	if _, ok := s.signal(syscall.SIGSTOP); !ok {
		s.t.Fatalf("redistest: pause redis-server on %s: not running", s.Addr())
	}
}

// Resume continues a paused server (SIGCONT).
func (s *Server) Resume() {
	s.t.Helper()
	if _, ok := s.signal(syscall.SIGCONT); !ok {
		s.t.Fatalf("redistest: resume redis-server on %s: not running", s.Addr())
	}
}

func (s *Server) cleanup() { s.Kill() }
