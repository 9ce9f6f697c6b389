package chaos

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"strings"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlqsv3 "github.com/envoyproxy/go-control-plane/envoy/service/rate_limit_quota/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/leasebucket/leasebucket/internal/bucket"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// Probe is one malformed or abusive request and what it got.
type Probe struct {
	Target string // agent, envoy or coordinator
	Name   string
	Want   string // a gRPC code, an item status, or "decision" (a rate-limit answer, not an error)
	Got    string
}

// OK reports whether the probe got what it should.
func (p Probe) OK() bool { return p.Want == p.Got }

// decision is what a probe that must be answered as a normal check wants.
const decision = "decision"

// abuseTimeout bounds one probe.
const abuseTimeout = 5 * time.Second

// probeRetries is how long a check probe answered by its rule's failure mode is asked again. The
// probes follow the last fault, under the load: on a machine running the rest of make test too,
// a cold key's refills have outlasted the wait bound five tries in a row (a few seconds), so the
// bound is time, not tries.
const probeRetries = 20 * time.Second

// askAgain is the answer of ask, asked again while it is the failure mode's (again) for up to
// probeRetries, after the wait ask gives each time.
func askAgain(ask func() (got string, again bool, wait time.Duration)) string {
	for start := time.Now(); ; {
		got, again, wait := ask()
		if !again || time.Since(start) > probeRetries {
			return got
		}
		time.Sleep(wait)
	}
}

// AbuseResult is what the bad-input client found.
type AbuseResult struct {
	Probes     []Probe
	Violations []Violation
}

// Abuse sends malformed and oversized requests to agent 0 (native and Envoy APIs) and to
// coordinator 0 (directly, as a misbehaving agent would), while the load runs. Each must get its
// documented answer (docs/reliability.md lists them), no process may exit, no bucket key may be
// created for an unknown route, and a bystander's bucket must not move.
func Abuse(s *Stack, keys *Keys, seed uint64) AbuseResult {
	var res AbuseResult
	fail := func(format string, args ...any) {
		res.Violations = append(res.Violations, Violation{Check: "abuse", Detail: fmt.Sprintf(format, args...)})
	}
	pids := map[string]int{}
	for _, p := range s.Processes() {
		pids[p.Name] = p.Pid
	}
	conn, err := grpc.NewClient("passthrough:///"+s.Coordinators[0].Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fail("dial coordinator: %v", err)
		return res
	}
	defer func() { _ = conn.Close() }()
	coord := coordinatorv1.NewCoordinatorServiceClient(conn)

	bystander, err := bystanderKey(keys)
	if err != nil {
		fail("%v", err)
		return res
	}
	if err := seedBystander(coord, keys); err != nil {
		fail("seed the bystander: %v", err)
		return res
	}
	before, err := s.HGetAll(bystander)
	if err != nil || len(before) == 0 {
		fail("read the bystander %s: %v (%d fields)", bystander, err, len(before))
		return res
	}

	a := s.Agents[0]
	res.Probes = append(res.Probes, agentProbes(a, keys)...)
	res.Probes = append(res.Probes, envoyProbes(a, keys)...)
	res.Probes = append(res.Probes, rawProbes(a)...)
	res.Probes = append(res.Probes, quotaProbes(a)...)
	res.Probes = append(res.Probes, fuzzProbes(a, seed)...)
	res.Probes = append(res.Probes, coordinatorProbes(coord, keys)...)
	for _, p := range res.Probes {
		if !p.OK() {
			fail("%s %s: got %s, want %s", p.Target, p.Name, p.Got, p.Want)
		}
	}

	// Unknown routes go to the default rule's bucket: one key per class, never one per path.
	if n, err := countKeys(s, "lb1:"+abuseTenant(0)+"|*"); err != nil {
		fail("count keys: %v", err)
	} else if n != 1 {
		fail("%d bucket keys for tenant %s after %d checks on distinct unknown routes, want 1 (the default rule's read bucket)",
			n, abuseTenant(0), unknownRoutes)
	}
	// The quota streams refused as a whole named the bystander's quota bucket: nothing charged it.
	if n, err := countKeys(s, "lb1:"+bystanderTenant()+"|*"); err != nil {
		fail("count keys: %v", err)
	} else if n != 1 {
		fail("%d bucket keys for tenant %s, want 1 (the ledger's, seeded): a refused quota report charged a bucket", n, bystanderTenant())
	}
	after, err := s.HGetAll(bystander)
	if err != nil {
		fail("read the bystander again: %v", err)
	} else if !maps.Equal(before, after) {
		fail("the bystander's bucket %s moved: %v, then %v", bystander, before, after)
	}
	for _, p := range s.Processes() {
		if pids[p.Name] == p.Pid {
			delete(pids, p.Name)
		}
	}
	for name, pid := range pids {
		fail("%s (pid %d) is gone after the bad input", name, pid)
	}
	return res
}

