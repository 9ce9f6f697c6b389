package proctest_test

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
)

// bins holds testdata/child, the process the tests start.
var bins = proctest.NewBinaries(map[string]string{"child": "./testdata/child"})

func TestMain(m *testing.M) {
	code := m.Run()
	bins.Remove()
	os.Exit(code)
}

// fatalTB records a helper's Fatal, and ends its goroutine, instead of failing the test.
type fatalTB struct {
	testing.TB
	mu  sync.Mutex
	msg string
}

func (f *fatalTB) Helper() {}

func (f *fatalTB) Fatal(args ...any) { f.fail(fmt.Sprint(args...)) }

func (f *fatalTB) Fatalf(format string, args ...any) { f.fail(fmt.Sprintf(format, args...)) }

func (f *fatalTB) fail(msg string) {
	f.mu.Lock()
	f.msg = msg
	f.mu.Unlock()
	runtime.Goexit()
}

// fatal runs fn with a fatalTB on its own goroutine and returns the message it failed with ("" if
// it returned).
func fatal(t *testing.T, fn func(tb testing.TB)) string {
	f := &fatalTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(f)
	}()
	<-done
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.msg
}

// TestBinaries: a binary's path is in the build directory, which Remove deletes; a build error
// or an unknown name fails the test that asks for a path.
func TestBinaries(t *testing.T) {
	b := proctest.NewBinaries(map[string]string{"child": "./testdata/child"})
	path := b.Path(t, "child")
	if filepath.Base(path) != "child" {
		t.Fatalf("Path = %s", path)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatal(err)
	}
	if msg := fatal(t, func(tb testing.TB) { b.Path(tb, "other") }); msg != `build: no binary "other"` {
		t.Errorf("Path of an unknown binary: %q", msg)
	}
	b.Remove()
	if _, err := os.Stat(filepath.Dir(path)); !os.IsNotExist(err) {
		t.Errorf("build directory after Remove: %v", err)
	}

	bad := proctest.NewBinaries(map[string]string{"child": "./testdata/child", "missing": "./testdata/missing"})
	defer bad.Remove()
	msg := fatal(t, func(tb testing.TB) { bad.Path(tb, "child") })
	if !strings.Contains(msg, "go build ./testdata/missing") || strings.Contains(msg, "go build ./testdata/child") {
		t.Errorf("Path with a package that does not build: %q, want a go build error naming it alone", msg)
	}
}

// TestStartServeTerminate: a started process is found through its log, listens, serves metrics
// and exits cleanly on SIGTERM.
func TestStartServeTerminate(t *testing.T) {
	p := proctest.Start(t, bins.Path(t, "child"))
	addr := p.LogField(t, "child serving", "addr")
	proctest.WaitTCP(t, addr)
	if got := proctest.Metric(t, addr, "child_up"); got != 1 {
		t.Errorf("child_up = %v, want 1", got)
	}
	if msg := fatal(t, func(tb testing.TB) { proctest.Metric(tb, addr, "child_requests_total") }); msg != "metric child_requests_total not found" {
		t.Errorf("a labelled metric read as unlabelled: %q, want not found", msg)
	}
	p.Terminate(t)
	if err := p.Wait(); err != nil {
		t.Fatalf("Wait after SIGTERM: %v", err)
	}
	if !strings.Contains(p.Stderr(), `"msg":"child stopping"`) {
		t.Fatalf("stderr lacks the last record:\n%s", p.Stderr())
	}
}

func TestKill(t *testing.T) {
	p := proctest.Start(t, bins.Path(t, "child"))
	p.LogField(t, "child serving", "addr")
	p.Kill()
	if err := p.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("Wait after Kill: %v, want killed", err)
	}
	p.Kill() // a second Kill returns at once
}

// TestExited: LogField finds a record the process wrote before exiting, and fails at once, with
// the process's stderr, on one it never wrote; Terminate reports a failed exit.
func TestExited(t *testing.T) {
	p := proctest.Start(t, bins.Path(t, "child"), "-exit", "3")
	if err := p.Wait(); err == nil {
		t.Fatal("exit status 3: Wait returned nil")
	}
	if got := p.LogField(t, "exiting", "msg"); got != "exiting" {
		t.Errorf("LogField of the last record: %q", got)
	}
	start := time.Now()
	msg := fatal(t, func(tb testing.TB) { p.LogField(tb, "child serving", "addr") })
	if !strings.HasPrefix(msg, "child exited (exit status 3) before") || !strings.Contains(msg, "not a record") {
		t.Errorf("LogField on an exited process failed with %q", msg)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("LogField took %v to see the exit", d)
	}
	if msg := fatal(t, p.Terminate); msg != "child exited with exit status 3" {
		t.Errorf("Terminate of a failed process: %q", msg)
	}
}

func TestWaitFor(t *testing.T) {
	n := 0
	proctest.WaitFor(t, 5*time.Second, "third call", func() bool { n++; return n == 3 })
	if n != 3 {
		t.Fatalf("cond called %d times, want 3", n)
	}
	msg := fatal(t, func(tb testing.TB) {
		proctest.WaitFor(tb, 50*time.Millisecond, "miracle", func() bool { return false })
	})
	if msg != "no miracle within 50ms" {
		t.Fatalf("WaitFor failed with %q", msg)
	}
}

func TestFreeAddrAndWaitTCP(t *testing.T) {
	addr := proctest.FreeAddr(t)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("FreeAddr %s: %v", addr, err)
	}
	defer ln.Close()
	proctest.WaitTCP(t, addr)
}

func TestBufferRecords(t *testing.T) {
	var b proctest.Buffer
	fmt.Fprintf(&b, "plain\n{\"msg\":\"a\",\"n\":1}\n[1]\n{\"msg\":\"%s\"}\n", strings.Repeat("x", 100_000))
	recs := b.Records()
	if len(recs) != 2 || recs[0]["msg"] != "a" || recs[0]["n"] != 1.0 || len(recs[1]["msg"].(string)) != 100_000 {
		t.Fatalf("Records() = %.80v", recs)
	}
}
