package deploy_test

import (
	"bufio"
	"encoding/json"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/deploy"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/policy"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

var bins = proctest.NewBinaries(map[string]string{
	"leasebucket-agent":       "../cmd/agent",
	"leasebucket-coordinator": "../cmd/coordinator",
})

func TestMain(m *testing.M) {
	code := m.Run()
	bins.Remove()
	os.Exit(code)
}

// tool returns the path of a command the checks need: on PATH, or where
// scripts/ensure-ops-tools.sh puts it. Missing, the test is skipped, or fails under CI=true.
func tool(t *testing.T, name string) string {
	t.Helper()
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	if p, err := filepath.Abs(filepath.Join("..", "out", "tools", "bin", name)); err == nil {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	msg := name + " is not installed: run scripts/ensure-ops-tools.sh (make test does)"
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

// run runs a command in dir and fails the test if it fails or prints anything on stderr.
func run(t *testing.T, dir string, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil || stderr.Len() > 0 {
		t.Fatalf("%s %s: %v\n%s%s", filepath.Base(name), strings.Join(args, " "), err, out, stderr.String())
	}
	return string(out)
}

// manifests holds the decoded Kubernetes objects by kind.
type manifests struct {
	daemonSets  []*appsv1.DaemonSet
	deployments []*appsv1.Deployment
	services    []*corev1.Service
	pdbs        []*policyv1.PodDisruptionBudget
	configMaps  map[string]*corev1.ConfigMap
	namespaces  []*corev1.Namespace
	all         []deploy.Object
}

func loadManifests(t *testing.T) *manifests {
	t.Helper()
	objs, err := deploy.Kubernetes()
	if err != nil {
		t.Fatal(err)
	}
	m := &manifests{configMaps: map[string]*corev1.ConfigMap{}, all: objs}
	for _, o := range objs {
		switch x := o.Object.(type) {
		case *appsv1.DaemonSet:
			m.daemonSets = append(m.daemonSets, x)
		case *appsv1.Deployment:
			m.deployments = append(m.deployments, x)
		case *corev1.Service:
			m.services = append(m.services, x)
		case *policyv1.PodDisruptionBudget:
			m.pdbs = append(m.pdbs, x)
		case *corev1.ConfigMap:
			m.configMaps[x.Name] = x
		case *corev1.Namespace:
			m.namespaces = append(m.namespaces, x)
		default:
			t.Errorf("%s: unexpected %T", o.File, o.Object)
		}
	}
	if len(m.daemonSets) != 1 || len(m.deployments) != 1 || len(m.services) != 1 || len(m.pdbs) != 1 || len(m.namespaces) != 1 {
		t.Fatalf("want one DaemonSet (agents), one Deployment, Service and PodDisruptionBudget (coordinators) and a Namespace; got %d, %d, %d, %d, %d",
			len(m.daemonSets), len(m.deployments), len(m.services), len(m.pdbs), len(m.namespaces))
	}
	return m
}

// TestStrictDecoding: a typo in a manifest is an error, not a silently dropped field.
func TestStrictDecoding(t *testing.T) {
	if _, err := deploy.Kubernetes(); err != nil {
		t.Fatal(err)
	}
	bad := []byte("apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec:\n  selectr: {a: b}\n")
	if _, err := deploy.DecodeKubernetes("bad.yaml", bad); err == nil || !strings.Contains(err.Error(), "selectr") {
		t.Errorf("an unknown field decoded: %v", err)
	}
}

func TestKustomization(t *testing.T) {
	k, err := deploy.ReadKustomization()
	if err != nil {
		t.Fatal(err)
	}
	names, err := deploy.Names("kubernetes")
	if err != nil {
		t.Fatal(err)
	}
	var files []string
	for _, n := range names {
		if b := path.Base(n); b != "kustomization.yaml" {
			files = append(files, b)
		}
	}
	if got := slices.Sorted(slices.Values(k.Resources)); !slices.Equal(got, files) {
		t.Errorf("kustomization resources %q, want every manifest: %q", got, files)
	}
	m := loadManifests(t)
	for _, o := range m.all {
		meta, ok := o.Object.(metav1.Object)
		if !ok {
			continue
		}
		if _, isNS := o.Object.(*corev1.Namespace); isNS {
			if meta.GetName() != k.Namespace {
				t.Errorf("%s: namespace %q, the kustomization's is %q", o.File, meta.GetName(), k.Namespace)
			}
			continue
		}
		if meta.GetNamespace() != k.Namespace {
			t.Errorf("%s: %s in namespace %q, want %q", o.File, meta.GetName(), meta.GetNamespace(), k.Namespace)
		}
	}
	if len(k.Images) != 1 || k.Images[0].Name != "leasebucket" || k.Images[0].NewTag == "" || k.Images[0].NewTag == "latest" {
		t.Errorf("kustomization images %+v: want one entry for leasebucket with a tag", k.Images)
	}
}

// TestPods checks every pod template: probes, resources, non-root security contexts, volumes,
// images and the binaries the image holds.
func TestPods(t *testing.T) {
	m := loadManifests(t)
	image := dockerImage(t)
	templates := map[string]*corev1.PodTemplateSpec{}
	for _, d := range m.daemonSets {
		templates["DaemonSet "+d.Name] = &d.Spec.Template
	}
	for _, d := range m.deployments {
		templates["Deployment "+d.Name] = &d.Spec.Template
	}
	for name, tmpl := range templates {
		t.Run(name, func(t *testing.T) {
			checkPod(t, m, tmpl, image)
		})
	}
}

func checkPod(t *testing.T, m *manifests, tmpl *corev1.PodTemplateSpec, image *dockerfile) {
	spec := &tmpl.Spec
	psc := spec.SecurityContext
	if psc == nil || psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Error("the pod has no RuntimeDefault seccomp profile")
	}
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser == 0 {
		t.Error("the pod does not run as a non-root user")
	}
	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
		if v.ConfigMap != nil && m.configMaps[v.ConfigMap.Name] == nil {
			t.Errorf("volume %s: no ConfigMap %s in the manifests", v.Name, v.ConfigMap.Name)
		}
	}
	all := append(append([]corev1.Container(nil), spec.InitContainers...), spec.Containers...)
	for i, c := range all {
		init := i < len(spec.InitContainers)
		where := "container " + c.Name
		checkImage(t, where, c.Image)
		checkResources(t, where, c)
		sc := c.SecurityContext
		if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
			sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
			sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") {
			t.Errorf("%s: want allowPrivilegeEscalation false, a read-only root filesystem and every capability dropped", where)
		}
		root := sc != nil && sc.RunAsUser != nil && *sc.RunAsUser == 0
		switch {
		case init && root:
			// Only an init step may run as root, to own the hostPath directory, with no
			// capability but those.
			for _, c := range sc.Capabilities.Add {
				if c != "CHOWN" && c != "FOWNER" {
					t.Errorf("%s: runs as root with capability %s", where, c)
				}
			}
		case root || (sc != nil && sc.RunAsNonRoot != nil && !*sc.RunAsNonRoot):
			t.Errorf("%s: runs as root", where)
		case sc != nil && sc.Capabilities != nil && len(sc.Capabilities.Add) > 0:
			t.Errorf("%s: adds capabilities %v", where, sc.Capabilities.Add)
		}
		for _, vm := range c.VolumeMounts {
			v, ok := volumes[vm.Name]
			if !ok {
				t.Errorf("%s: mounts %s, which is no volume of the pod", where, vm.Name)
			}
			if v.ConfigMap != nil && vm.SubPath != "" {
				t.Errorf("%s: mounts ConfigMap %s with subPath: edits would never reach the pod", where, v.ConfigMap.Name)
			}
		}
		if init {
			continue
		}
		// The image is ours, and the command one of its binaries.
		if name, _, _ := strings.Cut(c.Image, ":"); name != "leasebucket" {
			t.Errorf("%s: image %s, want leasebucket:TAG (the kustomization sets the registry)", where, c.Image)
		}
		if len(c.Command) != 1 || !slices.Contains(image.binaries, c.Command[0]) {
			t.Errorf("%s: command %q, want one of the image's binaries %q", where, c.Command, image.binaries)
		}
		checkProbes(t, where, c)
		if lim, ok := c.Resources.Limits[corev1.ResourceMemory]; ok {
			for _, e := range c.Env {
				if e.Name == "GOMEMLIMIT" {
					q, err := resource.ParseQuantity(strings.TrimSuffix(e.Value, "B"))
					if err != nil || q.Cmp(lim) >= 0 {
						t.Errorf("%s: GOMEMLIMIT %s, want a size below the memory limit %s", where, e.Value, lim.String())
					}
				}
			}
		}
	}
}

