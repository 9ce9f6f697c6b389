package proctest

import (
	"bufio"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// FreeAddr returns a 127.0.0.1 address whose port was free a moment ago.
func FreeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	return ln.Addr().String()
}

// WaitTCP waits until addr accepts TCP connections, for 20 s at most.
func WaitTCP(t testing.TB, addr string) {
	t.Helper()
	var err error
	listening := poll(readyTimeout, func() bool {
		var c net.Conn
		if c, err = net.DialTimeout("tcp", addr, 100*time.Millisecond); err != nil {
			return false
		}
		_ = c.Close()
		return true
	})
	if !listening {
		t.Fatalf("%s not listening: %v", addr, err)
	}
}

// Metric reads one unlabelled metric from the Prometheus /metrics endpoint at addr (host:port).
func Metric(t testing.TB, addr, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("metric %s not found", name)
	return 0
}
