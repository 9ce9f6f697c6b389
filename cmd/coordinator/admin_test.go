package main

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/internal/tlsconfig"
	adminv1 "github.com/leasebucket/leasebucket/proto/leasebucket/admin/v1"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

func TestAdminConfig(t *testing.T) {
	mtls := []string{"--policy", "p", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"}
	for _, tc := range []struct {
		name  string
		args  []string
		env   map[string]string
		err   string
		check func(*config) bool
	}{
		{name: "defaults", args: []string{"--policy", "p"}, check: func(c *config) bool {
			return len(c.admins) == 0 && c.adminAuditLog == "stderr" && c.overridesInterval == coordinator.DefaultOverridesPoll
		}},
		{name: "identities", args: append(mtls, "--admin-identities", "cn:ops, URI:spiffe://x/admin ,"), check: func(c *config) bool {
			return len(c.admins) == 2 && c.admins[0] == coordinator.Identity{Kind: "cn", Value: "ops"} &&
				c.admins[1] == coordinator.Identity{Kind: "uri", Value: "spiffe://x/admin"}
		}},
		{name: "identities from the environment", args: mtls, env: map[string]string{"LEASEBUCKET_COORDINATOR_ADMIN_IDENTITIES": "email:ops@example.org"},
			check: func(c *config) bool { return len(c.admins) == 1 && c.admins[0].Kind == "email" }},
		{name: "identity without kind", args: append(mtls, "--admin-identities", "ops"), err: "want kind:value"},
		{name: "identity of unknown kind", args: append(mtls, "--admin-identities", "ip:10.0.0.1"), err: `kind "ip" is not one of cn, dns, uri, email`},
		{name: "admins without mutual TLS", args: []string{"--policy", "p", "--admin-identities", "cn:ops"}, err: "needs mutual TLS (--tls-client-ca)"},
		{name: "empty audit log", args: []string{"--policy", "p", "--admin-audit-log", ""}, err: "--admin-audit-log must not be empty"},
		{name: "zero overrides poll", args: []string{"--policy", "p", "--overrides-interval", "0s"}, err: "--overrides-interval=0s must be positive"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := parseConfig(tc.args, func(k string) string { return tc.env[k] }, io.Discard)
			switch {
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Fatalf("parseConfig(%q) error = %v, want one containing %q", tc.args, err, tc.err)
			case tc.err == "" && err != nil:
				t.Fatalf("parseConfig(%q): %v", tc.args, err)
			case tc.err == "" && !tc.check(c):
				t.Fatalf("parseConfig(%q) = %+v", tc.args, c)
			}
		})
	}
}

