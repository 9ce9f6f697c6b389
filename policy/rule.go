package policy

import (
	"fmt"
	"slices"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/leasebucket/leasebucket/internal/calendar"
)

var ruleFields = []string{"name", "description", "routes", "operations", "limit", "burst", "quota", "timezone", "limits", "cost", "scope",
	"regions", "on_failure", "retry_after_on_failure", "emergency", "shadow", "headers", "lease", "max_debt", "overrides"}

var defaultRuleFields = []string{"description", "limit", "burst", "quota", "timezone", "limits", "cost", "scope",
	"regions", "on_failure", "retry_after_on_failure", "emergency", "shadow", "headers", "lease", "max_debt", "overrides"}

// rule reads the rule at path (the default section when isDefault) and adds it to s. It returns
// nil when the rule has problems; every problem is reported.
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

	p.ruleIdentity(s, f, r, path)
	// A tenant budget has no routes: read its scope first.
	if v := f.get("scope"); v != nil && v.Kind == yaml.ScalarNode && v.Value == "tenant" && !isDefault {
		r.Scope = Tenant
	}
	if !isDefault {
		p.ruleRoutes(s, f, src)
	}
	p.ruleQuota(f, r, path)
	p.ruleFailure(f, r, path)
	p.ruleSwitches(f, r, path)
	p.ruleDebt(f, r, path)
	entries, costLine := p.ruleCosts(s, f, r, path)
	var ovs []*override
	if v := f.get("overrides"); v != nil {
		ovs = p.overrides(v, join(path, "overrides"), r)
	}
	if p.count() > nerr {
		return nil
	}
	p.checkCharges(f, r, path)
	p.checkRule(f, r, path, ovs, entries, costLine)
	if p.count() > nerr {
		return nil
	}
	addRule(s, r, ovs)
	return src
}