// unknownRoutes is how many distinct unknown routes the abuse client checks.
const unknownRoutes = 25

func bystanderKey(keys *Keys) (string, error) {
	r, err := keys.Set.Match(ledgerPath(), "GET")
	if err != nil {
		return "", err
	}
	return keys.Set.Key(r, bystanderTenant(), "")
}

// seedBystander takes 10 tokens of the bystander's bucket, as an agent would, so that its key
// exists in Redis with a level below its capacity; nobody touches it afterwards.
func seedBystander(coord coordinatorv1.CoordinatorServiceClient, keys *Keys) error {
	ctx, cancel := context.WithTimeout(context.Background(), abuseTimeout)
	defer cancel()
	resp, err := coord.Acquire(ctx, &coordinatorv1.AcquireRequest{AgentId: "chaos-bystander", Seq: 1,
		PolicyVersion: keys.Set.Version(), Items: []*coordinatorv1.AcquireItem{{
			Bucket:      ledgerRef(bystanderTenant()),
			NeededMicro: 10 * int64(bucket.PerToken), MinMicro: int64(bucket.PerToken),
		}}})
	if err != nil {
		return err
	}
	if st := resp.Results[0].Status; st != coordinatorv1.Status_STATUS_OK {
		return fmt.Errorf("status %v", st)
	}
	return nil
}

func ledgerRef(tenant string) *coordinatorv1.BucketRef {
	return &coordinatorv1.BucketRef{Rule: "ledger", Route: "/ledger", Operation: "read", Tenant: tenant}
}

// countKeys counts the keys matching pattern on every running Redis node.
func countKeys(s *Stack, pattern string) (int, error) {
	n := 0
	for i, node := range s.RedisNodes {
		if !node.Running() {
			continue
		}
		c := s.RedisClient(i)
		keys, err := c.Keys(context.Background(), pattern).Result()
		_ = c.Close()
		if err != nil && !errors.Is(err, redis.Nil) {
			return 0, err
		}
		n += len(keys)
	}
	return n, nil
}

// checkDecision is "decision" for an allow or a deny by the rule req resolves to; anything
// else (the failure mode, another rule) is spelled out.
func checkDecision(keys *Keys, req *agentv1.CheckRequest, resp *agentv1.CheckResponse) string {
	want := ""
	if r, err := keys.Set.Match(req.Route, req.Operation); err == nil {
		want = r.Rule.Name
	}
	switch {
	case resp.Decision != agentv1.Decision_DECISION_ALLOW && resp.Decision != agentv1.Decision_DECISION_DENY:
		return "decision " + resp.Decision.String()
	case resp.Rule != want:
		return fmt.Sprintf("decision by rule %q, not %q", resp.Rule, want)
	}
	return decision
}

func codeOf(err error) string {
	if err == nil {
		return decision
	}
	return status.Code(err).String()
}

var invalid = codes.InvalidArgument.String()

