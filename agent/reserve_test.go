package agent

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
)

// TestReserveSpec runs the reservation core's specification files in testdata/reserve (the
// commands of TestLeaseCore, and these). Times are in ms; amounts in µ or tokens (t suffix).
//
//	reserve t=T tenant=X path=P op=O want=W least=L life=MS
//	                                   Reserve: a reservation (named r1, r2, …) or the verdict; a
//	                                   Wait's ticket is named k1, k2, …
//	reserved t=T k=N want=W least=L life=MS
//	                                   Reserved on ticket kN
//	unreserve t=T k=N                  Unreserve ticket kN
//	release t=T r=N unused=U           Release U of reservation rN
//	lease tenant=X path=P op=O         the key's current and prefetched leases and its hand-back
//	demand tenant=X path=P op=O rate=R ObserveDemand
func TestReserveSpec(t *testing.T) {
	datadriven.Walk(t, "testdata/reserve", func(t *testing.T, path string) {
		var (
			l       *Limiter
			calls   []*Call
			tickets []*Ticket
			res     []Reservation
		)
		ms := func(d *datadriven.TestData, key string) clock.Nanos {
			var v int64
			d.ScanArgs(t, key, &v)
			return clock.Nanos(v) * clock.Nanos(time.Millisecond)
		}
		query := func(d *datadriven.TestData) Query {
			var q Query
			d.ScanArgs(t, "tenant", &q.Tenant)
			d.ScanArgs(t, "path", &q.Path)
			d.ScanArgs(t, "op", &q.Operation)
			return q
		}
		ask := func(d *datadriven.TestData) ReserveAsk {
			var want, least string
			d.ScanArgs(t, "want", &want)
			d.ScanArgs(t, "least", &least)
			return ReserveAsk{Want: bucket.Micro(micro(t, want)), Least: bucket.Micro(micro(t, least)), Life: ms(d, "life").Duration()}
		}
		show := func(r Reservation, v Verdict) string {
			if v.Outcome != Allow {
				return showVerdict(v)
			}
			res = append(res, r)
			return fmt.Sprintf("r%d tokens=%s expires=%dms", len(res), tok(int64(r.Tokens)), r.Expires/clock.Nanos(time.Millisecond))
		}
		datadriven.RunTest(t, path, func(t *testing.T, d *datadriven.TestData) string {
			switch d.Cmd {
			case "policy":
				set, err := policy.Parse("test.yaml", []byte(d.Input))
				if err != nil {
					return "error: " + err.Error()
				}
				l = New(Config{AgentID: "agent-1"}, set)
				return "version " + set.Version()
			case "check":
				v, err := l.Check(ms(d, "t"), query(d))
				if err != nil {
					return "error: " + err.Error()
				}
				return showVerdict(v)
			case "reserve":
				r, v, err := l.Reserve(ms(d, "t"), query(d), ask(d))
				if err != nil {
					return "error: " + err.Error()
				}
				if v.Outcome == Wait {
					tickets = append(tickets, v.Ticket)
					return fmt.Sprintf("wait k%d", len(tickets))
				}
				return show(r, v)
			case "reserved":
				var k int
				d.ScanArgs(t, "k", &k)
				r, v := l.Reserved(ms(d, "t"), tickets[k-1], ask(d))
				return show(r, v)
			case "unreserve":
				var k int
				d.ScanArgs(t, "k", &k)
				l.Unreserve(ms(d, "t"), tickets[k-1])
				return "ok"
			case "release":
				var n int
				var unused string
				d.ScanArgs(t, "r", &n)
				d.ScanArgs(t, "unused", &unused)
				l.Release(ms(d, "t"), res[n-1], bucket.Micro(micro(t, unused)))
				return "ok"
			case "demand":
				var rate string
				d.ScanArgs(t, "rate", &rate)
				if err := l.ObserveDemand(query(d), bucket.Micro(micro(t, rate))); err != nil {
					return "error: " + err.Error()
				}
				return "ok"
			case "lease":
				v := l.view.Load()
				r, err := l.resolve(v, query(d))
				if err != nil {
					return "error: " + err.Error()
				}
				e := r.e
				if e == nil {
					return "no entry"
				}
				e.mu.Lock()
				defer e.mu.Unlock()
				var b strings.Builder
				fmt.Fprintf(&b, "lease tokens=%s expires=%dms", tok(e.tokens.Load()), e.expires.Load()/int64(time.Millisecond))
				if e.s().next.tokens > 0 {
					fmt.Fprintf(&b, " next=%s expires=%dms", tok(int64(e.s().next.tokens)), e.s().next.expires/clock.Nanos(time.Millisecond))
				}
				if e.s().back.amount > 0 {
					fmt.Fprintf(&b, " back=%s", tok(int64(e.s().back.amount)))
				}
				fmt.Fprintf(&b, " demand=%s/s", tok(int64(e.demand.Rate())))
				return b.String()
			case "call":
				c := l.NextCall(ms(d, "t"))
				if c == nil {
					return "nothing to send"
				}
				calls = append(calls, c)
				return showCall(c)
			case "respond":
				c := calls[0]
				calls = calls[1:]
				if err := l.Apply(ms(d, "t"), c, parseReply(t, d, c)); err != nil {
					return "error: " + err.Error()
				}
				return "ok"
			case "tickets":
				var b strings.Builder
				for i, tk := range tickets {
					select {
					case <-tk.Ready():
						fmt.Fprintf(&b, "k%d %s\n", i+1, showVerdict(tk.Verdict()))
					default:
						fmt.Fprintf(&b, "k%d waiting\n", i+1)
					}
				}
				return b.String()
			case "expire":
				l.ExpireAll(ms(d, "t"))
				return "ok"
			case "stats":
				s := l.Stats()
				return fmt.Sprintf("degraded=%d returns=%d returned=%s skipped=%d skipped-tokens=%s", s.Degraded.Load(), s.Returns.Load(),
					tok(int64(s.ReturnedMicro.Load())), s.ReturnsSkipped.Load(), tok(int64(s.SkippedMicro.Load())))
			default:
				d.Fatalf(t, "unknown command %q", d.Cmd)
				return ""
			}
		})
	})
}
