// Command lbctl administers leasebucket through a coordinator's AdminService: it inspects, resets
// and sets a key's global bucket, and lists, sets and deletes runtime tenant overrides. It
// authenticates with a client certificate the coordinator lists in --admin-identities.
//
//	lbctl inspect --coordinator coord:7070 --tls-ca ca.pem --tls-cert me.pem --tls-key me-key.pem tenant=acme route=/orders/7 op=GET
//	lbctl overrides set --rule orders-read --tenant bigcorp 'limit: 1000/minute, burst: 100'
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/leasebucket/leasebucket/internal/cli"
	"github.com/leasebucket/leasebucket/internal/tlsconfig"
	adminv1 "github.com/leasebucket/leasebucket/proto/leasebucket/admin/v1"
)

const usage = `lbctl administers leasebucket through a coordinator's AdminService.

Usage:
  lbctl inspect [flags] tenant=T route=PATH op=OP [region=R] [rule=NAME]
      Show the key's global bucket: its level now, its last refill, its expiry and the last
      grant and return of each agent, with the leases that may still be outstanding.

  lbctl reset [flags] [--reason TEXT] tenant=T route=PATH op=OP [region=R] [rule=NAME]
      Fill the bucket to its capacity.

  lbctl set [flags] --level TOKENS [--reason TEXT] tenant=T route=PATH op=OP [region=R] [rule=NAME]
      Set the bucket's level, between 0 and its capacity (decimals up to a microtoken: 2.5).

      The bucket is named as a request names it and resolved with the coordinator's current
      policy, as "lbpolicy explain" resolves it: tenant=, route= (also path=), op= (also
      operation=, method=), region= for rules with regional scope, and rule= to refuse to act
      unless the route resolves to that rule. Leases agents already hold stay valid until they
      expire.

  lbctl overrides list [flags] [--rule RULE] [--tenant TENANT]
      List the runtime tenant overrides, and whether each applies to the current policy.

  lbctl overrides set [flags] --rule RULE --tenant TENANT [--reason TEXT] SPEC
      Create or replace the runtime override of RULE for TENANT. SPEC has the fields of an
      override in the policy file, as YAML ("limit: 1000/minute, burst: 100"; regions and
      emergency too). It replaces the file's override of the same tenant, if any.

  lbctl overrides delete [flags] --rule RULE --tenant TENANT [--reason TEXT]
      Remove the runtime override of RULE for TENANT.

  lbctl help
      Show this text.

Flags of every command (each with the environment variable in brackets):
  --coordinator HOST:PORT  the coordinator (required) [LEASEBUCKET_LBCTL_COORDINATOR]
  --tls-ca FILE            CA that signed the coordinator's certificate (default: the system's roots) [LEASEBUCKET_LBCTL_TLS_CA]
  --tls-cert FILE          client certificate carrying an admin identity (required) [LEASEBUCKET_LBCTL_TLS_CERT]
  --tls-key FILE           its private key (required) [LEASEBUCKET_LBCTL_TLS_KEY]
  --tls-server-name NAME   name expected in the coordinator's certificate (default: the host) [LEASEBUCKET_LBCTL_TLS_SERVER_NAME]
  --timeout DURATION       bound on the call (default 10s) [LEASEBUCKET_LBCTL_TIMEOUT]
  --json                   print the coordinator's answer as JSON

Every call is written to the coordinator's audit log, refused ones too; --reason is recorded
with a change.

Exit status: 0 success, 1 the coordinator refused or failed the call, 2 usage error.
`

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

// errUsage marks a usage error (exit status 2); its message has been printed.
var errUsage = errors.New("usage")

// run executes one command and returns the exit status.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	var err error
	switch cmd := args[0]; cmd {
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usage)
		return 0
	case "inspect", "reset", "set":
		err = bucketCommand(ctx, cmd, args[1:], getenv, stdout, stderr)
	case "overrides":
		if len(args) < 2 {
			fmt.Fprint(stderr, "lbctl overrides: want list, set or delete\n\n"+usage)
			return 2
		}
		err = overridesCommand(ctx, args[1], args[2:], getenv, stdout, stderr)
	default:
		fmt.Fprintf(stderr, "lbctl: unknown command %q\n\n%s", cmd, usage)
		return 2
	}
	switch {
	case err == nil || errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage):
		return 2
	}
	if st, ok := status.FromError(err); ok {
		fmt.Fprintf(stderr, "lbctl: %s: %s\n", st.Code(), st.Message())
	} else {
		fmt.Fprintln(stderr, "lbctl:", err)
	}
	return 1
}

