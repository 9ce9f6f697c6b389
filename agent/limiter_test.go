package agent

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// TestLeaseCore runs the lease core's specification files in testdata/lease. Times are in ms.
//
//	policy [guard=ms] [exact] [max-keys=n]
//	                                   a new Limiter with the YAML policy in the input; with exact,
//	                                   it reads an exact clock (Config.Exact) that check sets
//	check t=T tenant=X path=P op=O [cost=N] [exact=T] [exact-then=T]
//	                                   a Wait verdict's ticket is kept: tickets shows it; the
//	                                   exact clock reads exact (T if not given) during the check,
//	                                   or exact once and exact-then from the second reading on
//	call t=T                           the next call the core sends (NextCall); it is in flight
//	respond t=T [seq=N] [error=unavailable|deadline|invalid|unknown-version]
//	                                   the reply to the call in flight with seq N (the oldest)
//	  ok granted=G ttl=MS [remaining=R] [at=MS] [credited=C] [pace=MS]
//	  denied retry=MS [remaining=R] [credited=C] [pace=MS]
//	  store-unavailable | unknown-route | stale
//	                                   one line per item of an Acquire, µ or tokens (t suffix),
//	  returned credited=C | return-failed
//	                                   then one line per lease it hands back alone (Acquire
//	                                   returns or Return items)
//	tickets                            the checks waiting: each decided one's verdict (then
//	                                   forgotten), or "waiting"
//	give-up t=T                        the oldest waiting check stops waiting: its failure mode
//	                                   answers it (Fallback)
//	expire t=T                         sweep the whole table
//	close                              retire everything (shutdown)
//	stats
func TestLeaseCore(t *testing.T) {
	datadriven.Walk(t, "testdata/lease", func(t *testing.T, path string) {
		var (
			l       *Limiter
			calls   []*Call // in flight
			tickets []*Ticket
			exactAt []clock.Nanos // what Config.Exact reads, for the policy's exact: each in turn, the last for good
		)
		at := func(d *datadriven.TestData) clock.Nanos {
			var ms int64
			d.ScanArgs(t, "t", &ms)
			return clock.Nanos(ms) * clock.Nanos(time.Millisecond)
		}
		datadriven.RunTest(t, path, func(t *testing.T, d *datadriven.TestData) string {
			switch d.Cmd {
			case "policy":
				set, err := policy.Parse("test.yaml", []byte(d.Input))
				if err != nil {
					return "error: " + err.Error()
				}
				cfg := Config{AgentID: "agent-1", Region: "eu-west"}
				if d.HasArg("guard") {
					var g int64
					d.ScanArgs(t, "guard", &g)
					cfg.Guard = clock.Nanos(g) * clock.Nanos(time.Millisecond)
				}
				if d.HasArg("max-keys") {
					d.ScanArgs(t, "max-keys", &cfg.MaxKeys)
				}
				if d.HasArg("exact") {
					cfg.Exact = func() clock.Nanos {
						r := exactAt[0]
						if len(exactAt) > 1 {
							exactAt = exactAt[1:]
						}
						return r
					}
				}
				if l == nil {
					l = New(cfg, set)
				} else {
					l.SetPolicy(set)
				}
				return "version " + set.Version()
			case "check":
				q := Query{}
				d.ScanArgs(t, "tenant", &q.Tenant)
				d.ScanArgs(t, "path", &q.Path)
				d.ScanArgs(t, "op", &q.Operation)
				d.MaybeScanArgs(t, "cost", &q.Cost)
				exactAt = []clock.Nanos{at(d)}
				var ms int64
				if d.HasArg("exact") {
					d.ScanArgs(t, "exact", &ms)
					exactAt[0] = clock.Nanos(ms) * clock.Nanos(time.Millisecond)
				}
				if d.HasArg("exact-then") {
					d.ScanArgs(t, "exact-then", &ms)
					exactAt = append(exactAt, clock.Nanos(ms)*clock.Nanos(time.Millisecond))
				}
				v, err := l.Check(at(d), q)
				if err != nil {
					return "error: " + err.Error()
				}
				if v.Outcome == Wait {
					tickets = append(tickets, v.Ticket)
				}
				return showVerdict(v)
			case "call":
				c := l.NextCall(at(d))
				if c == nil {
					return "nothing to send"
				}
				calls = append(calls, c)
				return showCall(c)
			case "respond":
				i := 0
				if d.HasArg("seq") {
					var seq uint64
					d.ScanArgs(t, "seq", &seq)
					for i < len(calls) && calls[i].Seq() != seq {
						i++
					}
				}
				if i >= len(calls) {
					d.Fatalf(t, "respond without that call in flight")
				}
				c := calls[i]
				calls = append(calls[:i], calls[i+1:]...)
				if err := l.Apply(at(d), c, parseReply(t, d, c)); err != nil {
					return "error: " + err.Error()
				}
				return "ok"
			case "tickets":
				if len(tickets) == 0 {
					return "none"
				}
				var b strings.Builder
				kept := tickets[:0]
				for _, tk := range tickets {
					select {
					case <-tk.Ready():
						fmt.Fprintln(&b, showVerdict(tk.Verdict()))
					default:
						fmt.Fprintln(&b, "waiting")
						kept = append(kept, tk)
					}
				}
				tickets = kept
				return b.String()
			case "give-up":
				for i, tk := range tickets {
					select {
					case <-tk.Ready():
						continue
					default:
					}
					tickets = append(tickets[:i], tickets[i+1:]...)
					return showVerdict(l.Fallback(at(d), tk))
				}
				return "no check waits"
			case "expire":
				l.ExpireAll(at(d))
				return "ok"
			case "close":
				l.Close()
				return "ok"
			case "withheld":
				var b strings.Builder
				for _, f := range l.Withheld() {
					fmt.Fprintf(&b, "%s unspent=%s granted-at=%d\n", showRef(f.Ref()), tok(int64(f.Amount)), f.GrantedAt)
				}
				fmt.Fprintf(&b, "outstanding=%s", tok(int64(l.Outstanding())))
				return b.String()
			case "stats":
				s := l.Stats()
				refills, returns := l.Pending()
				return fmt.Sprintf("keys=%d acquires=%d resends=%d grants=%d granted=%s denials=%d failures=%d returns=%d returned=%s skipped=%d expired=%d evicted=%d unavailable=%d degraded=%d shadow-denied=%d queued-refills=%d queued-returns=%d dropped-refills=%d",
					l.Keys(), s.Acquires.Load(), s.Resends.Load(), s.Grants.Load(), tok(int64(s.GrantedMicro.Load())), s.Denials.Load(), s.ItemFailures.Load()+s.AcquireErrors.Load(),
					s.Returns.Load(), tok(int64(s.ReturnedMicro.Load())), s.ReturnsSkipped.Load(),
					s.Expired.Load(), s.Evicted.Load(), s.Unavailable.Load(), s.Degraded.Load(), s.ShadowDenied.Load(), refills, returns, s.RefillsDropped.Load())
			default:
				d.Fatalf(t, "unknown command %q", d.Cmd)
				return ""
			}
		})
	})
}