func checkImage(t *testing.T, where, image string) {
	name, tag, ok := strings.Cut(image, ":")
	if !ok || tag == "" || tag == "latest" || strings.Contains(tag, "/") || name == "" {
		t.Errorf("%s: image %q, want NAME:TAG with a tag other than latest", where, image)
	}
}

func checkResources(t *testing.T, where string, c corev1.Container) {
	req, lim := c.Resources.Requests, c.Resources.Limits
	cpu, hasCPU := req[corev1.ResourceCPU]
	mem, hasMem := req[corev1.ResourceMemory]
	memLimit, hasLimit := lim[corev1.ResourceMemory]
	if !hasCPU || !hasMem || !hasLimit || cpu.IsZero() || mem.IsZero() {
		t.Errorf("%s: want cpu and memory requests and a memory limit, have %v / %v", where, req, lim)
		return
	}
	if mem.Cmp(memLimit) > 0 {
		t.Errorf("%s: memory request %s above the limit %s", where, mem.String(), memLimit.String())
	}
}

// checkProbes: readiness on grpc.health.v1 at a declared port; liveness on a declared port.
func checkProbes(t *testing.T, where string, c corev1.Container) {
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	declared := func(port int32) bool {
		for _, p := range c.Ports {
			if p.ContainerPort == port {
				return true
			}
		}
		return false
	}
	resolve := func(p intstr.IntOrString) (int32, bool) {
		if p.Type == intstr.String {
			n, ok := ports[p.StrVal]
			return n, ok
		}
		return p.IntVal, declared(p.IntVal)
	}
	rp, lp := c.ReadinessProbe, c.LivenessProbe
	if rp == nil || rp.GRPC == nil {
		t.Errorf("%s: want a readiness probe on grpc.health.v1", where)
	} else if !declared(rp.GRPC.Port) {
		t.Errorf("%s: readiness probe on port %d, which the container does not declare", where, rp.GRPC.Port)
	}
	switch {
	case lp == nil:
		t.Errorf("%s: no liveness probe", where)
	case lp.GRPC != nil:
		if !declared(lp.GRPC.Port) {
			t.Errorf("%s: liveness probe on undeclared port %d", where, lp.GRPC.Port)
		}
	case lp.TCPSocket != nil:
		if _, ok := resolve(lp.TCPSocket.Port); !ok {
			t.Errorf("%s: liveness probe on undeclared port %s", where, lp.TCPSocket.Port.String())
		}
	default:
		t.Errorf("%s: liveness probe neither grpc nor tcpSocket", where)
	}
}

