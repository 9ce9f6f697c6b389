package policy

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"math/big"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

const (
	// MaxFileSize bounds a policy file: policies are hand-written, and the parser's memory must not
	// depend on what a mistaken deployment points it at.
	MaxFileSize = 4 << 20

	// MaxRoutes bounds the routes (rule × template × operation) of a Set; route IDs are dense.
	MaxRoutes = 1 << 16

	// MaxRegions bounds the slices of a regional rule.
	MaxRegions = 64

	// DefaultFailureRetryAfter is the Retry-After of a fail-closed 503 when the rule does not say:
	// short, because the outage behind it is usually brief and the agent retries its refill anyway.
	DefaultFailureRetryAfter = time.Second

	// maxFailureRetryAfter bounds retry_after_on_failure: longer would turn a short outage into an
	// hour of clients staying away.
	maxFailureRetryAfter = time.Hour

	// DefaultRuleName is the name of the rule for unmatched routes (BucketRef.rule on the wire).
	DefaultRuleName = "default"

	// AnyOperation is the default rule's operation entry for operations the Set does not know.
	AnyOperation = "*"

	maxDescription = 1024
)

var (
	reVersion   = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:+-]{0,63}$`)
	reRuleName  = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)
	reMethod    = regexp.MustCompile(`^[A-Z][A-Z0-9_-]{0,31}$`)
	reClass     = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,31}$`)
	reNamedOp   = regexp.MustCompile(`^[a-z][a-z0-9_.-]{0,63}$`)
	reRegion    = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,31}$`)
	reDomain    = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)
	reDescriptr = regexp.MustCompile(`^[A-Za-z0-9_:.-]{1,64}$`)
)

// defaultMethods maps HTTP methods to classes unless the file's methods section says otherwise.
var defaultMethods = map[string]string{
	"GET": "read", "HEAD": "read", "OPTIONS": "read",
	"POST": "write", "PUT": "write", "PATCH": "write", "DELETE": "write",
}

// Load reads and parses a policy file.
func Load(filename string) (*Set, error) {
	f, err := os.Open(filename)
	if err != nil {
		return nil, fmt.Errorf("policy: %w", err)
	}
	defer func() { _ = f.Close() }() // read only: nothing to lose
	data, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("policy: read %s: %w", filename, err)
	}
	return Parse(filename, data)
}

// Parse parses and validates a policy file. On failure the error is a *ParseError listing every
// problem found, one "file:line: field: message" per line.
func Parse(filename string, data []byte) (*Set, error) {
	p := &parser{file: filename}
	s := p.parse(data)
	if len(p.errs) > 0 {
		sort.SliceStable(p.errs, func(i, j int) bool { return p.errs[i].Line < p.errs[j].Line })
		if p.dropped > 0 {
			p.errs = append(p.errs, &FieldError{File: filename, Msg: fmt.Sprintf("%d more problems not shown", p.dropped)})
		}
		return nil, &ParseError{File: filename, Errors: p.errs}
	}
	return s, nil
}

// maxErrors bounds the problems reported for one file: past it, they are counted, not described.
const maxErrors = 100

type parser struct {
	file    string
	errs    []*FieldError
	dropped int
}

// count is the number of problems found, described or not.
func (p *parser) count() int { return len(p.errs) + p.dropped }

func (p *parser) errf(line int, field, format string, args ...any) {
	if len(p.errs) >= maxErrors {
		p.dropped++
		return
	}
	p.errs = append(p.errs, &FieldError{File: p.file, Line: line, Field: field, Msg: fmt.Sprintf(format, args...)})
}

var reYAMLLine = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)

// yamlParserProblems are the messages of the YAML parser (as opposed to its scanner). The yaml
// package reports their line 0-based, at the start of the enclosing collection; the scanner's are
// 1-based. The parser's are shifted here so that every line is 1-based.
var yamlParserProblems = map[string]bool{
	"did not find expected ',' or ']'": true, "did not find expected ',' or '}'": true,
	"did not find expected '-' indicator": true, "did not find expected <document start>": true,
	"did not find expected <stream-start>": true, "did not find expected key": true,
	"did not find expected node content": true, "found duplicate %TAG directive": true,
	"found duplicate %YAML directive": true, "found incompatible YAML document": true,
	"found undefined tag handle": true,
}

func (p *parser) yamlError(err error, data []byte) {
	lines := strings.Split(string(data), "\n")
	for _, msg := range strings.Split(err.Error(), "\n") {
		msg = strings.TrimSpace(msg)
		if msg == "" || msg == "yaml: unmarshal errors:" {
			continue
		}
		if m := reYAMLLine.FindStringSubmatch(msg); m != nil {
			line, _ := strconv.Atoi(m[1])
			if yamlParserProblems[m[2]] {
				line++
			}
			hint := ""
			if strings.Contains(m[2], "did not find expected ','") && line >= 1 && line <= len(lines) &&
				strings.Contains(lines[line-1], "[") && strings.Contains(lines[line-1], "/{") {
				hint = ` (inside [ ] or { }, quote templates with braces: ["/orders/{id}"])`
			}
			p.errf(line, "", "invalid YAML: %s%s", m[2], hint)
			continue
		}
		msg = strings.TrimPrefix(msg, "yaml: ")
		line := 0
		if yamlParserProblems[msg] {
			line = 1 // the parser omits line 1 (0-based 0)
		}
		p.errf(line, "", "invalid YAML: %s", msg)
	}
}

// ruleSrc is a rule while it is being parsed: what route building needs besides the Rule.
type ruleSrc struct {
	rule      *Rule
	path      string
	tmpls     []template
	tmplLines []int
}

func (p *parser) parse(data []byte) *Set {
	if len(data) > MaxFileSize {
		p.errf(0, "", "file is larger than %d bytes", MaxFileSize)
		return nil
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			p.errf(1, "", "empty policy file")
		} else {
			p.yamlError(err, data)
		}
		return nil
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); err == nil {
		p.errf(extra.Line, "", "a policy file holds one YAML document; found another")
		return nil
	} else if !errors.Is(err, io.EOF) {
		p.yamlError(err, data)
		return nil
	}
	if p.noAliases(&doc); p.count() > 0 {
		return nil
	}
	if doc.Kind != yaml.DocumentNode || len(doc.Content) != 1 {
		p.errf(doc.Line, "", "empty policy file")
		return nil
	}
	root := doc.Content[0]
	f, ok := p.fields(root, "", "version", "methods", "operations", "envoy", "rules", "default")
	if !ok {
		return nil
	}
	s := &Set{file: p.file, byName: map[string]*Rule{}, refs: map[routeRef]uint32{}, root: &node{}}

	if n := f.get("version"); n == nil {
		p.errf(root.Line, "version", "required: the policy set version agents and coordinators agree on")
	} else if v, ok := p.str(n, "version"); ok {
		if !reVersion.MatchString(v) {
			p.errf(n.Line, "version", "%q must match %s", v, reVersion)
		}
		s.version = v
	}
	p.operationsTable(s, f)
	s.envoy = p.envoy(f.get("envoy"))

	var srcs []*ruleSrc
	if n := f.get("rules"); n != nil {
		items, _ := p.seq(n, "rules")
		for i, item := range items {
			if src := p.rule(s, item, fmt.Sprintf("rules[%d]", i), false); src != nil {
				srcs = append(srcs, src)
			}
		}
	}
	if n := f.get("default"); n == nil {
		p.errf(root.Line, "default", "required: the rule for unmatched routes and operations")
	} else if src := p.rule(s, n, "default", true); src != nil {
		src.rule.Line = f.at("default")
		srcs = append(srcs, src)
	}
	if p.count() > 0 {
		return nil
	}
	p.routes(s, srcs)
	if p.count() > 0 {
		return nil
	}
	s.root.freeze()
	s.digest = digest(s)
	return s
}

// noAliases rejects aliases (and with them merge keys): a policy should read as what it means,
// and expanding aliases is how small YAML files become huge.
func (p *parser) noAliases(n *yaml.Node) {
	if n.Kind == yaml.AliasNode {
		p.errf(n.Line, "", "YAML aliases are not supported in policy files: write the value out")
		return
	}
	for _, c := range n.Content {
		p.noAliases(c)
	}
}

// fieldSet is a mapping's fields by name.
type fieldSet struct {
	m    map[string]*yaml.Node
	keys map[string]int // line of each field's name
	line int
}

func (f fieldSet) get(name string) *yaml.Node { return f.m[name] }

// at is the line of a field's name: where errors about its whole value point.
func (f fieldSet) at(name string) int { return f.keys[name] }

func join(path, field string) string {
	if path == "" {
		return field
	}
	return path + "." + field
}

func index(path, key string) string {
	for i := 0; i < len(key); i++ {
		c := key[i]
		if !(c == '-' || c == '_' || c == '.' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9') {
			return path + "[" + strconv.Quote(key) + "]"
		}
	}
	return path + "[" + key + "]"
}

// fields checks that n is a mapping whose keys are known field names, each at most once.
func (p *parser) fields(n *yaml.Node, path string, known ...string) (fieldSet, bool) {
	f := fieldSet{m: map[string]*yaml.Node{}, keys: map[string]int{}, line: n.Line}
	if n.Kind != yaml.MappingNode {
		p.errf(n.Line, path, "must be a mapping with fields %s", strings.Join(known, ", "))
		return f, false
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		name := k.Value
		switch {
		case k.Kind != yaml.ScalarNode:
			p.errf(k.Line, path, "field names must be plain words")
		case k.Tag == "!!merge":
			p.errf(k.Line, join(path, name), "merge keys are not supported in policy files: write the fields out")
		case !slices.Contains(known, name):
			msg := "unknown field"
			if len(p.errs) >= maxErrors {
				p.dropped++
				continue
			}
			if s := suggest(name, known); s != "" {
				msg += fmt.Sprintf(" (did you mean %q?)", s)
			}
			p.errf(k.Line, join(path, name), "%s; known fields: %s", msg, strings.Join(known, ", "))
		case f.m[name] != nil:
			p.errf(k.Line, join(path, name), "duplicate field (first on line %d)", f.m[name].Line)
		default:
			f.m[name] = v
			f.keys[name] = k.Line
		}
	}
	return f, true
}

// suggest returns the known name closest to name, if it is a likely typo.
func suggest(name string, known []string) string {
	best, bestD := "", 3
	for _, k := range known {
		if d := editDistance(name, k); d < bestD {
			best, bestD = k, d
		}
	}
	return best
}

func editDistance(a, b string) int {
	if len(a) > 64 || len(b) > 64 {
		return math.MaxInt
	}
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			c := 1
			if a[i-1] == b[j-1] {
				c = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+c)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// entry is one key/value pair of a mapping with free keys (methods, regions, overrides, cost).
type entry struct {
	key     string
	line    int
	val     *yaml.Node
	keyNode *yaml.Node
}

func (p *parser) entries(n *yaml.Node, path string, what string) []entry {
	if n.Kind != yaml.MappingNode {
		p.errf(n.Line, path, "must be a mapping of %s", what)
		return nil
	}
	var out []entry
	seen := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if k.Kind != yaml.ScalarNode || k.Tag == "!!null" {
			p.errf(k.Line, path, "keys must be scalars")
			continue
		}
		if first, dup := seen[k.Value]; dup {
			p.errf(k.Line, index(path, k.Value), "duplicate key (first on line %d)", first)
			continue
		}
		seen[k.Value] = k.Line
		out = append(out, entry{key: k.Value, line: k.Line, val: v, keyNode: k})
	}
	return out
}

func (p *parser) seq(n *yaml.Node, path string) ([]*yaml.Node, bool) {
	if n.Kind != yaml.SequenceNode {
		p.errf(n.Line, path, "must be a list")
		return nil, false
	}
	return n.Content, true
}

// str reads a scalar as text. Numbers are accepted as written ("1.10" stays "1.10").
func (p *parser) str(n *yaml.Node, path string) (string, bool) {
	if n.Kind != yaml.ScalarNode {
		p.errf(n.Line, path, "must be a single value")
		return "", false
	}
	switch n.Tag {
	case "!!str", "!!int", "!!float":
	case "!!null":
		p.errf(n.Line, path, "must not be empty")
		return "", false
	default:
		p.errf(n.Line, path, "must be text, not %s", tagName(n.Tag))
		return "", false
	}
	if n.Value == "" {
		p.errf(n.Line, path, "must not be empty")
		return "", false
	}
	return n.Value, true
}

func (p *parser) integer(n *yaml.Node, path string) (int64, bool) {
	if n.Kind != yaml.ScalarNode || n.Tag != "!!int" {
		p.errf(n.Line, path, "must be a whole number, not %s", describeNode(n))
		return 0, false
	}
	v, err := strconv.ParseInt(strings.ReplaceAll(n.Value, "_", ""), 0, 64)
	if err != nil {
		p.errf(n.Line, path, "%q is out of range", n.Value)
		return 0, false
	}
	return v, true
}

func (p *parser) boolean(n *yaml.Node, path string) (bool, bool) {
	if n.Kind != yaml.ScalarNode || n.Tag != "!!bool" {
		p.errf(n.Line, path, "must be true or false, not %s", describeNode(n))
		return false, false
	}
	return strings.EqualFold(n.Value, "true"), true
}

func tagName(tag string) string {
	switch tag {
	case "!!str":
		return "text"
	case "!!int":
		return "a whole number"
	case "!!float":
		return "a decimal number"
	case "!!bool":
		return "true/false"
	case "!!null":
		return "empty"
	case "!!map":
		return "a mapping"
	case "!!seq":
		return "a list"
	default:
		return "a value tagged " + tag
	}
}

func describeNode(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	if n.Tag == "!!str" {
		return strconv.Quote(n.Value)
	}
	return tagName(n.Tag)
}

// operationsTable reads methods and operations and interns every operation name.
func (p *parser) operationsTable(s *Set, f fieldSet) {
	s.methods = map[string]string{}
	for m, c := range defaultMethods {
		s.methods[m] = c
	}
	p.classTable(f, "methods", "HTTP methods to classes", "HTTP method", reMethod, s.methods, nil)
	s.named = map[string]string{}
	namedLine := map[string]int{}
	p.classTable(f, "operations", "named operations to classes", "named operation", reNamedOp, s.named, namedLine)
	classSet := map[string]bool{"read": true, "write": true}
	for _, c := range s.methods {
		classSet[c] = true
	}
	for _, c := range s.named {
		classSet[c] = true
	}
	for name := range s.named {
		if classSet[name] {
			p.errf(namedLine[name], index("operations", name),
				"%q is used as a class (by a method or another operation); a named operation needs its own name", name)
		}
	}
	for c := range classSet {
		s.classes = append(s.classes, c)
	}
	slices.Sort(s.classes)

	ids := map[string]int32{}
	intern := func(name string) int32 {
		if id, ok := ids[name]; ok {
			return id
		}
		id := int32(len(s.opNames))
		s.opNames = append(s.opNames, name)
		ids[name] = id
		return id
	}
	s.ops = map[string]opRef{}
	for _, c := range s.classes {
		id := intern(c)
		s.ops[c] = opRef{exact: id, class: id, kind: opClass}
	}
	for _, name := range sortedKeys(s.named) {
		if classSet[name] {
			continue
		}
		s.ops[name] = opRef{exact: intern(name), class: ids[s.named[name]], kind: opNamed}
	}
	for _, m := range sortedKeys(s.methods) {
		s.ops[m] = opRef{exact: intern(m), class: ids[s.methods[m]], kind: opMethod}
	}
	if len(s.ops) <= maxLinearOps {
		// Most frequent first: methods, then classes, then named operations.
		for _, kind := range []opKind{opMethod, opClass, opNamed} {
			for _, name := range sortedKeys(s.ops) {
				if s.ops[name].kind == kind {
					s.opList = append(s.opList, opEntry{name, s.ops[name]})
				}
			}
		}
	}
}

// classTable reads field, a mapping of names (noun, matching re) to class names, into m; lines,
// if not nil, gets the line of each entry read.
func (p *parser) classTable(f fieldSet, field, what, noun string, re *regexp.Regexp, m map[string]string, lines map[string]int) {
	n := f.get(field)
	if n == nil {
		return
	}
	for _, e := range p.entries(n, field, what) {
		path := index(field, e.key)
		if !re.MatchString(e.key) {
			p.errf(e.line, path, "%s %q must match %s", noun, e.key, re)
			continue
		}
		c, ok := p.str(e.val, path)
		if !ok {
			continue
		}
		if !reClass.MatchString(c) {
			p.errf(e.val.Line, path, "class %q must match %s", c, reClass)
			continue
		}
		m[e.key] = c
		if lines != nil {
			lines[e.key] = e.line
		}
	}
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func (p *parser) envoy(n *yaml.Node) Envoy {
	e := Envoy{Domain: "leasebucket", TenantKey: "tenant", RouteKey: "path", OperationKey: "method"}
	if n == nil {
		return e
	}
	f, ok := p.fields(n, "envoy", "domain", "tenant_key", "route_key", "operation_key")
	if !ok {
		return e
	}
	read := func(name string, re *regexp.Regexp, dst *string) {
		if v := f.get(name); v != nil {
			path := join("envoy", name)
			if s, ok := p.str(v, path); ok {
				if !re.MatchString(s) {
					p.errf(v.Line, path, "%q must match %s", s, re)
					return
				}
				*dst = s
			}
		}
	}
	read("domain", reDomain, &e.Domain)
	read("tenant_key", reDescriptr, &e.TenantKey)
	read("route_key", reDescriptr, &e.RouteKey)
	read("operation_key", reDescriptr, &e.OperationKey)
	if e.TenantKey == e.RouteKey || e.TenantKey == e.OperationKey || e.RouteKey == e.OperationKey {
		p.errf(n.Line, "envoy", "tenant_key, route_key and operation_key must be different descriptor keys (got %q, %q, %q)",
			e.TenantKey, e.RouteKey, e.OperationKey)
	}
	return e
}

var ruleFields = []string{"name", "description", "routes", "operations", "limit", "burst", "cost", "scope",
	"regions", "on_failure", "retry_after_on_failure", "emergency", "shadow", "headers", "lease", "overrides"}

var defaultRuleFields = []string{"description", "limit", "burst", "cost", "scope",
	"regions", "on_failure", "retry_after_on_failure", "emergency", "shadow", "headers", "lease", "overrides"}

// quotaCheck is an effective quota the rule's costs and emergency bucket are checked against.
type quotaCheck struct {
	what string
	q    Quota
}

func (p *parser) rule(s *Set, n *yaml.Node, path string, isDefault bool) *ruleSrc {
	known := ruleFields
	if isDefault {
		known = defaultRuleFields
	}
	f, ok := p.fields(n, path, known...)
	if !ok {
		return nil
	}
	nerr := p.count()
	r := &Rule{Line: n.Line, Default: isDefault, FailureRetryAfter: DefaultFailureRetryAfter, cost: 1}
	src := &ruleSrc{rule: r, path: path}

	if isDefault {
		r.Name = DefaultRuleName
	} else if v := f.get("name"); v == nil {
		p.errf(n.Line, join(path, "name"), "required")
	} else if name, ok := p.str(v, join(path, "name")); ok {
		switch {
		case !reRuleName.MatchString(name):
			p.errf(v.Line, join(path, "name"), "%q must match %s", name, reRuleName)
		case name == DefaultRuleName:
			p.errf(v.Line, join(path, "name"), "%q is reserved for the default section", name)
		case s.byName[name] != nil:
			p.errf(v.Line, join(path, "name"), "rule %q is already defined on line %d", name, s.byName[name].Line)
		default:
			r.Name = name
			s.byName[name] = r
		}
	}
	if v := f.get("description"); v != nil {
		if d, ok := p.str(v, join(path, "description")); ok {
			if len(d) > maxDescription {
				p.errf(v.Line, join(path, "description"), "longer than %d bytes", maxDescription)
			}
			r.Description = d
		}
	}
	if !isDefault {
		p.ruleRoutes(s, f, src)
	}

	// Quota, scope and regions.
	r.Quota, ok = p.quota(f.get("limit"), f.get("burst"), path, n.Line)
	quotaOK := ok
	if v := f.get("scope"); v != nil {
		if sc, ok := p.str(v, join(path, "scope")); ok {
			switch sc {
			case "global":
				r.Scope = Global
			case "regional":
				r.Scope = Regional
			default:
				p.errf(v.Line, join(path, "scope"), "%q must be global or regional", sc)
			}
		}
	}
	regionsNode := f.get("regions")
	switch {
	case r.Scope == Regional && regionsNode == nil:
		p.errf(n.Line, join(path, "regions"), "required with scope: regional (the per-region slices of the quota)")
	case r.Scope == Global && regionsNode != nil:
		p.errf(f.at("regions"), join(path, "regions"), "only allowed with scope: regional")
	case regionsNode != nil:
		r.Regions = p.regions(regionsNode, join(path, "regions"), f.at("regions"), r.Quota, quotaOK)
	}

	// Failure mode.
	if v := f.get("on_failure"); v != nil {
		if m, ok := p.str(v, join(path, "on_failure")); ok {
			switch m {
			case "deny":
				r.OnFailure = Deny
			case "emergency":
				r.OnFailure = Emergency
			default:
				p.errf(v.Line, join(path, "on_failure"), "%q must be deny or emergency", m)
			}
		}
	}
	if v := f.get("retry_after_on_failure"); v != nil {
		fp := join(path, "retry_after_on_failure")
		if r.OnFailure != Deny {
			p.errf(v.Line, fp, "applies only to on_failure: deny (an empty emergency bucket answers 429 with its own Retry-After)")
		} else if ds, ok := p.str(v, fp); ok {
			d, err := parsePeriod(ds)
			switch {
			case err != nil:
				p.errf(v.Line, fp, "%v", err)
			case d > maxFailureRetryAfter:
				p.errf(v.Line, fp, "%s is longer than %s", d, maxFailureRetryAfter)
			default:
				r.FailureRetryAfter = d
			}
		}
	}
	emNode := f.get("emergency")
	switch {
	case r.OnFailure == Emergency && emNode == nil:
		p.errf(n.Line, join(path, "emergency"), "required with on_failure: emergency (the local emergency bucket's limit and burst)")
	case r.OnFailure == Deny && emNode != nil:
		p.errf(f.at("emergency"), join(path, "emergency"), "only used with on_failure: emergency; this rule fails closed (deny)")
	case emNode != nil:
		if q, ok := p.emergency(emNode, join(path, "emergency")); ok {
			r.Emergency = &q
		}
	}

	if v := f.get("shadow"); v != nil {
		r.Shadow, _ = p.boolean(v, join(path, "shadow"))
	}
	if v := f.get("headers"); v != nil {
		r.Headers, _ = p.boolean(v, join(path, "headers"))
	}
	if v := f.get("lease"); v != nil {
		// on/off as written in the docs; true/false as YAML spells a switch.
		fp := join(path, "lease")
		if v.Tag == "!!bool" {
			on, _ := p.boolean(v, fp)
			r.Direct = !on
		} else if m, ok := p.str(v, fp); ok {
			switch m {
			case "on":
				r.Direct = false
			case "off":
				r.Direct = true
			default:
				p.errf(v.Line, fp, "%q must be on or off", m)
			}
		}
	}

	// Costs, by operation entry.
	entries := r.Operations
	if isDefault {
		entries = append(append([]string(nil), s.classes...), AnyOperation)
	}
	r.costs = map[string]int64{}
	costLine := n.Line
	if v := f.get("cost"); v != nil {
		costLine = v.Line
		p.costs(v, join(path, "cost"), r, entries)
	}

	// Overrides.
	var ovs []*override
	if v := f.get("overrides"); v != nil {
		ovs = p.overrides(v, join(path, "overrides"), r)
	}
	if p.count() > nerr {
		return nil
	}

	// Cross-field checks: costs within every burst; emergency below every main quota it backs up.
	base := quotaChecks("the rule's limit", r.Quota, r.Regions)
	all := append([]quotaCheck(nil), base...)
	for _, o := range ovs {
		all = append(all, quotaChecks(fmt.Sprintf("tenant %q's override", o.tenant), o.quota, o.regions)...)
	}
	maxCost, maxOp := int64(1), ""
	for _, op := range entries {
		if c := r.Cost(op); c > maxCost {
			maxCost, maxOp = c, op
		}
	}
	costWhat := fmt.Sprintf("cost %d of operation %s", maxCost, maxOp)
	for _, c := range all {
		if maxCost > c.q.Burst {
			p.errf(costLine, join(path, "cost"), "%s exceeds burst %d of %s: such a request could never be allowed",
				costWhat, c.q.Burst, c.what)
		}
	}
	ovPath := func(o *override) string { return index(join(path, "overrides"), o.tenant) }
	switch {
	case r.OnFailure == Emergency && r.Emergency != nil:
		ems := []Quota{*r.Emergency}
		for _, c := range base {
			p.checkEmergency(f.at("emergency"), join(path, "emergency"), "emergency", *r.Emergency, c)
		}
		for _, o := range ovs {
			em, field, label := *r.Emergency, ovPath(o), "the rule's emergency"
			if o.emergency != nil {
				em, field, label = *o.emergency, field+".emergency", "emergency"
				ems = append(ems, em)
			}
			for _, c := range quotaChecks(fmt.Sprintf("tenant %q's override", o.tenant), o.quota, o.regions) {
				p.checkEmergency(o.line, field, label, em, c)
			}
		}
		for _, em := range ems {
			if maxCost > em.Burst {
				p.errf(costLine, join(path, "cost"), "%s exceeds the emergency burst %d: the emergency bucket could never allow it",
					costWhat, em.Burst)
			}
		}
	case r.OnFailure == Deny:
		for _, o := range ovs {
			if o.emergency != nil {
				p.errf(o.line, ovPath(o)+".emergency", "only used with on_failure: emergency; this rule fails closed (deny)")
			}
		}
	}
	if p.count() > nerr {
		return nil
	}

	// Precompute the effective limits.
	var em *Quota
	if r.OnFailure == Emergency {
		em = r.Emergency
	}
	r.base = makeLimits(r.Quota, r.Scope, r.Regions, em, false)
	r.overrides = map[string]*override{}
	for _, o := range ovs {
		oe := em
		if o.emergency != nil {
			oe = o.emergency
		}
		o.limits = makeLimits(o.quota, r.Scope, o.regions, oe, true)
		r.overrides[o.tenant] = o
	}
	if isDefault {
		s.def = r
	} else {
		s.rules = append(s.rules, r)
	}
	s.byName[r.Name] = r
	return src
}

func (p *parser) checkEmergency(line int, field, label string, em Quota, c quotaCheck) {
	if em.Burst >= c.q.Burst || rateCmp(em, c.q) >= 0 {
		p.errf(line, field, "%s %s must be strictly smaller than %s (%s) in both rate and burst",
			label, em, c.what, c.q)
	}
}

// quotaChecks lists the quotas a limit enforces: itself, or its region slices.
func quotaChecks(what string, q Quota, regions []RegionQuota) []quotaCheck {
	if regions == nil {
		return []quotaCheck{{what, q}}
	}
	out := make([]quotaCheck, len(regions))
	for i, rq := range regions {
		out[i] = quotaCheck{fmt.Sprintf("%s region %s", what, rq.Region), rq.Quota}
	}
	return out
}

// rateCmp compares the refill rates Requests/Period of a and b.
func rateCmp(a, b Quota) int {
	l := new(big.Int).Mul(big.NewInt(a.Requests), big.NewInt(int64(b.Period)))
	r := new(big.Int).Mul(big.NewInt(b.Requests), big.NewInt(int64(a.Period)))
	return l.Cmp(r)
}

func makeLimits(q Quota, scope Scope, regions []RegionQuota, em *Quota, override bool) tenantLimits {
	if scope == Global {
		return tenantLimits{global: &Limits{Quota: q, Fingerprint: fingerprint(q, Global, ""), Scope: Global,
			Override: override, Emergency: em}}
	}
	tl := tenantLimits{regions: map[string]*Limits{}}
	for _, rq := range regions {
		tl.regions[rq.Region] = &Limits{Quota: rq.Quota, Fingerprint: fingerprint(rq.Quota, Regional, rq.Region),
			Scope: Regional, Region: rq.Region, Override: override, Emergency: em}
	}
	return tl
}

// list reads field of the rule at path: a list, required (what it holds, for the error when it is
// missing) and not empty (one names an item). ok is false when it is missing or not a list.
func (p *parser) list(f fieldSet, path, field, what, one string) (items []*yaml.Node, ok bool) {
	fp := join(path, field)
	v := f.get(field)
	if v == nil {
		p.errf(f.line, fp, "required: %s", what)
		return nil, false
	}
	if items, ok = p.seq(v, fp); ok && len(items) == 0 {
		p.errf(v.Line, fp, "must list at least one %s", one)
	}
	return items, ok
}

func (p *parser) ruleRoutes(s *Set, f fieldSet, src *ruleSrc) {
	r, path := src.rule, src.path
	if items, ok := p.list(f, path, "routes", "the route templates the rule applies to", "template"); ok {
		shapes := map[string]int{}
		for i, it := range items {
			fp := fmt.Sprintf("%s.routes[%d]", path, i)
			raw, ok := p.str(it, fp)
			if !ok {
				continue
			}
			t, err := parseTemplate(raw)
			if err != nil {
				p.errf(it.Line, fp, "%v", err)
				continue
			}
			if first, dup := shapes[t.shape]; dup {
				p.errf(it.Line, fp, "template %q matches the same paths as %q on line %d", raw, items[first].Value, items[first].Line)
				continue
			}
			shapes[t.shape] = i
			r.Templates = append(r.Templates, raw)
			src.tmpls = append(src.tmpls, t)
			src.tmplLines = append(src.tmplLines, it.Line)
		}
	}
	if items, ok := p.list(f, path, "operations", "classes (read, write), named operations or HTTP methods", "operation"); ok {
		seen := map[string]bool{}
		for i, it := range items {
			fp := fmt.Sprintf("%s.operations[%d]", path, i)
			op, ok := p.str(it, fp)
			if !ok {
				continue
			}
			if _, known := s.ops[op]; !known {
				p.errf(it.Line, fp, "unknown operation %q: not a class (%s), a named operation or an HTTP method of this policy",
					op, strings.Join(s.classes, ", "))
				continue
			}
			if seen[op] {
				p.errf(it.Line, fp, "operation %q is listed twice", op)
				continue
			}
			seen[op] = true
			r.Operations = append(r.Operations, op)
		}
	}
}

// quota reads limit and burst of a mapping (rule, region, override or emergency) at path.
// Burst defaults to the limit's request count.
func (p *parser) quota(limitN, burstN *yaml.Node, path string, line int) (Quota, bool) {
	var (
		reqs   int64
		period time.Duration
		ok     = true
	)
	if limitN == nil {
		p.errf(line, join(path, "limit"), "required: requests per period, such as 100/minute")
		ok = false
	} else if ls, sok := p.str(limitN, join(path, "limit")); !sok {
		ok = false
	} else {
		var err error
		if reqs, period, err = parseLimit(ls); err != nil {
			p.errf(limitN.Line, join(path, "limit"), "%v", err)
			ok = false
		}
	}
	burst := reqs
	blLine, blField := line, join(path, "limit")
	if limitN != nil {
		blLine = limitN.Line
	}
	if burstN != nil {
		var bok bool
		if burst, bok = p.integer(burstN, join(path, "burst")); !bok {
			return Quota{}, false
		}
		blLine, blField = burstN.Line, join(path, "burst")
		if burst < 1 {
			p.errf(burstN.Line, join(path, "burst"), "%d must be at least 1 (the bucket's capacity in tokens)", burst)
			return Quota{}, false
		}
	}
	if !ok {
		return Quota{}, false
	}
	q, err := makeQuota(reqs, period, burst)
	if err != nil {
		p.errf(blLine, blField, "%v", err)
		return Quota{}, false
	}
	return q, true
}

// maxTokens is the largest token count whose microtokens stay exact (below 2^53).
const maxTokens = bucket.MaxExact / int64(bucket.PerToken)

func makeQuota(reqs int64, period time.Duration, burst int64) (Quota, error) {
	if reqs > maxTokens || burst > maxTokens {
		return Quota{}, fmt.Errorf("%d/%s burst %d: %w: more than %d tokens", reqs, FormatPeriod(period), burst, bucket.ErrUnrepresentable, maxTokens)
	}
	bl, err := bucket.NewLimit(bucket.Micro(burst)*bucket.PerToken, bucket.Micro(reqs)*bucket.PerToken,
		bucket.Millis(period/time.Millisecond))
	if err != nil {
		return Quota{}, fmt.Errorf("%d/%s burst %d: %w", reqs, FormatPeriod(period), burst, err)
	}
	return Quota{Requests: reqs, Period: period, Burst: burst, Bucket: bl}, nil
}

// parseLimit reads "N/period": N a whole number of requests, period a unit (second, minute, hour,
// day, or s, m, h, d) or a duration ("30s", "1m30s", "2d").
func parseLimit(s string) (int64, time.Duration, error) {
	ns, ps, ok := strings.Cut(s, "/")
	if !ok {
		return 0, 0, fmt.Errorf("%q must be requests/period, such as 100/minute or 10/30s", s)
	}
	ns, ps = strings.TrimSpace(ns), strings.TrimSpace(ps)
	if ns == "" || strings.Trim(ns, "0123456789") != "" {
		return 0, 0, fmt.Errorf("%q: requests %q must be a whole number", s, ns)
	}
	n, err := strconv.ParseInt(ns, 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("%q: requests %q is out of range", s, ns)
	}
	if n < 1 {
		return 0, 0, fmt.Errorf("%q: the limit must allow at least 1 request per period", s)
	}
	d, err := parsePeriod(ps)
	if err != nil {
		return 0, 0, fmt.Errorf("%q: %w", s, err)
	}
	return n, d, nil
}

var unitPeriods = map[string]time.Duration{
	"s": time.Second, "sec": time.Second, "second": time.Second,
	"m": time.Minute, "min": time.Minute, "minute": time.Minute,
	"h": time.Hour, "hour": time.Hour,
	"d": 24 * time.Hour, "day": 24 * time.Hour,
}

// parsePeriod reads a period: a unit word or a duration in whole milliseconds, at least 1 ms.
// Besides time.ParseDuration's units it accepts whole days ("7d").
func parsePeriod(s string) (time.Duration, error) {
	if d, ok := unitPeriods[s]; ok {
		return d, nil
	}
	var d time.Duration
	if days, ok := strings.CutSuffix(s, "d"); ok && days != "" && strings.Trim(days, "0123456789") == "" {
		n, err := strconv.ParseInt(days, 10, 64)
		if err != nil || n > int64(math.MaxInt64/(24*time.Hour)) {
			return 0, fmt.Errorf("period %q is too long", s)
		}
		d = time.Duration(n) * 24 * time.Hour
	} else {
		var err error
		if d, err = time.ParseDuration(s); err != nil {
			return 0, fmt.Errorf("period %q must be second, minute, hour, day or a duration such as 30s, 1m30s, 2d", s)
		}
	}
	switch {
	case d < time.Millisecond:
		return 0, fmt.Errorf("period %q must be at least 1ms", s)
	case d%time.Millisecond != 0:
		return 0, fmt.Errorf("period %q must be a whole number of milliseconds", s)
	}
	return d, nil
}

func (p *parser) emergency(n *yaml.Node, path string) (Quota, bool) {
	f, ok := p.fields(n, path, "limit", "burst")
	if !ok {
		return Quota{}, false
	}
	return p.quota(f.get("limit"), f.get("burst"), path, n.Line)
}

// regions reads the slices of a regional quota and checks that they sum to total.
func (p *parser) regions(n *yaml.Node, path string, line int, total Quota, totalOK bool) []RegionQuota {
	es := p.entries(n, path, "regions to their limit and burst")
	if len(es) == 0 {
		if n.Kind == yaml.MappingNode {
			p.errf(line, path, "must list at least one region")
		}
		return nil
	}
	if len(es) > MaxRegions {
		p.errf(line, path, "more than %d regions", MaxRegions)
		return nil
	}
	var out []RegionQuota
	ok := true
	for _, e := range es {
		rp := index(path, e.key)
		if !reRegion.MatchString(e.key) {
			p.errf(e.line, rp, "region %q must match %s", e.key, reRegion)
			ok = false
			continue
		}
		f, fok := p.fields(e.val, rp, "limit", "burst")
		if !fok {
			ok = false
			continue
		}
		q, qok := p.quota(f.get("limit"), f.get("burst"), rp, e.val.Line)
		if !qok {
			ok = false
			continue
		}
		out = append(out, RegionQuota{Region: e.key, Quota: q})
	}
	if !ok || !totalOK {
		return nil
	}
	// Compare rates as exact fractions, shown in requests per the rule's period.
	var burst int64
	perPeriod := new(big.Rat)
	parts := make([]string, len(out))
	for i, rq := range out {
		burst += rq.Burst
		num := new(big.Int).Mul(big.NewInt(rq.Requests), big.NewInt(total.Period.Milliseconds()))
		perPeriod.Add(perPeriod, new(big.Rat).SetFrac(num, big.NewInt(rq.Period.Milliseconds())))
		parts[i] = fmt.Sprintf("%s %s", rq.Region, rq.Quota)
	}
	if burst != total.Burst {
		p.errf(line, path, "region bursts sum to %d, but the rule's burst is %d (%s): slices must sum to the global quota",
			burst, total.Burst, strings.Join(parts, ", "))
	}
	if perPeriod.Cmp(big.NewRat(total.Requests, 1)) != 0 {
		p.errf(line, path, "region limits sum to %s/%s, but the rule's limit is %d/%s (%s): slices must sum to the global quota",
			perPeriod.RatString(), FormatPeriod(total.Period), total.Requests, FormatPeriod(total.Period), strings.Join(parts, ", "))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Region < out[j].Region })
	return out
}

func (p *parser) costs(n *yaml.Node, path string, r *Rule, entries []string) {
	set := func(op string, v *yaml.Node, fp string) {
		c, ok := p.integer(v, fp)
		if !ok {
			return
		}
		if c < 1 {
			p.errf(v.Line, fp, "%d must be at least 1 token", c)
			return
		}
		r.costs[op] = c
	}
	if n.Kind == yaml.ScalarNode {
		if c, ok := p.integer(n, path); ok {
			if c < 1 {
				p.errf(n.Line, path, "%d must be at least 1 token", c)
				return
			}
			r.cost = c
		}
		return
	}
	for _, e := range p.entries(n, path, "operations to costs") {
		fp := index(path, e.key)
		if !slices.Contains(entries, e.key) {
			p.errf(e.line, fp, "%q is not an operation of this rule (%s)", e.key, strings.Join(entries, ", "))
			continue
		}
		set(e.key, e.val, fp)
	}
}

func (p *parser) overrides(n *yaml.Node, path string, r *Rule) []*override {
	var out []*override
	for _, e := range p.entries(n, path, "tenants to their limits") {
		op := index(path, e.key)
		if err := ValidTenant(e.key); err != nil {
			p.errf(e.line, op, "%s", strings.TrimPrefix(err.Error(), "policy: "))
			continue
		}
		f, ok := p.fields(e.val, op, "limit", "burst", "regions", "emergency")
		if !ok {
			continue
		}
		o := &override{tenant: e.key, line: e.line}
		q, qok := p.quota(f.get("limit"), f.get("burst"), op, e.val.Line)
		o.quota = q
		rn := f.get("regions")
		switch {
		case r.Scope == Regional && rn == nil:
			p.errf(e.val.Line, join(op, "regions"), "required: the rule is regional, so the override needs its own slices")
		case r.Scope == Global && rn != nil:
			p.errf(f.at("regions"), join(op, "regions"), "only allowed when the rule has scope: regional")
		case rn != nil:
			o.regions = p.regions(rn, join(op, "regions"), f.at("regions"), q, qok)
			if o.regions != nil && !sameRegions(o.regions, r.Regions) {
				p.errf(f.at("regions"), join(op, "regions"), "must name the same regions as the rule (%s)", regionNames(r.Regions))
			}
		}
		if en := f.get("emergency"); en != nil {
			if eq, ok := p.emergency(en, join(op, "emergency")); ok {
				o.emergency = &eq
			}
		}
		out = append(out, o)
	}
	return out
}

func sameRegions(a, b []RegionQuota) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Region != b[i].Region {
			return false
		}
	}
	return true
}

func regionNames(rs []RegionQuota) string {
	names := make([]string, len(rs))
	for i, r := range rs {
		names[i] = r.Region
	}
	return strings.Join(names, ", ")
}

// routes builds the routes of every rule, the matcher's trie and the wire references, and rejects
// ties: two rules claiming one (template shape, operation).
func (p *parser) routes(s *Set, srcs []*ruleSrc) {
	total := len(s.classes) + 1
	for _, src := range srcs {
		total += len(src.tmpls) * len(src.rule.Operations)
	}
	if total > MaxRoutes {
		p.errf(0, "rules", "%d routes (rule × template × operation), more than %d", total, MaxRoutes)
		return
	}
	add := func(r *Rule, t template, op string, line int, field string) int32 {
		maxRegion := 0
		for _, rq := range r.Regions {
			maxRegion = max(maxRegion, escapedLen(rq.Region))
		}
		rt := &route{set: s, rule: r, id: uint32(len(s.routes)), tmpl: t, op: op, cost: r.Cost(op),
			maxKey: maxKeyLen(t.shape, op, maxRegion)}
		if rt.maxKey > MaxKeyLen {
			p.errf(line, field, "template %q with operation %q makes bucket keys of up to %d bytes, more than %d: shorten it",
				t.raw, op, rt.maxKey, MaxKeyLen)
		}
		s.routes = append(s.routes, rt)
		s.refs[routeRef{r.Name, t.raw, op}] = rt.id
		return int32(rt.id)
	}
	type claim struct {
		rule string
		tmpl string
		line int
	}
	claims := map[[2]string]claim{}
	for _, src := range srcs {
		r := src.rule
		if r.Default {
			continue
		}
		for ti, t := range src.tmpls {
			field := fmt.Sprintf("%s.routes[%d]", src.path, ti)
			for _, op := range r.Operations {
				k := [2]string{t.shape, op}
				if c, dup := claims[k]; dup {
					p.errf(src.tmplLines[ti], field,
						"template %q with operation %q is also claimed by rule %q (template %q, line %d): the most specific match would be a tie",
						t.raw, op, c.rule, c.tmpl, c.line)
					continue
				}
				claims[k] = claim{r.Name, t.raw, src.tmplLines[ti]}
				id := add(r, t, op, src.tmplLines[ti], field)
				end := s.root.insert(t)
				end.ends = append(end.ends, endEntry{op: s.ops[op].exact, route: id})
			}
		}
	}
	s.defByClass = map[int32]int32{}
	for _, c := range s.classes {
		s.defByClass[s.ops[c].exact] = add(s.def, template{}, c, s.def.Line, "default")
	}
	s.defAny = add(s.def, template{}, AnyOperation, s.def.Line, "default")
}

// digest hashes a canonical rendering of everything the Set means: sorted, independent of
// formatting, comments and the order of rules, templates or map entries.
func digest(s *Set) string {
	var b strings.Builder
	fmt.Fprintf(&b, "leasebucket-policy-v1\nversion %q\n", s.version)
	for _, m := range sortedKeys(s.methods) {
		fmt.Fprintf(&b, "method %q %q\n", m, s.methods[m])
	}
	for _, o := range sortedKeys(s.named) {
		fmt.Fprintf(&b, "operation %q %q\n", o, s.named[o])
	}
	fmt.Fprintf(&b, "envoy %q %q %q %q\n", s.envoy.Domain, s.envoy.TenantKey, s.envoy.RouteKey, s.envoy.OperationKey)
	rules := append(s.Rules(), s.def)
	sort.Slice(rules, func(i, j int) bool { return rules[i].Name < rules[j].Name })
	q := func(q Quota) string { return fmt.Sprintf("%d/%d/%d", q.Requests, q.Period.Milliseconds(), q.Burst) }
	for _, r := range rules {
		fmt.Fprintf(&b, "rule %q default=%t\n description %q\n", r.Name, r.Default, r.Description)
		fmt.Fprintf(&b, " templates %q\n", sorted(r.Templates))
		fmt.Fprintf(&b, " operations %q\n", sorted(r.Operations))
		fmt.Fprintf(&b, " quota %s scope %s\n", q(r.Quota), r.Scope)
		for _, rq := range r.Regions {
			fmt.Fprintf(&b, " region %q %s\n", rq.Region, q(rq.Quota))
		}
		fmt.Fprintf(&b, " on_failure %s retry %d", r.OnFailure, r.FailureRetryAfter.Milliseconds())
		if r.Emergency != nil {
			fmt.Fprintf(&b, " emergency %s", q(*r.Emergency))
		}
		fmt.Fprintf(&b, "\n shadow %t headers %t direct %t\n", r.Shadow, r.Headers, r.Direct)
		fmt.Fprintf(&b, " cost %d\n", r.cost)
		for _, op := range sortedKeys(r.costs) {
			fmt.Fprintf(&b, " cost %q %d\n", op, r.costs[op])
		}
		for _, t := range sortedKeys(r.overrides) {
			o := r.overrides[t]
			fmt.Fprintf(&b, " override %q %s", t, q(o.quota))
			for _, rq := range o.regions {
				fmt.Fprintf(&b, " region %q %s", rq.Region, q(rq.Quota))
			}
			if o.emergency != nil {
				fmt.Fprintf(&b, " emergency %s", q(*o.emergency))
			}
			b.WriteByte('\n')
		}
	}
	sum := sha256.Sum256([]byte(b.String()))
	return hex.EncodeToString(sum[:])
}

func sorted(s []string) []string {
	out := append([]string(nil), s...)
	slices.Sort(out)
	return out
}
