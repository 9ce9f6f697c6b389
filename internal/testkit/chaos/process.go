package chaos

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// tailLines is how many lines of a process's stderr a failure message shows.
const tailLines = 40

// Process is one child process: its stderr goes to a log file, and the last lines are kept for
// failure messages. Every line is also offered to watch (if set) for readiness and events.
type Process struct {
	Name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error // set before done is closed

	mu   sync.Mutex
	tail []string
}

// startProcess starts bin with args; its stderr is appended to logFile, and watch (may be nil)
// sees every line on the reader's goroutine. The child dies with the harness (Pdeathsig).
func startProcess(name, logFile, bin string, args []string, watch func(line string)) (*Process, error) {
	f, err := os.OpenFile(logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Stdout = f
	pr, pw := io.Pipe()
	cmd.Stderr = pw
	if err := cmd.Start(); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("chaos: start %s: %w", name, err)
	}
	p := &Process{Name: name, cmd: cmd, done: make(chan struct{})}
	read := make(chan struct{})
	go func() {
		defer close(read)
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			_, _ = f.WriteString(line + "\n")
			p.mu.Lock()
			p.tail = append(p.tail, line)
			if len(p.tail) > 2*tailLines {
				p.tail = append(p.tail[:0], p.tail[len(p.tail)-tailLines:]...)
			}
			p.mu.Unlock()
			if watch != nil {
				watch(line)
			}
		}
		_, _ = io.Copy(io.Discard, pr)
	}()
	go func() {
		err := cmd.Wait()
		_ = pw.Close()
		<-read
		_ = f.Close()
		p.err = err
		close(p.done)
	}()
	return p, nil
}

// Pid is the process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Running reports whether the process has not exited.
func (p *Process) Running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// Exited is closed when the process has exited.
func (p *Process) Exited() <-chan struct{} { return p.done }

// Err is the process's exit error (nil for exit status 0); valid after Exited.
func (p *Process) Err() error { return p.err }

// Kill sends SIGKILL and waits until the process is gone.
func (p *Process) Kill() {
	if p.Running() {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
	}
	<-p.done
}

// Terminate sends SIGTERM and waits for the process to exit, at most within d; past it the
// process is killed and Terminate reports that it ignored SIGTERM.
func (p *Process) Terminate(d time.Duration) error {
	if !p.Running() {
		return fmt.Errorf("chaos: %s was not running: %w", p.Name, p.err)
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		if p.err != nil {
			return fmt.Errorf("chaos: %s exited with %w after SIGTERM", p.Name, p.err)
		}
		return nil
	case <-time.After(d):
		p.Kill()
		return fmt.Errorf("chaos: %s ignored SIGTERM for %v", p.Name, d)
	}
}

// Tail is the last lines of the process's stderr.
func (p *Process) Tail() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.tail[max(0, len(p.tail)-tailLines):], "\n")
}

// errExited: the process exited while the harness waited for it to get ready.
var errExited = errors.New("exited")
