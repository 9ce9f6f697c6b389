// Package deploy holds the files that deploy and watch leasebucket: systemd units, Kubernetes
// manifests, Prometheus alert rules and a Grafana dashboard (docs/operations.md describes them).
// Its Go code loads them for the tests that check them: against the Kubernetes API types, against
// the flags and the metrics of the commands (cmd/agent and cmd/coordinator run their own flag
// parsing on the files' arguments and describe their own metric registries), and with
// systemd-analyze and promtool. Nothing else imports it.
package deploy

import (
	"bufio"
	"bytes"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/prometheus/promql/parser"
	"go.yaml.in/yaml/v3"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	k8syaml "k8s.io/apimachinery/pkg/util/yaml"
)

//go:embed systemd kubernetes prometheus grafana
var files embed.FS

// ReadFile returns the file name, a path under deploy/ ("systemd/leasebucket-agent.service").
func ReadFile(name string) ([]byte, error) { return files.ReadFile(name) }

// Names returns the files of the directory dir, sorted.
func Names(dir string) ([]string, error) {
	entries, err := fs.ReadDir(files, dir)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range entries {
		if !e.IsDir() {
			names = append(names, path.Join(dir, e.Name()))
		}
	}
	return names, nil
}

// Object is one decoded Kubernetes object and the file it came from.
type Object struct {
	File string
	runtime.Object
}

// Kubernetes decodes every manifest of kubernetes/ but kustomization.yaml (DecodeKubernetes).
func Kubernetes() ([]Object, error) {
	names, err := Names("kubernetes")
	if err != nil {
		return nil, err
	}
	var objs []Object
	for _, name := range names {
		if path.Base(name) == "kustomization.yaml" {
			continue
		}
		data, err := files.ReadFile(name)
		if err != nil {
			return nil, err
		}
		o, err := DecodeKubernetes(name, data)
		if err != nil {
			return nil, err
		}
		objs = append(objs, o...)
	}
	return objs, nil
}

// DecodeKubernetes decodes the documents of a manifest into the types of k8s.io/api, strictly:
// an unknown field, a duplicate field, a value of the wrong type or a kind outside apps/v1,
// core/v1 and policy/v1 is an error.
func DecodeKubernetes(name string, data []byte) ([]Object, error) {
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{appsv1.AddToScheme, corev1.AddToScheme, policyv1.AddToScheme} {
		if err := add(scheme); err != nil {
			return nil, err
		}
	}
	decoder := serializer.NewCodecFactory(scheme, serializer.EnableStrict).UniversalDeserializer()
	var objs []Object
	r := k8syaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for i := 0; ; i++ {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", name, i, err)
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		obj, _, err := decoder.Decode(doc, nil, nil)
		if err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", name, i, err)
		}
		objs = append(objs, Object{File: name, Object: obj})
	}
}

func stripComments(doc []byte) []byte {
	var out []byte
	for _, line := range bytes.Split(doc, []byte("\n")) {
		if t := bytes.TrimSpace(line); len(t) > 0 && t[0] != '#' {
			out = append(out, line...)
			out = append(out, '\n')
		}
	}
	return out
}

// Kustomization is the part of kubernetes/kustomization.yaml the tests read.
type Kustomization struct {
	Namespace string   `yaml:"namespace"`
	Resources []string `yaml:"resources"`
	Images    []struct {
		Name    string `yaml:"name"`
		NewName string `yaml:"newName"`
		NewTag  string `yaml:"newTag"`
	} `yaml:"images"`
}

// ReadKustomization decodes kubernetes/kustomization.yaml.
func ReadKustomization() (*Kustomization, error) {
	data, err := files.ReadFile("kubernetes/kustomization.yaml")
	if err != nil {
		return nil, err
	}
	var k Kustomization
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(false) // apiVersion, kind and fields the tests do not read
	if err := dec.Decode(&k); err != nil {
		return nil, fmt.Errorf("kustomization.yaml: %w", err)
	}
	return &k, nil
}

// Unit is a parsed systemd unit file: for each section, each key's values in order.
type Unit struct {
	Name     string
	Sections map[string]map[string][]string
}

