package main

import (
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/leasebucket/leasebucket/deploy"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
)

// Memory the agent needs, from the benchmarks (docs/agent.md, docs/reliability.md): the lease
// table's heap per key (BenchmarkMemoryPerKey: 240 bytes, target 256), an idempotency record, and
// the resident set of an agent with a small table under the chaos load.
const (
	bytesPerKey         = 256
	bytesPerIdempotency = 300
	baseResident        = 32 << 20
)

// deployedAgent returns the agent container of the DaemonSet, its pod and the objects beside it.
func deployedAgent(t *testing.T) (*appsv1.DaemonSet, corev1.Container, []deploy.Object) {
	t.Helper()
	objs, err := deploy.Kubernetes()
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		if ds, ok := o.Object.(*appsv1.DaemonSet); ok {
			for _, c := range ds.Spec.Template.Spec.Containers {
				if c.Name == "agent" {
					return ds, c, objs
				}
			}
		}
	}
	t.Fatal("no DaemonSet with an agent container in deploy/kubernetes")
	return nil, corev1.Container{}, nil
}

// containerEnv is the container's environment as the agent sees it: values, and a stand-in for
// values taken from elsewhere.
func containerEnv(c corev1.Container) func(string) string {
	env := map[string]string{}
	for _, e := range c.Env {
		env[e.Name] = e.Value
		if e.ValueFrom != nil {
			env[e.Name] = "from-" + e.Name
		}
	}
	return func(k string) string { return env[k] }
}

// checkEnvNames: every LEASEBUCKET_ variable a deployment file sets is one the agent reads
// (a misspelt one would be ignored without a word), by its current name.
func checkEnvNames(t *testing.T, where string, names []string) {
	t.Helper()
	f := newFlags(&config{}, func(string) string { return "" }, io.Discard)
	known := f.EnvVars()
	for _, n := range names {
		if strings.HasPrefix(n, "LEASEBUCKET_") && !slices.Contains(known, n) {
			t.Errorf("%s: sets %s, which the agent does not read", where, n)
		}
	}
}