// conn is what every command's flags say about the coordinator.
type conn struct {
	addr, ca, cert, key, serverName string
	timeout                         time.Duration
	json                            bool
}

// newFlags returns a command's flag set with the connection flags.
func newFlags(name, synopsis string, getenv func(string) string, stderr io.Writer) (*cli.Flags, *conn) {
	c := &conn{}
	f := cli.NewFlags("lbctl "+name, "usage: lbctl "+name+" "+synopsis+"\n\nFlags:\n", getenv, stderr)
	f.EnvString(&c.addr, "coordinator", "LEASEBUCKET_LBCTL_COORDINATOR", "", "the coordinator, host:port (required)")
	f.EnvString(&c.ca, "tls-ca", "LEASEBUCKET_LBCTL_TLS_CA", "", "CA that signed the coordinator's certificate (default: the system's roots)")
	f.EnvString(&c.cert, "tls-cert", "LEASEBUCKET_LBCTL_TLS_CERT", "", "client certificate carrying an admin identity (required)")
	f.EnvString(&c.key, "tls-key", "LEASEBUCKET_LBCTL_TLS_KEY", "", "its private key (required)")
	f.EnvString(&c.serverName, "tls-server-name", "LEASEBUCKET_LBCTL_TLS_SERVER_NAME", "", "name expected in the coordinator's certificate (default: the host)")
	f.EnvDuration(&c.timeout, "timeout", "LEASEBUCKET_LBCTL_TIMEOUT", 10*time.Second, "bound on the call")
	f.BoolVar(&c.json, "json", false, "print the coordinator's answer as JSON")
	return f, c
}

// parse parses args; a usage error is printed and returned as errUsage.
func parse(f *cli.Flags, c *conn, args []string, stderr io.Writer) error {
	if err := f.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		if strings.HasPrefix(err.Error(), "LEASEBUCKET_") {
			fmt.Fprintf(stderr, "%s: %v\n", f.Name(), err) // an environment variable: the flag package printed nothing
		}
		return errUsage
	}
	var problem string
	switch {
	case c.addr == "":
		problem = "--coordinator is required"
	case c.cert == "" || c.key == "":
		problem = "--tls-cert and --tls-key are required: the coordinator recognises admins by their client certificate"
	case c.timeout <= 0:
		problem = "--timeout must be positive"
	}
	if problem != "" {
		return usageError(f, stderr, "%s", problem)
	}
	return nil
}

func usageError(f *cli.Flags, stderr io.Writer, format string, args ...any) error {
	fmt.Fprintf(stderr, "%s: %s\n", f.Name(), fmt.Sprintf(format, args...))
	f.Usage()
	return errUsage
}

// dial connects to the coordinator with mutual TLS.
func (c *conn) dial() (adminv1.AdminServiceClient, func(), error) {
	cfg, err := tlsconfig.Client(c.ca, c.cert, c.key, c.serverName)
	if err != nil {
		return nil, nil, err
	}
	cc, err := grpc.NewClient(c.addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		return nil, nil, fmt.Errorf("coordinator %s: %w", c.addr, err)
	}
	return adminv1.NewAdminServiceClient(cc), func() { _ = cc.Close() }, nil
}

// call dials, runs do within the timeout and prints its answer with text, or as JSON.
func call[R proto.Message](ctx context.Context, c *conn, stdout io.Writer, do func(context.Context, adminv1.AdminServiceClient) (R, error), text func(R) string) error {
	client, closeConn, err := c.dial()
	if err != nil {
		return err
	}
	defer closeConn()
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	resp, err := do(ctx, client)
	if err != nil {
		return err
	}
	if c.json {
		b, err := protojson.MarshalOptions{Multiline: true, EmitUnpopulated: true}.Marshal(resp)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(stdout, string(b))
		return err
	}
	_, err = io.WriteString(stdout, text(resp))
	return err
}

const bucketSynopsis = "[flags] tenant=T route=PATH op=OP [region=R] [rule=NAME]"

