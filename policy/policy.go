// Package policy is the policy model of leasebucket: which limit applies to a (tenant, route,
// operation), what a request costs, what happens when the global state cannot be reached, and
// which bucket key holds the state. The agent, the coordinator, the HTTP middleware and the
// simulator all use it.
//
// A policy file (YAML, docs/policy.md) is parsed and validated into an immutable *Set; a Watcher
// swaps Sets atomically when the file changes and keeps the last good one when it is broken.
// A Set is read concurrently without locks: Match, Limits and Cost are the agent's hot path and do
// not allocate for a canonical path and a valid tenant; Key and Explain allocate.
//
// Resolution of a request:
//
//	path ──Normalize──▶ canonical path ──templates (most specific first)──▶ Route (rule, template, operation)
//	Route + tenant (+ region) ──Limits──▶ effective limit and its fingerprint ──Key──▶ bucket key
//
// An unmatched path or operation resolves to the default rule, never to a bucket named after the
// raw input: the number of keys is bounded by tenants × routes of the Set.
package policy

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/calendar"
)

// Scope says whether a rule's quota is one global bucket or per-region slices.
type Scope uint8

const (
	// Global is one bucket per key shared by all regions (strict quota; refills cross regions).
	Global Scope = iota
	// Regional is one bucket per key and region; the regions' slices sum to the rule's quota.
	Regional
	// Tenant is a tenant-wide budget: one bucket per tenant, charged by every request of the
	// tenant (of the rule's operations) in addition to its route's rule.
	Tenant
)

func (s Scope) String() string {
	switch s {
	case Regional:
		return "regional"
	case Tenant:
		return "tenant"
	}
	return "global"
}

// FailureMode is what an agent does for a rule when its global state cannot be reached.
type FailureMode uint8

const (
	// Deny fails closed: 503 with Retry-After (Rule.FailureRetryAfter); nothing is let through.
	Deny FailureMode = iota
	// Emergency serves from a small local bucket per agent and key (Limits.Emergency); allowed
	// responses are marked degraded, and an empty emergency bucket answers 429.
	Emergency
)

func (m FailureMode) String() string {
	if m == Emergency {
		return "emergency"
	}
	return "deny"
}

// Quota is a limit as the file states it: Requests tokens refilled every Period, at most Burst
// tokens held. Bucket is the same in the bucket arithmetic's units: capacity Burst tokens, refilled
// at Requests tokens per Period.
//
// A calendar quota (Calendar set; the file's `quota: N/month`) is instead an exact counter of
// Requests tokens per calendar period, full again at the period's boundary: Period is 0, Burst is
// Requests and Bucket a Limit of capacity Requests that never refills (bucket.Counter's quota).
type Quota struct {
	Requests int64
	Period   time.Duration
	Burst    int64
	Bucket   bucket.Limit
	Calendar *calendar.Period
}

// String renders the quota as the file would write it ("100/1m burst 20", "100000/month",
// "100000/month Europe/Berlin").
func (q Quota) String() string {
	if q.Calendar != nil {
		return fmt.Sprintf("%d/%s", q.Requests, q.Calendar)
	}
	return fmt.Sprintf("%d/%s burst %d", q.Requests, FormatPeriod(q.Period), q.Burst)
}

// FormatPeriod writes a period in the largest unit that divides it ("1m", "36h", "2d", "250ms").
func FormatPeriod(d time.Duration) string {
	for _, u := range []struct {
		d    time.Duration
		name string
	}{{24 * time.Hour, "d"}, {time.Hour, "h"}, {time.Minute, "m"}, {time.Second, "s"}, {time.Millisecond, "ms"}} {
		if d >= u.d && d%u.d == 0 {
			return fmt.Sprintf("%d%s", d/u.d, u.name)
		}
	}
	return d.String()
}

// RegionQuota is one region's slice of a regional rule.
type RegionQuota struct {
	Region string
	Quota
}

// Limits is the effective limit of one route for one tenant (the tenant's override or the rule)
// and, for a regional rule, one region (its slice). Sets share Limits between callers: read only.
type Limits struct {
	Quota
	// Fingerprint is the key version: it changes exactly when the state of the global bucket would
	// mean something else (capacity, rate, scope, region slice).
	Fingerprint string
	Scope       Scope
	Region      string // "" for a global rule
	Override    bool   // a tenant override applies
	// Emergency is the local emergency bucket's quota when the rule's OnFailure is Emergency.
	Emergency *Quota
	// MaxDebt is how far below zero costs settled after the fact may take the bucket (the rule's
	// max_debt, at most the bucket's capacity), in µ; 0 for none.
	MaxDebt bucket.Micro
}