// ParseUnit parses the unit file name (under deploy/) as systemd reads it: sections, key=value
// lines, comments starting with '#' or ';', and lines continued by a trailing backslash.
func ParseUnit(name string) (*Unit, error) {
	data, err := files.ReadFile(name)
	if err != nil {
		return nil, err
	}
	u := &Unit{Name: name, Sections: map[string]map[string][]string{}}
	var section string
	lines := strings.Split(string(data), "\n")
	for i := 0; i < len(lines); i++ {
		line := strings.TrimSpace(lines[i])
		for strings.HasSuffix(line, "\\") && i+1 < len(lines) {
			i++
			next := strings.TrimSpace(lines[i])
			if next != "" && (next[0] == '#' || next[0] == ';') {
				continue // a comment inside a continued line is skipped
			}
			line = strings.TrimSuffix(line, "\\") + " " + next
		}
		switch {
		case line == "" || line[0] == '#' || line[0] == ';':
		case line[0] == '[' && line[len(line)-1] == ']':
			section = line[1 : len(line)-1]
			if u.Sections[section] == nil {
				u.Sections[section] = map[string][]string{}
			}
		default:
			k, v, ok := strings.Cut(line, "=")
			if !ok || section == "" {
				return nil, fmt.Errorf("%s:%d: want KEY=VALUE in a section: %q", name, i+1, line)
			}
			k, v = strings.TrimSpace(k), strings.TrimSpace(v)
			u.Sections[section][k] = append(u.Sections[section][k], v)
		}
	}
	return u, nil
}

// Get returns the values of key in section.
func (u *Unit) Get(section, key string) []string { return u.Sections[section][key] }

// Last returns the last value of key in section ("" if none): systemd's answer for keys that
// take one value.
func (u *Unit) Last(section, key string) string {
	v := u.Get(section, key)
	if len(v) == 0 {
		return ""
	}
	return v[len(v)-1]
}

// Environment returns the variables the unit's Environment= lines set.
func (u *Unit) Environment() (map[string]string, error) {
	env := map[string]string{}
	for _, line := range u.Get("Service", "Environment") {
		words, err := splitWords(line, func(string) string { return "" })
		if err != nil {
			return nil, fmt.Errorf("%s: Environment=%s: %w", u.Name, line, err)
		}
		for _, w := range words {
			k, v, ok := strings.Cut(w, "=")
			if !ok {
				return nil, fmt.Errorf("%s: Environment=%s: %q is not NAME=VALUE", u.Name, line, w)
			}
			env[k] = v
		}
	}
	return env, nil
}

// ExecStart returns the command line of the service: the binary and its arguments, split as
// systemd splits them, with ${NAME} and $NAME taken from env and the specifiers %t (/run) and %%.
func (u *Unit) ExecStart(env func(string) string) ([]string, error) {
	v := u.Get("Service", "ExecStart")
	if len(v) != 1 {
		return nil, fmt.Errorf("%s: %d ExecStart= lines, want 1", u.Name, len(v))
	}
	line := strings.TrimLeft(v[0], "-@:+!") // prefixes: ignore failure, argv[0], no expansion, privileges
	line = strings.NewReplacer("%t", "/run", "%%", "%").Replace(line)
	return splitWords(line, env)
}