// showCall prints a call as the spec files show it.
func showCall(c *Call) string {
	var b strings.Builder
	if a := c.Acquire; a != nil {
		fmt.Fprintf(&b, "acquire seq=%d version=%s\n", a.Seq, a.PolicyVersion)
		for _, it := range a.Items {
			fmt.Fprintf(&b, "%s needed=%s min=%s demand=%s/s", showRef(it.Bucket), tok(it.NeededMicro), tok(it.MinMicro), tok(it.DemandMicroPerSecond))
			if it.Scarce {
				b.WriteString(" scarce")
			}
			if it.ReturnMicro > 0 {
				fmt.Fprintf(&b, " return=%s granted-at=%d", tok(it.ReturnMicro), it.ReturnGrantedAtMs)
			}
			b.WriteByte('\n')
		}
		for _, it := range a.Returns {
			fmt.Fprintf(&b, "return %s unspent=%s granted-at=%d\n", showRef(it.Bucket), tok(it.UnspentMicro), it.GrantedAtMs)
		}
		return b.String()
	}
	fmt.Fprintf(&b, "return seq=%d version=%s\n", c.Return.Seq, c.Return.PolicyVersion)
	for _, it := range c.Return.Items {
		fmt.Fprintf(&b, "%s unspent=%s granted-at=%d\n", showRef(it.Bucket), tok(it.UnspentMicro), it.GrantedAtMs)
	}
	return b.String()
}

