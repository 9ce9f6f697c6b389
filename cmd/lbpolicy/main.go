// Command lbpolicy checks leasebucket policy files and explains how a request resolves.
//
//	lbpolicy check FILE...
//	lbpolicy explain --policy FILE 'tenant=acme route=/orders/7 op=read'
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/leasebucket/leasebucket/internal/cli"
	"github.com/leasebucket/leasebucket/policy"
)

const usage = `Usage: lbpolicy COMMAND [flags] ARGS

Checks leasebucket policy files and explains how a request resolves.

Commands:
  lbpolicy check FILE...
      Parse and validate each policy file. Prints one line per valid file and every problem of an
      invalid one as FILE:LINE: FIELD: MESSAGE. Exits 1 if any file is invalid (for CI pipelines).

  lbpolicy explain --policy FILE [--region REGION] 'tenant=T route=PATH op=OP'
      Resolve one request against the policy: the rule that matched and why, the rules it
      replaces, the effective limit (after tenant overrides), the cost, the failure mode and the
      bucket key. The request is key=value words, in one argument or several:
        tenant=T      the authenticated tenant (required)
        route=PATH    the request path, normalized as the agent does (required; also path=)
        op=OP         a class, named operation or HTTP method (also operation=, method=)
        region=R      the agent's region (needed for rules with regional scope)
      Exits 1 if the policy is invalid or the request cannot be resolved.

  lbpolicy help
      Show this text; lbpolicy COMMAND --help shows the flags of a command.

Exit status: 0 success, 1 invalid policy or request, 2 usage error.
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// noEnv: lbpolicy's flags take no defaults from the environment, so that a variable set for the
// agent on the same host does not change what a check reports.
func noEnv(string) string { return "" }

// run executes one command and returns the exit status.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "check":
		return check(args[1:], stdout, stderr)
	case "explain":
		return explain(args[1:], stdout, stderr)
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "lbpolicy: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
}

func check(args []string, stdout, stderr io.Writer) int {
	fs := cli.NewFlags("lbpolicy check", "Usage: lbpolicy check FILE...\n\nParses and validates each policy file.\n", noEnv, stderr)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return 2
	}
	status := 0
	for _, file := range fs.Args() {
		s, err := policy.Load(file)
		if err != nil {
			fmt.Fprintln(stderr, err)
			status = 1
			continue
		}
		fmt.Fprintf(stdout, "%s: ok: version %s, %d rules, %d routes, digest %s\n",
			file, s.Version(), len(s.Rules()), s.NumRoutes(), s.Digest()[:12])
	}
	return status
}

func explain(args []string, stdout, stderr io.Writer) int {
	fs := cli.NewFlags("lbpolicy explain", `Usage: lbpolicy explain --policy FILE [--region REGION] 'tenant=T route=PATH op=OP'

Resolves one request against the policy (see lbpolicy help).

Flags:
`, noEnv, stderr)
	file := fs.String("policy", "", "policy `file` (required)")
	region := fs.String("region", "", "the agent's `region` (for regional rules; region= in the request also works)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *file == "" {
		fmt.Fprintln(stderr, "lbpolicy explain: --policy FILE is required")
		fs.Usage()
		return 2
	}
	req, err := parseRequest(strings.Join(fs.Args(), " "))
	if err != nil {
		fmt.Fprintln(stderr, "lbpolicy explain:", err)
		return 2
	}
	if req.region == "" {
		req.region = *region
	}
	s, err := policy.Load(*file)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	e, err := s.Explain(req.tenant, req.route, req.op, req.region)
	if err != nil {
		fmt.Fprint(stdout, e)
		fmt.Fprintln(stderr, "lbpolicy explain:", err)
		return 1
	}
	fmt.Fprint(stdout, e)
	return 0
}

type request struct {
	tenant, route, op, region string
}

// parseRequest reads "tenant=acme route=/orders/7 op=read" (words in any order).
func parseRequest(s string) (request, error) {
	var r request
	seen := map[string]bool{}
	for _, w := range strings.Fields(s) {
		k, v, ok := strings.Cut(w, "=")
		if !ok {
			return r, fmt.Errorf("%q is not key=value", w)
		}
		var dst *string
		switch k {
		case "tenant":
			dst = &r.tenant
		case "route", "path":
			k, dst = "route", &r.route
		case "op", "operation", "method":
			k, dst = "op", &r.op
		case "region":
			dst = &r.region
		default:
			return r, fmt.Errorf("unknown key %q (want tenant, route, op or method, region)", k)
		}
		if seen[k] {
			return r, fmt.Errorf("%s given twice", k)
		}
		seen[k] = true
		*dst = v
	}
	switch {
	case r.tenant == "":
		return r, errors.New("tenant= is required")
	case r.route == "":
		return r, errors.New("route= is required")
	case r.op == "":
		return r, errors.New("op= (or method=) is required")
	}
	return r, nil
}
