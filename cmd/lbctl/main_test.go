package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/internal/tlsconfig"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

var bins = proctest.NewBinaries(map[string]string{"coordinator": "../coordinator"})

func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			os.Stderr.WriteString("goroutines left behind: " + err.Error() + "\n")
			code = 1
		}
	}
	bins.Remove()
	os.Exit(code)
}

// result is one run of the command.
type result struct {
	status         int
	stdout, stderr string
}

func lbctl(env map[string]string, args ...string) result {
	var out, errb bytes.Buffer
	status := run(context.Background(), args, func(k string) string { return env[k] }, &out, &errb)
	return result{status, out.String(), errb.String()}
}

func (r result) want(t *testing.T, what string, status int, stdout, stderr string) {
	t.Helper()
	if r.status != status || !strings.Contains(r.stdout, stdout) || !strings.Contains(r.stderr, stderr) {
		t.Errorf("%s: status %d\nstdout:\n%s\nstderr:\n%s\nwant status %d, stdout with %q, stderr with %q",
			what, r.status, r.stdout, r.stderr, status, stdout, stderr)
	}
}

// TestHelp: the usage lists every command and every flag each command defines.
func TestHelp(t *testing.T) {
	r := lbctl(nil, "help")
	if r.status != 0 || r.stdout != usage {
		t.Fatalf("help: %d %q", r.status, r.stderr)
	}
	if r := lbctl(nil); r.status != 2 || r.stderr != usage {
		t.Errorf("no command: %d", r.status)
	}
	for _, cmd := range [][]string{{"inspect"}, {"reset"}, {"set"}, {"overrides", "list"}, {"overrides", "set"}, {"overrides", "delete"}} {
		name := strings.Join(cmd, " ")
		if !strings.Contains(usage, "lbctl "+name+" [flags]") {
			t.Errorf("the usage does not show %q", name)
		}
		r := lbctl(nil, append(cmd, "--help")...)
		if r.status != 0 || !strings.Contains(r.stderr, "usage: lbctl "+name) {
			t.Errorf("%s --help: %d %q", name, r.status, r.stderr)
		}
		// Every flag the command parses is in the usage, with its variable when it has one.
		for _, line := range strings.Split(r.stderr, "\n") {
			line = strings.TrimSpace(line)
			if !strings.HasPrefix(line, "-") {
				continue
			}
			fl := strings.Fields(line)[0]
			if !strings.HasPrefix(fl, "--") {
				fl = "-" + fl
			}
			if !strings.Contains(usage, fl) {
				t.Errorf("%s defines %s, which the usage does not mention", name, fl)
			}
		}
	}
	for _, env := range []string{"LEASEBUCKET_LBCTL_COORDINATOR", "LEASEBUCKET_LBCTL_TLS_CA", "LEASEBUCKET_LBCTL_TLS_CERT",
		"LEASEBUCKET_LBCTL_TLS_KEY", "LEASEBUCKET_LBCTL_TLS_SERVER_NAME", "LEASEBUCKET_LBCTL_TIMEOUT"} {
		if !strings.Contains(usage, env) {
			t.Errorf("the usage does not name %s", env)
		}
	}

}