// parseReply reads the reply to c from a respond command.
func parseReply(t *testing.T, d *datadriven.TestData, c *Call) Reply {
	t.Helper()
	if d.HasArg("error") {
		var kind string
		d.ScanArgs(t, "error", &kind)
		var err error
		switch kind {
		case "unknown-version":
			err = coordinatorv1.UnknownPolicyVersionError("v0")
		case "deadline":
			err = status.Error(codes.DeadlineExceeded, "context deadline exceeded")
		case "invalid":
			err = status.Error(codes.InvalidArgument, "refused")
		default:
			err = status.Error(codes.Unavailable, "coordinator unreachable")
		}
		return Reply{Failure: Classify(err)}
	}
	var items []*coordinatorv1.AcquireResult
	var rets []*coordinatorv1.ReturnResult
	for _, line := range strings.Split(strings.TrimSpace(d.Input), "\n") {
		if line == "" {
			continue
		}
		f := strings.Fields(line)
		switch f[0] {
		case "returned":
			r := &coordinatorv1.ReturnResult{Status: coordinatorv1.Status_STATUS_OK}
			if len(f) > 1 {
				_, v, _ := strings.Cut(f[1], "=")
				r.CreditedMicro = micro(t, v)
			}
			rets = append(rets, r)
		case "return-failed":
			rets = append(rets, &coordinatorv1.ReturnResult{Status: coordinatorv1.Status_STATUS_STORE_UNAVAILABLE})
		default:
			items = append(items, parseResult(t, line))
		}
	}
	if c.Acquire != nil {
		return Reply{Acquire: &coordinatorv1.AcquireResponse{Results: items, Returns: rets}}
	}
	return Reply{Return: &coordinatorv1.ReturnResponse{Results: rets}}
}

func showVerdict(v Verdict) string {
	var b strings.Builder
	b.WriteString(v.Outcome.String())
	if v.Degraded {
		b.WriteString(" degraded")
	}
	if v.ShadowDeny {
		b.WriteString(" shadow-deny")
	}
	if v.RetryAfter > 0 {
		fmt.Fprintf(&b, " retry=%s", v.RetryAfter)
	}
	if v.Outcome != Wait {
		fmt.Fprintf(&b, " remaining=%s", tok(int64(v.Remaining)))
	}
	if v.Rule != nil {
		fmt.Fprintf(&b, " rule=%s", v.Rule.Name)
	}
	return b.String()
}

func showRef(r *coordinatorv1.BucketRef) string {
	s := fmt.Sprintf("%s %q %s tenant=%s", r.Rule, r.Route, r.Operation, r.Tenant)
	if r.Region != "" {
		s += " region=" + r.Region
	}
	return s
}

func tok(m int64) string {
	if m%int64(bucket.PerToken) == 0 {
		return fmt.Sprintf("%dt", m/int64(bucket.PerToken))
	}
	return fmt.Sprintf("%dµ", m)
}

func micro(t *testing.T, v string) int64 {
	t.Helper()
	mult := int64(1)
	if s, ok := strings.CutSuffix(v, "t"); ok {
		v, mult = s, int64(bucket.PerToken)
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		t.Fatalf("amount %q: %v", v, err)
	}
	return n * mult
}

func parseResult(t *testing.T, line string) *coordinatorv1.AcquireResult {
	t.Helper()
	f := strings.Fields(line)
	r := &coordinatorv1.AcquireResult{}
	switch f[0] {
	case "ok":
		r.Status = coordinatorv1.Status_STATUS_OK
	case "denied":
		r.Status = coordinatorv1.Status_STATUS_DENIED
	case "store-unavailable":
		r.Status = coordinatorv1.Status_STATUS_STORE_UNAVAILABLE
	case "unknown-route":
		r.Status = coordinatorv1.Status_STATUS_UNKNOWN_ROUTE
	case "stale":
		r.Status = coordinatorv1.Status_STATUS_STALE
	default:
		t.Fatalf("unknown result %q", f[0])
	}
	for _, kv := range f[1:] {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "granted":
			r.GrantedMicro = micro(t, v)
		case "ttl":
			r.TtlMs = micro(t, v)
		case "remaining":
			r.RemainingMicro = micro(t, v)
		case "retry":
			r.RetryAfterMs = micro(t, v)
		case "at":
			r.GrantedAtMs = micro(t, v)
		case "credited":
			r.CreditedMicro = micro(t, v)
		case "pace":
			r.PaceMs = micro(t, v)
		default:
			t.Fatalf("unknown field %q", k)
		}
	}
	return r
}
