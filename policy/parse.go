package policy

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"sort"
	"time"

	"go.yaml.in/yaml/v3"
)

const (
	// MaxFileSize bounds a policy file: policies are hand-written, and the parser's memory must not
	// depend on what a mistaken deployment points it at.
	MaxFileSize = 4 << 20

	// MaxRoutes bounds the routes (rule × template × operation) of a Set; route IDs are dense.
	MaxRoutes = 1 << 16

	// MaxRegions bounds the slices of a regional rule.
	MaxRegions = 64

	// MaxLimits bounds the limits of one rule: with MaxTenantBudgets it keeps a check within
	// MaxCharges buckets, which the agent holds in an array on the stack (a check's cost grows
	// with each).
	MaxLimits = 4
	// MaxTenantBudgets bounds the tenant budgets (scope: tenant) of a Set: each may be charged by
	// every check.
	MaxTenantBudgets = 4
	// MaxCharges is the most buckets one check charges besides its route's own (its rule's
	// further limits and the tenant budgets' limits together).
	MaxCharges = MaxLimits + MaxTenantBudgets

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

// routes builds the routes of every rule, the matcher's trie and the wire references, and rejects
// ties: two rules claiming one (template shape, operation).
func (p *parser) routes(s *Set, srcs []*ruleSrc) {
	total := len(s.classes) + 1
	var budgets []*ruleSrc // tenant budgets, in file order
	for _, src := range srcs {
		total += len(src.tmpls) * len(src.rule.Operations) * (1 + len(src.rule.Extra))
		if src.rule.Scope == Tenant {
			budgets = append(budgets, src)
			total++
		}
	}
	if len(budgets) > MaxTenantBudgets {
		p.errf(budgets[MaxTenantBudgets].rule.Line, budgets[MaxTenantBudgets].path, "more than %d tenant budgets (scope: tenant)", MaxTenantBudgets)
		return
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
				for _, x := range r.Extra {
					xid := add(x, t, op, src.tmplLines[ti], field)
					s.routes[id].charges = append(s.routes[id].charges, uint32(xid))
				}
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
	for _, x := range s.def.Extra {
		for _, rt := range s.routes {
			if rt.rule == s.def {
				xid := add(x, template{}, rt.op, s.def.Line, "default")
				rt.charges = append(rt.charges, uint32(xid))
			}
		}
	}
	p.tenantBudgets(s, budgets, add)
	p.hashTags(s)
}

// hashTags gives a hash tag to the keys of every bucket that can be charged together with another
// (a route with charges and every route it charges), so that the buckets of one check share a
// Redis Cluster slot and direct mode takes them in one script. Such keys are two bytes longer.
func (p *parser) hashTags(s *Set) {
	for _, rt := range s.routes {
		if len(rt.charges) == 0 {
			continue
		}
		rt.tagged = true
		for _, id := range rt.charges {
			s.routes[id].tagged = true
		}
	}
	for _, rt := range s.routes {
		if !rt.tagged {
			continue
		}
		fits := rt.maxKey <= MaxKeyLen // else said already
		if rt.maxKey += tagLen; fits && rt.maxKey > MaxKeyLen {
			p.errf(rt.rule.Line, rt.rule.Name, "template %q with operation %q makes bucket keys of up to %d bytes with their hash tag, more than %d: shorten it",
				rt.tmpl.raw, rt.op, rt.maxKey, MaxKeyLen)
		}
	}
}

// tenantBudgets gives each tenant budget its route (one bucket per tenant, keyed by the shape
// "@name", which no template has) and charges it on every route whose operation it covers.
func (p *parser) tenantBudgets(s *Set, budgets []*ruleSrc, add func(*Rule, template, string, int, string) int32) {
	n := len(s.routes)
	for _, src := range budgets {
		b := src.rule
		id := uint32(add(b, template{shape: "@" + b.Name}, AnyOperation, b.Line, src.path))
		var xids []uint32
		for _, x := range b.Extra {
			xids = append(xids, uint32(add(x, template{shape: "@" + b.Name}, AnyOperation, b.Line, src.path)))
		}
		for _, rt := range s.routes[:n] {
			if rt.rule.Of != nil || !s.covers(b, rt.op) {
				continue
			}
			if rt.rule.Direct && b.Shadow && !rt.rule.Shadow {
				p.errf(rt.rule.Line, rt.rule.Name, "rule %q has lease: off, and tenant budget %q (line %d) covering its operation %s is a shadow rule: a direct check takes every bucket in one atomic take, which a shadow budget must never refuse (make the budget enforcing, or keep leases on the rule)",
					rt.rule.Name, b.Name, b.Line, rt.op)
				continue
			}
			for _, q := range append([]Quota{b.Quota}, extraQuotas(b)...) {
				if rt.rule.Direct && (q.Calendar != nil || rt.rule.Quota.Calendar != nil) {
					// Direct mode takes every bucket of the check in one atomic script of token buckets.
					p.errf(rt.rule.Line, rt.rule.Name, "rule %q has lease: off, and tenant budget %q (line %d) covers its operation %s: a direct check takes every bucket in one atomic script of token buckets, and %s is a calendar quota (keep leases on the rule)",
						rt.rule.Name, b.Name, b.Line, rt.op, calendarOf(rt.rule.Quota, q))
					break
				}
				if rt.cost > q.Burst {
					p.errf(b.Line, src.path, "rule %q's cost %d of operation %s exceeds the burst %d of tenant budget %q (%s): such a request could never be allowed",
						rt.rule.Name, rt.cost, rt.op, q.Burst, b.Name, q)
				}
			}
			before := len(rt.charges)
			rt.charges = append(rt.charges, id)
			rt.charges = append(rt.charges, xids...)
			if before <= MaxCharges && len(rt.charges) > MaxCharges {
				p.errf(b.Line, src.path, "rule %q's route %s %s would charge more than %d buckets besides its own with tenant budget %q",
					rt.rule.Name, cmp.Or(rt.tmpl.raw, "(default)"), rt.op, MaxCharges, b.Name)
			}
		}
	}
}

// calendarOf names the calendar quota of a direct route's own limit own or of a budget's limit q.
func calendarOf(own, q Quota) string {
	if own.Calendar != nil {
		return "the rule's limit " + own.String()
	}
	return "the budget's limit " + q.String()
}

func extraQuotas(r *Rule) []Quota {
	qs := make([]Quota, len(r.Extra))
	for i, x := range r.Extra {
		qs[i] = x.Quota
	}
	return qs
}

// covers reports whether tenant budget b is charged on routes of operation entry op: a budget
// without operations covers all; otherwise the entries of the classes it lists (the default
// rule's "*", unknown operations, only when it lists none).
func (s *Set) covers(b *Rule, op string) bool {
	if len(b.Operations) == 0 {
		return true
	}
	if op == AnyOperation {
		return false
	}
	for _, c := range b.Operations {
		if s.ops[op].class == s.ops[c].exact {
			return true
		}
	}
	return false
}