// Rule is one rule of a Set, or its default rule. Read only: a Rule is shared by every reader of
// the Set.
type Rule struct {
	Name        string
	Description string
	Line        int  // line of the rule in the policy file
	Default     bool // the rule for unmatched routes and operations
	// Templates and Operations as written (the default rule has none).
	Templates  []string
	Operations []string

	Quota   Quota // the rule's quota before tenant overrides (for a regional rule, the sum of Regions)
	Scope   Scope
	Regions []RegionQuota // sorted by region; only for Regional

	OnFailure         FailureMode
	FailureRetryAfter time.Duration // Retry-After of the 503 when OnFailure is Deny
	Emergency         *Quota        // the emergency bucket when OnFailure is Emergency

	Shadow  bool // evaluate and report, never deny
	Headers bool // expose IETF RateLimit / RateLimit-Policy headers
	// Direct is lease: off: every check is one atomic take of its cost in the global bucket, no
	// lease is kept (admission bound C + r·w, exact per request).
	Direct bool
	// MaxDebt (max_debt, tokens) is how far below zero costs settled after the response may take
	// each of the rule's buckets: admissions then wait until the debt is repaid. 0: settled costs
	// are charged only while tokens are there, the rest is forgiven.
	MaxDebt int64

	// Extra are the rule's limits after the first (a rule with `limits:`), each a rule of its own
	// named "name#2", "name#3", ... with the same templates, operations, costs and switches: a
	// check charges the rule's first limit and every extra one, all or nothing.
	Extra []*Rule
	// Of is the rule an extra limit belongs to (nil for a rule as written) and Nth its number
	// (2, 3, ...; 0 for a rule as written).
	Of  *Rule
	Nth int

	cost      int64            // the cost of entries not in costs (default 1)
	costs     map[string]int64 // by operation entry
	base      tenantLimits
	overrides map[string]*override
	extra     []Quota // parsed limits after the first, until addRule makes Extra
}

type override struct {
	tenant    string
	line      int
	quota     Quota
	regions   []RegionQuota
	emergency *Quota // nil: the rule's
	limits    tenantLimits
}

// tenantLimits are the precomputed Limits of a rule, or of one tenant's override.
type tenantLimits struct {
	global  *Limits
	regions map[string]*Limits
}

// Cost is the tokens one request of the operation entry costs (default 1).
func (r *Rule) Cost(operation string) int64 {
	if c, ok := r.costs[operation]; ok {
		return c
	}
	return r.cost
}

// OverrideTenants lists the tenants with an override of this rule, sorted.
func (r *Rule) OverrideTenants() []string {
	out := make([]string, 0, len(r.overrides))
	for t := range r.overrides {
		out = append(out, t)
	}
	slices.Sort(out)
	return out
}

// Route is a rule applied to one template and one operation entry: one bucket per tenant (and
// region). Routes are values; ID is dense (0..NumRoutes-1) and unique within its Set, so agents
// key per-bucket tables by (ID, tenant) without building strings. A Route belongs to the Set that
// made it. The zero Route is invalid.
type Route struct {
	Rule *Rule
	ID   uint32
	r    *route
}

type route struct {
	set    *Set
	rule   *Rule
	id     uint32
	tmpl   template // raw and shape "" for the default rule, "@name" for a tenant budget
	op     string   // operation entry: class, named operation, method, or "*" (default rule)
	cost   int64
	maxKey int // the longest key the route can make, checked against MaxKeyLen
	// charges are the other routes a check of this one charges with it, all or nothing: the
	// routes of its rule's extra limits, then the tenant budgets that cover its operation.
	charges []uint32
	// tagged: the route's keys hold a hash tag of the tenant, since it is charged together with
	// other routes (it has charges, or is one); see buildKey.
	tagged bool
}

// Valid reports whether r is a route of some Set (not the zero Route).
func (r Route) Valid() bool { return r.r != nil }

// Charges are the IDs of the routes a check of r charges besides r itself (RouteByID), all or
// nothing: its rule's extra limits, then the tenant budgets covering its operation. Most routes
// have none. The slice belongs to the Set: read only.
func (r Route) Charges() []uint32 {
	if r.r == nil {
		return nil
	}
	return r.r.charges
}

// Template is the route template as written ("/orders/{id}"), or "" for the default rule.
func (r Route) Template() string {
	if r.r == nil {
		return ""
	}
	return r.r.tmpl.raw
}