func TestUsageErrors(t *testing.T) {
	env := map[string]string{"LEASEBUCKET_LBCTL_COORDINATOR": "127.0.0.1:1", "LEASEBUCKET_LBCTL_TLS_CERT": "c.pem", "LEASEBUCKET_LBCTL_TLS_KEY": "k.pem"}
	for _, c := range []struct {
		env  map[string]string
		args []string
		msg  string
	}{
		{env, []string{"frobnicate"}, `unknown command "frobnicate"`},
		{env, []string{"overrides"}, "want list, set or delete"},
		{env, []string{"overrides", "purge"}, `unknown command "purge"`},
		{nil, []string{"inspect", "tenant=a", "route=/", "op=GET"}, "--coordinator is required"},
		{map[string]string{"LEASEBUCKET_LBCTL_COORDINATOR": "x:1"}, []string{"inspect", "tenant=a", "route=/", "op=GET"}, "--tls-cert and --tls-key are required"},
		{env, []string{"inspect", "route=/", "op=GET"}, "tenant= is required"},
		{env, []string{"inspect", "tenant=a", "op=GET"}, "route= is required"},
		{env, []string{"inspect", "tenant=a", "route=/"}, "op= is required"},
		{env, []string{"inspect", "tenant=a", "tenant=b", "route=/", "op=GET"}, "tenant given twice"},
		{env, []string{"inspect", "tenant=a", "route=/", "op=GET", "colour=red"}, `unknown key "colour"`},
		{env, []string{"inspect", "acme"}, `"acme" is not key=value`},
		{env, []string{"set", "tenant=a", "route=/", "op=GET"}, "--level is required"},
		{env, []string{"set", "--level", "1.0000001", "tenant=a", "route=/", "op=GET"}, "at most 6 decimals"},
		{env, []string{"set", "--level", "-1", "tenant=a", "route=/", "op=GET"}, "is not a number of tokens"},
		{env, []string{"inspect", "--nope", "tenant=a", "route=/", "op=GET"}, "flag provided but not defined: -nope"},
		{env, []string{"overrides", "set", "--rule", "r", "--tenant", "t"}, "want the override's spec as one argument"},
		{env, []string{"overrides", "delete", "--rule", "r"}, "--rule and --tenant are required"},
		{env, []string{"overrides", "list", "extra"}, `unexpected arguments ["extra"]`},
		{map[string]string{"LEASEBUCKET_LBCTL_TIMEOUT": "soon"}, []string{"overrides", "list"}, `LEASEBUCKET_LBCTL_TIMEOUT="soon"`},
	} {
		lbctl(c.env, c.args...).want(t, strings.Join(c.args, " "), 2, "", c.msg)
	}
	for in, want := range map[string]int64{"0": 0, "2.5": 2_500_000, "20": 20_000_000, "0.000001": 1, "3.": 3_000_000} {
		if got, err := parseTokens(in); err != nil || got != want {
			t.Errorf("parseTokens(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
}

// stack is a coordinator process on a real Redis, serving mutual TLS with an admin identity.
type stack struct {
	env       map[string]string // lbctl's connection, as the admin
	pki       tlsconfig.Files
	addr      string
	auditFile string
	agent     coordinatorv1.CoordinatorServiceClient
}

func startStack(t *testing.T) *stack {
	t.Helper()
	srv := redistest.Start(t)
	dir := t.TempDir()
	pki, err := tlsconfig.WriteTestPKI(dir)
	if err != nil {
		t.Fatal(err)
	}
	policyFile := filepath.Join("..", "..", "examples", "policy.yaml")
	s := &stack{pki: pki, addr: proctest.FreeAddr(t), auditFile: filepath.Join(dir, "audit.log")}
	proctest.Start(t, bins.Path(t, "coordinator"), "--listen", s.addr, "--metrics-listen", "", "--policy", policyFile,
		"--redis-addrs", srv.Addr(), "--tls-cert", pki.ServerCert, "--tls-key", pki.ServerKey, "--tls-client-ca", pki.CA,
		"--admin-identities", "uri:"+tlsconfig.AdminURI, "--admin-audit-log", s.auditFile, "--overrides-interval", "50ms")
	proctest.WaitTCP(t, s.addr)
	s.env = map[string]string{"LEASEBUCKET_LBCTL_COORDINATOR": s.addr, "LEASEBUCKET_LBCTL_TLS_CA": pki.CA,
		"LEASEBUCKET_LBCTL_TLS_CERT": pki.AdminCert, "LEASEBUCKET_LBCTL_TLS_KEY": pki.AdminKey}
	cfg, err := tlsconfig.Client(pki.CA, pki.ClientCert, pki.ClientKey, "")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(s.addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	s.agent = coordinatorv1.NewCoordinatorServiceClient(conn)
	return s
}

func (s *stack) lbctl(args ...string) result { return lbctl(s.env, args...) }

// acquire takes want tokens of tenant's orders-read bucket as agent-1, under version.
func (s *stack) acquire(t *testing.T, seq uint64, version, tenant string, want int64) *coordinatorv1.AcquireResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := s.agent.Acquire(ctx, &coordinatorv1.AcquireRequest{AgentId: "agent-1", Seq: seq, PolicyVersion: version,
		Items: []*coordinatorv1.AcquireItem{{Bucket: &coordinatorv1.BucketRef{Rule: "orders-read", Route: "/orders/{id}", Operation: "read", Tenant: tenant},
			NeededMicro: want * perToken, MinMicro: perToken}}})
	if err != nil {
		t.Fatalf("Acquire: %v", err)
	}
	return resp.Results[0]
}

// audited returns the audit log's records as "method code".
func (s *stack) audited(t *testing.T) []string {
	t.Helper()
	data, err := os.ReadFile(s.auditFile)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for line := range strings.SplitSeq(strings.TrimSpace(string(data)), "\n") {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("audit line %q: %v", line, err)
		}
		out = append(out, rec["method"].(string)+" "+rec["code"].(string))
	}
	return out
}

// TestBuckets runs inspect, set and reset against a coordinator and Redis.
func TestBuckets(t *testing.T) {
	s := startStack(t)
	key := []string{"tenant=acme", "route=/orders/7", "op=GET"}
	s.lbctl(append([]string{"inspect"}, key...)...).want(t, "inspect unused", 0,
		"level:        20 of 20 tokens: full, no state stored", "")
	r := s.lbctl(append([]string{"inspect"}, key...)...)
	for _, want := range []string{"policy:       version 2026-12-01.1", "bucket:       rule orders-read, route /orders/{id}, operation read, tenant acme",
		"key:          lb1:acme|/orders/%7B%7D|read|", "limit:        100/1m burst 20 (the rule's); capacity 20 tokens, refill 1.66667 tokens/s"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("inspect does not show %q:\n%s", want, r.stdout)
		}
	}

	g := s.acquire(t, 1, "2026-12-01.1", "acme", 5)
	if g.Status != coordinatorv1.Status_STATUS_OK {
		t.Fatalf("Acquire: %v", g)
	}
	s.lbctl(append([]string{"inspect"}, key...)...).want(t, "inspect after a grant", 0,
		"agent-1: granted "+tokens(g.GrantedMicro)+" at ", "")
	s.lbctl(append([]string{"inspect"}, key...)...).want(t, "inspect after a grant", 0, "(seq 1), expires ", "")

	// Above the capacity: refused, nothing changes.
	s.lbctl(append([]string{"set", "--level", "25"}, key...)...).want(t, "set above capacity", 1, "",
		"lbctl: InvalidArgument: level 25 tokens is above the bucket's capacity of 20 tokens (limit 100/1m burst 20): nothing changed")
	s.lbctl(append([]string{"set", "--level", "2.5", "--reason", "ticket 9"}, key...)...).want(t, "set 2.5", 0,
		"after:        2.5 tokens", "")
	if d := s.acquire(t, 2, "2026-12-01.1", "acme", 3); d.Status != coordinatorv1.Status_STATUS_OK || d.GrantedMicro > 2_500_000+perToken {
		t.Errorf("Acquire after set 2.5: %v", d)
	}
	s.lbctl(append([]string{"reset"}, key...)...).want(t, "reset", 0, "after:        20 tokens", "")
	r = s.lbctl(append([]string{"inspect", "--json"}, key...)...)
	var js map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &js); r.status != 0 || err != nil {
		t.Fatalf("inspect --json: %d %v\n%s", r.status, err, r.stdout)
	}
	if b := js["bucket"].(map[string]any); b["rule"] != "orders-read" || b["limitSource"] != "LIMIT_SOURCE_RULE" {
		t.Errorf("inspect --json: %v", b)
	}

	// Selectors the policy cannot resolve, and a guard that does not hold.
	s.lbctl("inspect", "tenant=acme", "route=/orders/7", "op=GET", "rule=nope").want(t, "unknown rule", 1, "",
		`lbctl: NotFound: rule "nope": no such rule in policy version 2026-12-01.1`)
	s.lbctl("reset", "tenant=acme", "route=/orders/7", "op=GET", "rule=orders-write").want(t, "guard", 1, "",
		"lbctl: FailedPrecondition: route /orders/7 with operation GET resolves to orders-read /orders/{id} read, not to rule \"orders-write\": nothing done")
	s.lbctl("inspect", "tenant=acme", "route=/search", "op=GET").want(t, "no region", 1, "",
		`lbctl: InvalidArgument: region "": rule "search" is regional, with slices for eu-west, us-east`)
	s.lbctl("inspect", "tenant=acme", "route=/a/%zz", "op=GET").want(t, "bad path", 1, "", "lbctl: InvalidArgument: route")
	s.lbctl("inspect", "tenant=acme", "route=/search", "op=GET", "region=eu-west").want(t, "regional", 0,
		"limit:        180/1m burst 18 (the rule's)", "")

	// An agent's certificate is refused.
	agentEnv := map[string]string{"LEASEBUCKET_LBCTL_COORDINATOR": s.addr, "LEASEBUCKET_LBCTL_TLS_CA": s.pki.CA,
		"LEASEBUCKET_LBCTL_TLS_CERT": s.pki.ClientCert, "LEASEBUCKET_LBCTL_TLS_KEY": s.pki.ClientKey}
	lbctl(agentEnv, append([]string{"reset"}, key...)...).want(t, "agent certificate", 1, "",
		"lbctl: PermissionDenied: certificate cn:agent carries no admin identity")

	want := []string{"InspectBucket OK", "InspectBucket OK", "InspectBucket OK", "InspectBucket OK", "SetBucket InvalidArgument",
		"SetBucket OK", "ResetBucket OK", "InspectBucket OK", "InspectBucket NotFound", "ResetBucket FailedPrecondition",
		"InspectBucket InvalidArgument", "InspectBucket InvalidArgument", "InspectBucket OK", "ResetBucket PermissionDenied"}
	if got := s.audited(t); strings.Join(got, ", ") != strings.Join(want, ", ") {
		t.Errorf("audited:\n%s\nwant:\n%s", strings.Join(got, ", "), strings.Join(want, ", "))
	}
}