// TestAgentDaemonSet: the socket directory is a hostPath the agent mounts; the readiness probe
// asks for the agent's service.
func TestAgentDaemonSet(t *testing.T) {
	ds := loadManifests(t).daemonSets[0]
	var hostPath *corev1.Volume
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.HostPath != nil {
			hostPath = &v
		}
	}
	if hostPath == nil || hostPath.HostPath.Type == nil || *hostPath.HostPath.Type != corev1.HostPathDirectoryOrCreate {
		t.Fatalf("no hostPath volume of type DirectoryOrCreate for the socket: %+v", hostPath)
	}
	c := ds.Spec.Template.Spec.Containers[0]
	if !slices.ContainsFunc(c.VolumeMounts, func(vm corev1.VolumeMount) bool { return vm.Name == hostPath.Name && !vm.ReadOnly }) {
		t.Errorf("the agent does not mount %s writable", hostPath.Name)
	}
	if s := c.ReadinessProbe.GRPC.Service; s == nil || *s != agentv1.AgentService_ServiceDesc.ServiceName {
		t.Errorf("readiness probe service %v, want %s", s, agentv1.AgentService_ServiceDesc.ServiceName)
	}
}

// TestCoordinators: several replicas behind a headless Service (agents balance over the
// addresses), a budget that keeps most of them through a drain, readiness on the coordinator's
// health service.
func TestCoordinators(t *testing.T) {
	m := loadManifests(t)
	d, svc, pdb := m.deployments[0], m.services[0], m.pdbs[0]
	pods := labels.Set(d.Spec.Template.Labels)
	if d.Spec.Replicas == nil || *d.Spec.Replicas < 2 {
		t.Errorf("%d coordinator replicas: one is a single point of failure", d.Spec.Replicas)
	}
	sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
	if err != nil || !sel.Matches(pods) {
		t.Errorf("the Deployment's selector does not match its pods: %v", err)
	}
	if svc.Spec.ClusterIP != corev1.ClusterIPNone {
		t.Errorf("Service clusterIP %q: want headless (None), so that its DNS name lists every replica", svc.Spec.ClusterIP)
	}
	if !labels.SelectorFromSet(svc.Spec.Selector).Matches(pods) {
		t.Error("the Service's selector does not match the coordinators")
	}
	c := d.Spec.Template.Spec.Containers[0]
	for _, p := range svc.Spec.Ports {
		if !slices.ContainsFunc(c.Ports, func(cp corev1.ContainerPort) bool {
			return cp.Name == p.TargetPort.StrVal || cp.ContainerPort == p.TargetPort.IntVal
		}) {
			t.Errorf("Service port %s: target %s is no port of the coordinator", p.Name, p.TargetPort.String())
		}
	}
	psel, err := metav1.LabelSelectorAsSelector(pdb.Spec.Selector)
	if err != nil || !psel.Matches(pods) {
		t.Errorf("the PodDisruptionBudget does not select the coordinators: %v", err)
	}
	if pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() < 1 || pdb.Spec.MaxUnavailable.IntValue() >= int(*d.Spec.Replicas) {
		t.Errorf("PodDisruptionBudget maxUnavailable %v with %d replicas: want at least 1 and fewer than the replicas", pdb.Spec.MaxUnavailable, *d.Spec.Replicas)
	}
	if s := c.ReadinessProbe.GRPC.Service; s == nil || *s != coordinator.HealthService {
		t.Errorf("readiness probe service %v, want %s (NOT_SERVING while the store is down)", s, coordinator.HealthService)
	}
	if c.LivenessProbe.GRPC != nil {
		t.Error("liveness on the coordinator's health service: a Redis outage would restart every replica")
	}
}

