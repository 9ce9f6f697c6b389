package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	adminv1 "github.com/leasebucket/leasebucket/proto/leasebucket/admin/v1"
)

func overridesCommand(ctx context.Context, sub string, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	var synopsis string
	switch sub {
	case "list":
		synopsis = "[flags] [--rule RULE] [--tenant TENANT]"
	case "set":
		synopsis = "[flags] --rule RULE --tenant TENANT [--reason TEXT] SPEC"
	case "delete":
		synopsis = "[flags] --rule RULE --tenant TENANT [--reason TEXT]"
	default:
		fmt.Fprintf(stderr, "lbctl overrides: unknown command %q (want list, set or delete)\n\n%s", sub, usage)
		return errUsage
	}
	f, c := newFlags("overrides "+sub, synopsis, getenv, stderr)
	var rule, tenant, reason string
	f.StringVar(&rule, "rule", "", "the rule's name (\"default\" for the default rule)")
	f.StringVar(&tenant, "tenant", "", "the tenant")
	if sub != "list" {
		f.StringVar(&reason, "reason", "", "why: written to the coordinator's audit log")
	}
	if err := parse(f, c, args, stderr); err != nil {
		return err
	}
	want := 0
	if sub == "set" {
		want = 1
	}
	switch {
	case f.NArg() != want && sub == "set":
		return usageError(f, stderr, "want the override's spec as one argument, such as 'limit: 1000/minute, burst: 100'")
	case f.NArg() != want:
		return usageError(f, stderr, "unexpected arguments %q", f.Args())
	case sub != "list" && (rule == "" || tenant == ""):
		return usageError(f, stderr, "--rule and --tenant are required")
	}
	switch sub {
	case "list":
		return call(ctx, c, stdout, func(ctx context.Context, a adminv1.AdminServiceClient) (*adminv1.ListOverridesResponse, error) {
			return a.ListOverrides(ctx, &adminv1.ListOverridesRequest{Rule: rule, Tenant: tenant})
		}, formatList)
	case "set":
		return call(ctx, c, stdout, func(ctx context.Context, a adminv1.AdminServiceClient) (*adminv1.SetOverrideResponse, error) {
			return a.SetOverride(ctx, &adminv1.SetOverrideRequest{Rule: rule, Tenant: tenant, Spec: f.Arg(0), Reason: reason})
		}, func(r *adminv1.SetOverrideResponse) string {
			o := r.Override
			s := fmt.Sprintf("override of rule %s for tenant %s: %s\n", o.Rule, o.Tenant, o.Spec)
			switch r.PreviousSpec {
			case "":
				s += "new\n"
			case o.Spec:
				s += "unchanged\n"
			default:
				s += "replaces " + r.PreviousSpec + "\n"
			}
			return s + "policy version " + r.PolicyVersion + " on this coordinator; the others and the agents follow within their poll intervals\n"
		})
	}
	return call(ctx, c, stdout, func(ctx context.Context, a adminv1.AdminServiceClient) (*adminv1.DeleteOverrideResponse, error) {
		return a.DeleteOverride(ctx, &adminv1.DeleteOverrideRequest{Rule: rule, Tenant: tenant, Reason: reason})
	}, func(r *adminv1.DeleteOverrideResponse) string {
		return fmt.Sprintf("deleted the override of rule %s for tenant %s (was %s)\npolicy version %s on this coordinator\n",
			rule, tenant, r.PreviousSpec, r.PolicyVersion)
	})
}

func formatList(r *adminv1.ListOverridesResponse) string {
	var s strings.Builder
	fmt.Fprintf(&s, "policy version %s; %d of at most %d runtime overrides, %d of at most %d bytes\n",
		r.PolicyVersion, r.Count, r.MaxCount, r.Bytes, r.MaxBytes)
	if len(r.Overrides) == 0 {
		return s.String()
	}
	w := tabwriter.NewWriter(&s, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "RULE\tTENANT\tSPEC\tAPPLIED")
	for _, o := range r.Overrides {
		applied := "yes"
		if !o.Applied {
			applied = "no: " + o.Problem
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", o.Rule, o.Tenant, o.Spec, applied)
	}
	_ = w.Flush()
	return s.String()
}