func agentProbes(a *Agent, keys *Keys) []Probe {
	burst := keys.Set.Rule("ledger").Quota.Burst
	check := func(name, want string, req *agentv1.CheckRequest) Probe {
		// A check that needs a refill answers with its rule's failure mode when the refill takes
		// longer than the agent's wait bound (a loaded machine): a decision, but not the one the
		// probe looks for, so it is asked again, after the Retry-After it was given (the key's
		// failure backoff; at least 100 ms, at most 2 s), for up to probeRetries.
		got := askAgain(func() (string, bool, time.Duration) {
			ctx, cancel := context.WithTimeout(context.Background(), abuseTimeout)
			resp, err := a.Client.Check(ctx, req)
			cancel()
			if err != nil {
				return codeOf(err), false, 0
			}
			got := checkDecision(keys, req, resp)
			return got, got == "decision "+agentv1.Decision_DECISION_UNAVAILABLE.String(),
				min(2*time.Second, max(100*time.Millisecond, time.Duration(resp.RetryAfterMs)*time.Millisecond))
		})
		return Probe{Target: "agent", Name: name, Want: want, Got: got}
	}
	ok := func(tenant, route, op string) *agentv1.CheckRequest {
		return &agentv1.CheckRequest{Tenant: tenant, Route: route, Operation: op}
	}
	with := func(r *agentv1.CheckRequest, f func(*agentv1.CheckRequest)) *agentv1.CheckRequest { f(r); return r }
	ps := []Probe{
		check("empty tenant", invalid, ok("", "/cold/1", "GET")),
		check("tenant of 129 bytes", invalid, ok(strings.Repeat("t", 129), "/cold/1", "GET")),
		check("tenant with a control byte", invalid, ok("abuse\x01", "/cold/1", "GET")),
		check("empty route", invalid, ok(abuseTenant(1), "", "GET")),
		check("route without a leading slash", invalid, ok(abuseTenant(1), "cold/1", "GET")),
		check("route with NUL (%00)", invalid, ok(abuseTenant(1), "/cold/%00", "GET")),
		check("route with a malformed escape", invalid, ok(abuseTenant(1), "/cold/%zz", "GET")),
		check("route of 4 KiB", invalid, ok(abuseTenant(1), "/"+strings.Repeat("a", 4096), "GET")),
		check("route of 100 segments", invalid, ok(abuseTenant(1), strings.Repeat("/a", 100), "GET")),
		check("negative cost", invalid, with(ok(abuseTenant(1), "/cold/1", "GET"), func(r *agentv1.CheckRequest) { r.Cost = -1 })),
		check("cost above the burst (bystander)", invalid,
			with(ok(bystanderTenant(), ledgerPath(), "GET"), func(r *agentv1.CheckRequest) { r.Cost = burst + 1 })),
		check("cost of 2^63-1 (bystander)", invalid,
			with(ok(bystanderTenant(), ledgerPath(), "GET"), func(r *agentv1.CheckRequest) { r.Cost = math.MaxInt64 })),
		check("idempotency key of 300 bytes", invalid,
			with(ok(abuseTenant(1), "/cold/1", "GET"), func(r *agentv1.CheckRequest) { r.IdempotencyKey = strings.Repeat("k", 300) })),
		check("message of 5 MiB", codes.ResourceExhausted.String(), ok(strings.Repeat("t", 5<<20), "/cold/1", "GET")),
		check("cost 0 (the rule's cost)", decision, ok(abuseTenant(1), "/cold/1", "GET")),
		check("unknown operation", decision, ok(abuseTenant(1), "/cold/1", "FROBNICATE")),
		check("tenant never seen", decision, ok(fmt.Sprintf("never-seen-%d", time.Now().UnixNano()), "/cold/1", "GET")),
		check("percent-encoded invalid UTF-8 in the path (%FF, opaque)", decision, ok(abuseTenant(1), "/cold/%FF", "GET")),
	}
	// Tenants that try to forge the bystander's key or a Cluster hash tag are charged to their own
	// (escaped) keys; the bystander's bucket is compared after the probes.
	if r, err := keys.Set.Match(ledgerPath(), "GET"); err == nil {
		if lim, err := keys.Set.Limits(r, bystanderTenant(), ""); err == nil {
			forged := bystanderTenant() + "|/ledger|read|" + lim.Fingerprint
			ps = append(ps,
				check("tenant forging the bystander's key", decision, ok(forged, ledgerPath(), "GET")),
				check("tenant as a Cluster hash tag", decision, ok("{"+bystanderTenant()+"}", ledgerPath(), "GET")))
		}
	}
	unknown := Probe{Target: "agent", Name: fmt.Sprintf("%d distinct unknown routes", unknownRoutes), Want: decision, Got: decision}
	for i := range unknownRoutes {
		if p := check("unknown route", decision, ok(abuseTenant(0), unknownPath(i), "GET")); !p.OK() {
			unknown.Got = p.Got
		}
	}
	ps = append(ps, unknown)

	// Batches and streams.
	ctx, cancel := context.WithTimeout(context.Background(), abuseTimeout)
	defer cancel()
	big := make([]*agentv1.CheckRequest, 1025)
	for i := range big {
		big[i] = ok(abuseTenant(1), "/cold/1", "GET")
	}
	_, err := a.Client.CheckBatch(ctx, &agentv1.CheckBatchRequest{Checks: big})
	ps = append(ps, Probe{Target: "agent", Name: "CheckBatch of 1025 checks", Want: invalid, Got: codeOf(err)})
	resp, err := a.Client.CheckBatch(ctx, &agentv1.CheckBatchRequest{Checks: []*agentv1.CheckRequest{
		ok(abuseTenant(1), "/cold/1", "GET"), ok("", "/cold/1", "GET"),
	}})
	got := codeOf(err)
	if err == nil {
		got = fmt.Sprintf("errors %q", resp.Errors)
		if len(resp.Errors) == 2 && resp.Errors[0] == "" && resp.Errors[1] != "" {
			got = "per-check error"
		}
	}
	ps = append(ps, Probe{Target: "agent", Name: "CheckBatch with one malformed check", Want: "per-check error", Got: got})
	stream, err := a.Client.CheckStream(ctx)
	got = codeOf(err)
	if err == nil {
		err = stream.Send(&agentv1.CheckStreamRequest{Id: 1, Checks: big})
		if err == nil {
			_, err = stream.Recv()
		}
		got = codeOf(err)
	}
	ps = append(ps, Probe{Target: "agent", Name: "CheckStream message of 1025 checks", Want: invalid, Got: got})
	return ps
}