// TestRunAdminRedis runs the command on Redis as the least-privileged ACL user of
// docs/coordinator.md, with mutual TLS and an admin identity: the admin changes an override and a
// bucket, an agent's certificate is refused, every call lands in the audit file, and Redis
// refused none of the coordinator's commands.
func TestRunAdminRedis(t *testing.T) {
	srv := redistest.Start(t, redistest.WithUser("admin", "admin-pw"), redistest.WithPassword("root-only"))
	addACLUser(t, "s3cret", srv)
	dir := t.TempDir()
	pki, err := tlsconfig.WriteTestPKI(dir)
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "policy.yaml")
	writeFile(t, file, policyYAML("v1", "100/second"))
	auditFile := filepath.Join(dir, "audit.log")
	c := start(t, map[string]string{envRedisPassword: "s3cret"}, "--policy", file,
		"--redis-addrs", srv.Addr(), "--redis-user", "leasebucket-coordinator",
		"--tls-cert", pki.ServerCert, "--tls-key", pki.ServerKey, "--tls-client-ca", pki.CA,
		"--admin-identities", "uri:"+tlsconfig.AdminURI, "--admin-audit-log", auditFile, "--overrides-interval", "50ms")
	creds := func(cert, key string) grpc.DialOption {
		cfg, err := tlsconfig.Client(pki.CA, cert, key, "")
		if err != nil {
			t.Fatal(err)
		}
		return grpc.WithTransportCredentials(credentials.NewTLS(cfg))
	}
	c.dial(creds(pki.ClientCert, pki.ClientKey))
	c.waitHealth(healthpb.HealthCheckResponse_SERVING)
	adminConn, err := grpc.NewClient(c.grpcAddr, creds(pki.AdminCert, pki.AdminKey))
	if err != nil {
		t.Fatal(err)
	}
	defer adminConn.Close()
	admin := adminv1.NewAdminServiceClient(adminConn)
	ctx := ctxFor(t, 30*time.Second)

	set, err := admin.SetOverride(ctx, &adminv1.SetOverrideRequest{Rule: "orders", Tenant: "bigcorp", Spec: "limit: 1000/second, burst: 500", Reason: "contract 12"})
	if err != nil || !strings.HasPrefix(set.PolicyVersion, "v1+o") {
		t.Fatalf("SetOverride: %v, %v", set, err)
	}
	resp, err := c.acquire("agent-1", 1, set.PolicyVersion, "bigcorp")
	if err != nil || resp.Results[0].Status != coordinatorv1.Status_STATUS_OK {
		t.Fatalf("Acquire under the new version: %v, %v", resp, err)
	}
	sel := &adminv1.BucketSelector{Tenant: "bigcorp", Route: "/orders", Operation: "read"}
	bk, err := admin.SetBucket(ctx, &adminv1.SetBucketRequest{Bucket: sel, LevelMicro: 7 * tok})
	if err != nil || bk.After.State.LevelMicro != 7*tok || bk.After.CapacityMicro != 500*tok ||
		bk.After.LimitSource != adminv1.LimitSource_LIMIT_SOURCE_RUNTIME_OVERRIDE || len(bk.After.State.Agents) != 1 {
		t.Fatalf("SetBucket: %v, %v", bk, err)
	}
	in, err := admin.InspectBucket(ctx, &adminv1.InspectBucketRequest{Bucket: sel})
	if err != nil || in.Bucket.State.StoredMicro != 7*tok || in.Bucket.State.LevelMicro < 7*tok {
		t.Fatalf("InspectBucket: %v, %v", in, err)
	}
	_, err = admin.SetBucket(ctx, &adminv1.SetBucketRequest{Bucket: sel, LevelMicro: 501 * tok})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("level above capacity: %v", err)
	}
	asAgent := adminv1.NewAdminServiceClient(c.conn)
	if _, err := asAgent.ResetBucket(ctx, &adminv1.ResetBucketRequest{Bucket: sel}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("ResetBucket with an agent's certificate: %v", err)
	}
	list, err := admin.ListOverrides(ctx, &adminv1.ListOverridesRequest{})
	if err != nil || list.Count != 1 || !list.Overrides[0].Applied {
		t.Fatalf("ListOverrides: %v, %v", list, err)
	}
	if _, err := admin.DeleteOverride(ctx, &adminv1.DeleteOverrideRequest{Rule: "orders", Tenant: "bigcorp"}); err != nil {
		t.Fatal(err)
	}
	noACLDenials(t, srv)
	if err := c.stop(); err != nil {
		t.Fatal(err)
	}

	data, err := os.ReadFile(auditFile)
	if err != nil {
		t.Fatal(err)
	}
	var methods []string
	for line := range strings.SplitSeq(strings.TrimSpace(string(data)), "\n") {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("audit line %q: %v", line, err)
		}
		if rec["logger"] != "audit" || rec["msg"] != "admin call" {
			t.Errorf("audit record %v", rec)
		}
		methods = append(methods, rec["method"].(string)+" "+rec["code"].(string))
	}
	want := "SetOverride OK,SetBucket OK,InspectBucket OK,SetBucket InvalidArgument,ResetBucket PermissionDenied,ListOverrides OK,DeleteOverride OK"
	if strings.Join(methods, ",") != want {
		t.Errorf("audited %s\nwant    %s", strings.Join(methods, ","), want)
	}
}