// TestPolicyConfigMap: the policy the manifests ship is valid.
func TestPolicyConfigMap(t *testing.T) {
	cm := loadManifests(t).configMaps["leasebucket-policy"]
	if cm == nil {
		t.Fatal("no ConfigMap leasebucket-policy")
	}
	if _, err := policy.Parse("policy.yaml", []byte(cm.Data["policy.yaml"])); err != nil {
		t.Fatal(err)
	}
}

// dockerfile is what the checks read of the Dockerfile.
type dockerfile struct {
	stages   []stage
	binaries []string // paths in the final image
}

type stage struct {
	from, name string
	lines      []instruction
}

type instruction struct {
	cmd, args string
}

// readDockerfile parses ../Dockerfile: instructions (continued lines joined), grouped in stages.
func readDockerfile(t *testing.T) *dockerfile {
	t.Helper()
	f, err := os.Open("../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var d dockerfile
	var logical string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "#") || (line == "" && logical == "") {
			continue
		}
		if cont, ok := strings.CutSuffix(line, "\\"); ok {
			logical += cont + " "
			continue
		}
		logical += line
		cmd, args, _ := strings.Cut(strings.TrimSpace(logical), " ")
		logical = ""
		in := instruction{cmd: strings.ToUpper(cmd), args: strings.TrimSpace(args)}
		known := []string{"FROM", "WORKDIR", "COPY", "RUN", "ENV", "USER", "EXPOSE", "ENTRYPOINT", "CMD", "ARG", "LABEL"}
		if !slices.Contains(known, in.cmd) {
			t.Fatalf("Dockerfile: unknown instruction %q", cmd)
		}
		if in.cmd == "FROM" {
			from, name, _ := strings.Cut(in.args, " AS ")
			d.stages = append(d.stages, stage{from: strings.TrimSpace(from), name: strings.TrimSpace(name)})
			continue
		}
		if len(d.stages) == 0 {
			t.Fatalf("Dockerfile: %s before FROM", in.cmd)
		}
		s := &d.stages[len(d.stages)-1]
		s.lines = append(s.lines, in)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return &d
}

