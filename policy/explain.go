package policy

import (
	"fmt"
	"strings"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

// Explanation says how a request resolves: which rule and why, which broader rules it replaces,
// the effective limit, the cost, the failure mode and the bucket key.
type Explanation struct {
	Tenant     string
	Path       string // as given
	Normalized string
	Operation  string // as given
	OpMeaning  string // how the Set reads the operation ("HTTP method of class read", ...)
	Region     string

	Route  Route
	Params []string // template bindings, such as "{id}=7"
	Why    string
	// Replaced are the other routes that match the request, most specific first; they are not
	// charged (a request is charged to exactly one bucket).
	Replaced []Candidate

	Limits *Limits
	Cost   int64
	Key    string
	// Also are the other buckets the request charges, all or nothing with Key: the rule's further
	// limits, then the tenant budgets covering the operation.
	Also []Charge

	Version string
	Digest  string
}

// Charge is one more bucket a request charges, and why.
type Charge struct {
	Route  Route
	Limits *Limits
	Key    string
	Why    string
}

// Candidate is a route that also matched but lost, and why.
type Candidate struct {
	Route  Route
	Reason string
}

// Explain resolves a request like Match, Limits, Cost and Key do, and says why. It is for the
// operator (lbpolicy explain, the agent's debug endpoint), not for the hot path.
func (s *Set) Explain(tenant, path, operation, region string) (Explanation, error) {
	e := Explanation{Tenant: tenant, Path: path, Operation: operation, Region: region,
		Version: s.version, Digest: s.digest}
	norm, err := Normalize(path)
	if err != nil {
		return e, err
	}
	e.Normalized = norm
	if e.Route, err = s.Match(norm, operation); err != nil {
		return e, err
	}
	ref, known := s.resolveOp(operation)
	switch {
	case !known:
		e.OpMeaning = "unknown to this policy"
	case ref.kind == opMethod:
		e.OpMeaning = "HTTP method of class " + s.opNames[ref.class]
	case ref.kind == opNamed:
		e.OpMeaning = "named operation of class " + s.opNames[ref.class]
	default:
		e.OpMeaning = "class"
	}

	var all []int32
	if known {
		if len(norm) == 1 {
			all = s.root.appendEnds(ref.exact, ref.class, nil)
		} else {
			all = s.root.collect(norm, 1, ref.exact, ref.class, nil)
		}
	}
	win := e.Route.r
	switch {
	case !known:
		e.Why = fmt.Sprintf("operation %q is not a class, named operation or HTTP method of this policy: the default rule applies", operation)
	case win.rule.Default:
		e.Why = fmt.Sprintf("no template of any rule matches %s for operation %s (or its class): the default rule applies", norm, operation)
	default:
		e.Params = win.tmpl.params(norm)
		how := "is listed by the rule"
		if win.op != operation {
			how = fmt.Sprintf("matches through its class %s", win.op)
		}
		e.Why = fmt.Sprintf("%s is the most specific template matching %s with an entry for the operation; operation %s %s",
			win.tmpl.raw, norm, operation, how)
	}
	for _, id := range all {
		c := s.routes[id]
		if c == win {
			continue
		}
		var reason string
		if c.tmpl.shape == win.tmpl.shape {
			reason = fmt.Sprintf("same template; the exact operation %s beats the class %s", win.op, c.op)
		} else {
			reason = "less specific template: " + precedence(win.tmpl, c.tmpl)
		}
		e.Replaced = append(e.Replaced, Candidate{Route: c.route(), Reason: reason})
	}

	if e.Limits, err = s.Limits(e.Route, tenant, region); err != nil {
		return e, err
	}
	e.Cost = s.Cost(e.Route)
	if e.Key, err = s.Key(e.Route, tenant, region); err != nil {
		return e, err
	}
	for _, id := range e.Route.Charges() {
		c := Charge{Route: s.RouteByID(id)}
		r := c.Route.Rule
		if c.Limits, err = s.Limits(c.Route, tenant, region); err != nil {
			return e, err
		}
		c.Key = s.KeyFor(c.Route, tenant, c.Limits)
		owner := r
		if r.Of != nil {
			owner = r.Of
		}
		if owner.Scope == Tenant {
			c.Why = fmt.Sprintf("tenant budget %s (line %d): every request of the tenant", owner.Name, owner.Line)
			if len(owner.Operations) > 0 {
				c.Why += " of " + strings.Join(owner.Operations, ", ")
			}
			if r.Of != nil {
				c.Why += fmt.Sprintf(", its limit %d", r.Nth)
			}
		} else {
			c.Why = fmt.Sprintf("limit %d of rule %s", r.Nth, owner.Name)
		}
		e.Also = append(e.Also, c)
	}
	return e, nil
}

// limitLine describes an effective limit in one line, with its max debt if it has one.
func limitLine(l *Limits) string {
	if l.MaxDebt > 0 {
		return baseLimitLine(l) + ", max debt " + microTokens(l.MaxDebt)
	}
	return baseLimitLine(l)
}

func baseLimitLine(l *Limits) string {
	if c := l.Calendar; c != nil {
		return fmt.Sprintf("%d per calendar %s in %s", l.Requests, c.Unit, c.Loc)
	}
	return fmt.Sprintf("%d per %s, burst %d", l.Requests, FormatPeriod(l.Period), l.Burst)
}

// String renders the explanation for a terminal, one fact per line.
func (e Explanation) String() string {
	var b strings.Builder
	line := func(k, format string, args ...any) {
		if k != "" {
			k += ":"
		}
		fmt.Fprintf(&b, "%-12s %s\n", k, fmt.Sprintf(format, args...))
	}
	r := e.Route.Rule
	line("policy", "version %s (digest %s)", e.Version, short(e.Digest))
	line("tenant", "%s", e.Tenant)
	if e.Normalized != e.Path {
		line("route", "%s (normalized %s)", e.Path, e.Normalized)
	} else {
		line("route", "%s", e.Path)
	}
	line("operation", "%s (%s)", e.Operation, e.OpMeaning)
	if e.Region != "" {
		line("region", "%s", e.Region)
	}
	if r == nil {
		return b.String()
	}
	if r.Default {
		line("rule", "default (line %d), operation %s", r.Line, e.Route.Operation())
	} else {
		line("rule", "%s (line %d)", r.Name, r.Line)
		tmpl := e.Route.Template()
		if len(e.Params) > 0 {
			tmpl += "  " + strings.Join(e.Params, " ")
		}
		line("template", "%s", tmpl)
		line("entry", "%s", e.Route.Operation())
	}
	if r.Description != "" {
		line("description", "%s", r.Description)
	}
	line("why", "%s", e.Why)
	for i, c := range e.Replaced {
		k := ""
		if i == 0 {
			k = "replaces"
		}
		line(k, "%s — %s", c.Route, c.Reason)
	}
	if l := e.Limits; l != nil {
		src := "rule"
		if l.Override {
			src = "tenant override"
		}
		scope := l.Scope.String()
		if l.Region != "" {
			scope += ", slice of region " + l.Region
		}
		if c := l.Calendar; c != nil {
			line("quota", "%d per calendar %s in %s, all of it again at each %s's start (%s; %s)", l.Requests, c.Unit, c.Loc, c.Unit, src, scope)
			line("counter", "exact: %dµ per period, spent and handed back within it; no refill", l.Bucket.Capacity())
		} else {
			line("limit", "%d per %s, burst %d (%s; %s)", l.Requests, FormatPeriod(l.Period), l.Burst, src, scope)
			line("bucket", "%s", l.Bucket)
		}
	}
	if l := e.Limits; l != nil && l.MaxDebt > 0 {
		line("max debt", "%s token(s): costs settled after the response may take the bucket that far below zero (checks wait until it is repaid); beyond it they are forgiven", microTokens(l.MaxDebt))
	}
	line("cost", "%d token(s) per request", e.Cost)
	switch r.OnFailure {
	case Deny:
		line("on failure", "deny: 503 with Retry-After %s", FormatPeriod(r.FailureRetryAfter))
	case Emergency:
		em := r.Emergency
		if e.Limits != nil && e.Limits.Emergency != nil {
			em = e.Limits.Emergency
		}
		line("on failure", "emergency: local bucket %d per %s, burst %d per agent; responses marked degraded",
			em.Requests, FormatPeriod(em.Period), em.Burst)
	}
	line("shadow", "%s", yesNo(r.Shadow, "yes: reported, never denied", "no"))
	line("headers", "%s", yesNo(r.Headers, "RateLimit headers exposed", "no"))
	switch {
	case r.Direct && len(e.Also) > 0:
		line("lease", "off: every check is one atomic take of its cost from all %d buckets below, in one script (their keys share the tenant's hash tag, one Cluster slot); other routes may charge the same tenant budgets from leases, and each bucket keeps its own bound", len(e.Also)+1)
	default:
		line("lease", "%s", yesNo(r.Direct, "off: every check is one atomic take in the global bucket", "on: agents hold leases sized by demand"))
	}
	if e.Limits != nil {
		line("key", "%s", e.Key)
		line("key version", "%s (fingerprint of the effective limit)", e.Limits.Fingerprint)
	}
	for i, c := range e.Also {
		k := ""
		if i == 0 {
			k = "also"
		}
		line(k, "%s: %s (%s)", c.Route.Rule.Name, limitLine(c.Limits), c.Why)
		line("", "  key %s", c.Key)
	}
	if len(e.Also) > 0 {
		line("charged", "all %d buckets or none: one that refuses refuses the request, and nothing is spent", len(e.Also)+1)
		if e.Key != "" && hashTag(e.Key) != "" {
			line("slot", "keys tagged {%s}: one Redis Cluster slot for the tenant's buckets charged together", hashTag(e.Key))
		}
	}
	return b.String()
}

// microTokens writes µ as tokens, with a fraction only when there is one.
func microTokens(µ bucket.Micro) string {
	if µ%bucket.PerToken == 0 {
		return fmt.Sprintf("%d", µ/bucket.PerToken)
	}
	return fmt.Sprintf("%.6f", float64(µ)/float64(bucket.PerToken))
}

func yesNo(b bool, yes, no string) string {
	if b {
		return yes
	}
	return no
}

func short(digest string) string {
	if len(digest) > 12 {
		return digest[:12]
	}
	return digest
}