func port(t *testing.T, addr string) int32 {
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

// TestDeployedDaemonSet runs the agent's own flag parsing on the DaemonSet's arguments and
// environment, and checks the manifest against what they say: the socket in the hostPath mount,
// a group the pod has, the ports of the probes and of the metrics, the files in their mounts,
// the coordinators' Service, and memory for the lease table.
func TestDeployedDaemonSet(t *testing.T) {
	ds, c, objs := deployedAgent(t)
	cfg, err := parseFlags(c.Args, containerEnv(c), io.Discard)
	if err != nil {
		t.Fatalf("the agent rejects the DaemonSet's arguments %q: %v", c.Args, err)
	}
	if len(cfg.deprecated) > 0 {
		t.Errorf("the DaemonSet uses deprecated names: %v", cfg.deprecated)
	}
	var names []string
	for _, e := range c.Env {
		names = append(names, e.Name)
	}
	checkEnvNames(t, "DaemonSet", names)

	spec := ds.Spec.Template.Spec
	mounts := map[string]corev1.Volume{} // mount path → volume
	for _, vm := range c.VolumeMounts {
		for _, v := range spec.Volumes {
			if v.Name == vm.Name {
				mounts[vm.MountPath] = v
			}
		}
	}
	if v, ok := mounts[filepath.Dir(cfg.socket)]; !ok || v.HostPath == nil {
		t.Errorf("--socket %s: its directory is not a hostPath mount, so gateways' pods cannot reach it", cfg.socket)
	}
	gid, err := strconv.ParseInt(cfg.socketGroup, 10, 64)
	psc := spec.SecurityContext
	if err != nil || psc == nil || !(slices.Contains(psc.SupplementalGroups, gid) || (psc.RunAsGroup != nil && *psc.RunAsGroup == gid)) {
		t.Errorf("--socket-group %q: want a numeric group of the pod (runAsGroup or supplementalGroups) to give the socket", cfg.socketGroup)
	}
	under := func(flag, file, mount string) {
		if v, ok := mounts[mount]; !ok || filepath.Dir(file) != mount {
			t.Errorf("%s %s: not in the mount %s (%+v)", flag, file, mount, v)
		}
	}
	under("--policy", cfg.policyFile, "/etc/leasebucket")
	under("--tls-ca", cfg.tlsCA, "/etc/leasebucket/tls")
	under("--tls-cert", cfg.tlsCert, "/etc/leasebucket/tls")
	under("--tls-key", cfg.tlsKey, "/etc/leasebucket/tls")
	if v := mounts["/etc/leasebucket"]; v.ConfigMap == nil {
		t.Error("/etc/leasebucket is not the policy's ConfigMap")
	}

	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	if cfg.healthListen == "" || c.ReadinessProbe.GRPC.Port != port(t, cfg.healthListen) || c.LivenessProbe.GRPC.Port != port(t, cfg.healthListen) ||
		ports["health"] != port(t, cfg.healthListen) {
		t.Errorf("--health-listen %q: the probes and the health port must use it", cfg.healthListen)
	}
	if ports["metrics"] != port(t, cfg.metricsListen) || ds.Spec.Template.Annotations["prometheus.io/port"] != strconv.Itoa(int(port(t, cfg.metricsListen))) {
		t.Errorf("--metrics-listen %q: the metrics port and the scrape annotation must use it", cfg.metricsListen)
	}

	// The coordinators: the headless Service's DNS name, all its addresses.
	var svc *corev1.Service
	for _, o := range objs {
		if s, ok := o.Object.(*corev1.Service); ok {
			svc = s
		}
	}
	if svc == nil || len(svc.Spec.Ports) != 1 {
		t.Fatal("no coordinator Service with one port")
	}
	want := "dns:///" + svc.Name + "." + svc.Namespace + ".svc.cluster.local:" + strconv.Itoa(int(svc.Spec.Ports[0].Port))
	if cfg.coordinators != want {
		t.Errorf("--coordinators %s, want %s (the coordinators' Service, resolved to every replica)", cfg.coordinators, want)
	}
	if cfg.tlsCA == "" || cfg.tlsCert == "" || cfg.tlsKey == "" {
		t.Error("the DaemonSet talks to the coordinators without mutual TLS")
	}

	// Memory: the lease table and the idempotency records at their bounds, and the rest.
	need := resource.NewQuantity(int64(baseResident+cfg.maxKeys*bytesPerKey+cfg.idempotencyKeys*bytesPerIdempotency), resource.BinarySI)
	if req := c.Resources.Requests[corev1.ResourceMemory]; req.Cmp(*need) < 0 {
		t.Errorf("memory request %s below the %s that --max-keys %d and --idempotency-keys %d take", req.String(), need.String(), cfg.maxKeys, cfg.idempotencyKeys)
	}
}

// TestDeployedUnit runs the agent's flag parsing on the systemd unit's ExecStart= and the example
// environment file it reads, and checks the socket against the unit's runtime directory and groups.
func TestDeployedUnit(t *testing.T) {
	u, err := deploy.ParseUnit("systemd/leasebucket-agent.service")
	if err != nil {
		t.Fatal(err)
	}
	env, err := deploy.EnvFile("systemd/agent.env")
	if err != nil {
		t.Fatal(err)
	}
	unitEnv, err := u.Environment()
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range unitEnv {
		env[k] = v
	}
	env["CREDENTIALS_DIRECTORY"] = "/run/credentials/leasebucket-agent.service"
	argv, err := u.ExecStart(func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := parseFlags(argv[1:], func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatalf("the agent rejects the unit's command line %q: %v", argv, err)
	}
	if len(cfg.deprecated) > 0 {
		t.Errorf("the unit uses deprecated names: %v", cfg.deprecated)
	}
	checkEnvNames(t, "agent.env", slices.Collect(func(yield func(string) bool) {
		for k := range env {
			if !yield(k) {
				return
			}
		}
	}))
	if dir := "/run/" + u.Last("Service", "RuntimeDirectory"); filepath.Dir(cfg.socket) != dir {
		t.Errorf("--socket %s: not in the unit's RuntimeDirectory %s (systemd creates and owns it)", cfg.socket, dir)
	}
	groups := append([]string{u.Last("Service", "Group")}, strings.Fields(strings.Join(u.Get("Service", "SupplementaryGroups"), " "))...)
	if !slices.Contains(groups, cfg.socketGroup) {
		t.Errorf("--socket-group %s: the agent is not a member (groups %q), so it cannot give it the socket", cfg.socketGroup, groups)
	}
	if mode, err := strconv.ParseUint(u.Last("Service", "RuntimeDirectoryMode"), 8, 32); err != nil || mode&0o001 == 0 {
		t.Errorf("RuntimeDirectoryMode=%s: gateways outside the agent's group cannot reach the socket inside", u.Last("Service", "RuntimeDirectoryMode"))
	}
	for _, cred := range u.Get("Service", "LoadCredential") {
		name, _, _ := strings.Cut(cred, ":")
		if !slices.Contains(argv, "/run/credentials/leasebucket-agent.service/"+name) {
			t.Errorf("LoadCredential=%s: no flag reads it", cred)
		}
	}
}

// TestDeployMetrics: every agent metric the alert rules and the dashboard name is one the agent
// registers, as run registers them (audit on, so its metrics are there).
func TestDeployMetrics(t *testing.T) {
	var reg atomic.Pointer[prometheus.Registry]
	defer func(f func() *prometheus.Registry) { newRegistry = f }(newRegistry)
	newRegistry = func() *prometheus.Registry {
		r := prometheus.NewRegistry()
		reg.Store(r)
		return r
	}
	dir, err := os.MkdirTemp("", "lbm")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	env := map[string]string{
		"LEASEBUCKET_AGENT_SOCKET":         filepath.Join(dir, "agent.sock"),
		"LEASEBUCKET_COORDINATORS":         "127.0.0.1:1", // never called: no check is made
		"LEASEBUCKET_POLICY":               filepath.Join("..", "..", "examples", "policy.yaml"),
		"LEASEBUCKET_AGENT_METRICS_LISTEN": "127.0.0.1:0",
		"LEASEBUCKET_AGENT_AUDIT_LOG":      filepath.Join(dir, "audit.log"),
	}
	ctx, cancel := context.WithCancel(context.Background())
	var logs proctest.Buffer
	done := make(chan error, 1)
	go func() { done <- run(ctx, nil, func(k string) string { return env[k] }, &logs) }()
	proctest.WaitFor(t, 30*time.Second, "the agent serving", func() bool { return strings.Contains(logs.String(), "agent serving") })
	err = deploy.CheckExported(deploy.Agent, reg.Load())
	cancel()
	if rerr := <-done; rerr != nil {
		t.Errorf("run: %v\n%s", rerr, logs.String())
	}
	if err != nil {
		t.Error(err)
	}
}
