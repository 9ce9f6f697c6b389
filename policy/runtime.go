package policy

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Runtime overrides are tenant overrides set while the system runs (by an operator through the
// coordinators' admin API) instead of in the policy file: for fleets with more tenants than a
// file should hold. A snapshot of them (Overrides) is applied to a file's Set by WithOverrides,
// which yields a new Set whose version is the file's version plus a digest of the snapshot, so
// that agents and coordinators that agree on the version agree on every tenant's limits.
//
// A runtime override has the fields of a file override (limit, burst, regions, emergency) and
// replaces the file's override of the same rule and tenant, if there is one.
const (
	// MaxRuntimeOverrides bounds the runtime overrides of a deployment: every agent holds all of
	// them (a few hundred bytes each) and receives them in one message when they change.
	MaxRuntimeOverrides = 20_000

	// MaxOverrideSpecLen bounds one override's spec: a regional override of MaxRegions slices
	// fits in it.
	MaxOverrideSpecLen = 4096

	// MaxOverridesBytes bounds the sum of len(rule)+len(tenant)+len(spec) over all runtime
	// overrides, so that a snapshot stays well inside gRPC's default 4 MiB message limit.
	MaxOverridesBytes = 3 << 20

	// maxFileVersion is the longest version a policy file may state (reVersion).
	maxFileVersion = 64

	// runtimeVersionSep joins a file's version and the digest of the runtime overrides applied.
	runtimeVersionSep = "+o"

	// MaxVersionLen bounds the version of any Set: a file's version plus the runtime suffix.
	MaxVersionLen = maxFileVersion + len(runtimeVersionSep) + FingerprintLen
)

var (
	// ErrUnknownRule is wrapped when a runtime override names a rule the policy does not have.
	ErrUnknownRule = errors.New("policy: unknown rule")
	// ErrInvalidOverride is wrapped when a runtime override cannot apply to its rule: a malformed
	// spec, an invalid tenant, or limits the rule's costs and failure mode do not allow.
	ErrInvalidOverride = errors.New("policy: invalid override")
	// ErrTooManyOverrides is wrapped when a snapshot breaks MaxRuntimeOverrides or
	// MaxOverridesBytes.
	ErrTooManyOverrides = errors.New("policy: too many runtime overrides")
)

// RuntimeOverride is one tenant's override of one rule, set at run time. Spec is a YAML mapping
// with the fields of a file override: "{limit: 1000/minute, burst: 100}".
type RuntimeOverride struct {
	Rule   string
	Tenant string
	Spec   string
}

// Size is what the override counts against MaxOverridesBytes.
func (o RuntimeOverride) Size() int { return len(o.Rule) + len(o.Tenant) + len(o.Spec) }

// Overrides is an immutable snapshot of the runtime overrides, sorted by rule and tenant, with
// the digest that names it. The zero number of overrides is the empty snapshot (digest "").
type Overrides struct {
	entries []RuntimeOverride
	specs   []overrideSpec // parsed entries[i].Spec, or its error
	digest  string
	bytes   int
}

// NewOverrides returns the snapshot of entries. It fails when two entries name the same rule and
// tenant or when the snapshot is larger than MaxRuntimeOverrides or MaxOverridesBytes; an entry
// that cannot apply to a policy does not fail it (WithOverrides reports that entry).
func NewOverrides(entries []RuntimeOverride) (*Overrides, error) {
	o := &Overrides{entries: slices.Clone(entries)}
	if len(o.entries) > MaxRuntimeOverrides {
		return nil, fmt.Errorf("%w: %d, at most %d", ErrTooManyOverrides, len(o.entries), MaxRuntimeOverrides)
	}
	slices.SortFunc(o.entries, func(a, b RuntimeOverride) int {
		if c := strings.Compare(a.Rule, b.Rule); c != 0 {
			return c
		}
		return strings.Compare(a.Tenant, b.Tenant)
	})
	h := sha256.New()
	_, _ = io.WriteString(h, "leasebucket-overrides-v1\n")
	o.specs = make([]overrideSpec, len(o.entries))
	for i, e := range o.entries {
		if i > 0 && e.Rule == o.entries[i-1].Rule && e.Tenant == o.entries[i-1].Tenant {
			return nil, fmt.Errorf("policy: runtime override of rule %q for tenant %q given twice", e.Rule, e.Tenant)
		}
		o.bytes += e.Size()
		o.specs[i] = parseSpec(e.Spec)
		_, _ = fmt.Fprintf(h, "%q %q %q\n", e.Rule, e.Tenant, e.Spec)
	}
	if o.bytes > MaxOverridesBytes {
		return nil, fmt.Errorf("%w: %d bytes, at most %d", ErrTooManyOverrides, o.bytes, MaxOverridesBytes)
	}
	if len(o.entries) > 0 {
		o.digest = hex.EncodeToString(h.Sum(nil))
	}
	return o, nil
}

// Len is the number of overrides.
func (o *Overrides) Len() int {
	if o == nil {
		return 0
	}
	return len(o.entries)
}

// Bytes is the snapshot's size as MaxOverridesBytes counts it.
func (o *Overrides) Bytes() int {
	if o == nil {
		return 0
	}
	return o.bytes
}

// Entries are the overrides, sorted by rule and tenant.
func (o *Overrides) Entries() []RuntimeOverride {
	if o == nil {
		return nil
	}
	return slices.Clone(o.entries)
}

// Digest is the SHA-256 (hex) of the snapshot's content; "" for no overrides.
func (o *Overrides) Digest() string {
	if o == nil {
		return ""
	}
	return o.digest
}

// OverrideProblem is a runtime override that WithOverrides did not apply, and why.
type OverrideProblem struct {
	Rule, Tenant string
	Err          error
}

func (p OverrideProblem) Error() string {
	return fmt.Sprintf("runtime override of rule %q for tenant %q: %v", p.Rule, p.Tenant, p.Err)
}

// runtimeLayer is what a Set made by WithOverrides knows beyond its content.
type runtimeLayer struct {
	base      *Set
	overrides *Overrides
	applied   map[[2]string]string // (rule, tenant) → spec of the overrides applied
	problems  []OverrideProblem
}

// WithOverrides returns the Set of s's policy file with the runtime overrides o applied: for
// each (rule, tenant) of o, the runtime override replaces the file's override, if any. An
// override that cannot apply to this policy (its rule is missing, its spec is invalid for the
// rule) is left out and reported; the result is a function of the file's content and o only, so
// every agent and coordinator that applies one snapshot to one file version gets the same Set.
//
// With overrides, the version is the file's version + "+o" + the first FingerprintLen hex digits
// of o's digest, and the digest covers the overrides. Without (o nil or empty) the result is the
// file's Set itself. s may itself carry overrides: they are replaced, not added to.
func (s *Set) WithOverrides(o *Overrides) (*Set, []OverrideProblem) {
	base := s.Base()
	if o.Len() == 0 {
		return base, nil
	}
	rt := &runtimeLayer{base: base, overrides: o, applied: make(map[[2]string]string, len(o.entries))}
	merged := map[*Rule]map[string]*override{}
	for i, e := range o.entries {
		r := base.byName[e.Rule]
		if r == nil {
			rt.problems = append(rt.problems, OverrideProblem{e.Rule, e.Tenant,
				fmt.Errorf("%w %q in policy version %s", ErrUnknownRule, e.Rule, base.version)})
			continue
		}
		ov, err := r.runtimeOverride(e.Tenant, o.specs[i])
		if err != nil {
			rt.problems = append(rt.problems, OverrideProblem{e.Rule, e.Tenant, err})
			continue
		}
		m := merged[r]
		if m == nil {
			m = maps.Clone(r.overrides)
			if m == nil {
				m = map[string]*override{}
			}
			merged[r] = m
		}
		m[e.Tenant] = ov
		rt.applied[[2]string{e.Rule, e.Tenant}] = e.Spec
	}

	ns := new(Set)
	*ns = *base
	ns.rt = rt
	ns.version = base.version + runtimeVersionSep + o.digest[:FingerprintLen]
	rules := make(map[*Rule]*Rule, len(merged)) // the file's rule → its copy with runtime overrides
	for r, m := range merged {
		c := new(Rule)
		*c = *r
		c.overrides = m
		rules[r] = c
	}
	remap := func(r *Rule) *Rule {
		if c := rules[r]; c != nil {
			return c
		}
		return r
	}
	ns.rules = make([]*Rule, len(base.rules))
	for i, r := range base.rules {
		ns.rules[i] = remap(r)
	}
	ns.def = remap(base.def)
	ns.byName = make(map[string]*Rule, len(base.byName))
	for name, r := range base.byName {
		ns.byName[name] = remap(r)
	}
	// Routes point to their Set and rule; the matcher and the wire references hold route IDs only,
	// which stay the same, so they are shared with the file's Set.
	ns.routes = make([]*route, len(base.routes))
	for i, r := range base.routes {
		c := new(route)
		*c = *r
		c.set, c.rule = ns, remap(r.rule)
		ns.routes[i] = c
	}
	ns.digest = digest(ns)
	return ns, slices.Clone(rt.problems)
}

// Base is the Set of the policy file alone: s without runtime overrides.
func (s *Set) Base() *Set {
	if s.rt != nil {
		return s.rt.base
	}
	return s
}

// Overrides is the runtime overrides snapshot applied to s, or nil.
func (s *Set) Overrides() *Overrides {
	if s.rt == nil {
		return nil
	}
	return s.rt.overrides
}

// OverrideProblems are the runtime overrides of the snapshot that did not apply to s.
func (s *Set) OverrideProblems() []OverrideProblem {
	if s.rt == nil {
		return nil
	}
	return slices.Clone(s.rt.problems)
}

// RuntimeOverride returns the spec of the runtime override that applies to rule and tenant in s,
// if one does (a file override of the same tenant is then replaced).
func (s *Set) RuntimeOverride(rule, tenant string) (spec string, ok bool) {
	if s.rt == nil {
		return "", false
	}
	spec, ok = s.rt.applied[[2]string{rule, tenant}]
	return spec, ok
}

// CheckOverride validates a runtime override of rule for tenant against the file's rules of s and
// returns it with its spec in canonical form (what is stored and compared). The error wraps
// ErrUnknownRule or ErrInvalidOverride and says what is wrong.
func (s *Set) CheckOverride(rule, tenant, spec string) (RuntimeOverride, error) {
	base := s.Base()
	r := base.byName[rule]
	if r == nil {
		return RuntimeOverride{}, fmt.Errorf("%w %q in policy version %s (rules: %s)", ErrUnknownRule, rule, base.version,
			strings.Join(slices.Sorted(maps.Keys(base.byName)), ", "))
	}
	ps := parseSpec(spec)
	if _, err := r.runtimeOverride(tenant, ps); err != nil {
		return RuntimeOverride{}, err
	}
	o := RuntimeOverride{Rule: rule, Tenant: tenant, Spec: ps.String()}
	if len(o.Spec) > MaxOverrideSpecLen {
		return RuntimeOverride{}, fmt.Errorf("%w: spec longer than %d bytes in canonical form", ErrInvalidOverride, MaxOverrideSpecLen)
	}
	return o, nil
}

// overrideSpec is a parsed spec, independent of the rule it is for.
type overrideSpec struct {
	quota     Quota
	regions   []RegionQuota // nil for a global override
	emergency *Quota
	err       error
}

// parseSpec reads a spec: a YAML mapping with the fields of a file override. On one line the
// braces may be left out ("limit: 100/minute, burst: 20").
func parseSpec(spec string) overrideSpec {
	bad := func(format string, args ...any) overrideSpec {
		return overrideSpec{err: fmt.Errorf("%w: %s", ErrInvalidOverride, fmt.Sprintf(format, args...))}
	}
	if len(spec) > MaxOverrideSpecLen {
		return bad("spec longer than %d bytes", MaxOverrideSpecLen)
	}
	src := strings.TrimSpace(spec)
	if src == "" {
		return bad("empty spec: want a mapping such as {limit: 100/minute, burst: 20}")
	}
	if !strings.HasPrefix(src, "{") && !strings.HasPrefix(src, "[") && !strings.Contains(src, "\n") {
		src = "{" + src + "}"
	}
	p := &parser{file: "override"}
	dec := yaml.NewDecoder(strings.NewReader(src))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		p.yamlError(err, []byte(src))
		return overrideSpec{err: specError(p.errs)}
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return bad("one YAML mapping expected, found more")
	}
	if p.noAliases(&doc); len(p.errs) > 0 {
		return overrideSpec{err: specError(p.errs)}
	}
	if doc.Kind != yaml.DocumentNode || len(doc.Content) != 1 {
		return bad("empty spec")
	}
	root := doc.Content[0]
	f, ok := p.fields(root, "", "limit", "burst", "quota", "regions", "emergency")
	if !ok {
		return overrideSpec{err: specError(p.errs)}
	}
	var ps overrideSpec
	var qok bool
	if qn := f.get("quota"); qn != nil {
		// A calendar quota in UTC until runtimeOverride gives it the rule's time zone.
		p.calendarOnly(f, "")
		ps.quota, qok = p.calendarQuota(qn, nil, "")
	} else {
		ps.quota, qok = p.quota(f.get("limit"), f.get("burst"), "", root.Line)
	}
	if rn := f.get("regions"); rn != nil {
		ps.regions = p.regions(rn, "regions", f.at("regions"), ps.quota, qok)
	}
	if en := f.get("emergency"); en != nil {
		if q, ok := p.emergency(en, "emergency"); ok {
			ps.emergency = &q
		}
	}
	if len(p.errs) > 0 {
		return overrideSpec{err: specError(p.errs)}
	}
	return ps
}

