package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const example = "../../examples/policy.yaml"

func runCmd(args ...string) (code int, stdout, stderr string) {
	var out, errb bytes.Buffer
	code = run(args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestCheck(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("version: v1\ndefault: {limit: 10/minute}\nrules:\n  - name: r\n    routes: [/a]\n    operations: [read]\n    limit: 0/s\n    brust: 3\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	code, out, errs := runCmd("check", example)
	if code != 0 || !strings.HasPrefix(out, example+": ok: version 2026-12-01.1, 6 rules, ") || errs != "" {
		t.Errorf("check example = %d, %q, %q; want 0 and an ok line", code, out, errs)
	}

	code, out, errs = runCmd("check", example, bad, filepath.Join(dir, "missing.yaml"))
	if code != 1 {
		t.Errorf("check with an invalid file exits %d, want 1", code)
	}
	if !strings.Contains(out, example+": ok") {
		t.Errorf("the valid file is not reported ok: %q", out)
	}
	for _, want := range []string{
		bad + `:7: rules[0].limit: "0/s": the limit must allow at least 1 request per period`,
		bad + `:8: rules[0].brust: unknown field (did you mean "burst"?)`,
		"missing.yaml: no such file or directory",
	} {
		if !strings.Contains(errs, want) {
			t.Errorf("check stderr lacks %q:\n%s", want, errs)
		}
	}

	if code, _, errs := runCmd("check"); code != 2 || !strings.Contains(errs, "Usage: lbpolicy check FILE...") {
		t.Errorf("check without files = %d, %q; want 2 and usage", code, errs)
	}
}

func TestExplain(t *testing.T) {
	for _, tc := range []struct {
		args  []string
		lines []string
	}{
		{[]string{"explain", "--policy", example, "tenant=acme route=/orders/7 op=read"}, []string{
			"rule:        orders-read (line 26)",
			"limit:       100 per 1m, burst 20 (rule; global)",
			"on failure:  deny: 503 with Retry-After 2s",
			"key:         lb1:acme|/orders/%7B%7D|read|",
		}},
		{[]string{"explain", "--policy", example, "tenant=acme", "route=/orders/7", "method=POST"}, []string{
			"rule:        orders-write (line 56)",
			"operation:   POST (HTTP method of class write)",
			"on failure:  deny: 503 with Retry-After 1s",
		}},
		{[]string{"explain", "--policy", example, "tenant=acme path=/products/9 operation=GET"}, []string{
			"rule:        catalog-read (line 70)",
			"on failure:  emergency: local bucket 5 per 1m, burst 3 per agent; responses marked degraded",
		}},
		{[]string{"explain", "--policy", example, "--region", "us-east", "tenant=acme route=/search op=read"}, []string{
			"limit:       120 per 1m, burst 12 (rule; regional, slice of region us-east)",
			"key:         lb1:acme|/search|read|",
		}},
		{[]string{"explain", "--policy", example, "tenant=acme route=/search op=read region=eu-west"}, []string{
			"limit:       180 per 1m, burst 18 (rule; regional, slice of region eu-west)",
		}},
	} {
		code, out, errs := runCmd(tc.args...)
		if code != 0 || errs != "" {
			t.Errorf("%q = %d, stderr %q", tc.args, code, errs)
		}
		for _, line := range tc.lines {
			if !strings.Contains(out, line) {
				t.Errorf("%q output lacks %q:\n%s", tc.args, line, out)
			}
		}
	}
}

func TestExplainErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"explain", "tenant=acme route=/ op=read"}, 2, "--policy FILE is required"},
		{[]string{"explain", "--policy", example, "tenant=acme route=/"}, 2, "op= (or method=) is required"},
		{[]string{"explain", "--policy", example, "route=/ op=read"}, 2, "tenant= is required"},
		{[]string{"explain", "--policy", example, "tenant=acme op=read"}, 2, "route= is required"},
		{[]string{"explain", "--policy", example, "tenant=acme route=/ op=read colour=red"}, 2, `unknown key "colour"`},
		{[]string{"explain", "--policy", example, "tenant=acme route=/ op=read op=write"}, 2, "op given twice"},
		{[]string{"explain", "--policy", example, "tenant=acme /orders op=read"}, 2, `"/orders" is not key=value`},
		{[]string{"explain", "--policy", example, "tenant=acme route=/a%zz op=read"}, 1, "malformed percent-escape"},
		{[]string{"explain", "--policy", example, "tenant=acme route=/search op=read"}, 1, `unknown region "" for rule "search"`},
		{[]string{"explain", "-policy", "missing.yaml", "tenant=acme route=/ op=read"}, 1, "no such file"},
		{[]string{"explain", "-bogus"}, 2, "flag provided but not defined: -bogus"},
	} {
		code, _, errs := runCmd(tc.args...)
		if code != tc.code || !strings.Contains(errs, tc.want) {
			t.Errorf("%q = %d, %q; want %d and %q", tc.args, code, errs, tc.code, tc.want)
		}
	}
}

func TestUsage(t *testing.T) {
	if code, _, errs := runCmd(); code != 2 || !strings.Contains(errs, "lbpolicy check FILE...") {
		t.Errorf("no command = %d, %q; want 2 and usage", code, errs)
	}
	if code, _, errs := runCmd("frobnicate"); code != 2 || !strings.Contains(errs, `unknown command "frobnicate"`) {
		t.Errorf("unknown command = %d, %q", code, errs)
	}
	for _, h := range []string{"help", "-h", "--help"} {
		code, out, _ := runCmd(h)
		if code != 0 || !strings.HasPrefix(out, "Usage: lbpolicy COMMAND") || !strings.Contains(out, "lbpolicy explain --policy FILE") ||
			!strings.Contains(out, "Exits 1 if any file is invalid") {
			t.Errorf("%s = %d, %q", h, code, out)
		}
	}
}

// TestDocumentedExplain keeps the explain transcript in docs/policy.md true.
func TestDocumentedExplain(t *testing.T) {
	doc, err := os.ReadFile("../../docs/policy.md")
	if err != nil {
		t.Fatal(err)
	}
	const prompt = "$ lbpolicy explain --policy examples/policy.yaml '"
	_, rest, ok := strings.Cut(string(doc), prompt)
	if !ok {
		t.Fatal("docs/policy.md has no explain transcript")
	}
	query, rest, _ := strings.Cut(rest, "'\n")
	want, _, ok := strings.Cut(rest, "```")
	if !ok {
		t.Fatal("the transcript's code block is not closed")
	}
	code, out, errs := runCmd("explain", "--policy", example, query)
	if code != 0 {
		t.Fatalf("explain %q = %d: %s", query, code, errs)
	}
	if out != want {
		t.Errorf("documented output:\n%s\nactual output:\n%s", want, out)
	}
}

func TestExplainHelp(t *testing.T) {
	code, _, errs := runCmd("explain", "--help")
	if code != 0 {
		t.Errorf("explain --help = %d", code)
	}
	for _, want := range []string{"Usage: lbpolicy explain --policy FILE", "\n  --policy file\n", "\n  --region region\n"} {
		if !strings.Contains(errs, want) {
			t.Errorf("explain --help lacks %q:\n%s", want, errs)
		}
	}
}
