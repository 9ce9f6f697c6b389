// Command child is the process that proctest's tests start: it logs JSON records to stderr,
// serves /metrics on a loopback port and exits 0 on SIGTERM, or with -exit n at once with status n.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	exit := flag.Int("exit", -1, "log a line and exit at once with this status")
	flag.Parse()
	log := json.NewEncoder(os.Stderr)
	if *exit >= 0 {
		fmt.Fprintln(os.Stderr, "not a record")
		_ = log.Encode(map[string]any{"msg": "exiting", "code": *exit})
		os.Exit(*exit)
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, "# TYPE child_up gauge\nchild_up 1\nchild_requests_total{path=\"/\"} 7\n")
	})
	go func() { _ = http.Serve(ln, mux) }()
	_ = log.Encode(map[string]any{"msg": "child serving", "addr": ln.Addr().String(), "port": ln.Addr().(*net.TCPAddr).Port})
	<-sigs
	_ = log.Encode(map[string]any{"msg": "child stopping"})
}