func bucketCommand(ctx context.Context, cmd string, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	synopsis := bucketSynopsis
	if cmd == "set" {
		synopsis = "--level TOKENS " + synopsis
	}
	f, c := newFlags(cmd, synopsis, getenv, stderr)
	var reason, level string
	if cmd != "inspect" {
		f.StringVar(&reason, "reason", "", "why: written to the coordinator's audit log")
	}
	if cmd == "set" {
		f.StringVar(&level, "level", "", "the level to set, in tokens (up to 6 decimals; required)")
	}
	if err := parse(f, c, args, stderr); err != nil {
		return err
	}
	sel, err := parseSelector(f.Args())
	if err != nil {
		return usageError(f, stderr, "%v", err)
	}
	switch cmd {
	case "inspect":
		return call(ctx, c, stdout, func(ctx context.Context, a adminv1.AdminServiceClient) (*adminv1.InspectBucketResponse, error) {
			return a.InspectBucket(ctx, &adminv1.InspectBucketRequest{Bucket: sel})
		}, func(r *adminv1.InspectBucketResponse) string { return formatBucket(r.Bucket) })
	case "reset":
		return call(ctx, c, stdout, func(ctx context.Context, a adminv1.AdminServiceClient) (*adminv1.ResetBucketResponse, error) {
			return a.ResetBucket(ctx, &adminv1.ResetBucketRequest{Bucket: sel, Reason: reason})
		}, func(r *adminv1.ResetBucketResponse) string { return formatChange(r.Before, r.After) })
	}
	if level == "" {
		return usageError(f, stderr, "--level is required")
	}
	micro, err := parseTokens(level)
	if err != nil {
		return usageError(f, stderr, "--level: %v", err)
	}
	return call(ctx, c, stdout, func(ctx context.Context, a adminv1.AdminServiceClient) (*adminv1.SetBucketResponse, error) {
		return a.SetBucket(ctx, &adminv1.SetBucketRequest{Bucket: sel, LevelMicro: micro, Reason: reason})
	}, func(r *adminv1.SetBucketResponse) string { return formatChange(r.Before, r.After) })
}

// parseSelector reads the key=value words naming a bucket; each argument is one word, so a
// value may hold spaces ('tenant=Big Corp').
func parseSelector(words []string) (*adminv1.BucketSelector, error) {
	sel := &adminv1.BucketSelector{}
	seen := map[string]bool{}
	for _, w := range words {
		k, v, ok := strings.Cut(w, "=")
		if !ok {
			return nil, fmt.Errorf("%q is not key=value", w)
		}
		var dst *string
		switch k {
		case "tenant":
			dst = &sel.Tenant
		case "route", "path":
			k, dst = "route", &sel.Route
		case "op", "operation", "method":
			k, dst = "op", &sel.Operation
		case "region":
			dst = &sel.Region
		case "rule":
			dst = &sel.Rule
		default:
			return nil, fmt.Errorf("unknown key %q (want tenant, route, op, region or rule)", k)
		}
		if seen[k] {
			return nil, fmt.Errorf("%s given twice", k)
		}
		seen[k] = true
		*dst = v
	}
	switch {
	case sel.Tenant == "":
		return nil, errors.New("tenant= is required")
	case sel.Route == "":
		return nil, errors.New("route= is required")
	case sel.Operation == "":
		return nil, errors.New("op= is required")
	}
	return sel, nil
}

// perToken is microtokens per token (bucket.PerToken).
const perToken = 1_000_000

// parseTokens reads a number of tokens with up to six decimals as microtokens, exactly.
func parseTokens(s string) (int64, error) {
	whole, frac, _ := strings.Cut(s, ".")
	if whole == "" || strings.Trim(whole, "0123456789") != "" || strings.Trim(frac, "0123456789") != "" || len(frac) > 6 {
		return 0, fmt.Errorf("%q is not a number of tokens with at most 6 decimals", s)
	}
	if len(whole) > 10 {
		return 0, fmt.Errorf("%q is too large", s)
	}
	var w, f int64
	for _, c := range whole {
		w = w*10 + int64(c-'0')
	}
	frac += strings.Repeat("0", 6-len(frac))
	for _, c := range frac {
		f = f*10 + int64(c-'0')
	}
	return w*perToken + f, nil
}

