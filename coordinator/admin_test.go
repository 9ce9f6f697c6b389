package coordinator_test

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/internal/tlsconfig"
	"github.com/leasebucket/leasebucket/policy"
	adminv1 "github.com/leasebucket/leasebucket/proto/leasebucket/admin/v1"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// auditLog collects the audit records of an AdminService.
type auditLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (a *auditLog) Write(p []byte) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.buf.Write(p)
}

func (a *auditLog) logger() *zap.Logger {
	return zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(a), zap.InfoLevel))
}

func (a *auditLog) records(t *testing.T) []map[string]any {
	t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []map[string]any
	for line := range strings.SplitSeq(strings.TrimSpace(a.buf.String()), "\n") {
		if line == "" {
			continue
		}
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("audit line %q: %v", line, err)
		}
		out = append(out, rec)
	}
	return out
}

// adminStores are the stores the admin tests run on, both on the test's manual clock.
type adminStores struct {
	name      string
	store     storeAndAdmin
	overrides coordinator.OverridesStore
	keys      func(t *testing.T) int // bucket keys held
}

type storeAndAdmin interface {
	coordinator.Store
	coordinator.AdminStore
}

func adminBackends(t *testing.T, clock func() bucket.Millis) []adminStores {
	mem := memstore.New(memstore.WithClock(clock))
	srv := redistest.Start(t)
	c := redis.NewClient(srv.Options())
	t.Cleanup(func() { _ = c.Close() })
	rs := redisstore.New(c, redisstore.WithClock(clock))
	return []adminStores{
		{"memory", mem, memstore.NewOverrides(), func(*testing.T) int { return mem.Len() }},
		{"redis", rs, rs, func(t *testing.T) int {
			keys, err := c.Keys(ctxFor(t, 10*time.Second), "lb1:*|*").Result()
			if err != nil {
				t.Fatal(err)
			}
			return len(keys)
		}},
	}
}

// adminStack is a coordinator with the admin API over mutual TLS, an admin client and an agent
// client.
type adminStack struct {
	policies  *coordinator.Policies
	overrides coordinator.OverridesStore
	audit     *auditLog
	admin     adminv1.AdminServiceClient
	agent     coordinatorv1.CoordinatorServiceClient
	agentOv   coordinatorv1.OverridesServiceClient
	pki       tlsconfig.Files
	addr      string
}

func newAdminStack(t *testing.T, s adminStores, admins []coordinator.Identity, bounds coordinator.OverridesBounds) *adminStack {
	t.Helper()
	pki, err := tlsconfig.WriteTestPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	serverTLS, err := tlsconfig.Server(pki.ServerCert, pki.ServerKey, pki.CA)
	if err != nil {
		t.Fatal(err)
	}
	set := mustPolicy(t, "v1")
	var pol *coordinator.Policies
	svc := coordinator.NewService(s.store, set, coordinator.WithUnknownVersion(func(v string) bool { return pol.Miss(v) }))
	pol = coordinator.NewPolicies(svc, set, s.overrides, zaptest.NewLogger(t), time.Second)
	st := &adminStack{policies: pol, overrides: s.overrides, audit: &auditLog{}, pki: pki}
	adm := coordinator.NewAdminService(coordinator.AdminConfig{Store: s.store, Overrides: s.overrides, Policies: pol,
		Admins: admins, Audit: st.audit.logger(), Logger: zaptest.NewLogger(t), StoreTimeout: 5 * time.Second, Bounds: bounds})
	r := startReplica(t, svc, coordinator.ServerOptions{TLS: serverTLS, Admin: adm, Overrides: coordinator.NewOverridesServer(pol)},
		st.dial(t, pki.ClientCert, pki.ClientKey))
	st.addr = r.addr
	st.agent = r.client
	st.agentOv = coordinatorv1.NewOverridesServiceClient(r.conn)
	st.admin = adminv1.NewAdminServiceClient(st.conn(t, pki.AdminCert, pki.AdminKey))
	return st
}

func (st *adminStack) dial(t *testing.T, cert, key string) grpc.DialOption {
	t.Helper()
	cfg, err := tlsconfig.Client(st.pki.CA, cert, key, "")
	if err != nil {
		t.Fatal(err)
	}
	return grpc.WithTransportCredentials(credentials.NewTLS(cfg))
}