var envRef = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)`)

// splitWords splits s at unquoted white space, removing double and single quotes and
// backslash escapes, and expands ${NAME} within words and $NAME as words of its own.
func splitWords(s string, env func(string) string) ([]string, error) {
	var words []string
	var cur strings.Builder
	inWord := false
	var quote byte
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case quote != 0 && c == quote:
			quote = 0
		case quote == 0 && (c == '"' || c == '\''):
			quote, inWord = c, true
		case c == '\\' && i+1 < len(s):
			i++
			cur.WriteByte(s[i])
			inWord = true
		case quote == 0 && (c == ' ' || c == '\t'):
			if inWord {
				words = append(words, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteByte(c)
			inWord = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unterminated quote in %q", s)
	}
	if inWord {
		words = append(words, cur.String())
	}
	var out []string
	for _, w := range words {
		if m := envRef.FindStringSubmatch(w); m != nil && m[0] == w && m[2] != "" {
			out = append(out, strings.Fields(env(m[2]))...) // $NAME alone: split into words
			continue
		}
		out = append(out, envRef.ReplaceAllStringFunc(w, func(ref string) string {
			m := envRef.FindStringSubmatch(ref)
			return env(m[1] + m[2])
		}))
	}
	return out, nil
}

// EnvFile parses an environment file as systemd's EnvironmentFile= reads it: NAME=VALUE lines,
// comments, values optionally quoted.
func EnvFile(name string) (map[string]string, error) {
	data, err := files.ReadFile(name)
	if err != nil {
		return nil, err
	}
	env := map[string]string{}
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' || line[0] == ';' {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			return nil, fmt.Errorf("%s:%d: want NAME=VALUE: %q", name, i+1, line)
		}
		if uq, err := strconv.Unquote(v); err == nil && len(v) > 1 && v[0] == '"' {
			v = uq
		}
		env[strings.TrimSpace(k)] = v
	}
	return env, nil
}

// Query is a PromQL expression of an alert rule or a dashboard panel.
type Query struct {
	Where string // "prometheus/alerts.yaml: alert LeasebucketStoreDown"
	Expr  string
}

// AlertRules is the part of a Prometheus rule file the tests read.
type AlertRules struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Record      string            `yaml:"record"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// ReadAlerts decodes prometheus/alerts.yaml.
func ReadAlerts() (*AlertRules, error) {
	data, err := files.ReadFile("prometheus/alerts.yaml")
	if err != nil {
		return nil, err
	}
	var r AlertRules
	if err := yaml.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("alerts.yaml: %w", err)
	}
	return &r, nil
}