// ruleIdentity reads the rule's name (the default rule has its own) and description.
func (p *parser) ruleIdentity(s *Set, f fieldSet, r *Rule, path string) {
	if r.Default {
		r.Name = DefaultRuleName
	} else if v := f.get("name"); v == nil {
		p.errf(f.line, join(path, "name"), "required")
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
}

// ruleQuota reads the rule's limit and burst (or its calendar quota and time zone), scope and
// region slices.
func (p *parser) ruleQuota(f fieldSet, r *Rule, path string) {
	var quotaOK bool
	if ln := f.get("limits"); ln != nil {
		quotaOK = p.ruleLimits(f, ln, r, path)
	} else if qn := f.get("quota"); qn != nil {
		p.calendarOnly(f, path)
		r.Quota, quotaOK = p.calendarQuota(qn, f.get("timezone"), path)
	} else {
		if f.get("timezone") != nil {
			p.errf(f.at("timezone"), join(path, "timezone"), "only used with quota (a calendar quota); a limit is a rolling token bucket")
		}
		r.Quota, quotaOK = p.quota(f.get("limit"), f.get("burst"), path, f.line)
	}
	if v := f.get("scope"); v != nil {
		if r.Default {
			if i, ok := p.oneOf(v, join(path, "scope"), "global", "regional"); ok {
				r.Scope = [...]Scope{Global, Regional}[i]
			}
		} else if i, ok := p.oneOf(v, join(path, "scope"), "global", "regional", "tenant"); ok {
			r.Scope = [...]Scope{Global, Regional, Tenant}[i]
		}
	}
	if r.Quota.Calendar != nil && r.Scope == Regional {
		p.errf(f.at("scope"), join(path, "scope"), "a calendar quota is global: one exact counter per period (regional slices need a limit)")
		return
	}
	regionsNode := f.get("regions")
	switch {
	case r.Scope == Regional && regionsNode == nil:
		p.errf(f.line, join(path, "regions"), "required with scope: regional (the per-region slices of the quota)")
	case r.Scope != Regional && regionsNode != nil:
		p.errf(f.at("regions"), join(path, "regions"), "only allowed with scope: regional")
	case regionsNode != nil:
		r.Regions = p.regions(regionsNode, join(path, "regions"), f.at("regions"), r.Quota, quotaOK)
	}
}

// ruleLimits reads a rule's `limits`: a list of limits ({limit, burst} or {quota, timezone}),
// all charged by each check. The first becomes the rule's Quota, the others its extra limits.
func (p *parser) ruleLimits(f fieldSet, ln *yaml.Node, r *Rule, path string) bool {
	lp := join(path, "limits")
	for _, other := range []string{"limit", "burst", "quota", "timezone"} {
		if f.get(other) != nil {
			p.errf(f.at(other), join(path, other), "not beside limits: list every limit of the rule under limits")
		}
	}
	items, ok := p.seq(ln, lp)
	if !ok {
		return false
	}
	switch {
	case len(items) == 0:
		p.errf(ln.Line, lp, "must list at least one limit")
		return false
	case len(items) > MaxLimits:
		p.errf(ln.Line, lp, "more than %d limits", MaxLimits)
		return false
	}
	var qs []Quota
	seen := map[string]int{}
	all := true
	for i, it := range items {
		fp := fmt.Sprintf("%s[%d]", lp, i)
		lf, ok := p.fields(it, fp, "limit", "burst", "quota", "timezone")
		if !ok {
			all = false
			continue
		}
		var q Quota
		if qn := lf.get("quota"); qn != nil {
			p.calendarOnly(lf, fp)
			q, ok = p.calendarQuota(qn, lf.get("timezone"), fp)
		} else {
			if lf.get("timezone") != nil {
				p.errf(lf.at("timezone"), join(fp, "timezone"), "only used with quota (a calendar quota); a limit is a rolling token bucket")
			}
			q, ok = p.quota(lf.get("limit"), lf.get("burst"), fp, it.Line)
		}
		if !ok {
			all = false
			continue
		}
		fpr := fingerprint(q, Global, "")
		if j, dup := seen[fpr]; dup {
			p.errf(it.Line, fp, "the same limit as limits[%d] (%s): list it once", j, q)
			all = false
			continue
		}
		seen[fpr] = i
		qs = append(qs, q)
	}
	if !all {
		return false
	}
	r.Quota, r.extra = qs[0], qs[1:]
	return true
}

// checkCharges checks what a rule charged beside others may not be: a rule of several limits and
// a tenant budget fail closed, and (a rule of several limits) has no overrides and no regional
// slices; a tenant budget charges each request's cost on its route, so it has none of its own,
// and keeps leases (its routes choose direct mode, not the budget). A rule of several limits
// in direct mode takes all of them in one atomic script: token buckets only (directCalendar).
func (p *parser) checkCharges(f fieldSet, r *Rule, path string) {
	what := ""
	switch {
	case r.Scope == Tenant:
		what = "a tenant budget"
		if f.get("cost") != nil {
			p.errf(f.at("cost"), join(path, "cost"), "a tenant budget is charged each request's cost on its route; it has no cost of its own")
		}
		if r.Direct {
			p.errf(f.at("lease"), join(path, "lease"), "a tenant budget is charged from leases by its leased routes, and in the atomic take of a route with lease: off: set lease: off on those routes' rules, not on the budget")
		}
	case len(r.extra) > 0:
		what = "a rule with several limits"
		if f.get("overrides") != nil {
			p.errf(f.at("overrides"), join(path, "overrides"), "not available for a rule with several limits (give the tenant a rule of its own)")
		}
		if r.Scope == Regional {
			p.errf(f.at("scope"), join(path, "scope"), "a rule with several limits is global")
		}
		if r.Direct {
			for i, q := range append([]Quota{r.Quota}, r.extra...) {
				if q.Calendar != nil {
					p.errf(f.at("lease"), join(path, "lease"), "lease: off takes every limit in one atomic script of token buckets; limit %d is a calendar quota (%s): keep leases, or give it a rule of its own", i+1, q)
					break
				}
			}
		}
	default:
		return
	}
	if r.OnFailure == Emergency {
		p.errf(f.at("on_failure"), join(path, "on_failure"), "%s fails closed: on_failure: deny (no emergency bucket)", what)
	}
}

// calendarOnly reports the fields a calendar quota leaves no room for: a limit and a burst (the
// quota is the whole capacity of its period).
func (p *parser) calendarOnly(f fieldSet, path string) {
	if f.get("limit") != nil {
		p.errf(f.at("limit"), join(path, "limit"), "a rule has either limit (a rolling token bucket) or quota (a calendar quota), not both")
	}
	if f.get("burst") != nil {
		p.errf(f.at("burst"), join(path, "burst"), "not used with quota: a calendar quota's capacity is the quota of its period")
	}
}

// ruleFailure reads what the rule does when the global state cannot be reached: on_failure,
// retry_after_on_failure and the emergency bucket.
func (p *parser) ruleFailure(f fieldSet, r *Rule, path string) {
	if v := f.get("on_failure"); v != nil {
		if i, ok := p.oneOf(v, join(path, "on_failure"), "deny", "emergency"); ok {
			r.OnFailure = [...]FailureMode{Deny, Emergency}[i]
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
	if r.Quota.Calendar != nil && (r.OnFailure == Emergency || emNode != nil) {
		// Every agent's emergency bucket would admit beside the period's exact count.
		line := f.at("on_failure")
		if line == 0 {
			line = f.at("emergency")
		}
		p.errf(line, join(path, "on_failure"), "a calendar quota fails closed: on_failure: deny (no emergency bucket)")
		return
	}
	switch {
	case r.OnFailure == Emergency && emNode == nil:
		p.errf(f.line, join(path, "emergency"), "required with on_failure: emergency (the local emergency bucket's limit and burst)")
	case r.OnFailure == Deny && emNode != nil:
		p.errf(f.at("emergency"), join(path, "emergency"), "only used with on_failure: emergency; this rule fails closed (deny)")
	case emNode != nil:
		if q, ok := p.emergency(emNode, join(path, "emergency")); ok {
			r.Emergency = &q
		}
	}
}

// ruleSwitches reads the rule's switches: shadow, headers and lease.
func (p *parser) ruleSwitches(f fieldSet, r *Rule, path string) {
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
		} else if i, ok := p.oneOf(v, fp, "on", "off"); ok {
			r.Direct = i == 1
		}
	}
}

// ruleDebt reads max_debt: how many tokens below zero costs settled after the response may take
// each of the rule's buckets (checkRule holds it within every burst).
func (p *parser) ruleDebt(f fieldSet, r *Rule, path string) {
	v := f.get("max_debt")
	if v == nil {
		return
	}
	fp := join(path, "max_debt")
	d, ok := p.integer(v, fp)
	switch {
	case !ok:
	case d < 0:
		p.errf(v.Line, fp, "%d must not be negative (tokens below zero a settled cost may take the bucket)", d)
	default:
		r.MaxDebt = d
	}
}

// ruleCosts reads the rule's costs. It returns the operation entries a cost may name (the default
// rule's are the classes and AnyOperation) and the line errors about costs point at.
func (p *parser) ruleCosts(s *Set, f fieldSet, r *Rule, path string) (entries []string, costLine int) {
	entries = r.Operations
	if r.Default {
		entries = append(append([]string(nil), s.classes...), AnyOperation)
	}
	r.costs = map[string]int64{}
	costLine = f.line
	if v := f.get("cost"); v != nil {
		costLine = v.Line
		p.costs(v, join(path, "cost"), r, entries)
	}
	return entries, costLine
}

// checkRule checks the rule's fields against each other: costs and max_debt within every burst
// (a calendar quota's is its quota), emergency below every main quota it backs up.
func (p *parser) checkRule(f fieldSet, r *Rule, path string, ovs []*override, entries []string, costLine int) {
	base := quotaChecks("the rule's limit", r.Quota, r.Regions)
	all := append([]quotaCheck(nil), base...)
	for i, q := range r.extra {
		all = append(all, quotaCheck{fmt.Sprintf("the rule's limit %d", i+2), q})
	}
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
	for _, c := range all {
		if r.MaxDebt > c.q.Burst {
			p.errf(f.at("max_debt"), join(path, "max_debt"), "%d exceeds burst %d of %s: a debt larger than the capacity is refused",
				r.MaxDebt, c.q.Burst, c.what)
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
}

// addRule precomputes the effective limits of a valid rule and its overrides and adds it to s.
func addRule(s *Set, r *Rule, ovs []*override) {
	var em *Quota
	if r.OnFailure == Emergency {
		em = r.Emergency
	}
	r.base = makeLimits(r.Quota, r.Scope, r.Regions, em, false, r.MaxDebt)
	r.overrides = map[string]*override{}
	for _, o := range ovs {
		oe := em
		if o.emergency != nil {
			oe = o.emergency
		}
		o.limits = makeLimits(o.quota, r.Scope, o.regions, oe, true, r.MaxDebt)
		r.overrides[o.tenant] = o
	}
	for i, q := range r.extra {
		x := &Rule{Name: fmt.Sprintf("%s#%d", r.Name, i+2), Description: r.Description, Line: r.Line, Default: r.Default,
			Templates: r.Templates, Operations: r.Operations, Quota: q, Scope: r.Scope, OnFailure: r.OnFailure,
			FailureRetryAfter: r.FailureRetryAfter, Shadow: r.Shadow, Headers: r.Headers, Direct: r.Direct,
			MaxDebt: r.MaxDebt, Of: r, Nth: i + 2, cost: r.cost, costs: r.costs, overrides: map[string]*override{}}
		x.base = makeLimits(q, r.Scope, nil, nil, false, r.MaxDebt)
		r.Extra = append(r.Extra, x)
		s.byName[x.Name] = x
	}
	r.extra = nil
	if r.Default {
		s.def = r
	} else {
		s.rules = append(s.rules, r)
	}
	s.byName[r.Name] = r
}

func (p *parser) ruleRoutes(s *Set, f fieldSet, src *ruleSrc) {
	r, path := src.rule, src.path
	if r.Scope == Tenant {
		// A tenant budget covers every route; operations, if listed, narrow it.
		if f.get("routes") != nil {
			p.errf(f.at("routes"), join(path, "routes"), "a tenant budget (scope: tenant) applies to every route of the tenant; it has no routes")
		}
		if f.get("operations") == nil {
			return
		}
	} else if items, ok := p.list(f, path, "routes", "the route templates the rule applies to", "template"); ok {
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
			if r.Scope == Tenant && !slices.Contains(s.classes, op) {
				p.errf(it.Line, fp, "a tenant budget lists classes (%s), not %q", strings.Join(s.classes, ", "), op)
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
		f, ok := p.fields(e.val, op, "limit", "burst", "quota", "regions", "emergency")
		if !ok {
			continue
		}
		o := &override{tenant: e.key, line: e.line}
		var q Quota
		var qok bool
		switch qn := f.get("quota"); {
		case r.Quota.Calendar != nil && qn == nil:
			p.errf(e.val.Line, join(op, "quota"), "required: the rule is a calendar quota, so the override gives its own quota (such as 1000000/month)")
			continue
		case r.Quota.Calendar == nil && qn != nil:
			p.errf(f.at("quota"), join(op, "quota"), "only for a rule with a calendar quota; this rule has a limit")
			continue
		case qn != nil:
			p.calendarOnly(f, op)
			q, qok = p.overrideCalendar(qn, op, r.Quota.Calendar)
			if !qok {
				continue
			}
		default:
			q, qok = p.quota(f.get("limit"), f.get("burst"), op, e.val.Line)
		}
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

// overrideCalendar reads an override's calendar quota: the same period and time zone as the
// rule's (rule), another count.
func (p *parser) overrideCalendar(n *yaml.Node, path string, rule *calendar.Period) (Quota, bool) {
	q, ok := p.calendarQuota(n, nil, path)
	if !ok {
		return Quota{}, false
	}
	if q.Calendar.Unit != rule.Unit {
		p.errf(n.Line, join(path, "quota"), "the rule's quota is per %s; an override keeps the period (and the rule's time zone)", rule.Unit)
		return Quota{}, false
	}
	q.Calendar = rule
	return q, true
}