var goBuild = regexp.MustCompile(`go build .*?-o (\S+) (\./cmd/\S+)`)

// dockerImage checks the Dockerfile and returns it with the binaries of its final image.
func dockerImage(t *testing.T) *dockerfile {
	t.Helper()
	d := readDockerfile(t)
	if len(d.stages) < 2 {
		t.Fatalf("the Dockerfile has %d stages, want a build stage and a runtime stage", len(d.stages))
	}
	build, final := d.stages[0], d.stages[len(d.stages)-1]
	gomod, err := os.ReadFile("../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	goVersion := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(gomod)
	if goVersion == nil || !strings.HasPrefix(build.from, "golang:"+string(goVersion[1])+"-") {
		t.Errorf("build stage FROM %s: want the golang image of go.mod's Go %s", build.from, goVersion[1])
	}
	var static bool
	built := map[string]string{} // path in the build stage → package
	for _, in := range build.lines {
		if (in.cmd == "ENV" && regexp.MustCompile(`\bCGO_ENABLED=0\b`).MatchString(in.args)) ||
			(in.cmd == "RUN" && strings.Contains(in.args, "CGO_ENABLED=0 go build")) {
			static = true
		}
		if in.cmd == "RUN" {
			for _, m := range goBuild.FindAllStringSubmatch(in.args, -1) {
				built[m[1]] = m[2]
			}
		}
	}
	if !static {
		t.Error("the build stage does not set CGO_ENABLED=0: the binaries would not be static")
	}
	for out, pkg := range built {
		main, err := os.ReadFile(filepath.Join("..", pkg, "main.go"))
		if err != nil || !regexp.MustCompile(`(?m)^package main$`).Match(main) {
			t.Errorf("go build -o %s %s: no command there (%v)", out, pkg, err)
		}
	}
	if !strings.HasPrefix(final.from, "gcr.io/distroless/static") && final.from != "scratch" {
		t.Errorf("runtime stage FROM %s: want distroless static or scratch (nothing but the static binaries)", final.from)
	}
	var user string
	for _, in := range final.lines {
		switch in.cmd {
		case "USER":
			user = in.args
		case "COPY":
			fields := strings.Fields(in.args)
			if len(fields) != 3 || fields[0] != "--from="+build.name {
				t.Errorf("COPY %s: want COPY --from=%s SRC DST", in.args, build.name)
				continue
			}
			src, dst := fields[1], fields[2]
			for out := range built {
				if rel, ok := strings.CutPrefix(out, src); ok && strings.HasSuffix(src, "/") {
					d.binaries = append(d.binaries, path.Join(dst, rel))
				} else if out == src {
					d.binaries = append(d.binaries, dst)
				}
			}
		}
	}
	uid, _, _ := strings.Cut(user, ":")
	if n, err := strconv.Atoi(uid); err != nil || n == 0 {
		t.Errorf("USER %q: want a numeric non-root user (Kubernetes' runAsNonRoot checks numbers)", user)
	}
	slices.Sort(d.binaries)
	for _, want := range []string{"/usr/local/bin/leasebucket-agent", "/usr/local/bin/leasebucket-coordinator"} {
		if !slices.Contains(d.binaries, want) {
			t.Errorf("the image lacks %s (it holds %q)", want, d.binaries)
		}
	}
	for _, in := range final.lines {
		if in.cmd == "ENTRYPOINT" {
			var argv []string
			if err := json.Unmarshal([]byte(in.args), &argv); err != nil || len(argv) == 0 || !slices.Contains(d.binaries, argv[0]) {
				t.Errorf("ENTRYPOINT %s: want the JSON form naming a binary of the image", in.args)
			}
		}
	}
	return d
}

func TestDockerfile(t *testing.T) {
	d := dockerImage(t)
	if len(d.binaries) != 4 {
		t.Errorf("the image holds %q, want the agent, the coordinator, lbpolicy and lbcheck", d.binaries)
	}
}

// TestSystemdUnits verifies the units with systemd-analyze (with the real binaries where
// ExecStart= names them) and the sysusers.d file with systemd-sysusers, and checks that the users
// and groups the units name are the ones it creates.
func TestSystemdUnits(t *testing.T) {
	analyze, sysusers := tool(t, "systemd-analyze"), tool(t, "systemd-sysusers")
	root := t.TempDir()
	// systemd-analyze verify --root looks up every unit under root, the targets units depend
	// on included: give it the system's.
	system := "/usr/lib/systemd/system"
	if _, err := os.Stat(system); err != nil {
		system = "/lib/systemd/system"
	}
	if err := os.MkdirAll(filepath.Join(root, "usr/lib/systemd"), 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("cp", "-a", system, filepath.Join(root, "usr/lib/systemd/system")).CombinedOutput(); err != nil {
		t.Fatalf("copy %s: %v\n%s", system, err, out)
	}
	units := map[string]string{"leasebucket-agent.service": "leasebucket-agent", "leasebucket-coordinator.service": "leasebucket-coordinator"}
	for unit, binary := range units {
		u, err := deploy.ParseUnit("systemd/" + unit)
		if err != nil {
			t.Fatal(err)
		}
		argv, err := u.ExecStart(func(string) string { return "/run/credentials/" + unit })
		if err != nil {
			t.Fatal(err)
		}
		if want := "/usr/local/bin/" + binary; argv[0] != want {
			t.Fatalf("%s: ExecStart runs %s, want %s", unit, argv[0], want)
		}
		install(t, bins.Path(t, binary), filepath.Join(root, argv[0]), 0o755)
		data, err := deploy.ReadFile("systemd/" + unit)
		if err != nil {
			t.Fatal(err)
		}
		install(t, writeTemp(t, data), filepath.Join(root, "etc/systemd/system", unit), 0o644)
		if out := run(t, ".", analyze, "verify", "--root="+root, "/etc/systemd/system/"+unit); out != "" {
			t.Errorf("systemd-analyze verify %s:\n%s", unit, out)
		}
		// The example environment file is the one the unit reads.
		envFiles := u.Get("Service", "EnvironmentFile")
		want := "-/etc/leasebucket/" + strings.TrimPrefix(strings.TrimSuffix(unit, ".service"), "leasebucket-") + ".env"
		if !slices.Equal(envFiles, []string{want}) {
			t.Errorf("%s: EnvironmentFile=%q, want %q (deploy/systemd has its example)", unit, envFiles, want)
		}
		checkUsers(t, u)
	}

	// systemd-analyze finds what a unit gets wrong: the check can fail.
	install(t, writeTemp(t, []byte("[Service]\nExecStart=/usr/local/bin/leasebucket-agent\nRestartSec=soon\n")),
		filepath.Join(root, "etc/systemd/system/broken.service"), 0o644)
	if out, err := exec.Command(analyze, "verify", "--root="+root, "/etc/systemd/system/broken.service").CombinedOutput(); err == nil && !strings.Contains(string(out), "soon") {
		t.Errorf("systemd-analyze verify accepts a unit with RestartSec=soon:\n%s", out)
	}

	sysroot := t.TempDir()
	for _, f := range []string{"etc/passwd", "etc/group"} {
		install(t, writeTemp(t, nil), filepath.Join(sysroot, f), 0o644)
	}
	conf, err := deploy.ReadFile("systemd/leasebucket.sysusers")
	if err != nil {
		t.Fatal(err)
	}
	// It says what it would do on stderr; a mistake makes it fail.
	outb, err := exec.Command(sysusers, "--root="+sysroot, "--dry-run", writeTemp(t, conf)).CombinedOutput()
	out := string(outb)
	if err != nil {
		t.Fatalf("systemd-sysusers --dry-run: %v\n%s", err, out)
	}
	for _, want := range []string{"Creating group 'leasebucket-clients'", "Creating user 'leasebucket'"} {
		if !strings.Contains(out, want) {
			t.Errorf("systemd-sysusers --dry-run did not say %q:\n%s", want, out)
		}
	}
}

// checkUsers: the unit's user and groups are created by leasebucket.sysusers, and the user is a
// member of every supplementary group.
func checkUsers(t *testing.T, u *deploy.Unit) {
	conf, err := deploy.ReadFile("systemd/leasebucket.sysusers")
	if err != nil {
		t.Fatal(err)
	}
	users, groups, members := map[string]bool{}, map[string]bool{}, map[string]bool{}
	for _, line := range strings.Split(string(conf), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || strings.HasPrefix(f[0], "#") {
			continue
		}
		switch f[0] {
		case "u":
			users[f[1]], groups[f[1]] = true, true // u creates the user's group too
		case "g":
			groups[f[1]] = true
		case "m":
			members[f[1]+" "+f[2]] = true
		}
	}
	user := u.Last("Service", "User")
	if !users[user] {
		t.Errorf("%s: User=%s, which leasebucket.sysusers does not create", u.Name, user)
	}
	if g := u.Last("Service", "Group"); !groups[g] {
		t.Errorf("%s: Group=%s, which leasebucket.sysusers does not create", u.Name, g)
	}
	for _, line := range u.Get("Service", "SupplementaryGroups") {
		for _, g := range strings.Fields(line) {
			if !groups[g] || !members[user+" "+g] {
				t.Errorf("%s: SupplementaryGroups=%s: leasebucket.sysusers does not create it with %s a member", u.Name, g, user)
			}
		}
	}
}

func writeTemp(t *testing.T, data []byte) string {
	t.Helper()
	f, err := os.CreateTemp(t.TempDir(), "file")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return f.Name()
}

func install(t *testing.T, src, dst string, mode os.FileMode) {
	t.Helper()
	data, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, data, mode); err != nil {
		t.Fatal(err)
	}
}

// TestAlertRules runs promtool's check and unit tests of the rules, and checks that every alert
// has a severity, words for people and a runbook that docs/operations.md has.
func TestAlertRules(t *testing.T) {
	promtool := tool(t, "promtool")
	out := run(t, "prometheus", promtool, "check", "rules", "alerts.yaml")
	if !strings.Contains(out, "SUCCESS") {
		t.Errorf("promtool check rules:\n%s", out)
	}
	out = run(t, "prometheus", promtool, "test", "rules", "alerts_test.yaml")
	if !strings.Contains(out, "SUCCESS") {
		t.Errorf("promtool test rules:\n%s", out)
	}

	rules, err := deploy.ReadAlerts()
	if err != nil {
		t.Fatal(err)
	}
	ops, err := os.ReadFile("../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	tests, err := os.ReadFile("prometheus/alerts_test.yaml")
	if err != nil {
		t.Fatal(err)
	}
	const base = "https://github.com/leasebucket/leasebucket/blob/main/docs/operations.md#"
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
			if r.Alert == "" {
				t.Errorf("group %s: a rule without alert", g.Name)
				continue
			}
			if s := r.Labels["severity"]; s != "critical" && s != "warning" {
				t.Errorf("%s: severity %q, want critical or warning", r.Alert, s)
			}
			if r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("%s: no summary or description", r.Alert)
			}
			if want := base + strings.ToLower(r.Alert); r.Annotations["runbook_url"] != want {
				t.Errorf("%s: runbook_url %q, want %q", r.Alert, r.Annotations["runbook_url"], want)
			}
			if !regexp.MustCompile(`(?m)^### ` + r.Alert + `$`).Match(ops) {
				t.Errorf("%s: docs/operations.md has no runbook section \"### %s\"", r.Alert, r.Alert)
			}
			if !regexp.MustCompile(`alertname: ` + r.Alert + `\n\s+exp_alerts:\n\s+- exp_labels`).Match(tests) {
				t.Errorf("%s: alerts_test.yaml never expects it to fire", r.Alert)
			}
		}
	}
	if n == 0 {
		t.Fatal("no alert rules")
	}
}

