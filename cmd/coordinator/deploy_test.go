package main

import (
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/leasebucket/leasebucket/deploy"
)

// checkEnvNames: every LEASEBUCKET_ variable a deployment file sets is one the coordinator reads
// (a misspelt one would be ignored without a word), by its current name; the secrets are read
// apart from the flags.
func checkEnvNames(t *testing.T, where string, names []string) {
	t.Helper()
	known := append(newFlags(func(string) string { return "" }, io.Discard).EnvVars(), envRedisPassword, envRedisSentinelPassword)
	for _, n := range names {
		if strings.HasPrefix(n, "LEASEBUCKET_") && !slices.Contains(known, n) {
			t.Errorf("%s: sets %s, which the coordinator does not read", where, n)
		}
	}
}

func portOf(t *testing.T, addr string) int32 {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("address %q: %v", addr, err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatalf("address %q: %v", addr, err)
	}
	return int32(n)
}

// TestDeployedDeployment runs the coordinator's own flag parsing on the Deployment's arguments
// and environment, and checks the manifest against what they say: Redis for several replicas,
// the ports of the Service, the probes and the metrics, mutual TLS with files in their mounts.
func TestDeployedDeployment(t *testing.T) {
	objs, err := deploy.Kubernetes()
	if err != nil {
		t.Fatal(err)
	}
	var d *appsv1.Deployment
	var svc *corev1.Service
	for _, o := range objs {
		switch x := o.Object.(type) {
		case *appsv1.Deployment:
			d = x
		case *corev1.Service:
			svc = x
		}
	}
	if d == nil || svc == nil || len(d.Spec.Template.Spec.Containers) != 1 {
		t.Fatal("want a Deployment of one coordinator container and its Service")
	}
	c := d.Spec.Template.Spec.Containers[0]
	env := map[string]string{}
	var names []string
	for _, e := range c.Env {
		names = append(names, e.Name)
		env[e.Name] = e.Value
		if e.ValueFrom != nil {
			env[e.Name] = "from-" + e.Name
		}
	}
	checkEnvNames(t, "Deployment", names)
	cfg, err := parseConfig(c.Args, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatalf("the coordinator rejects the Deployment's arguments %q: %v", c.Args, err)
	}
	if len(cfg.deprecated) > 0 {
		t.Errorf("the Deployment uses deprecated names: %v", cfg.deprecated)
	}
	if d.Spec.Replicas != nil && *d.Spec.Replicas > 1 && cfg.store != storeRedis {
		t.Errorf("%d replicas on the %s store: each would hold buckets of its own", *d.Spec.Replicas, cfg.store)
	}
	if cfg.redis.password == "" || cfg.redis.user == "" {
		t.Error("the coordinators reach Redis without an ACL user and password")
	}
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	if ports["grpc"] != portOf(t, cfg.listen) || svc.Spec.Ports[0].Port != portOf(t, cfg.listen) {
		t.Errorf("--listen %s: the container's grpc port and the Service must use it", cfg.listen)
	}
	health := portOf(t, cfg.healthListen)
	if c.ReadinessProbe.GRPC.Port != health || ports["health"] != health {
		t.Errorf("--health-listen %q: the readiness probe and the health port must use it", cfg.healthListen)
	}
	if ports["metrics"] != portOf(t, cfg.metricsListen) || d.Spec.Template.Annotations["prometheus.io/port"] != strconv.Itoa(int(portOf(t, cfg.metricsListen))) {
		t.Errorf("--metrics-listen %q: the metrics port and the scrape annotation must use it", cfg.metricsListen)
	}
	if cfg.tlsCert == "" || cfg.tlsClientCA == "" {
		t.Error("the coordinators serve agents without mutual TLS")
	}
	mounts := map[string]bool{}
	for _, vm := range c.VolumeMounts {
		mounts[vm.MountPath] = true
	}
	for flag, file := range map[string]string{"--policy": cfg.policyFile, "--tls-cert": cfg.tlsCert, "--tls-key": cfg.tlsKey, "--tls-client-ca": cfg.tlsClientCA} {
		if !mounts[filepath.Dir(file)] {
			t.Errorf("%s %s: not in a mounted volume", flag, file)
		}
	}
}

// TestDeployedUnit runs the coordinator's flag parsing on the systemd unit's ExecStart= and the
// example environment file it reads, with the credentials the unit loads in place.
func TestDeployedUnit(t *testing.T) {
	u, err := deploy.ParseUnit("systemd/leasebucket-coordinator.service")
	if err != nil {
		t.Fatal(err)
	}
	env, err := deploy.EnvFile("systemd/coordinator.env")
	if err != nil {
		t.Fatal(err)
	}
	checkEnvNames(t, "coordinator.env", slices.Collect(func(yield func(string) bool) {
		for k := range env {
			if !yield(k) {
				return
			}
		}
	}))
	creds := t.TempDir()
	for _, cred := range u.Get("Service", "LoadCredential") {
		name, _, _ := strings.Cut(cred, ":")
		if err := os.WriteFile(filepath.Join(creds, name), []byte("secret\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	env["CREDENTIALS_DIRECTORY"] = creds
	argv, err := u.ExecStart(func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := parseConfig(argv[1:], func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatalf("the coordinator rejects the unit's command line %q: %v", argv, err)
	}
	if len(cfg.deprecated) > 0 {
		t.Errorf("the unit uses deprecated names: %v", cfg.deprecated)
	}
	if cfg.store != storeRedis || cfg.redis.password != "secret" || cfg.tlsClientCA == "" {
		t.Errorf("the unit's coordinator: store %s, a Redis password %v, mutual TLS %v; want Redis with a password and mutual TLS",
			cfg.store, cfg.redis.password != "", cfg.tlsClientCA != "")
	}
	for _, cred := range u.Get("Service", "LoadCredential") {
		name, _, _ := strings.Cut(cred, ":")
		if !slices.Contains(argv, filepath.Join(creds, name)) {
			t.Errorf("LoadCredential=%s: no flag reads it", cred)
		}
	}
}

// TestDeployMetrics: every coordinator metric the alert rules and the dashboard name is one the
// coordinator registers, as run registers them on a Redis store (here one that does not answer).
func TestDeployMetrics(t *testing.T) {
	var reg atomic.Pointer[prometheus.Registry]
	defer func(f func() *prometheus.Registry) { newRegistry = f }(newRegistry)
	newRegistry = func() *prometheus.Registry {
		r := prometheus.NewRegistry()
		reg.Store(r)
		return r
	}
	file := filepath.Join(t.TempDir(), "policy.yaml")
	writeFile(t, file, policyYAML("v1", "100/second"))
	start(t, nil, "--policy", file, "--redis-addrs", "127.0.0.1:1", "--redis-dial-timeout", "50ms", "--store-timeout", "100ms")
	if err := deploy.CheckExported(deploy.Coordinator, reg.Load()); err != nil {
		t.Error(err)
	}
}
