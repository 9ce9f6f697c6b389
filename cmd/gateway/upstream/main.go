// Command upstream is the tiny upstream service of the gateway demo (`make run`): it answers
// every request with 200 and one JSON line naming the request and counting the calls it has
// served, so a demo shows which requests got through the rate limiter.
//
//	upstream [-listen 127.0.0.1:8081]
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/leasebucket/leasebucket/internal/cli"
)

func main() {
	cli.Main("upstream", func(ctx context.Context) error { return run(ctx, os.Args[1:], os.Stderr) })
}

func run(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("upstream", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", "127.0.0.1:8081", "HTTP address to serve on")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: newHandler(), ReadHeaderTimeout: 10 * time.Second}
	fmt.Fprintf(stderr, "upstream: serving on %s\n", ln.Addr())
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return srv.Shutdown(sctx)
}

// reply is what the upstream answers.
type reply struct {
	Method string `json:"method"`
	Path   string `json:"path"`
	Call   int64  `json:"call"` // calls served so far, this one included
}

func newHandler() http.Handler {
	var calls atomic.Int64
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(reply{Method: r.Method, Path: r.URL.Path, Call: n})
	})
}
