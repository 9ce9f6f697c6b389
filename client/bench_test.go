package client_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/policy"
)

// benchPolicy never denies within a benchmark: every check is an allow from a live lease, so
// the figures are the cost of the path to the agent and back.
const benchPolicy = `
version: "bench"
rules:
  - name: hot
    routes: ["/hot/{id}"]
    operations: [read]
    limit: 100000000/second
    burst: 100000000
default:
  limit: 60/minute
  burst: 10
`

// BenchmarkCheck: checks per second and wall time per check through the real agent on a Unix
// socket, unary calls against the coalesced stream, at 1, 16 and 64 concurrent callers (a
// gateway's in-flight requests), all on one hot key.
func BenchmarkCheck(b *testing.B) {
	set, err := policy.Parse("bench.yaml", []byte(benchPolicy))
	if err != nil {
		b.Fatal(err)
	}
	socket := serveAgent(b, set)
	for _, path := range []string{"unary", "stream"} {
		for _, conc := range []int{1, 16, 64} {
			b.Run(fmt.Sprintf("%s/conc=%d", path, conc), func(b *testing.B) {
				c := newClient(b, socket, client.Options{Unary: path == "unary"})
				req := client.Request{Tenant: "acme", Route: "/hot/1", Operation: "GET"}
				for range 100 { // connect, open the stream, take the first lease
					if _, err := c.Check(context.Background(), req); err != nil {
						b.Fatal(err)
					}
				}
				before := c.Stats()
				b.ReportAllocs()
				b.ResetTimer()
				var next atomic.Int64
				var wg sync.WaitGroup
				for range conc {
					wg.Go(func() {
						for next.Add(1) <= int64(b.N) {
							res, err := c.Check(context.Background(), req)
							if err != nil || res.Decision != client.Allow {
								b.Errorf("check: %+v, %v; stats %+v", res, err, c.Stats())
								return
							}
						}
					})
				}
				wg.Wait()
				b.StopTimer()
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "checks/s")
				if path == "stream" {
					st := c.Stats()
					if batches := st.StreamBatches - before.StreamBatches; batches > 0 {
						b.ReportMetric(float64(st.StreamChecks-before.StreamChecks)/float64(batches), "checks/batch")
					}
					if st.UnaryChecks != before.UnaryChecks {
						b.Errorf("%d unary checks on the stream path", st.UnaryChecks-before.UnaryChecks)
					}
				}
			})
		}
	}
}