// Operation is the operation entry of the route: a class ("read"), a named operation ("export"),
// an HTTP method ("GET"), or for the default rule a class or "*" (unknown operations).
func (r Route) Operation() string {
	if r.r == nil {
		return ""
	}
	return r.r.op
}

// String names the route as explain shows it.
func (r Route) String() string {
	if r.r == nil {
		return "<no route>"
	}
	if r.Rule.Default {
		return fmt.Sprintf("default (operation %s)", r.r.op)
	}
	return fmt.Sprintf("%s %s %s", r.Rule.Name, r.r.tmpl.raw, r.r.op)
}

var (
	// ErrUnknownRegion is returned when the region is not one of a regional rule's slices.
	ErrUnknownRegion = errors.New("policy: unknown region")
	// ErrForeignRoute is returned when a Route of another Set (or the zero Route) was passed to a Set.
	ErrForeignRoute = errors.New("policy: route does not belong to this policy set")
)

// Envoy maps Envoy rate-limit descriptors (envoy.service.ratelimit.v3) onto tenant, route and
// operation. The agent's RLS server answers Domain and reads the three entries by key.
type Envoy struct {
	Domain       string // default "leasebucket"
	TenantKey    string // default "tenant"
	RouteKey     string // default "path" (the request path, normalized like any path)
	OperationKey string // default "method" (an HTTP method, class or named operation)
	// SettleKey (default "settle") marks a descriptor sent after the response (Envoy's
	// apply_on_stream_done): its hits_addend is a cost charged after the fact, never refused,
	// spent from leases and the rest debited as debt (max_debt).
	SettleKey string
	// PerDescriptor (charge: per_descriptor) charges each descriptor of a request on its own, as
	// Envoy's reference service does: a refused descriptor leaves the others' charges spent. The
	// default (all_or_nothing) charges every descriptor of a request or none.
	PerDescriptor bool
}

// maxLinearOps is the number of operation names resolved by a linear scan: comparing a few short
// strings (length first) is cheaper than hashing one.
const maxLinearOps = 16

type opEntry struct {
	name string
	ref  opRef
}

func (s *Set) resolveOp(op string) (opRef, bool) {
	if s.opList != nil {
		for i := range s.opList {
			if s.opList[i].name == op {
				return s.opList[i].ref, true
			}
		}
		return opRef{}, false
	}
	ref, ok := s.ops[op]
	return ref, ok
}

// opRef is a request operation resolved to interned ids: the exact entry and its class.
type opRef struct {
	exact, class int32
	kind         opKind
}

type opKind uint8

const (
	opClass opKind = iota
	opNamed
	opMethod
)

// Set is a parsed, validated policy: immutable and safe for concurrent readers.
type Set struct {
	file    string
	version string
	digest  string

	rules  []*Rule
	byName map[string]*Rule
	def    *Rule

	routes []*route
	refs   map[routeRef]uint32
	root   *node

	ops        map[string]opRef // request operation → ids
	opList     []opEntry        // the same, searched linearly when short (cheaper than hashing)
	opNames    []string         // id → entry name
	defByClass map[int32]int32  // class id → default route
	defAny     int32            // the default route of unknown operations
	methods    map[string]string
	named      map[string]string
	classes    []string

	envoy Envoy

	// rt is set on a Set made by WithOverrides: the file's Set and the runtime overrides applied.
	rt *runtimeLayer
}

type routeRef struct{ rule, template, op string }

// Version is the policy set's version as written in the file. Agents and coordinators compare it:
// equal versions mean equal content (the Watcher enforces this for reloads).
func (s *Set) Version() string { return s.version }

// Digest is the SHA-256 (hex) of the Set's canonical content: formatting and comments do not
// change it, anything the Set means does (including the version).
func (s *Set) Digest() string { return s.digest }

// File is the name the Set was parsed from.
func (s *Set) File() string { return s.file }

// Rules are the named rules in file order (without the default rule).
func (s *Set) Rules() []*Rule { return append([]*Rule(nil), s.rules...) }

// Rule returns the rule with that name ("default" is the default rule), or nil.
func (s *Set) Rule(name string) *Rule { return s.byName[name] }

// Default is the rule for unmatched routes and operations.
func (s *Set) Default() *Rule { return s.def }

// Envoy is the descriptor mapping, with defaults filled in.
func (s *Set) Envoy() Envoy { return s.envoy }