// Dashboard is the part of a Grafana dashboard the tests read.
type Dashboard struct {
	UID        string  `json:"uid"`
	Title      string  `json:"title"`
	Panels     []Panel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string `json:"name"`
			Type  string `json:"type"`
			Query any    `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

// Panel is a dashboard panel; a row holds panels when collapsed.
type Panel struct {
	ID         int             `json:"id"`
	Type       string          `json:"type"`
	Title      string          `json:"title"`
	Datasource json.RawMessage `json:"datasource"`
	GridPos    *struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Targets []struct {
		RefID        string          `json:"refId"`
		Expr         string          `json:"expr"`
		LegendFormat string          `json:"legendFormat"`
		Datasource   json.RawMessage `json:"datasource"`
	} `json:"targets"`
	Panels []Panel `json:"panels"`
}

// ReadDashboard decodes grafana/leasebucket.json.
func ReadDashboard() (*Dashboard, error) {
	data, err := files.ReadFile("grafana/leasebucket.json")
	if err != nil {
		return nil, err
	}
	var d Dashboard
	if err := json.Unmarshal(data, &d); err != nil {
		return nil, fmt.Errorf("leasebucket.json: %w", err)
	}
	return &d, nil
}

// AllPanels returns the dashboard's panels, those inside collapsed rows included.
func (d *Dashboard) AllPanels() []Panel {
	var out []Panel
	var walk func([]Panel)
	walk = func(ps []Panel) {
		for _, p := range ps {
			out = append(out, p)
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	return out
}

// Queries returns every PromQL expression of the alert rules and the dashboard.
func Queries() ([]Query, error) {
	rules, err := ReadAlerts()
	if err != nil {
		return nil, err
	}
	var qs []Query
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			qs = append(qs, Query{Where: "prometheus/alerts.yaml: " + r.Alert + r.Record, Expr: r.Expr})
		}
	}
	d, err := ReadDashboard()
	if err != nil {
		return nil, err
	}
	for _, p := range d.AllPanels() {
		for _, t := range p.Targets {
			qs = append(qs, Query{Where: fmt.Sprintf("grafana/leasebucket.json: panel %q %s", p.Title, t.RefID), Expr: t.Expr})
		}
	}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		q, _ := v.Query.(string)
		if m, ok := v.Query.(map[string]any); ok {
			q, _ = m["query"].(string)
		}
		// label_values(SELECTOR, label) is Grafana's, not PromQL: its selector is.
		m := labelValues.FindStringSubmatch(q)
		if m == nil {
			return nil, fmt.Errorf("grafana/leasebucket.json: variable %s: query %q is not label_values(SELECTOR, label)", v.Name, q)
		}
		qs = append(qs, Query{Where: "grafana/leasebucket.json: variable " + v.Name, Expr: m[1]})
	}
	return qs, nil
}

var labelValues = regexp.MustCompile(`^label_values\((.+),\s*[a-zA-Z_][a-zA-Z0-9_]*\)$`)

// grafanaVars are the dashboard's interval variables, which PromQL cannot parse; $name inside a
// label matcher's quotes is a string and needs nothing.
var grafanaVars = strings.NewReplacer("$__rate_interval", "5m", "${__rate_interval}", "5m", "$__interval", "1m", "$__range", "1h")

// MetricNames returns the names of the metrics expr selects, after parsing it as PromQL.
func MetricNames(expr string) ([]string, error) {
	e, err := parser.NewParser(parser.Options{}).ParseExpr(grafanaVars.Replace(expr))
	if err != nil {
		return nil, err
	}
	names := map[string]bool{}
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			name := vs.Name
			for _, m := range vs.LabelMatchers {
				if m.Name == "__name__" {
					name = m.Value
				}
			}
			names[name] = true
		}
		return nil
	})
	return slices.Sorted(maps.Keys(names)), nil
}

// Binaries that export metrics.
const (
	Agent       = "agent"
	Coordinator = "coordinator"
)

// Owners returns the binaries that export the metric name, by its prefix: leasebucket_agent_ the
// agent, leasebucket_coordinator_ the coordinator; leasebucket_policy_ (the policy watcher) and the
// Go runtime's go_ and process_ both. None for any other name.
func Owners(name string) []string {
	switch {
	case strings.HasPrefix(name, "leasebucket_agent_"):
		return []string{Agent}
	case strings.HasPrefix(name, "leasebucket_coordinator_"):
		return []string{Coordinator}
	case strings.HasPrefix(name, "leasebucket_policy_"), strings.HasPrefix(name, "go_"), strings.HasPrefix(name, "process_"):
		return []string{Agent, Coordinator}
	}
	return nil
}

// descName reads the metric name out of a *prometheus.Desc, which has no accessor for it:
// its String is `Desc{fqName: "name", ...}`.
var descName = regexp.MustCompile(`^Desc\{fqName: ("(?:[^"\\]|\\.)*")`)

// Described returns the name of every metric c describes (a *prometheus.Registry describes every
// collector registered with it), whether or not it has a sample yet: a vector without children
// is described but not gathered.
func Described(c prometheus.Collector) (map[string]bool, error) {
	ch := make(chan *prometheus.Desc)
	go func() {
		c.Describe(ch)
		close(ch)
	}()
	names := map[string]bool{}
	var err error
	for d := range ch {
		m := descName.FindStringSubmatch(d.String())
		if m == nil {
			err = errors.Join(err, fmt.Errorf("deploy: cannot read the name of %s", d))
			continue
		}
		name, uerr := strconv.Unquote(m[1])
		if uerr != nil {
			err = errors.Join(err, uerr)
			continue
		}
		names[name] = true
	}
	return names, err
}

// Exported reports whether name is a series of a metric in described: the metric itself, or
// the _bucket, _sum or _count series of a histogram or summary.
func Exported(described map[string]bool, name string) bool {
	if described[name] {
		return true
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suffix); ok && described[base] {
			return true
		}
	}
	return false
}

// CheckExported checks every metric the alert rules and the dashboard name that binary exports
// (by Owners) against reg, the binary's registry: one error per name reg does not describe.
// It fails too if the files name no metric of binary at all.
func CheckExported(binary string, reg prometheus.Collector) error {
	described, err := Described(reg)
	if err != nil {
		return err
	}
	qs, err := Queries()
	if err != nil {
		return err
	}
	var errs []error
	checked := 0
	for _, q := range qs {
		names, err := MetricNames(q.Expr)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", q.Where, err))
			continue
		}
		for _, n := range names {
			if !slices.Contains(Owners(n), binary) {
				continue
			}
			checked++
			if !Exported(described, n) {
				errs = append(errs, fmt.Errorf("%s: %s is not a metric the %s exports", q.Where, n, binary))
			}
		}
	}
	if checked == 0 {
		errs = append(errs, fmt.Errorf("the deployment files name no metric of the %s", binary))
	}
	return errors.Join(errs...)
}
