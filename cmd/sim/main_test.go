package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const scenario = `
name: tiny
duration: 20s
agents: 3
policy: |
  version: "1"
  rules:
    - {name: api, routes: ["/api/*"], operations: [read], limit: 600/minute, burst: 100}
  default: {limit: 60/minute, burst: 10}
identities:
  - {name: a, tenants: 5, path: /api/x, operation: GET}
traffic:
  - {identities: a, rate: 200/s}
sweep: {parameter: load, values: [0.5, 1]}
`

func write(t *testing.T, name, data string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestRunWritesReport(t *testing.T) {
	out := t.TempDir()
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), []string{"-out", out, "-seed", "9", write(t, "tiny.yaml", scenario)}, &stdout, &stderr)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, stderr.String())
	}
	for _, f := range []string{"report.md", "tiny/timeline.csv", "tiny/timeline.svg", "tiny/identities.csv",
		"tiny/keys.csv", "tiny/sweep.csv", "tiny/sweep-loss.svg", "tiny/sweep-load.svg"} {
		if _, err := os.Stat(filepath.Join(out, f)); err != nil {
			t.Errorf("missing %s: %v", f, err)
		}
	}
	md, _ := os.ReadFile(filepath.Join(out, "report.md"))
	if !strings.Contains(string(md), "seed 9") || !strings.Contains(string(md), "![decisions per second](tiny/timeline.svg)") {
		t.Errorf("report.md lacks the seed or the plot:\n%s", md)
	}
	if !strings.Contains(stdout.String(), "tiny") || !strings.Contains(stdout.String(), "bounds held") {
		t.Errorf("summary: %q", stdout.String())
	}
	if strings.Contains(stderr.String(), "simulated s") {
		t.Errorf("a progress bar on a non-terminal without -progress: %q", stderr.String())
	}
}

func TestRunFailsOnBrokenBound(t *testing.T) {
	broken := strings.Replace(scenario, "rate: 200/s", "rate: 2000/s", 1) + "faults: {overgrant_factor: 3}\n"
	out := t.TempDir()
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), []string{"-out", out, "-no-sweep", write(t, "broken.yaml", broken)}, &stdout, &stderr)
	if err == nil || !strings.Contains(err.Error(), "bound broke") {
		t.Fatalf("run = %v, want a broken bound", err)
	}
	md, _ := os.ReadFile(filepath.Join(out, "report.md"))
	if !strings.Contains(string(md), "FAILED") {
		t.Error("the report does not say the run failed")
	}
}

func TestUsage(t *testing.T) {
	var stdout, stderr bytes.Buffer
	var u usageError
	if err := run(context.Background(), nil, &stdout, &stderr); !errors.As(err, &u) {
		t.Errorf("no scenario: %v, want a usage error", err)
	}
	if err := run(context.Background(), []string{"-bogus", "x.yaml"}, &stdout, &stderr); !errors.As(err, &u) {
		t.Errorf("unknown flag: %v, want a usage error", err)
	}
	if err := run(context.Background(), []string{"-out", t.TempDir(), "missing.yaml"}, &stdout, &stderr); err == nil || errors.As(err, &u) {
		t.Errorf("missing file: %v", err)
	}
}

func TestCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var stdout, stderr bytes.Buffer
	err := run(ctx, []string{"-out", t.TempDir(), write(t, "tiny.yaml", scenario)}, &stdout, &stderr)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("run = %v, want context.Canceled", err)
	}
}

func TestHelp(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if err := run(context.Background(), []string{"--help"}, &stdout, &stderr); err != nil {
		t.Fatalf("--help: %v", err)
	}
	for _, want := range []string{"Usage: sim [flags] SCENARIO.yaml...\n", "\n  --out directory  (default out/sim)\n", "\n  --seed seed\n", "\n  --redis-ops rate\n"} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("--help lacks %q:\n%s", want, stderr.String())
		}
	}
}