func envoyProbes(a *Agent, keys *Keys) []Probe {
	entry := func(k, v string) *commonv3.RateLimitDescriptor_Entry {
		return &commonv3.RateLimitDescriptor_Entry{Key: k, Value: v}
	}
	desc := func(tenant, path, method string) *commonv3.RateLimitDescriptor {
		return &commonv3.RateLimitDescriptor{Entries: []*commonv3.RateLimitDescriptor_Entry{
			entry("tenant", tenant), entry("path", path), entry("method", method)}}
	}
	call := func(name, want string, req *ratelimitv3.RateLimitRequest) Probe {
		// As for the native probes: a failure-mode answer (fail closed: UNAVAILABLE, which repeats
		// for the key's failure backoff, up to 2 s) is asked again for up to probeRetries.
		got := askAgain(func() (string, bool, time.Duration) {
			ctx, cancel := context.WithTimeout(context.Background(), abuseTimeout)
			resp, err := a.Envoy.ShouldRateLimit(ctx, req)
			cancel()
			got := codeOf(err)
			if err == nil && resp.OverallCode != ratelimitv3.RateLimitResponse_OK && resp.OverallCode != ratelimitv3.RateLimitResponse_OVER_LIMIT {
				got = "decision " + resp.OverallCode.String()
			}
			return got, want == decision && got == codes.Unavailable.String(), 200 * time.Millisecond
		})
		return Probe{Target: "envoy", Name: name, Want: want, Got: got}
	}
	req := func(ds ...*commonv3.RateLimitDescriptor) *ratelimitv3.RateLimitRequest {
		return &ratelimitv3.RateLimitRequest{Domain: "leasebucket", Descriptors: ds}
	}
	many := func(n int) []*commonv3.RateLimitDescriptor {
		ds := make([]*commonv3.RateLimitDescriptor, n)
		for i := range ds {
			ds[i] = desc(abuseTenant(2), "/cold/1", "GET")
		}
		return ds
	}
	nine := desc(abuseTenant(2), "/cold/1", "GET")
	for range 6 {
		nine.Entries = append(nine.Entries, entry("x", "y"))
	}
	burst := uint32(keys.Set.Rule("ledger").Quota.Burst)
	return []Probe{
		call("unknown domain", invalid, &ratelimitv3.RateLimitRequest{Domain: "other", Descriptors: many(1)}),
		call("no descriptors", invalid, req()),
		call("17 descriptors", invalid, req(many(17)...)),
		call("10000 descriptors", invalid, req(many(10000)...)),
		call("descriptor of 9 entries", invalid, req(nine)),
		call("unknown entry key", invalid, req(&commonv3.RateLimitDescriptor{Entries: []*commonv3.RateLimitDescriptor_Entry{
			entry("tenant", abuseTenant(2)), entry("path", "/cold/1"), entry("colour", "red")}})),
		call("no tenant entry", invalid, req(&commonv3.RateLimitDescriptor{Entries: []*commonv3.RateLimitDescriptor_Entry{
			entry("path", "/cold/1"), entry("method", "GET")}})),
		call("entry value of 3 KiB", invalid, req(desc(abuseTenant(2), "/"+strings.Repeat("p", 3<<10), "GET"))),
		call("limit override", invalid, req(&commonv3.RateLimitDescriptor{Entries: desc(abuseTenant(2), "/cold/1", "GET").Entries,
			Limit: &commonv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 1e9}})),
		call("negative hits", invalid, req(&commonv3.RateLimitDescriptor{Entries: desc(abuseTenant(2), "/cold/1", "GET").Entries,
			IsNegativeHits: true})),
		call("hits_addend above the burst (bystander)", invalid, &ratelimitv3.RateLimitRequest{Domain: "leasebucket",
			Descriptors: []*commonv3.RateLimitDescriptor{desc(bystanderTenant(), ledgerPath(), "GET")}, HitsAddend: burst + 1}),
		call("descriptor hits_addend 0", invalid, req(&commonv3.RateLimitDescriptor{Entries: desc(abuseTenant(2), "/cold/1", "GET").Entries,
			HitsAddend: wrapperspb.UInt64(0)})),
		call("a valid bystander descriptor beside a malformed one", invalid,
			req(desc(bystanderTenant(), ledgerPath(), "GET"), desc("", "/cold/1", "GET"))),
		call("unknown route", decision, req(desc(abuseTenant(0), unknownPath(unknownRoutes), "GET"))),
	}
}

