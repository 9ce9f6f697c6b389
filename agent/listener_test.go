package agent_test

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/leasebucket/leasebucket/agent"
)

func TestListenUnix(t *testing.T) {
	path := filepath.Join(shortTempDir(t), "run", "agent.sock")
	ln, err := agent.ListenUnix(path, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != agent.SocketMode {
		t.Fatalf("socket mode %v, want a socket with %v", fi.Mode(), agent.SocketMode)
	}
	accepted := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			c.Close()
		}
		accepted <- err
	}()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if err := <-accepted; err != nil {
		t.Fatal(err)
	}

	// A second agent on the same path is refused, and the first one's socket still answers.
	if _, err := agent.ListenUnix(path, 0, -1); !errors.Is(err, agent.ErrSocketInUse) {
		t.Fatalf("second ListenUnix = %v, want ErrSocketInUse", err)
	}
	if c, err := net.Dial("unix", path); err != nil {
		t.Fatalf("the live socket was taken away: %v", err)
	} else {
		c.Close()
	}
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left after Close: %v", err)
	}
	if err := ln.Close(); err != nil {
		t.Fatalf("second Close = %v", err)
	}
}

// TestListenUnixLiveSocketOfAnotherProcess: a socket something else serves (no lock of ours, so
// a process that is not an agent, or an agent of another build) is never removed.
func TestListenUnixLiveSocketOfAnotherProcess(t *testing.T) {
	path := filepath.Join(shortTempDir(t), "agent.sock")
	other, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	go func() {
		for {
			c, err := other.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	if _, err := agent.ListenUnix(path, 0, -1); !errors.Is(err, agent.ErrSocketInUse) {
		t.Fatalf("ListenUnix on a live socket = %v, want ErrSocketInUse", err)
	}
	if c, err := net.Dial("unix", path); err != nil {
		t.Fatalf("the live socket was taken away: %v", err)
	} else {
		c.Close()
	}
}

// TestListenUnixStaleSocket: a socket file left by a crashed agent (nobody answers) is replaced.
func TestListenUnixStaleSocket(t *testing.T) {
	path := filepath.Join(shortTempDir(t), "agent.sock")
	dead, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	dead.SetUnlinkOnClose(false)
	dead.Close()
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("stale socket not left behind: %v", err)
	}
	ln, err := agent.ListenUnix(path, 0, -1)
	if err != nil {
		t.Fatalf("ListenUnix over a stale socket = %v", err)
	}
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			c.Close()
		}
	}()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
}

// TestListenUnixNotASocket: a regular file at the path is an operator's mistake, never removed.
func TestListenUnixNotASocket(t *testing.T) {
	path := filepath.Join(shortTempDir(t), "agent.sock")
	if err := os.WriteFile(path, []byte("data"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := agent.ListenUnix(path, 0, -1); err == nil {
		t.Fatal("ListenUnix over a regular file succeeded")
	}
	if data, err := os.ReadFile(path); err != nil || string(data) != "data" {
		t.Fatalf("the file was touched: %q, %v", data, err)
	}
}

// TestListenUnixCloseLeavesSuccessor: Close removes the socket only if it is still its own.
func TestListenUnixCloseLeavesSuccessor(t *testing.T) {
	path := filepath.Join(shortTempDir(t), "agent.sock")
	ln, err := agent.ListenUnix(path, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	successor, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer successor.Close()
	ln.Close()
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("Close removed another listener's socket: %v", err)
	}
}