// tokens writes microtokens as tokens ("2.5").
func tokens(m int64) string {
	sign := ""
	if m < 0 {
		sign, m = "-", -m
	}
	s := fmt.Sprintf("%d.%06d", m/perToken, m%perToken)
	return sign + strings.TrimSuffix(strings.TrimRight(s, "0"), ".")
}

// at writes a store clock reading (ms since 1970) as UTC time.
func at(ms int64) string {
	return time.UnixMilli(ms).UTC().Format("2006-01-02T15:04:05.000Z")
}

var sources = map[adminv1.LimitSource]string{
	adminv1.LimitSource_LIMIT_SOURCE_RULE:             "the rule's",
	adminv1.LimitSource_LIMIT_SOURCE_FILE_OVERRIDE:    "the tenant's override in the policy file",
	adminv1.LimitSource_LIMIT_SOURCE_RUNTIME_OVERRIDE: "the tenant's runtime override",
}

// formatBucket writes a bucket for a terminal, one fact per line.
func formatBucket(b *adminv1.Bucket) string {
	var s strings.Builder
	line := func(k, format string, args ...any) {
		fmt.Fprintf(&s, "%-13s %s\n", k+":", fmt.Sprintf(format, args...))
	}
	line("policy", "version %s", b.PolicyVersion)
	route := b.Template
	if b.Template == "" {
		route = "(default rule)"
	}
	line("bucket", "rule %s, route %s, operation %s, tenant %s", b.Rule, route, b.OperationEntry, b.Tenant)
	if b.Region != "" {
		line("region", "%s", b.Region)
	}
	line("key", "%s", b.Key)
	perSecond := float64(b.RefillMicro) * 1000 / float64(max(b.RefillPeriodMs, 1)) / perToken
	line("limit", "%s (%s); capacity %s tokens, refill %.6g tokens/s", b.Limit, sources[b.LimitSource], tokens(b.CapacityMicro), perSecond)
	st := b.State
	if st == nil {
		return s.String()
	}
	if !st.Stored {
		line("level", "%s of %s tokens: full, no state stored (unused, or idle past its expiry)", tokens(st.LevelMicro), tokens(b.CapacityMicro))
		line("read at", "%s (store clock)", at(st.NowMs))
		return s.String()
	}
	line("level", "%s of %s tokens at %s (store clock)", tokens(st.LevelMicro), tokens(b.CapacityMicro), at(st.NowMs))
	line("last refill", "%s, leaving %s tokens", at(st.LastRefillMs), tokens(st.StoredMicro))
	if st.ExpiresAtMs > 0 {
		line("expires", "%s, a full bucket again if untouched", at(st.ExpiresAtMs))
	} else {
		line("expires", "never (it does not refill)")
	}
	line("leases", "live for %s each; %s tokens may be outstanding", time.Duration(b.LeaseTtlMs)*time.Millisecond, tokens(st.OutstandingMicro))
	for _, a := range st.Agents {
		var parts []string
		if a.TakeSeq > 0 {
			p := fmt.Sprintf("granted %s at %s (seq %d), expires %s", tokens(a.GrantedMicro), at(a.GrantedAtMs), a.TakeSeq, at(a.LeaseExpiresAtMs))
			if a.Outstanding {
				p += ", may be outstanding"
			}
			parts = append(parts, p)
		}
		if a.ReturnSeq > 0 {
			parts = append(parts, fmt.Sprintf("returned: %s credited at %s (seq %d)", tokens(a.CreditedMicro), at(a.ReturnedAtMs), a.ReturnSeq))
		}
		fmt.Fprintf(&s, "  %s: %s\n", a.AgentId, strings.Join(parts, "; "))
	}
	if len(st.OtherFields) > 0 {
		line("other fields", "%s (left as they are)", strings.Join(st.OtherFields, ", "))
	}
	return s.String()
}

func formatChange(before, after *adminv1.Bucket) string {
	return fmt.Sprintf("%s\nbefore:       %s tokens\nafter:        %s tokens\n", strings.TrimRight(formatBucket(after), "\n"),
		tokens(before.GetState().GetLevelMicro()), tokens(after.GetState().GetLevelMicro()))
}