// fuzzChecks is how many random checks fuzzProbes sends to each API.
const fuzzChecks = 300

// fuzzProbes sends random checks (seeded): tenants, paths and operations of random bytes,
// printable or not, short or over the bounds, with escapes, separators and braces, and costs
// around the valid range. Every answer must be a decision (for Envoy's API, UNAVAILABLE is the
// fail-closed decision) or INVALID_ARGUMENT; the tenants start
// with "fz" so none is the bystander.
func fuzzProbes(a *Agent, seed uint64) []Probe {
	rng := rand.New(rand.NewPCG(seed, 0xf022))
	alphabet := []string{"a", "Z", "0", "/", "%", "%2F", "%00", "%zz", "|", "{", "}", " ", "\t", "é", "\u2028", "..", ".", "?", "#", "\x7f"}
	str := func(max int) string {
		var b strings.Builder
		for range rng.IntN(max + 1) {
			b.WriteString(alphabet[rng.IntN(len(alphabet))])
		}
		return strings.ToValidUTF8(b.String(), "?")
	}
	random := func() (tenant, path, op string, cost int64) {
		tenant = "fz" + str(12)
		if rng.IntN(10) == 0 {
			tenant = "fz" + strings.Repeat("x", 120+rng.IntN(20))
		}
		path = str(20)
		if rng.IntN(2) == 0 {
			path = "/" + path
		}
		if rng.IntN(10) == 0 {
			path = "/" + strings.Repeat("p/", 40+rng.IntN(1100))
		}
		op = []string{"GET", "POST", "read", "write", "export", "", "get", str(5)}[rng.IntN(8)]
		cost = rng.Int64N(30) - 5
		return
	}
	tally := func(api string, f func() error) Probe {
		counts := map[string]int{}
		for range fuzzChecks {
			code := codeOf(f())
			if api == "envoy" && code == codes.Unavailable.String() {
				// Envoy's API has no fail-closed answer but a gRPC error: a random route falls
				// to the default rule, which fails closed when its first refill outlasts
				// --max-wait under this load. The native API says the same as a decision.
				code = decision
			}
			counts[code]++
		}
		p := Probe{Target: api, Name: fmt.Sprintf("%d random checks", fuzzChecks), Want: "decision or InvalidArgument",
			Got: "decision or InvalidArgument"}
		for code, n := range counts {
			if code != decision && code != invalid {
				p.Got = fmt.Sprintf("%d × %s", n, code)
			}
		}
		return p
	}
	ctx := context.Background()
	native := tally("agent", func() error {
		tenant, path, op, cost := random()
		cctx, cancel := context.WithTimeout(ctx, abuseTimeout)
		defer cancel()
		_, err := a.Client.Check(cctx, &agentv1.CheckRequest{Tenant: tenant, Route: path, Operation: op, Cost: cost})
		return err
	})
	envoy := tally("envoy", func() error {
		tenant, path, op, cost := random()
		cctx, cancel := context.WithTimeout(ctx, abuseTimeout)
		defer cancel()
		d := &commonv3.RateLimitDescriptor{Entries: []*commonv3.RateLimitDescriptor_Entry{
			{Key: "tenant", Value: tenant}, {Key: "path", Value: path}, {Key: "method", Value: op}}}
		_, err := a.Envoy.ShouldRateLimit(cctx, &ratelimitv3.RateLimitRequest{Domain: "leasebucket",
			Descriptors: []*commonv3.RateLimitDescriptor{d}, HitsAddend: uint32(max(cost, 0))})
		return err
	})
	return []Probe{native, envoy}
}