func (st *adminStack) conn(t *testing.T, cert, key string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(st.addr, st.dial(t, cert, key))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

var adminURI = coordinator.Identity{Kind: "uri", Value: tlsconfig.AdminURI}

func wantCode(t *testing.T, what string, err error, code codes.Code, msg string) {
	t.Helper()
	if status.Code(err) != code || !strings.Contains(status.Convert(err).Message(), msg) {
		t.Errorf("%s: %v; want %v containing %q", what, err, code, msg)
	}
}

// TestAdminBuckets: inspect, set and reset a bucket agents use; the records of the agents'
// leases survive, levels above capacity change nothing, and every call is audited.
func TestAdminBuckets(t *testing.T) {
	var now atomic.Int64
	now.Store(1_700_000_000_000)
	clock := func() bucket.Millis { return bucket.Millis(now.Load()) }
	for _, b := range adminBackends(t, clock) {
		t.Run(b.name, func(t *testing.T) {
			st := newAdminStack(t, b, []coordinator.Identity{adminURI}, coordinator.OverridesBounds{})
			ctx := ctxFor(t, 30*time.Second)
			sel := &adminv1.BucketSelector{Tenant: "acme-" + b.name, Route: "/hot", Operation: "GET"}
			hot := ref("hot", sel.Tenant)
			inspect := func() *adminv1.Bucket {
				t.Helper()
				resp, err := st.admin.InspectBucket(ctx, &adminv1.InspectBucketRequest{Bucket: sel})
				if err != nil {
					t.Fatalf("InspectBucket: %v", err)
				}
				return resp.Bucket
			}
			calls := 0

			bk := inspect()
			calls++
			capacity := 50 * tok
			ttl := lease.TTL(limit(t, mustPolicy(t, "v1"), hot)).Milliseconds()
			if bk.State.Stored || bk.State.LevelMicro != int64(capacity) || bk.CapacityMicro != int64(capacity) ||
				bk.Rule != "hot" || bk.Template != "/hot" || bk.OperationEntry != "read" || bk.Limit != "200/1s burst 50" ||
				bk.LimitSource != adminv1.LimitSource_LIMIT_SOURCE_RULE || bk.PolicyVersion != "v1" || bk.LeaseTtlMs != ttl ||
				bk.Key != key(t, mustPolicy(t, "v1"), hot) {
				t.Fatalf("unused bucket: %v", bk)
			}

			resp, err := st.agent.Acquire(ctx, acquire("agent-1", 1, "v1", item(hot, 10*tok, tok)))
			if err != nil || resp.Results[0].Status != coordinatorv1.Status_STATUS_OK {
				t.Fatalf("Acquire: %v, %v", resp, err)
			}
			g := resp.Results[0].GrantedMicro
			at := now.Load()
			bk = inspect()
			calls++
			want := &adminv1.BucketState{Stored: true, NowMs: at, LevelMicro: int64(capacity) - g, StoredMicro: int64(capacity) - g,
				LastRefillMs: at, ExpiresAtMs: bk.State.ExpiresAtMs, OutstandingMicro: g,
				Agents: []*adminv1.AgentRecord{{AgentId: "agent-1", TakeSeq: 1, GrantedMicro: g, GrantedAtMs: at,
					LeaseExpiresAtMs: at + ttl, Outstanding: true}}}
			if !proto.Equal(bk.State, want) || bk.State.ExpiresAtMs <= at {
				t.Fatalf("after a grant of %d µ: %v, want %v", g, bk.State, want)
			}
			// Past the lease's lifetime the grant is no longer outstanding; the level has refilled.
			now.Add(ttl)
			bk = inspect()
			calls++
			if bk.State.OutstandingMicro != 0 || bk.State.Agents[0].Outstanding || bk.State.LevelMicro != int64(capacity) {
				t.Fatalf("after the lease's lifetime: %v", bk.State)
			}
			now.Add(-ttl)

			// Bad levels change nothing.
			_, err = st.admin.SetBucket(ctx, &adminv1.SetBucketRequest{Bucket: sel, LevelMicro: int64(capacity) + 1})
			calls++
			wantCode(t, "level above capacity", err, codes.InvalidArgument, "above the bucket's capacity of 50 tokens")
			_, err = st.admin.SetBucket(ctx, &adminv1.SetBucketRequest{Bucket: sel, LevelMicro: -1})
			calls++
			wantCode(t, "negative level", err, codes.InvalidArgument, "negative")
			if got := inspect(); !proto.Equal(got.State, want) {
				t.Fatalf("rejected SetBucket calls changed the bucket: %v, want %v", got.State, want)
			}
			calls++

			// Empty it: agents are denied, a retried Acquire is still answered from its record.
			set, err := st.admin.SetBucket(ctx, &adminv1.SetBucketRequest{Bucket: sel, LevelMicro: 0, Reason: "abuse ticket 7"})
			calls++
			if err != nil || set.Before.State.LevelMicro != int64(capacity)-g || set.After.State.LevelMicro != 0 ||
				len(set.After.State.Agents) != 1 {
				t.Fatalf("SetBucket 0: %v, %v", set, err)
			}
			replay, err := st.agent.Acquire(ctx, acquire("agent-1", 1, "v1", item(hot, 10*tok, tok)))
			if err != nil || !replay.Results[0].Replayed || replay.Results[0].GrantedMicro != g {
				t.Fatalf("retried Acquire after SetBucket: %v, %v", replay, err)
			}
			denied, err := st.agent.Acquire(ctx, acquire("agent-1", 2, "v1", item(hot, tok, tok)))
			if err != nil || denied.Results[0].Status != coordinatorv1.Status_STATUS_DENIED || denied.Results[0].RetryAfterMs != 5 {
				t.Fatalf("Acquire from an empty bucket: %v, %v (1 token takes 5 ms at 200/s)", denied, err)
			}

			reset, err := st.admin.ResetBucket(ctx, &adminv1.ResetBucketRequest{Bucket: sel})
			calls++
			if err != nil || reset.Before.State.LevelMicro != 0 || reset.After.State.LevelMicro != int64(capacity) {
				t.Fatalf("ResetBucket: %v, %v", reset, err)
			}
			ok, err := st.agent.Acquire(ctx, acquire("agent-1", 3, "v1", item(hot, tok, tok)))
			if err != nil || ok.Results[0].Status != coordinatorv1.Status_STATUS_OK {
				t.Fatalf("Acquire after the reset: %v, %v", ok, err)
			}

			recs := st.audit.records(t)
			if len(recs) != calls {
				t.Fatalf("%d audit records for %d calls", len(recs), calls)
			}
			for _, r := range recs {
				if r["identity"] != adminURI.String() || r["key"] != bk.Key || r["method"] == nil || r["code"] == nil {
					t.Errorf("audit record %v", r)
				}
			}
			last := recs[len(recs)-1]
			if last["method"] != "ResetBucket" || last["code"] != "OK" || last["level_before_micro"] != 0.0 ||
				last["level_after_micro"] != float64(capacity) {
				t.Errorf("last audit record %v", last)
			}
			if r := recs[6]; r["method"] != "SetBucket" || r["reason"] != "abuse ticket 7" || r["level_after_micro"] != 0.0 {
				t.Errorf("SetBucket audit record %v", r)
			}
			if r := recs[3]; r["code"] != "InvalidArgument" || !strings.Contains(r["error"].(string), "capacity") {
				t.Errorf("rejected SetBucket audit record %v", r)
			}
		})
	}
}

// TestAdminBadInput: requests that name no bucket of the policy, or an impossible change, are
// rejected with a clear error before the store is touched.
func TestAdminBadInput(t *testing.T) {
	mem := memstore.New()
	st := newAdminStack(t, adminStores{"memory", mem, memstore.NewOverrides(), nil}, []coordinator.Identity{adminURI}, coordinator.OverridesBounds{})
	ctx := ctxFor(t, 30*time.Second)
	sel := func(tenant, route, op, region, rule string) *adminv1.BucketSelector {
		return &adminv1.BucketSelector{Tenant: tenant, Route: route, Operation: op, Region: region, Rule: rule}
	}
	for _, c := range []struct {
		name string
		sel  *adminv1.BucketSelector
		code codes.Code
		msg  string
	}{
		{"no bucket", nil, codes.InvalidArgument, "bucket: required"},
		{"no tenant", sel("", "/hot", "GET", "", ""), codes.InvalidArgument, "tenant: required"},
		{"bad tenant", sel("a\x01b", "/hot", "GET", "", ""), codes.InvalidArgument, "control character"},
		{"no route", sel("acme", "", "GET", "", ""), codes.InvalidArgument, "route: required"},
		{"bad route", sel("acme", "/hot/%zz", "GET", "", ""), codes.InvalidArgument, `route "/hot/%zz"`},
		{"no operation", sel("acme", "/hot", "", "", ""), codes.InvalidArgument, "operation: required"},
		{"unknown rule", sel("acme", "/hot", "GET", "", "cold"), codes.NotFound, `rule "cold": no such rule in policy version v1`},
		{"other rule", sel("acme", "/slow", "GET", "", "hot"), codes.FailedPrecondition, `resolves to slow /slow read, not to rule "hot"`},
		{"unmatched route", sel("acme", "/nowhere", "GET", "", "hot"), codes.FailedPrecondition, "resolves to default (operation read)"},
		{"no region", sel("acme", "/search", "GET", "", ""), codes.InvalidArgument, `region "": rule "search" is regional, with slices for eu-west, us-east`},
		{"unknown region", sel("acme", "/search", "GET", "mars", ""), codes.InvalidArgument, `region "mars"`},
		{"calendar quota", sel("acme", "/monthly", "GET", "", ""), codes.FailedPrecondition, `rule "monthly" is a calendar quota (1000/month)`},
	} {
		_, err := st.admin.InspectBucket(ctx, &adminv1.InspectBucketRequest{Bucket: c.sel})
		wantCode(t, "InspectBucket "+c.name, err, c.code, c.msg)
		_, err = st.admin.SetBucket(ctx, &adminv1.SetBucketRequest{Bucket: c.sel, LevelMicro: 1})
		wantCode(t, "SetBucket "+c.name, err, c.code, c.msg)
		_, err = st.admin.ResetBucket(ctx, &adminv1.ResetBucketRequest{Bucket: c.sel})
		wantCode(t, "ResetBucket "+c.name, err, c.code, c.msg)
	}
	_, err := st.admin.ResetBucket(ctx, &adminv1.ResetBucketRequest{Bucket: sel("acme", "/hot", "GET", "", ""), Reason: strings.Repeat("x", 1025)})
	wantCode(t, "long reason", err, codes.InvalidArgument, "reason: longer than 1024 bytes")
	// A regional bucket above its slice's capacity (18 tokens in eu-west, 30 in all).
	_, err = st.admin.SetBucket(ctx, &adminv1.SetBucketRequest{Bucket: sel("acme", "/search", "GET", "eu-west", ""), LevelMicro: int64(20 * tok)})
	wantCode(t, "regional level", err, codes.InvalidArgument, "capacity of 18 tokens (limit 180/1m burst 18)")
	if mem.Len() != 0 {
		t.Errorf("rejected calls wrote %d keys", mem.Len())
	}
	if n := len(st.audit.records(t)); n != 3*12+2 {
		t.Errorf("%d audit records, want one per call (38)", n)
	}
}

// TestAdminAuthorization: only a certificate that carries an admin identity gets in; an agent's
// certificate, a plaintext client and a coordinator without admins are refused, and nothing
// changes.
func TestAdminAuthorization(t *testing.T) {
	mem := memstore.New()
	ov := memstore.NewOverrides()
	stores := adminStores{"memory", mem, ov, nil}
	sel := &adminv1.BucketSelector{Tenant: "acme", Route: "/hot", Operation: "GET"}
	type result struct {
		method string
		err    error
	}
	calls := func(c adminv1.AdminServiceClient) []result {
		ctx := ctxFor(t, 30*time.Second)
		var out []result
		do := func(m string) func(any, error) { return func(_ any, err error) { out = append(out, result{m, err}) } }
		do("InspectBucket")(c.InspectBucket(ctx, &adminv1.InspectBucketRequest{Bucket: sel}))
		do("SetBucket")(c.SetBucket(ctx, &adminv1.SetBucketRequest{Bucket: sel, LevelMicro: 0}))
		do("ResetBucket")(c.ResetBucket(ctx, &adminv1.ResetBucketRequest{Bucket: sel}))
		do("ListOverrides")(c.ListOverrides(ctx, &adminv1.ListOverridesRequest{}))
		do("SetOverride")(c.SetOverride(ctx, &adminv1.SetOverrideRequest{Rule: "hot", Tenant: "acme", Spec: "{limit: 1/1s}"}))
		do("DeleteOverride")(c.DeleteOverride(ctx, &adminv1.DeleteOverrideRequest{Rule: "hot", Tenant: "acme"}))
		return out
	}
	denied := func(name string, c adminv1.AdminServiceClient, msg string) {
		t.Helper()
		for _, r := range calls(c) {
			wantCode(t, name+" "+r.method, r.err, codes.PermissionDenied, msg)
		}
	}

	st := newAdminStack(t, stores, []coordinator.Identity{adminURI, {Kind: "cn", Value: "ops-alice"}}, coordinator.OverridesBounds{})
	denied("agent certificate", adminv1.NewAdminServiceClient(st.conn(t, st.pki.ClientCert, st.pki.ClientKey)),
		"certificate cn:agent carries no admin identity")
	recs := st.audit.records(t)
	if len(recs) != 6 {
		t.Fatalf("%d audit records for 6 refused calls", len(recs))
	}
	for _, r := range recs {
		if r["code"] != "PermissionDenied" || r["identity"] != "cn:agent" || r["peer"] == "" {
			t.Errorf("audit record of a refused call: %v", r)
		}
	}
	// The agent's certificate still works for what agents do.
	if _, err := st.agentOv.GetOverrides(ctxFor(t, 10*time.Second), &coordinatorv1.GetOverridesRequest{}); err != nil {
		t.Errorf("GetOverrides with an agent's certificate: %v", err)
	}
	if stamp, entries, _ := ov.LoadOverrides(ctxFor(t, time.Second)); mem.Len() != 0 || stamp != "" || len(entries) != 0 {
		t.Fatalf("refused calls changed the store: %d keys, overrides %q %v", mem.Len(), stamp, entries)
	}

	// The admin's certificate gets in by its URI, and would by its common name if that were listed.
	for _, r := range calls(st.admin) {
		if r.err != nil {
			t.Errorf("admin %s: %v", r.method, r.err)
		}
	}
	cn := newAdminStack(t, adminStores{"memory", memstore.New(), memstore.NewOverrides(), nil},
		[]coordinator.Identity{{Kind: "cn", Value: "admin"}}, coordinator.OverridesBounds{})
	if _, err := cn.admin.InspectBucket(ctxFor(t, 10*time.Second), &adminv1.InspectBucketRequest{Bucket: sel}); err != nil {
		t.Errorf("admin listed by its common name: %v", err)
	}
	// A kind must match: a DNS name equal to an admin's common name is not that admin.
	dns := newAdminStack(t, adminStores{"memory", memstore.New(), memstore.NewOverrides(), nil},
		[]coordinator.Identity{{Kind: "dns", Value: "admin"}}, coordinator.OverridesBounds{})
	denied("admin certificate, admins listed by another kind", dns.admin, "certificate cn:admin,uri:"+tlsconfig.AdminURI+" carries no admin identity")

	off := newAdminStack(t, adminStores{"memory", memstore.New(), memstore.NewOverrides(), nil}, nil, coordinator.OverridesBounds{})
	denied("no admins listed", off.admin, "the admin API is off on this coordinator")

	// Without TLS there is no certificate to authorise.
	plainSvc := coordinator.NewService(memstore.New(), mustPolicy(t, "v1"))
	plainPol := coordinator.NewPolicies(plainSvc, mustPolicy(t, "v1"), memstore.NewOverrides(), nil, time.Second)
	audit := &auditLog{}
	plain := startReplica(t, plainSvc, coordinator.ServerOptions{Admin: coordinator.NewAdminService(coordinator.AdminConfig{
		Store: memstore.New(), Overrides: memstore.NewOverrides(), Policies: plainPol, Admins: []coordinator.Identity{adminURI}, Audit: audit.logger()})})
	denied("plaintext", adminv1.NewAdminServiceClient(plain.conn), "needs a client certificate")
	if n := len(audit.records(t)); n != 6 {
		t.Errorf("%d audit records for 6 refused plaintext calls", n)
	}
}

// TestAdminOverrides: runtime overrides through the admin API change the coordinator's policy
// version and limits at once, are served to agents, and bad ones change nothing.
func TestAdminOverrides(t *testing.T) {
	var now atomic.Int64
	now.Store(1_700_000_000_000)
	clock := func() bucket.Millis { return bucket.Millis(now.Load()) }
	for _, b := range adminBackends(t, clock) {
		t.Run(b.name, func(t *testing.T) {
			st := newAdminStack(t, b, []coordinator.Identity{adminURI}, coordinator.OverridesBounds{Count: 2, Bytes: 1000})
			ctx := ctxFor(t, 30*time.Second)
			tenant := "acme-" + b.name
			list := func() *adminv1.ListOverridesResponse {
				t.Helper()
				l, err := st.admin.ListOverrides(ctx, &adminv1.ListOverridesRequest{})
				if err != nil {
					t.Fatalf("ListOverrides: %v", err)
				}
				return l
			}
			if l := list(); l.Count != 0 || l.Digest != "" || l.PolicyVersion != "v1" || l.MaxCount != 2 || l.MaxBytes != 1000 {
				t.Fatalf("no overrides: %v", l)
			}

			// Bad overrides: clear errors, nothing written.
			for _, c := range []struct {
				req  *adminv1.SetOverrideRequest
				code codes.Code
				msg  string
			}{
				{&adminv1.SetOverrideRequest{Rule: "cold", Tenant: tenant, Spec: "{limit: 1/1s}"}, codes.NotFound, `unknown rule "cold" in policy version v1 (rules: big, default, hot, monthly, search, slow)`},
				{&adminv1.SetOverrideRequest{Rule: "hot", Tenant: tenant, Spec: "{limit: 10/fortnight}"}, codes.InvalidArgument, `invalid override: limit: "10/fortnight"`},
				{&adminv1.SetOverrideRequest{Rule: "hot", Tenant: tenant, Spec: "{limit: 10/1s, brust: 5}"}, codes.InvalidArgument, `brust: unknown field (did you mean "burst"?)`},
				{&adminv1.SetOverrideRequest{Rule: "search", Tenant: tenant, Spec: "{limit: 10/1s}"}, codes.InvalidArgument, `regions: required`},
				{&adminv1.SetOverrideRequest{Rule: "hot", Tenant: "", Spec: "{limit: 10/1s}"}, codes.InvalidArgument, "tenant: required"},
				{&adminv1.SetOverrideRequest{Rule: "", Tenant: tenant, Spec: "{limit: 10/1s}"}, codes.InvalidArgument, "rule: required"},
				{&adminv1.SetOverrideRequest{Rule: "hot", Tenant: "a\nb", Spec: "{limit: 10/1s}"}, codes.InvalidArgument, "control character"},
			} {
				_, err := st.admin.SetOverride(ctx, c.req)
				wantCode(t, "SetOverride "+c.req.Spec, err, c.code, c.msg)
			}
			_, err := st.admin.DeleteOverride(ctx, &adminv1.DeleteOverrideRequest{Rule: "hot", Tenant: tenant})
			wantCode(t, "DeleteOverride of none", err, codes.NotFound, `no runtime override of rule "hot" for tenant "`+tenant+`"`)
			if stamp, entries, err := st.overrides.LoadOverrides(ctx); stamp != "" || len(entries) != 0 || err != nil {
				t.Fatalf("rejected calls wrote overrides: %q %v %v", stamp, entries, err)
			}

			set, err := st.admin.SetOverride(ctx, &adminv1.SetOverrideRequest{Rule: "hot", Tenant: tenant, Spec: "limit: 400/second, burst: 100", Reason: "launch"})
			if err != nil {
				t.Fatalf("SetOverride: %v", err)
			}
			v2 := st.policies.Current().Version()
			if !strings.HasPrefix(set.PolicyVersion, "v1+o") || set.PolicyVersion != v2 || set.PreviousSpec != "" ||
				!proto.Equal(set.Override, &adminv1.Override{Rule: "hot", Tenant: tenant, Spec: "{limit: 400/1s, burst: 100}", Applied: true}) {
				t.Fatalf("SetOverride: %v (policy %s)", set, v2)
			}
			bk, err := st.admin.InspectBucket(ctx, &adminv1.InspectBucketRequest{Bucket: &adminv1.BucketSelector{Tenant: tenant, Route: "/hot", Operation: "read"}})
			if err != nil || bk.Bucket.Limit != "400/1s burst 100" || bk.Bucket.LimitSource != adminv1.LimitSource_LIMIT_SOURCE_RUNTIME_OVERRIDE ||
				bk.Bucket.CapacityMicro != int64(100*tok) || bk.Bucket.PolicyVersion != v2 {
				t.Fatalf("bucket under the override: %v, %v", bk, err)
			}

			// Agents get the snapshot, and then only "unchanged".
			got, err := st.agentOv.GetOverrides(ctx, &coordinatorv1.GetOverridesRequest{})
			if err != nil || len(got.Overrides) != 1 || got.Overrides[0].Spec != "{limit: 400/1s, burst: 100}" || got.Digest == "" ||
				!strings.HasSuffix(v2, got.Digest[:policy.FingerprintLen]) {
				t.Fatalf("GetOverrides: %v, %v", got, err)
			}
			again, err := st.agentOv.GetOverrides(ctx, &coordinatorv1.GetOverridesRequest{KnownDigest: got.Digest})
			if err != nil || !again.Unchanged || len(again.Overrides) != 0 {
				t.Fatalf("GetOverrides with the digest held: %v, %v", again, err)
			}
			// An agent that has the new version is served with the override's limit; one still on
			// the file's version keeps working with the old one.
			for seq, version := range []string{v2, "v1"} {
				resp, err := st.agent.Acquire(ctx, acquire("agent-1", uint64(seq+1), version, item(ref("hot", tenant), 60*tok, 60*tok)))
				if err != nil {
					t.Fatalf("Acquire under %s: %v", version, err)
				}
				if want := map[string]coordinatorv1.Status{v2: coordinatorv1.Status_STATUS_OK, "v1": coordinatorv1.Status_STATUS_DENIED}[version]; resp.Results[0].Status != want {
					t.Errorf("60 tokens under %s: %v, want %v (capacity 100 with the override, 50 without)", version, resp.Results[0], want)
				}
			}

			// The same spec again changes nothing; another replaces it; the bounds hold.
			same, err := st.admin.SetOverride(ctx, &adminv1.SetOverrideRequest{Rule: "hot", Tenant: tenant, Spec: "{limit: 400/1s, burst: 100}"})
			if err != nil || same.PolicyVersion != v2 || same.PreviousSpec != "{limit: 400/1s, burst: 100}" {
				t.Fatalf("SetOverride of the spec held: %v, %v", same, err)
			}
			if _, err := st.admin.SetOverride(ctx, &adminv1.SetOverrideRequest{Rule: "default", Tenant: tenant, Spec: "{limit: 1/1s}"}); err != nil {
				t.Fatal(err)
			}
			_, err = st.admin.SetOverride(ctx, &adminv1.SetOverrideRequest{Rule: "slow", Tenant: tenant, Spec: "{limit: 1/1s}"})
			wantCode(t, "third override with room for two", err, codes.ResourceExhausted, "at most 2 overrides and 1000 bytes")
			if l := list(); l.Count != 2 || len(l.Overrides) != 2 || !l.Overrides[0].Applied || l.Overrides[0].Rule != "default" {
				t.Fatalf("overrides: %v", l)
			}
			if l, _ := st.admin.ListOverrides(ctx, &adminv1.ListOverridesRequest{Rule: "hot"}); len(l.Overrides) != 1 || l.Count != 2 {
				t.Errorf("ListOverrides of rule hot: %v", l)
			}

			// Deleting both gives the file's version back.
			for _, rule := range []string{"hot", "default"} {
				del, err := st.admin.DeleteOverride(ctx, &adminv1.DeleteOverrideRequest{Rule: rule, Tenant: tenant})
				if err != nil || del.PreviousSpec == "" {
					t.Fatalf("DeleteOverride %s: %v, %v", rule, del, err)
				}
				if rule == "default" && del.PolicyVersion != "v1" {
					t.Errorf("version after the last delete: %s, want v1", del.PolicyVersion)
				}
			}
			methods := map[string]int{}
			for _, r := range st.audit.records(t) {
				methods[r["method"].(string)]++
				if r["method"] == "SetOverride" && r["reason"] == "launch" && r["spec"] != "{limit: 400/1s, burst: 100}" {
					t.Errorf("SetOverride audit record %v", r)
				}
			}
			if methods["SetOverride"] != 7+4 || methods["DeleteOverride"] != 3 || methods["ListOverrides"] != 3 {
				t.Errorf("audited calls by method: %v", methods)
			}
		})
	}
}

// TestPoliciesAcrossCoordinators: a change written through one coordinator reaches another by
// its poll, and at once when an agent that learnt the new version calls it; a file reload keeps
// the overrides.
func TestPoliciesAcrossCoordinators(t *testing.T) {
	srv := redistest.Start(t)
	newCoord := func() (*coordinator.Service, *coordinator.Policies, *redisstore.Store) {
		c := redis.NewClient(srv.Options())
		t.Cleanup(func() { _ = c.Close() })
		rs := redisstore.New(c)
		var pol *coordinator.Policies
		svc := coordinator.NewService(rs, mustPolicy(t, "v1"), coordinator.WithUnknownVersion(func(v string) bool { return pol.Miss(v) }))
		pol = coordinator.NewPolicies(svc, mustPolicy(t, "v1"), rs, zaptest.NewLogger(t), time.Second)
		return svc, pol, rs
	}
	svcA, polA, rsA := newCoord()
	svcB, polB, _ := newCoord()
	ctx := ctxFor(t, 30*time.Second)
	o, err := polA.Current().CheckOverride("hot", "acme", "{limit: 400/1s, burst: 100}")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rsA.PutOverride(ctx, o, coordinator.DefaultOverridesBounds); err != nil {
		t.Fatal(err)
	}
	if err := polA.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	v2 := svcA.Policy().Version()
	if v2 == "v1" || svcB.Policy().Version() != "v1" {
		t.Fatalf("versions %s, %s", v2, svcB.Policy().Version())
	}
	// B has not polled; an agent with A's version gets an answer from B all the same.
	resp, err := svcB.Acquire(ctx, acquire("agent-1", 1, v2, item(ref("hot", "acme"), 60*tok, 60*tok)))
	if err != nil || resp.Results[0].Status != coordinatorv1.Status_STATUS_OK || svcB.Policy().Version() != v2 {
		t.Fatalf("B with A's version: %v, %v (B at %s)", resp, err, svcB.Policy().Version())
	}
	// A version of another policy file does not make B read anything, and stays unknown.
	_, err = svcB.Acquire(ctx, acquire("agent-1", 2, "v9+o0123456789", item(ref("hot", "acme"), tok, tok)))
	if coordinatorv1.Reason(err) != coordinatorv1.ReasonUnknownPolicyVersion {
		t.Errorf("unknown file version: %v", err)
	}

	// A change polled: B runs its poll loop.
	runCtx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); polB.Run(runCtx, 20*time.Millisecond) }()
	t.Cleanup(func() { stop(); <-done })
	if _, err := rsA.DeleteOverride(ctx, "hot", "acme"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for svcB.Policy().Version() != "v1" {
		if time.Now().After(deadline) {
			t.Fatalf("B still at %s after the delete", svcB.Policy().Version())
		}
		time.Sleep(10 * time.Millisecond)
	}

	// A reload of the file keeps the overrides: the version is the new file's plus the same digest.
	if _, err := rsA.PutOverride(ctx, o, coordinator.DefaultOverridesBounds); err != nil {
		t.Fatal(err)
	}
	if err := polA.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	polA.SetFile(mustPolicy(t, "v2"))
	if got, want := svcA.Policy().Version(), "v2"+strings.TrimPrefix(v2, "v1"); got != want {
		t.Errorf("after a file reload: %s, want %s", got, want)
	}
}