// specError joins the problems of a spec: "field: message; field: message".
func specError(errs []*FieldError) error {
	msgs := make([]string, len(errs))
	for i, e := range errs {
		if e.Field != "" {
			msgs[i] = e.Field + ": " + e.Msg
		} else {
			msgs[i] = e.Msg
		}
	}
	return fmt.Errorf("%w: %s", ErrInvalidOverride, strings.Join(msgs, "; "))
}

// String is the spec in canonical form: one line, fields in file order, periods as FormatPeriod
// writes them, regions sorted and quoted. Parsing it gives the same spec.
func (ps overrideSpec) String() string {
	var b strings.Builder
	quota := func(q Quota) {
		if q.Calendar != nil {
			fmt.Fprintf(&b, "{quota: %d/%s", q.Requests, q.Calendar.Unit)
			return
		}
		fmt.Fprintf(&b, "{limit: %d/%s, burst: %d", q.Requests, FormatPeriod(q.Period), q.Burst)
	}
	quota(ps.quota)
	if ps.regions != nil {
		b.WriteString(", regions: {")
		for i, rq := range ps.regions {
			if i > 0 {
				b.WriteString(", ")
			}
			b.WriteString(strconv.Quote(rq.Region) + ": ")
			quota(rq.Quota)
			b.WriteString("}")
		}
		b.WriteString("}")
	}
	if ps.emergency != nil {
		b.WriteString(", emergency: ")
		quota(*ps.emergency)
		b.WriteString("}")
	}
	b.WriteString("}")
	return b.String()
}