// TestOverrides runs overrides list, set and delete against a coordinator and Redis.
func TestOverrides(t *testing.T) {
	s := startStack(t)
	s.lbctl("overrides", "list").want(t, "empty list", 0,
		"policy version 2026-12-01.1; 0 of at most 20000 runtime overrides, 0 of at most 3145728 bytes", "")

	// Bad overrides change nothing.
	s.lbctl("overrides", "set", "--rule", "orders-read", "--tenant", "bigcorp", "limit: 2000/fortnight").want(t, "bad period", 1, "",
		`lbctl: InvalidArgument: invalid override: limit: "2000/fortnight": period "fortnight" must be`)
	s.lbctl("overrides", "set", "--rule", "orders-export", "--tenant", "bigcorp", "limit: 10/1h, burst: 5").want(t, "burst below cost", 1, "",
		`cost 10 exceeds burst 5 of the override`)
	s.lbctl("overrides", "set", "--rule", "nope", "--tenant", "bigcorp", "limit: 1/1s").want(t, "unknown rule", 1, "",
		`lbctl: NotFound: unknown rule "nope" in policy version 2026-12-01.1`)
	s.lbctl("overrides", "delete", "--rule", "orders-read", "--tenant", "bigcorp").want(t, "delete none", 1, "",
		`lbctl: NotFound: no runtime override of rule "orders-read" for tenant "bigcorp"`)
	s.lbctl("overrides", "list").want(t, "still empty", 0, "0 of at most 20000", "")

	r := s.lbctl("overrides", "set", "--rule", "orders-read", "--tenant", "bigcorp", "--reason", "contract 7", "limit: 2000/minute, burst: 200")
	r.want(t, "set", 0, "override of rule orders-read for tenant bigcorp: {limit: 2000/1m, burst: 200}\nnew\npolicy version 2026-12-01.1+o", "")
	version := strings.Fields(r.stdout[strings.Index(r.stdout, "policy version "):])[2]
	s.lbctl("inspect", "tenant=bigcorp", "route=/orders/7", "op=GET").want(t, "inspect under the override", 0,
		"limit:        2000/1m burst 200 (the tenant's runtime override); capacity 200 tokens", "")
	// The agent that fetched the new version is served with the override; 150 tokens fit only there.
	if g := s.acquire(t, 1, version, "bigcorp", 150); g.Status != coordinatorv1.Status_STATUS_OK {
		t.Errorf("Acquire under %s: %v", version, g)
	}
	s.lbctl("overrides", "set", "--rule", "orders-read", "--tenant", "bigcorp", "{limit: 2000/1m, burst: 200}").want(t, "same again", 0,
		"unchanged\npolicy version "+version, "")
	s.lbctl("overrides", "list").want(t, "list", 0, "orders-read  bigcorp  {limit: 2000/1m, burst: 200}  yes", "")
	r = s.lbctl("overrides", "list", "--json")
	var js map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &js); r.status != 0 || err != nil || js["count"] != "1" || js["policyVersion"] != version {
		t.Errorf("list --json: %d %v %v", r.status, err, js)
	}
	s.lbctl("overrides", "list", "--rule", "orders-write").want(t, "filtered", 0, "1 of at most 20000", "")
	if r := s.lbctl("overrides", "list", "--rule", "orders-write"); strings.Contains(r.stdout, "bigcorp") {
		t.Errorf("list --rule orders-write shows another rule's override:\n%s", r.stdout)
	}
	s.lbctl("overrides", "delete", "--rule", "orders-read", "--tenant", "bigcorp").want(t, "delete", 0,
		"deleted the override of rule orders-read for tenant bigcorp (was {limit: 2000/1m, burst: 200})\npolicy version 2026-12-01.1 on", "")
	s.lbctl("inspect", "tenant=bigcorp", "route=/orders/7", "op=GET").want(t, "inspect after the delete", 0,
		"limit:        1000/1m burst 100 (the tenant's override in the policy file)", "")

	got := strings.Join(s.audited(t), ", ")
	want := "ListOverrides OK, SetOverride InvalidArgument, SetOverride InvalidArgument, SetOverride NotFound, DeleteOverride NotFound, " +
		"ListOverrides OK, SetOverride OK, InspectBucket OK, SetOverride OK, ListOverrides OK, ListOverrides OK, ListOverrides OK, " +
		"ListOverrides OK, DeleteOverride OK, InspectBucket OK"
	if got != want {
		t.Errorf("audited:\n%s\nwant:\n%s", got, want)
	}
}
