package proctest

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// stopTimeout bounds how long Terminate waits for a graceful exit.
const stopTimeout = 20 * time.Second

// Process is a child process whose stderr is kept for failure messages and scanned for JSON log
// records.
type Process struct {
	name   string
	cmd    *exec.Cmd
	stderr Buffer
	done   chan struct{} // closed once the process has exited and its stderr is read
	err    error         // the exit error, set before done is closed
}

// Start runs the binary bin with args, named after bin's base name in messages. The process is
// killed when the test ends; if the test failed, the last lines of its stderr are logged.
func Start(t testing.TB, bin string, args ...string) *Process {
	t.Helper()
	p := &Process{name: filepath.Base(bin), cmd: exec.Command(bin, args...), done: make(chan struct{})}
	p.cmd.SysProcAttr = procAttr()
	p.cmd.Stderr = &p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", p.name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.Kill()
		if t.Failed() {
			t.Logf("%s stderr (last lines):\n%s", p.name, p.lastLines())
		}
	})
	return p
}

// Stderr is what the process wrote to its stderr so far.
func (p *Process) Stderr() string { return p.stderr.String() }

// Kill sends SIGKILL and waits until the process is gone.
func (p *Process) Kill() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

// Terminate sends SIGTERM and waits for the process to exit; the test fails if it exits with an
// error or is still running after 20 s.
func (p *Process) Terminate(t testing.TB) {
	t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		if p.err != nil {
			t.Fatalf("%s exited with %v", p.name, p.err)
		}
	case <-time.After(stopTimeout):
		t.Fatalf("%s ignored SIGTERM", p.name)
	}
}

// Wait waits until the process has exited and returns its exit error, as exec.Cmd.Wait does.
func (p *Process) Wait() error {
	<-p.done
	return p.err
}

// Await polls cond until it holds. The test fails if the process exits first or cond does not
// hold within 20 s; what names the awaited state in the failure message.
func (p *Process) Await(t testing.TB, what string, cond func() bool) {
	t.Helper()
	var exited bool
	held := poll(readyTimeout, func() bool {
		if cond() {
			return true
		}
		select {
		case <-p.done: // its stderr is complete: one last look
			exited = !cond()
			return true
		default:
			return false
		}
	})
	switch {
	case exited:
		t.Fatalf("%s exited (%v) before %s:\n%s", p.name, p.err, what, p.lastLines())
	case !held:
		t.Fatalf("%s: no %s within %v:\n%s", p.name, what, readyTimeout, p.lastLines())
	}
}

// LogField waits until the process logs a JSON record whose msg is msg and whose field is a
// string, and returns that string. The test fails if the process exits first or 20 s pass.
func (p *Process) LogField(t testing.TB, msg, field string) string {
	t.Helper()
	var v string
	p.Await(t, fmt.Sprintf("log %q with %s", msg, field), func() bool {
		for _, rec := range p.stderr.Records() {
			if s, ok := rec[field].(string); ok && rec["msg"] == msg {
				v = s
				return true
			}
		}
		return false
	})
	return v
}

// lastLines is the end of the process's stderr, for failure messages.
func (p *Process) lastLines() string {
	lines := strings.Split(strings.TrimRight(p.stderr.String(), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-40):], "\n")
}