// Classes are the operation classes of the Set, sorted.
func (s *Set) Classes() []string { return append([]string(nil), s.classes...) }

// MethodClass maps an HTTP method to its class.
func (s *Set) MethodClass(method string) (string, bool) {
	c, ok := s.methods[method]
	return c, ok
}

// NumRoutes is the number of routes; route IDs are 0..NumRoutes()-1.
func (s *Set) NumRoutes() int { return len(s.routes) }

// RouteByID returns the route with that ID, or the zero Route if there is none.
func (s *Set) RouteByID(id uint32) Route {
	if int(id) >= len(s.routes) {
		return Route{}
	}
	return s.routes[id].route()
}

func (r *route) route() Route { return Route{Rule: r.rule, ID: r.id, r: r} }

// Match resolves a request path and operation to a route. operation may be a class, a named
// operation or an HTTP method. The most specific template with an entry for the operation wins
// (docs/policy.md, "Precedence"); an unmatched path or an unknown operation resolves to the
// default rule, never to an error. The error is for a path that cannot be normalized safely
// (ErrInvalidPath). Match does not allocate when path is already canonical.
func (s *Set) Match(path, operation string) (Route, error) {
	p := path
	if !isCanonical(p) {
		var err error
		if p, err = Normalize(path); err != nil {
			return Route{}, err
		}
	}
	ref, ok := s.resolveOp(operation)
	if !ok {
		return s.routes[s.defAny].route(), nil
	}
	var r int32
	if len(p) == 1 {
		r = s.root.end(ref.exact, ref.class)
	} else {
		r = s.root.find(p, 1, ref.exact, ref.class)
	}
	if r < 0 {
		r = s.defByClass[ref.class]
	}
	return s.routes[r].route(), nil
}

// Lookup resolves a reference received on the wire (BucketRef): rule name, template as written
// ("" for the default rule) and operation entry.
func (s *Set) Lookup(rule, template, operation string) (Route, bool) {
	id, ok := s.refs[routeRef{rule, template, operation}]
	if !ok {
		return Route{}, false
	}
	return s.routes[id].route(), true
}

// Cost is the tokens one request on the route costs: the rule's cost for the route's operation.
func (s *Set) Cost(r Route) int64 {
	if r.r == nil {
		return 1
	}
	return r.r.cost
}

// Limits returns the effective limits of a route for a tenant (its override, or the rule's) and,
// for a regional rule, a region (its slice; the region is ignored for a global rule). It does not
// allocate unless it fails: an invalid tenant (ErrInvalidTenant), an unknown region of a regional
// rule (ErrUnknownRegion) or a route of another Set (ErrForeignRoute).
func (s *Set) Limits(r Route, tenant, region string) (*Limits, error) {
	if r.r == nil || r.r.set != s {
		return nil, ErrForeignRoute
	}
	if err := ValidTenant(tenant); err != nil {
		return nil, err
	}
	tl := &r.Rule.base
	if o := r.Rule.overrides[tenant]; o != nil {
		tl = &o.limits
	}
	if r.Rule.Scope != Regional {
		return tl.global, nil
	}
	if l := tl.regions[region]; l != nil {
		return l, nil
	}
	return nil, fmt.Errorf("%w %q for rule %q", ErrUnknownRegion, region, r.Rule.Name)
}

// Key returns the bucket key of a route for a tenant and region (see KeyPrefix for the format).
// It is at most MaxKeyLen bytes.
func (s *Set) Key(r Route, tenant, region string) (string, error) {
	l, err := s.Limits(r, tenant, region)
	if err != nil {
		return "", err
	}
	return s.KeyFor(r, tenant, l), nil
}

// KeyFor is Key for limits already resolved with Limits(r, tenant, region): a caller that has
// them does not resolve them twice.
func (s *Set) KeyFor(r Route, tenant string, l *Limits) string {
	return buildKey(tenant, r.r.tmpl.shape, r.r.op, l.Fingerprint, l.Region, r.r.tagged)
}

// CheckRegion reports whether every regional rule (and every override of one) has a slice for
// region. An agent checks its own region when it loads a Set, so that a policy without its region
// is rejected at load rather than failing each request with ErrUnknownRegion.
func (s *Set) CheckRegion(region string) error {
	var missing []string
	for _, r := range append(s.Rules(), s.def) {
		if r.Scope == Regional && r.base.regions[region] == nil {
			missing = append(missing, r.Name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w %q: rules %v have no slice for it", ErrUnknownRegion, region, missing)
	}
	return nil
}
