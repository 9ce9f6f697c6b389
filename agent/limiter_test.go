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
//	policy [guard=ms] [max-keys=n]     a new Limiter with the YAML policy in the input
//	check t=T tenant=X path=P op=O [cost=N]
//	acquire t=T                        the next Acquire the core sends
//	respond t=T [error=unavailable|unknown-version]
//	  ok granted=G ttl=MS [remaining=R] [at=MS] [scarce]   one line per item, µ or tokens (t suffix)
//	  denied retry=MS [remaining=R]
//	  store-unavailable | unknown-route | stale
//	expire t=T                         sweep the whole table
//	returns                            the next Return the core sends
//	close                              retire everything (shutdown)
//	stats
func TestLeaseCore(t *testing.T) {
	datadriven.Walk(t, "testdata/lease", func(t *testing.T, path string) {
		var (
			l       *Limiter
			refill  *Refill
			notices int
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
				cfg := Config{AgentID: "agent-1", Region: "eu-west", Notify: func() { notices++ }}
				if d.HasArg("guard") {
					var g int64
					d.ScanArgs(t, "guard", &g)
					cfg.Guard = clock.Nanos(g) * clock.Nanos(time.Millisecond)
				}
				if d.HasArg("max-keys") {
					d.ScanArgs(t, "max-keys", &cfg.MaxKeys)
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
				v, err := l.Check(at(d), q)
				if err != nil {
					return "error: " + err.Error()
				}
				return showVerdict(v)
			case "acquire":
				refill = l.NextAcquire(at(d))
				if refill == nil {
					return "nothing to acquire"
				}
				var b strings.Builder
				fmt.Fprintf(&b, "seq=%d version=%s\n", refill.Req.Seq, refill.Req.PolicyVersion)
				for _, it := range refill.Req.Items {
					fmt.Fprintf(&b, "%s want=%s min=%s demand=%s/s\n", showRef(it.Bucket), tok(it.WantMicro), tok(it.MinMicro), tok(it.DemandMicroPerSecond))
				}
				return b.String()
			case "respond":
				if refill == nil {
					d.Fatalf(t, "respond without an acquire in flight")
				}
				var err error
				if d.HasArg("error") {
					var kind string
					d.ScanArgs(t, "error", &kind)
					switch kind {
					case "unknown-version":
						err = unknownVersionError(t)
					case "deadline":
						err = status.Error(codes.DeadlineExceeded, "context deadline exceeded")
					case "invalid":
						err = status.Error(codes.InvalidArgument, "refused")
					default:
						err = status.Error(codes.Unavailable, "coordinator unreachable")
					}
				}
				resp := &coordinatorv1.AcquireResponse{}
				if err == nil {
					for _, line := range strings.Split(strings.TrimSpace(d.Input), "\n") {
						resp.Results = append(resp.Results, parseResult(t, line))
					}
				}
				r := refill
				refill = nil
				if err := l.ApplyAcquire(at(d), r, resp, err); err != nil {
					return "error: " + err.Error()
				}
				return "ok"
			case "expire":
				l.Expire(at(d), 0, 1<<shardsLog2)
				return "ok"
			case "returns":
				r := l.NextReturn()
				if r == nil {
					return "nothing to return"
				}
				var b strings.Builder
				fmt.Fprintf(&b, "seq=%d version=%s\n", r.Req.Seq, r.Req.PolicyVersion)
				for _, it := range r.Req.Items {
					fmt.Fprintf(&b, "%s unspent=%s granted-at=%d\n", showRef(it.Bucket), tok(it.UnspentMicro), it.GrantedAtMs)
				}
				return b.String()
			case "close":
				l.Close()
				return "ok"
			case "stats":
				s := l.Stats()
				refills, returns := l.Pending()
				return fmt.Sprintf("keys=%d acquires=%d resends=%d grants=%d granted=%s denials=%d failures=%d expired=%d evicted=%d unavailable=%d degraded=%d shadow-denied=%d queued-refills=%d queued-returns=%d",
					l.Keys(), s.Acquires.Load(), s.Resends.Load(), s.Grants.Load(), tok(int64(s.GrantedMicro.Load())), s.Denials.Load(), s.ItemFailures.Load()+s.AcquireErrors.Load(),
					s.Expired.Load(), s.Evicted.Load(), s.Unavailable.Load(), s.Degraded.Load(), s.ShadowDenied.Load(), refills, returns)
			default:
				d.Fatalf(t, "unknown command %q", d.Cmd)
				return ""
			}
		})
	})
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
		case "scarce":
			r.Scarce = true
		default:
			t.Fatalf("unknown field %q", k)
		}
	}
	return r
}

func unknownVersionError(t *testing.T) error {
	t.Helper()
	err := coordinatorv1.UnknownPolicyVersionError("v0")
	if !isUnknownVersion(err) {
		t.Fatal("unknown-version status not recognized")
	}
	return err
}