// runtimeOverride checks a parsed spec against the rule, as the file's checks do for a file
// override, and returns the override with its limits.
func (r *Rule) runtimeOverride(tenant string, ps overrideSpec) (*override, error) {
	if err := ValidTenant(tenant); err != nil {
		return nil, fmt.Errorf("%w: %s", ErrInvalidOverride, strings.TrimPrefix(err.Error(), "policy: "))
	}
	if ps.err != nil {
		return nil, ps.err
	}
	if r.Of != nil || len(r.Extra) > 0 {
		return nil, fmt.Errorf("%w: rule %q has several limits: overrides are not available for it", ErrInvalidOverride, cmp.Or(r.Of, r).Name)
	}
	p := &parser{file: "override"}
	switch {
	case r.Scope == Regional && ps.regions == nil:
		p.errf(0, "regions", "required: rule %q is regional, so the override needs its own slices (%s)", r.Name, regionNames(r.Regions))
	case r.Scope == Global && ps.regions != nil:
		p.errf(0, "regions", "only allowed when the rule has scope: regional; rule %q is global", r.Name)
	case ps.regions != nil && !sameRegions(ps.regions, r.Regions):
		p.errf(0, "regions", "must name the same regions as rule %q (%s)", r.Name, regionNames(r.Regions))
	case r.Quota.Calendar != nil && ps.quota.Calendar == nil:
		p.errf(0, "quota", "required: rule %q is a calendar quota (%s), so the override gives its own quota", r.Name, r.Quota)
	case r.Quota.Calendar == nil && ps.quota.Calendar != nil:
		p.errf(0, "quota", "only for a rule with a calendar quota; rule %q has a limit", r.Name)
	case r.Quota.Calendar != nil && ps.quota.Calendar.Unit != r.Quota.Calendar.Unit:
		p.errf(0, "quota", "rule %q's quota is per %s; an override keeps the period (and the rule's time zone)", r.Name, r.Quota.Calendar.Unit)
	case r.Quota.Calendar != nil:
		ps.quota.Calendar = r.Quota.Calendar
	}
	if len(p.errs) > 0 {
		return nil, specError(p.errs)
	}
	checks := quotaChecks("the override", ps.quota, ps.regions)
	maxCost, maxOp := r.cost, ""
	for _, op := range sortedKeys(r.costs) {
		if c := r.costs[op]; c > maxCost {
			maxCost, maxOp = c, op
		}
	}
	costWhat := fmt.Sprintf("rule %q's cost %d", r.Name, maxCost)
	if maxOp != "" {
		costWhat = fmt.Sprintf("rule %q's cost %d of operation %s", r.Name, maxCost, maxOp)
	}
	for _, c := range checks {
		if maxCost > c.q.Burst {
			p.errf(0, "burst", "%s exceeds burst %d of %s: such a request could never be allowed", costWhat, c.q.Burst, c.what)
		}
	}
	em := r.Emergency
	switch {
	case r.OnFailure == Deny && ps.emergency != nil:
		p.errf(0, "emergency", "only used with on_failure: emergency; rule %q fails closed (deny)", r.Name)
	case r.OnFailure == Emergency:
		label := "the rule's emergency"
		if ps.emergency != nil {
			em, label = ps.emergency, "emergency"
			if maxCost > em.Burst {
				p.errf(0, "emergency", "%s exceeds the emergency burst %d: the emergency bucket could never allow it", costWhat, em.Burst)
			}
		}
		for _, c := range checks {
			p.checkEmergency(0, "emergency", label, *em, c)
		}
	default:
		em = nil
	}
	if len(p.errs) > 0 {
		return nil, specError(p.errs)
	}
	return &override{tenant: tenant, quota: ps.quota, regions: ps.regions, emergency: ps.emergency,
		limits: makeLimits(ps.quota, r.Scope, ps.regions, em, true, r.MaxDebt)}, nil
}
