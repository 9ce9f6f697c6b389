package chaos

import (
	"bufio"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// echo serves line echo on a free port until the test ends.
func echo(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); <-done })
	return ln.Addr().String()
}

// roundTrip sends a line through c and waits at most wait for it to come back.
func roundTrip(c net.Conn, r *bufio.Reader, wait time.Duration) (time.Duration, error) {
	start := time.Now()
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return 0, err
	}
	_ = c.SetReadDeadline(time.Now().Add(wait))
	line, err := r.ReadString('\n')
	if err != nil {
		return 0, err
	}
	if line != "ping\n" {
		return 0, io.ErrUnexpectedEOF
	}
	return time.Since(start), nil
}

func TestProxyModes(t *testing.T) {
	p, err := NewProxy("test", echo(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	dial := func() (net.Conn, *bufio.Reader) {
		c, err := net.Dial("tcp", p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c, bufio.NewReader(c)
	}
	c, r := dial()
	if _, err := roundTrip(c, r, time.Second); err != nil {
		t.Fatalf("pass: %v", err)
	}

	p.Set(Delay, 50*time.Millisecond)
	if d, err := roundTrip(c, r, time.Second); err != nil || d < 100*time.Millisecond {
		t.Fatalf("delay of 50 ms each way: round trip %v, %v; want at least 100 ms", d, err)
	}

	p.Set(Blackhole, 0)
	if _, err := roundTrip(c, r, 200*time.Millisecond); err == nil {
		t.Fatal("blackhole: the echo came back")
	}
	p.Set(Pass, 0) // what was held goes through now
	_ = c.SetReadDeadline(time.Now().Add(time.Second))
	if line, err := r.ReadString('\n'); err != nil || line != "ping\n" {
		t.Fatalf("after the blackhole: %q, %v; want the held line", line, err)
	}

	p.Set(Cut, 0)
	_ = c.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := r.ReadString('\n'); err == nil || strings.Contains(err.Error(), "timeout") {
		t.Fatalf("cut: the connection is still open (%v)", err)
	}
	c2, r2 := dial() // accepted, then closed at once
	if _, err := roundTrip(c2, r2, time.Second); err == nil {
		t.Fatal("cut: a new connection was served")
	}
	p.Set(Pass, 0)
	c3, r3 := dial()
	if _, err := roundTrip(c3, r3, time.Second); err != nil {
		t.Fatalf("pass after cut: %v", err)
	}
	if accepted, cut := p.Stats(); accepted != 3 || cut != 2 {
		t.Fatalf("stats: %d accepted, %d cut; want 3, 2", accepted, cut)
	}
}

// TestProxyDropsWhatAClosedClientSent: data held in a blackhole is not forwarded once its client
// has gone (a coordinator that gave up on a hung Redis must not have its commands run later).
func TestProxyDropsWhatAClosedClientSent(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	got := make(chan string, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		b, _ := io.ReadAll(c)
		got <- string(b)
	}()
	p, err := NewProxy("test", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	p.Set(Blackhole, 0)
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("INCR x\n")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	c.Close()
	time.Sleep(50 * time.Millisecond)
	p.Set(Pass, 0)
	select {
	case b := <-got:
		if b != "" {
			t.Fatalf("the target received %q after its client closed", b)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("the target's connection was not closed")
	}
}