// TestDashboard: a well-formed dashboard whose every query is PromQL naming metrics of the agent
// or the coordinator (cmd/agent and cmd/coordinator check the names against their registries).
func TestDashboard(t *testing.T) {
	d, err := deploy.ReadDashboard()
	if err != nil {
		t.Fatal(err)
	}
	if d.UID == "" || d.Title == "" {
		t.Error("the dashboard has no uid or title")
	}
	vars := map[string]bool{}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
	}
	if !vars["datasource"] {
		t.Error("no datasource variable")
	}
	ids := map[int]bool{}
	type cell struct{ x, y int }
	taken := map[cell]string{}
	for _, p := range d.AllPanels() {
		if ids[p.ID] {
			t.Errorf("panel %q: id %d used twice", p.Title, p.ID)
		}
		ids[p.ID] = true
		if p.GridPos == nil || p.GridPos.W <= 0 || p.GridPos.H <= 0 || p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("panel %q: gridPos %+v", p.Title, p.GridPos)
			continue
		}
		for x := p.GridPos.X; x < p.GridPos.X+p.GridPos.W; x++ {
			for y := p.GridPos.Y; y < p.GridPos.Y+p.GridPos.H; y++ {
				if other, ok := taken[cell{x, y}]; ok {
					t.Errorf("panels %q and %q overlap at %d,%d", other, p.Title, x, y)
				}
				taken[cell{x, y}] = p.Title
			}
		}
		if p.Type == "row" {
			continue
		}
		if !strings.Contains(string(p.Datasource), "${datasource}") {
			t.Errorf("panel %q: datasource %s, want ${datasource}", p.Title, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q: no query", p.Title)
		}
		for _, tg := range p.Targets {
			for _, ref := range regexp.MustCompile(`\$\{?([a-z_]+)`).FindAllStringSubmatch(tg.Expr, -1) {
				if !vars[ref[1]] && !strings.HasPrefix(ref[1], "__") {
					t.Errorf("panel %q: query uses $%s, which is no variable of the dashboard", p.Title, ref[1])
				}
			}
		}
	}
	checkQueries(t)
}