// rawCodec sends bytes as they are: a message a Go client's proto marshaller would refuse to
// build (proto3 strings must be valid UTF-8).
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *v.(*[]byte), nil }
func (rawCodec) Unmarshal(data []byte, v any) error {
	*v.(*[]byte) = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string { return "proto" }

// rawProbes send invalid UTF-8 in string fields. gRPC's decoder rejects such a message before
// any handler sees it, with INTERNAL (grpc-go answers every unmarshal failure so).
func rawProbes(a *Agent) []Probe {
	field := func(b []byte, num protowire.Number, v string) []byte {
		b = protowire.AppendTag(b, num, protowire.BytesType)
		return protowire.AppendString(b, v)
	}
	var check []byte
	check = field(check, 1, "abuse-\xff\xfe")
	check = field(check, 2, "/cold/1")
	check = field(check, 3, "GET")
	var entryT, entryP, descr, envoy []byte
	entryT = field(field(entryT, 1, "tenant"), 2, "\xc3\x28")
	entryP = field(field(entryP, 1, "path"), 2, "/cold/1")
	descr = protowire.AppendBytes(protowire.AppendTag(descr, 1, protowire.BytesType), entryT)
	descr = protowire.AppendBytes(protowire.AppendTag(descr, 1, protowire.BytesType), entryP)
	envoy = field(envoy, 1, "leasebucket")
	envoy = protowire.AppendBytes(protowire.AppendTag(envoy, 2, protowire.BytesType), descr)
	call := func(target, name, method string, msg []byte) Probe {
		ctx, cancel := context.WithTimeout(context.Background(), abuseTimeout)
		defer cancel()
		var out []byte
		err := a.conn.Invoke(ctx, method, &msg, &out, grpc.ForceCodec(rawCodec{}))
		return Probe{Target: target, Name: name, Want: codes.Internal.String(), Got: codeOf(err)}
	}
	return []Probe{
		call("agent", "tenant of invalid UTF-8", "/"+agentv1.AgentService_ServiceDesc.ServiceName+"/Check", check),
		call("envoy", "descriptor value of invalid UTF-8", "/"+ratelimitv3.RateLimitService_ServiceDesc.ServiceName+"/ShouldRateLimit", envoy),
	}
}

func coordinatorProbes(c coordinatorv1.CoordinatorServiceClient, keys *Keys) []Probe {
	version := keys.Set.Version()
	var seq uint64 = 100
	acquire := func(name, want string, req *coordinatorv1.AcquireRequest, item bool) Probe {
		ctx, cancel := context.WithTimeout(context.Background(), abuseTimeout)
		defer cancel()
		if req.Seq == 0 && req.AgentId != "" && name != "seq 0" {
			seq++
			req.Seq = seq
		}
		resp, err := c.Acquire(ctx, req)
		got := codeOf(err)
		if err == nil && item {
			got = resp.Results[len(resp.Results)-1].Status.String()
		}
		if err != nil && coordinatorv1.Reason(err) != "" {
			got += " " + coordinatorv1.Reason(err)
		}
		return Probe{Target: "coordinator", Name: name, Want: want, Got: got}
	}
	item := func(ref *coordinatorv1.BucketRef, want, least int64) *coordinatorv1.AcquireItem {
		return &coordinatorv1.AcquireItem{Bucket: ref, NeededMicro: want, MinMicro: least}
	}
	abuse := func() *coordinatorv1.BucketRef { return ledgerRef(abuseTenant(3)) }
	one := int64(bucket.PerToken)
	req := func(items ...*coordinatorv1.AcquireItem) *coordinatorv1.AcquireRequest {
		return &coordinatorv1.AcquireRequest{AgentId: "chaos-abuse", PolicyVersion: version, Items: items}
	}
	many := make([]*coordinatorv1.AcquireItem, 1025)
	for i := range many {
		many[i] = item(abuse(), one, one)
	}
	capacity := keys.Set.Rule("ledger").Quota.Burst * one
	ps := []Probe{
		acquire("empty agent id", invalid, &coordinatorv1.AcquireRequest{Seq: 1, PolicyVersion: version,
			Items: []*coordinatorv1.AcquireItem{item(abuse(), one, one)}}, false),
		acquire("agent id of 100 bytes", invalid, &coordinatorv1.AcquireRequest{AgentId: strings.Repeat("a", 100), Seq: 1,
			PolicyVersion: version, Items: []*coordinatorv1.AcquireItem{item(abuse(), one, one)}}, false),
		acquire("seq 0", invalid, &coordinatorv1.AcquireRequest{AgentId: "chaos-abuse", PolicyVersion: version,
			Items: []*coordinatorv1.AcquireItem{item(abuse(), one, one)}}, false),
		acquire("1025 items", invalid, req(many...), false),
		acquire("unknown policy version", codes.FailedPrecondition.String()+" "+coordinatorv1.ReasonUnknownPolicyVersion,
			&coordinatorv1.AcquireRequest{AgentId: "chaos-abuse", PolicyVersion: "no-such-version",
				Items: []*coordinatorv1.AcquireItem{item(ledgerRef(bystanderTenant()), one, one)}}, false),
		acquire("unknown rule", coordinatorv1.Status_STATUS_UNKNOWN_ROUTE.String(),
			req(item(&coordinatorv1.BucketRef{Rule: "no-such-rule", Route: "/x", Operation: "read", Tenant: abuseTenant(3)}, one, one)), true),
		acquire("no bucket", coordinatorv1.Status_STATUS_INVALID.String(), req(item(nil, one, one)), true),
		acquire("negative want", coordinatorv1.Status_STATUS_INVALID.String(), req(item(abuse(), -5, one)), true),
		acquire("min of 0", coordinatorv1.Status_STATUS_INVALID.String(), req(item(abuse(), one, 0)), true),
		acquire("tenant of 200 bytes", coordinatorv1.Status_STATUS_INVALID.String(),
			req(item(ledgerRef(strings.Repeat("t", 200)), one, one)), true),
		acquire("min above the capacity", coordinatorv1.Status_STATUS_DENIED.String(), req(item(abuse(), capacity+one, capacity+one)), true),
		acquire("the same bucket twice", coordinatorv1.Status_STATUS_INVALID.String(), req(item(abuse(), one, one), item(abuse(), one, one)), true),
		acquire("message of 5 MiB", codes.ResourceExhausted.String(), req(item(ledgerRef(strings.Repeat("t", 5<<20)), one, one)), false),
	}
	ctx, cancel := context.WithTimeout(context.Background(), abuseTimeout)
	defer cancel()
	seq++
	resp, err := c.Return(ctx, &coordinatorv1.ReturnRequest{AgentId: "chaos-abuse", Seq: seq, PolicyVersion: version,
		Items: []*coordinatorv1.ReturnItem{{Bucket: abuse(), UnspentMicro: -1, GrantedAtMs: 1}}})
	got := codeOf(err)
	if err == nil {
		got = resp.Results[0].Status.String()
	}
	ps = append(ps, Probe{Target: "coordinator", Name: "return of a negative amount", Want: coordinatorv1.Status_STATUS_INVALID.String(), Got: got})
	return ps
}

// quotaProbes sends malformed and abusive rate limit quota streams (envoy.service.rate_limit_quota.v3):
// each malformed message must end its stream with its documented code and charge nothing, a
// bucket that maps to no key must get DENY_ALL, and reports of buckets never announced before,
// with absurd counts, must be answered with actions, not errors.
func quotaProbes(a *Agent) []Probe {
	usage := func(id map[string]string, allowed uint64) *rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage {
		return &rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{BucketId: &rlqsv3.BucketId{Bucket: id}, NumRequestsAllowed: allowed,
			NumRequestsDenied: allowed}
	}
	id := func(tenant string) map[string]string {
		return map[string]string{"tenant": tenant, "path": "/quota/{id}", "method": "GET"}
	}
	// stream sends msgs and reads the first answer: its first action's strategy, or the code the
	// stream ended with.
	stream := func(name, want string, msgs ...*rlqsv3.RateLimitQuotaUsageReports) Probe {
		ctx, cancel := context.WithTimeout(context.Background(), abuseTimeout)
		defer cancel()
		got := ""
		st, err := rlqsv3.NewRateLimitQuotaServiceClient(a.conn).StreamRateLimitQuotas(ctx)
		for _, m := range msgs {
			if err == nil {
				err = st.Send(m)
			}
		}
		var resp *rlqsv3.RateLimitQuotaResponse
		if err == nil {
			resp, err = st.Recv()
		}
		switch {
		case err != nil:
			got = status.Code(err).String()
		case len(resp.BucketAction) == 0:
			got = "no action"
		case resp.BucketAction[0].GetQuotaAssignmentAction().GetRateLimitStrategy().GetTokenBucket() != nil:
			got = decision
		default:
			got = resp.BucketAction[0].GetQuotaAssignmentAction().GetRateLimitStrategy().GetBlanketRule().String()
		}
		return Probe{Target: "quota", Name: name, Want: want, Got: got}
	}
	msg := func(domain string, us ...*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage) *rlqsv3.RateLimitQuotaUsageReports {
		return &rlqsv3.RateLimitQuotaUsageReports{Domain: domain, BucketQuotaUsages: us}
	}
	wide := id(abuseTenant(3))
	for i := range 9 {
		wide[fmt.Sprintf("k%d", i)] = "v"
	}
	many := make([]*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage, 1025)
	for i := range many {
		many[i] = usage(id(abuseTenant(3)), 1)
	}
	unknown := id(abuseTenant(3))
	unknown["colour"] = "red"
	return []Probe{
		stream("first message without a domain", invalid, msg("", usage(id(bystanderTenant()), 1))),
		stream("another domain", invalid, msg("other", usage(id(bystanderTenant()), 1))),
		stream("a bucket id of 12 entries beside a valid bucket", invalid, msg("leasebucket", usage(id(bystanderTenant()), 1), usage(wide, 1))),
		stream("a bucket id value of 3 KiB", invalid, msg("leasebucket", usage(id(strings.Repeat("t", 3<<10)), 1))),
		stream("1025 usages in one message", invalid, msg("leasebucket", many...)),
		stream("a bucket of an unknown key", "DENY_ALL", msg("leasebucket", usage(unknown, 1))),
		stream("a bucket of a tenant no policy can key", "DENY_ALL", msg("leasebucket", usage(id("bad\x00tenant"), 1))),
		stream("reports of buckets never announced, absurd counts", decision, msg("leasebucket", usage(id(abuseTenant(4)), math.MaxUint64))),
	}
}
