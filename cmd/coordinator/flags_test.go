package main

import (
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/cli"
)

// TestRenamedNames: the names this release replaced keep working, each reported as deprecated;
// the new names report nothing; both names of one setting are an error.
func TestRenamedNames(t *testing.T) {
	renamedEnv := map[string]string{ // old → new
		"LEASEBUCKET_LISTEN":           "LEASEBUCKET_COORDINATOR_LISTEN",
		"LEASEBUCKET_METRICS_LISTEN":   "LEASEBUCKET_COORDINATOR_METRICS_LISTEN",
		"LEASEBUCKET_STORE":            "LEASEBUCKET_COORDINATOR_STORE",
		"LEASEBUCKET_STORE_TIMEOUT":    "LEASEBUCKET_COORDINATOR_STORE_TIMEOUT",
		"LEASEBUCKET_HEALTH_INTERVAL":  "LEASEBUCKET_COORDINATOR_HEALTH_INTERVAL",
		"LEASEBUCKET_SHUTDOWN_TIMEOUT": "LEASEBUCKET_COORDINATOR_SHUTDOWN_TIMEOUT",
		"LEASEBUCKET_TLS_CERT":         "LEASEBUCKET_COORDINATOR_TLS_CERT",
		"LEASEBUCKET_TLS_KEY":          "LEASEBUCKET_COORDINATOR_TLS_KEY",
		"LEASEBUCKET_TLS_CLIENT_CA":    "LEASEBUCKET_COORDINATOR_TLS_CLIENT_CA",
		"LEASEBUCKET_POLICY_POLL":      "LEASEBUCKET_POLICY_INTERVAL",
	}
	// A value each variable accepts, and how to read it back.
	values := map[string]string{
		"LEASEBUCKET_COORDINATOR_LISTEN": "127.0.0.1:1", "LEASEBUCKET_COORDINATOR_METRICS_LISTEN": "127.0.0.1:2",
		"LEASEBUCKET_COORDINATOR_STORE":         "memory",
		"LEASEBUCKET_COORDINATOR_STORE_TIMEOUT": "123ms", "LEASEBUCKET_COORDINATOR_HEALTH_INTERVAL": "234ms",
		"LEASEBUCKET_COORDINATOR_SHUTDOWN_TIMEOUT": "3s", "LEASEBUCKET_COORDINATOR_TLS_CERT": "c.pem",
		"LEASEBUCKET_COORDINATOR_TLS_KEY": "k.pem", "LEASEBUCKET_COORDINATOR_TLS_CLIENT_CA": "ca.pem",
		"LEASEBUCKET_POLICY_INTERVAL": "345ms",
	}
	read := func(c *config, env string) string {
		return map[string]string{
			"LEASEBUCKET_COORDINATOR_LISTEN": c.listen, "LEASEBUCKET_COORDINATOR_METRICS_LISTEN": c.metricsListen,
			"LEASEBUCKET_COORDINATOR_STORE":         c.store,
			"LEASEBUCKET_COORDINATOR_STORE_TIMEOUT": c.storeTimeout.String(), "LEASEBUCKET_COORDINATOR_HEALTH_INTERVAL": c.healthInterval.String(),
			"LEASEBUCKET_COORDINATOR_SHUTDOWN_TIMEOUT": c.shutdownTimeout.String(), "LEASEBUCKET_COORDINATOR_TLS_CERT": c.tlsCert,
			"LEASEBUCKET_COORDINATOR_TLS_KEY": c.tlsKey, "LEASEBUCKET_COORDINATOR_TLS_CLIENT_CA": c.tlsClientCA,
			"LEASEBUCKET_POLICY_INTERVAL": c.policyInterval.String(),
		}[env]
	}
	// Every variable the flags read is a new name or one of the old names above.
	known := newFlags(func(string) string { return "" }, io.Discard).EnvVars()
	for old, nw := range renamedEnv {
		if !slices.Contains(known, old) || !slices.Contains(known, nw) {
			t.Errorf("the flags do not read %s and %s", old, nw)
		}
	}
	for old, nw := range renamedEnv {
		for _, tc := range []struct {
			name       string
			env        map[string]string
			deprecated []cli.Deprecation
			err        string
		}{
			{name: "new", env: map[string]string{nw: values[nw]}},
			{name: "old", env: map[string]string{old: values[nw]}, deprecated: []cli.Deprecation{{Old: old, New: nw}}},
			{name: "both", env: map[string]string{old: values[nw], nw: values[nw]}, err: old + " and " + nw + " are both set"},
		} {
			t.Run(old+"/"+tc.name, func(t *testing.T) {
				env := map[string]string{"LEASEBUCKET_POLICY": "p.yaml"}
				if strings.Contains(nw, "_TLS_") { // TLS needs all three files: the others by their new names
					for _, v := range []string{"LEASEBUCKET_COORDINATOR_TLS_CERT", "LEASEBUCKET_COORDINATOR_TLS_KEY", "LEASEBUCKET_COORDINATOR_TLS_CLIENT_CA"} {
						if v != nw {
							env[v] = values[v]
						}
					}
				}
				for k, v := range tc.env {
					env[k] = v
				}
				c, err := parseConfig(nil, func(k string) string { return env[k] }, io.Discard)
				if tc.err != "" {
					if err == nil || !strings.Contains(err.Error(), tc.err) {
						t.Fatalf("error %v, want one containing %q", err, tc.err)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				if got := read(c, nw); got != values[nw] {
					t.Errorf("%s = %q, want %q", nw, got, values[nw])
				}
				if !slices.Equal(c.deprecated, tc.deprecated) {
					t.Errorf("deprecated %v, want %v", c.deprecated, tc.deprecated)
				}
			})
		}
	}

	// The old flag.
	c, err := parseConfig([]string{"--policy", "p", "--policy-poll", "50ms"}, func(string) string { return "" }, io.Discard)
	if err != nil || c.policyInterval != 50*time.Millisecond ||
		!slices.Equal(c.deprecated, []cli.Deprecation{{Old: "--policy-poll", New: "--policy-interval"}}) {
		t.Errorf("--policy-poll 50ms: %+v, %v", c, err)
	}
	c, err = parseConfig([]string{"--policy", "p", "--policy-interval", "50ms"}, func(string) string { return "" }, io.Discard)
	if err != nil || c.policyInterval != 50*time.Millisecond || len(c.deprecated) != 0 {
		t.Errorf("--policy-interval 50ms: %+v, %v", c, err)
	}
	if _, err := parseConfig([]string{"--policy", "p", "--policy-poll", "1s", "--policy-interval", "2s"}, func(string) string { return "" }, io.Discard); err == nil ||
		!strings.Contains(err.Error(), "--policy-poll and --policy-interval are one flag") {
		t.Errorf("both flags: %v", err)
	}
}

// TestDeprecationLogged: a coordinator started with old names serves and warns about each in its
// log.
func TestDeprecationLogged(t *testing.T) {
	file := filepath.Join(t.TempDir(), "policy.yaml")
	writeFile(t, file, policyYAML("v1", "100/second"))
	c := start(t, map[string]string{"LEASEBUCKET_STORE_TIMEOUT": "200ms"}, "--policy", file, "--policy-poll", "1s")
	c.dial()
	if _, err := c.acquire("agent-1", 1, "v1", "acme"); err != nil {
		t.Fatalf("Acquire: %v", err)
	}
	var warned []string
	for _, r := range c.logs.Records() {
		if r["level"] == "warn" && r["deprecated"] != nil {
			warned = append(warned, fmt.Sprint(r["deprecated"], " → ", r["use"]))
		}
	}
	want := []string{"LEASEBUCKET_STORE_TIMEOUT → LEASEBUCKET_COORDINATOR_STORE_TIMEOUT", "--policy-poll → --policy-interval"}
	if !slices.Equal(warned, want) {
		t.Errorf("deprecation warnings %q, want %q", warned, want)
	}
}