// checkQueries: every query of the dashboard and the alerts parses as PromQL and names only
// metrics that the agent or the coordinator exports, by name.
func checkQueries(t *testing.T) {
	qs, err := deploy.Queries()
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range qs {
		names, err := deploy.MetricNames(q.Expr)
		if err != nil {
			t.Errorf("%s: %v", q.Where, err)
			continue
		}
		if len(names) == 0 {
			t.Errorf("%s: names no metric", q.Where)
		}
		for _, n := range names {
			if deploy.Owners(n) == nil {
				t.Errorf("%s: %s is exported by neither the agent nor the coordinator", q.Where, n)
			}
		}
	}
}

// TestMetricNamesParsed: the parsing under the metric checks finds what a query selects and
// rejects what is not PromQL, so a check against the registries cannot pass vacuously.
func TestMetricNamesParsed(t *testing.T) {
	got, err := deploy.MetricNames(`histogram_quantile(0.99, sum by (le) (rate(a_bucket{job="x"}[$__rate_interval]))) / on() b + {__name__="c"}`)
	if err != nil || !slices.Equal(got, []string{"a_bucket", "b", "c"}) {
		t.Errorf("MetricNames = %q, %v", got, err)
	}
	if _, err := deploy.MetricNames(`rate(a[5m]`); err == nil {
		t.Error("a malformed query parsed")
	}
	described := map[string]bool{"leasebucket_agent_refill_duration_seconds": true, "leasebucket_agent_keys": true}
	for name, want := range map[string]bool{
		"leasebucket_agent_refill_duration_seconds_bucket": true, "leasebucket_agent_keys": true,
		"leasebucket_agent_key": false, "leasebucket_agent_keys_total": false,
	} {
		if deploy.Exported(described, name) != want {
			t.Errorf("Exported(%s) = %v", name, !want)
		}
	}
}
