package coordinator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
	adminv1 "github.com/leasebucket/leasebucket/proto/leasebucket/admin/v1"
)

// maxReason bounds the free text an operator gives for a change (it goes to the audit log).
const maxReason = 1024

// AdminConfig configures an AdminService. Store, Overrides, Policies and Audit are required.
type AdminConfig struct {
	Store     AdminStore
	Overrides OverridesStore
	Policies  *Policies
	// Admins are the identities allowed to call. A caller whose client certificate (verified by
	// the server's client CA) carries none of them gets PERMISSION_DENIED; with no Admins, every
	// call is denied.
	Admins []Identity
	// Audit receives one record per call, allowed or not, after it is answered: who (the
	// certificate's identity and address), what (the method, the bucket or override, the reason
	// given), the outcome (the status code) and the change (levels or specs before and after).
	// Give it an unsampled logger.
	Audit *zap.Logger
	// Logger receives store failures, whose causes callers do not see.
	Logger *zap.Logger
	// StoreTimeout bounds each store operation (none if zero).
	StoreTimeout time.Duration
	// Bounds on the runtime overrides (DefaultOverridesBounds if zero).
	Bounds OverridesBounds
}

// AdminService is the AdminService of a coordinator: thin handlers that authorise the caller,
// resolve the bucket or check the override against the current policy, call the store once and
// audit the call. Bad input is rejected before the store is touched.
type AdminService struct {
	adminv1.UnimplementedAdminServiceServer
	cfg AdminConfig
	log *zap.Logger
}

// NewAdminService returns an AdminService.
func NewAdminService(cfg AdminConfig) *AdminService {
	if cfg.Bounds == (OverridesBounds{}) {
		cfg.Bounds = DefaultOverridesBounds
	}
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	return &AdminService{cfg: cfg, log: log}
}

// adminCall is one call being handled: what its audit record says.
type adminCall struct {
	method   string
	identity string // the admin identity that matched, or the certificate's names when denied
	peer     string
	fields   []zap.Field
}

func (c *adminCall) add(f ...zap.Field) { c.fields = append(c.fields, f...) }

// begin authorises the call: the server verified the client's certificate against its client CA
// (mutual TLS); one of the certificate's identities must be an admin's.
func (a *AdminService) begin(ctx context.Context, method string) (*adminCall, error) {
	c := &adminCall{method: method, peer: peerAddr(ctx)}
	cert := PeerCertificate(ctx)
	switch {
	case len(a.cfg.Admins) == 0:
		return c, status.Error(codes.PermissionDenied,
			"the admin API is off on this coordinator: it lists no admin identities (--admin-identities)")
	case cert == nil:
		return c, status.Error(codes.PermissionDenied,
			"the admin API needs a client certificate (mutual TLS) that carries an admin identity")
	}
	ids := CertIdentities(cert)
	for _, id := range ids {
		if slices.Contains(a.cfg.Admins, id) {
			c.identity = id.String()
			return c, nil
		}
	}
	names := make([]string, len(ids))
	for i, id := range ids {
		names[i] = id.String()
	}
	c.identity = strings.Join(names, ",")
	return c, status.Errorf(codes.PermissionDenied, "certificate %s carries no admin identity of this coordinator", c.identity)
}

// end writes the call's audit record.
func (a *AdminService) end(c *adminCall, err error) {
	fields := append([]zap.Field{
		zap.String("method", c.method), zap.String("identity", c.identity), zap.String("peer", c.peer),
		zap.String("code", status.Code(err).String()),
	}, c.fields...)
	if err != nil {
		fields = append(fields, zap.String("error", status.Convert(err).Message()))
	}
	a.cfg.Audit.Info("admin call", fields...)
}

func (a *AdminService) storeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if a.cfg.StoreTimeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, a.cfg.StoreTimeout)
}

// storeError maps a store failure: the caller's own cancellation as such, anything else as
// UNAVAILABLE with a generic message (the cause, which names Redis nodes, goes to the log).
func (a *AdminService) storeError(ctx context.Context, c *adminCall, err error, changing bool) error {
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
	a.log.Warn("admin call: store failed", zap.String("method", c.method), zap.Error(err))
	if changing {
		return status.Error(codes.Unavailable, "the store did not answer: the change may or may not have been made; inspect before trying again")
	}
	return status.Error(codes.Unavailable, "the store did not answer")
}

// adminBucket is a bucket selector resolved with a policy.
type adminBucket struct {
	set    *policy.Set
	route  policy.Route
	tenant string
	limits *policy.Limits
	key    string
	source adminv1.LimitSource
}

// resolve resolves sel with the current policy, as lbpolicy explain does.
func (a *AdminService) resolve(c *adminCall, sel *adminv1.BucketSelector) (adminBucket, error) {
	if sel == nil {
		return adminBucket{}, status.Error(codes.InvalidArgument, "bucket: required (tenant, route and operation)")
	}
	c.add(zap.String("tenant", sel.Tenant), zap.String("route", sel.Route), zap.String("operation", sel.Operation),
		zap.String("region", sel.Region))
	set := a.cfg.Policies.Current()
	c.add(zap.String("policy_version", set.Version()))
	switch {
	case sel.Tenant == "":
		return adminBucket{}, status.Error(codes.InvalidArgument, "tenant: required")
	case sel.Route == "":
		return adminBucket{}, status.Error(codes.InvalidArgument, "route: required (a request path such as /orders/7)")
	case sel.Operation == "":
		return adminBucket{}, status.Error(codes.InvalidArgument, "operation: required (a class, named operation or HTTP method)")
	}
	if err := policy.ValidTenant(sel.Tenant); err != nil {
		return adminBucket{}, status.Errorf(codes.InvalidArgument, "tenant %q: %s", sel.Tenant, trimPolicy(err))
	}
	route, err := set.Match(sel.Route, sel.Operation)
	if err != nil {
		return adminBucket{}, status.Errorf(codes.InvalidArgument, "route %q: %s", sel.Route, trimPolicy(err))
	}
	if sel.Rule != "" {
		c.add(zap.String("rule_guard", sel.Rule))
		if set.Rule(sel.Rule) == nil {
			return adminBucket{}, status.Errorf(codes.NotFound, "rule %q: no such rule in policy version %s", sel.Rule, set.Version())
		}
		if route.Rule.Name != sel.Rule {
			return adminBucket{}, status.Errorf(codes.FailedPrecondition,
				"route %s with operation %s resolves to %s, not to rule %q: nothing done", sel.Route, sel.Operation, route, sel.Rule)
		}
	}
	lim, err := set.Limits(route, sel.Tenant, sel.Region)
	if errors.Is(err, policy.ErrUnknownRegion) {
		var regions []string
		for _, rq := range route.Rule.Regions {
			regions = append(regions, rq.Region)
		}
		return adminBucket{}, status.Errorf(codes.InvalidArgument, "region %q: rule %q is regional, with slices for %s",
			sel.Region, route.Rule.Name, strings.Join(regions, ", "))
	}
	if err != nil {
		return adminBucket{}, status.Errorf(codes.InvalidArgument, "%s", trimPolicy(err))
	}
	if lim.Calendar != nil {
		// The admin scripts read and write token buckets; a counter's state means something else.
		return adminBucket{}, status.Errorf(codes.FailedPrecondition,
			"rule %q is a calendar quota (%s): the admin API inspects and sets token buckets only; nothing done", route.Rule.Name, lim.Quota)
	}
	key, err := set.Key(route, sel.Tenant, sel.Region)
	if err != nil {
		return adminBucket{}, status.Errorf(codes.InvalidArgument, "%s", trimPolicy(err))
	}
	b := adminBucket{set: set, route: route, tenant: sel.Tenant, limits: lim, key: key, source: adminv1.LimitSource_LIMIT_SOURCE_RULE}
	if lim.Override {
		b.source = adminv1.LimitSource_LIMIT_SOURCE_FILE_OVERRIDE
		if _, ok := set.RuntimeOverride(route.Rule.Name, sel.Tenant); ok {
			b.source = adminv1.LimitSource_LIMIT_SOURCE_RUNTIME_OVERRIDE
		}
	}
	c.add(zap.String("rule", route.Rule.Name), zap.String("template", route.Template()),
		zap.String("operation_entry", route.Operation()), zap.String("key", key), zap.String("limit", lim.Quota.String()))
	return b, nil
}

func trimPolicy(err error) string { return strings.TrimPrefix(err.Error(), "policy: ") }

// proto is the bucket with the state s.
func (b adminBucket) proto(s Snapshot) *adminv1.Bucket {
	l := b.limits.Bucket
	num, den := l.Rate()
	ttl := bucket.Millis(lease.TTL(l) / time.Millisecond)
	out := &adminv1.Bucket{
		PolicyVersion: b.set.Version(), Rule: b.route.Rule.Name, Template: b.route.Template(),
		OperationEntry: b.route.Operation(), Tenant: b.tenant, Region: b.limits.Region, Key: b.key,
		Limit: b.limits.Quota.String(), LimitSource: b.source,
		CapacityMicro: int64(l.Capacity()), RefillMicro: num, RefillPeriodMs: den, LeaseTtlMs: int64(ttl),
	}
	st := &adminv1.BucketState{Stored: s.Stored, NowMs: int64(s.Now), LevelMicro: int64(s.Level(l)), OtherFields: s.Other}
	out.State = st
	if !s.Stored {
		return out
	}
	st.StoredMicro, st.LastRefillMs = int64(s.State.Tokens), int64(s.State.Last)
	if s.Expires {
		st.ExpiresAtMs = int64(s.Expiry)
	}
	agents := make([]string, 0, len(s.Takes)+len(s.Returns))
	for a := range s.Takes {
		agents = append(agents, a)
	}
	for a := range s.Returns {
		if _, dup := s.Takes[a]; !dup {
			agents = append(agents, a)
		}
	}
	slices.Sort(agents)
	for _, a := range agents {
		rec := &adminv1.AgentRecord{AgentId: a}
		t, took := s.Takes[a]
		r, returned := s.Returns[a]
		if took {
			rec.TakeSeq, rec.GrantedMicro, rec.GrantedAtMs = t.Seq, int64(t.Granted), int64(t.Now)
			rec.LeaseExpiresAtMs = int64(t.Now + ttl)
			// A Return at or after the grant retired the agent's lease on the key.
			rec.Outstanding = t.Granted > 0 && s.Now < t.Now+ttl && !(returned && r.Now >= t.Now)
			if rec.Outstanding {
				st.OutstandingMicro += rec.GrantedMicro
			}
		}
		if returned {
			rec.ReturnSeq, rec.CreditedMicro, rec.ReturnedAtMs = r.Seq, int64(r.Credited), int64(r.Now)
		}
		st.Agents = append(st.Agents, rec)
	}
	return out
}

// InspectBucket implements AdminService.
func (a *AdminService) InspectBucket(ctx context.Context, req *adminv1.InspectBucketRequest) (_ *adminv1.InspectBucketResponse, err error) {
	c, err := a.begin(ctx, "InspectBucket")
	defer func() { a.end(c, err) }()
	if err != nil {
		return nil, err
	}
	b, err := a.resolve(c, req.Bucket)
	if err != nil {
		return nil, err
	}
	sctx, cancel := a.storeContext(ctx)
	defer cancel()
	snap, err := a.cfg.Store.Inspect(sctx, b.key, b.limits.Bucket)
	if err != nil {
		return nil, a.storeError(ctx, c, err, false)
	}
	c.add(zap.Int64("level_micro", int64(snap.Level(b.limits.Bucket))))
	return &adminv1.InspectBucketResponse{Bucket: b.proto(snap)}, nil
}

// ResetBucket implements AdminService: SetBucket to the capacity.
func (a *AdminService) ResetBucket(ctx context.Context, req *adminv1.ResetBucketRequest) (_ *adminv1.ResetBucketResponse, err error) {
	c, err := a.begin(ctx, "ResetBucket")
	defer func() { a.end(c, err) }()
	if err != nil {
		return nil, err
	}
	before, after, err := a.setLevel(ctx, c, req.Bucket, 0, true, req.Reason)
	if err != nil {
		return nil, err
	}
	return &adminv1.ResetBucketResponse{Before: before, After: after}, nil
}

// SetBucket implements AdminService.
func (a *AdminService) SetBucket(ctx context.Context, req *adminv1.SetBucketRequest) (_ *adminv1.SetBucketResponse, err error) {
	c, err := a.begin(ctx, "SetBucket")
	defer func() { a.end(c, err) }()
	if err != nil {
		return nil, err
	}
	before, after, err := a.setLevel(ctx, c, req.Bucket, bucket.Micro(req.LevelMicro), false, req.Reason)
	if err != nil {
		return nil, err
	}
	return &adminv1.SetBucketResponse{Before: before, After: after}, nil
}

// setLevel sets the bucket's level, or with full its capacity (a reset).
func (a *AdminService) setLevel(ctx context.Context, c *adminCall, sel *adminv1.BucketSelector, level bucket.Micro, full bool, reason string) (before, after *adminv1.Bucket, err error) {
	c.add(zap.String("reason", reason))
	if len(reason) > maxReason {
		return nil, nil, status.Errorf(codes.InvalidArgument, "reason: longer than %d bytes", maxReason)
	}
	b, err := a.resolve(c, sel)
	if err != nil {
		return nil, nil, err
	}
	l := b.limits.Bucket
	if full {
		level = l.Capacity()
	}
	c.add(zap.Int64("level_micro", int64(level)))
	if level < 0 {
		return nil, nil, status.Errorf(codes.InvalidArgument, "level_micro %d is negative: a bucket holds 0 tokens or more; nothing changed", level)
	}
	if level > l.Capacity() {
		return nil, nil, status.Errorf(codes.InvalidArgument,
			"level %s tokens is above the bucket's capacity of %s tokens (limit %s): nothing changed",
			tokenString(level), tokenString(l.Capacity()), b.limits.Quota)
	}
	sctx, cancel := a.storeContext(ctx)
	defer cancel()
	sb, sa, err := a.cfg.Store.SetLevel(sctx, b.key, l, level)
	if errors.Is(err, ErrInvalidRequest) {
		return nil, nil, status.Errorf(codes.InvalidArgument, "%v", err)
	}
	if err != nil {
		return nil, nil, a.storeError(ctx, c, err, true)
	}
	c.add(zap.Int64("level_before_micro", int64(sb.Level(l))), zap.Int64("level_after_micro", int64(sa.Level(l))))
	return b.proto(sb), b.proto(sa), nil
}

// tokenString writes microtokens as tokens ("2.5").
func tokenString(m bucket.Micro) string {
	s := fmt.Sprintf("%d.%06d", m/bucket.PerToken, m%bucket.PerToken)
	return strings.TrimSuffix(strings.TrimRight(s, "0"), ".")
}

// ListOverrides implements AdminService: the store is read first, so the list is current.
func (a *AdminService) ListOverrides(ctx context.Context, req *adminv1.ListOverridesRequest) (_ *adminv1.ListOverridesResponse, err error) {
	c, err := a.begin(ctx, "ListOverrides")
	defer func() { a.end(c, err) }()
	if err != nil {
		return nil, err
	}
	c.add(zap.String("rule", req.Rule), zap.String("tenant", req.Tenant))
	sctx, cancel := a.storeContext(ctx)
	defer cancel()
	if err := a.cfg.Policies.Refresh(sctx); err != nil {
		return nil, a.storeError(ctx, c, err, false)
	}
	set, ov := a.cfg.Policies.Current(), a.cfg.Policies.Overrides()
	problems := map[[2]string]string{}
	for _, p := range set.OverrideProblems() {
		problems[[2]string{p.Rule, p.Tenant}] = trimPolicy(p.Err)
	}
	resp := &adminv1.ListOverridesResponse{PolicyVersion: set.Version(), Digest: ov.Digest(),
		Count: int64(ov.Len()), Bytes: int64(ov.Bytes()), MaxCount: int64(a.cfg.Bounds.Count), MaxBytes: int64(a.cfg.Bounds.Bytes)}
	for _, e := range ov.Entries() {
		if req.Rule != "" && e.Rule != req.Rule || req.Tenant != "" && e.Tenant != req.Tenant {
			continue
		}
		o := &adminv1.Override{Rule: e.Rule, Tenant: e.Tenant, Spec: e.Spec}
		_, o.Applied = set.RuntimeOverride(e.Rule, e.Tenant)
		o.Problem = problems[[2]string{e.Rule, e.Tenant}]
		resp.Overrides = append(resp.Overrides, o)
	}
	c.add(zap.Int("listed", len(resp.Overrides)))
	return resp, nil
}

// SetOverride implements AdminService: the override is checked against the current policy's
// rule, written, and this coordinator reads the overrides again at once.
func (a *AdminService) SetOverride(ctx context.Context, req *adminv1.SetOverrideRequest) (_ *adminv1.SetOverrideResponse, err error) {
	c, err := a.begin(ctx, "SetOverride")
	defer func() { a.end(c, err) }()
	if err != nil {
		return nil, err
	}
	c.add(zap.String("rule", req.Rule), zap.String("tenant", req.Tenant), zap.String("spec_given", req.Spec), zap.String("reason", req.Reason))
	switch {
	case req.Rule == "":
		return nil, status.Error(codes.InvalidArgument, "rule: required")
	case req.Tenant == "":
		return nil, status.Error(codes.InvalidArgument, "tenant: required")
	case len(req.Reason) > maxReason:
		return nil, status.Errorf(codes.InvalidArgument, "reason: longer than %d bytes", maxReason)
	}
	set := a.cfg.Policies.Current()
	c.add(zap.String("policy_version", set.Version()))
	o, err := set.CheckOverride(req.Rule, req.Tenant, req.Spec)
	switch {
	case errors.Is(err, policy.ErrUnknownRule):
		return nil, status.Errorf(codes.NotFound, "%s", trimPolicy(err))
	case err != nil:
		return nil, status.Errorf(codes.InvalidArgument, "%s", trimPolicy(err))
	}
	c.add(zap.String("spec", o.Spec))
	sctx, cancel := a.storeContext(ctx)
	defer cancel()
	prev, err := a.cfg.Overrides.PutOverride(sctx, o, a.cfg.Bounds)
	if errors.Is(err, ErrOverridesFull) {
		return nil, status.Errorf(codes.ResourceExhausted,
			"the runtime overrides hold at most %d overrides and %d bytes: delete some, or move them to the policy file; nothing changed",
			a.cfg.Bounds.Count, a.cfg.Bounds.Bytes)
	}
	if err != nil {
		return nil, a.storeError(ctx, c, err, true)
	}
	c.add(zap.String("previous_spec", prev))
	a.refreshAfterWrite(ctx, c)
	now := a.cfg.Policies.Current()
	_, applied := now.RuntimeOverride(o.Rule, o.Tenant)
	return &adminv1.SetOverrideResponse{
		Override:     &adminv1.Override{Rule: o.Rule, Tenant: o.Tenant, Spec: o.Spec, Applied: applied},
		PreviousSpec: prev, PolicyVersion: now.Version(),
	}, nil
}

// DeleteOverride implements AdminService.
func (a *AdminService) DeleteOverride(ctx context.Context, req *adminv1.DeleteOverrideRequest) (_ *adminv1.DeleteOverrideResponse, err error) {
	c, err := a.begin(ctx, "DeleteOverride")
	defer func() { a.end(c, err) }()
	if err != nil {
		return nil, err
	}
	c.add(zap.String("rule", req.Rule), zap.String("tenant", req.Tenant), zap.String("reason", req.Reason))
	switch {
	case req.Rule == "" || strings.ContainsRune(req.Rule, '|') || strings.HasPrefix(req.Rule, "#"):
		return nil, status.Errorf(codes.InvalidArgument, "rule %q: required, a rule name", req.Rule)
	case len(req.Reason) > maxReason:
		return nil, status.Errorf(codes.InvalidArgument, "reason: longer than %d bytes", maxReason)
	}
	if err := policy.ValidTenant(req.Tenant); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "tenant %q: %s", req.Tenant, trimPolicy(err))
	}
	sctx, cancel := a.storeContext(ctx)
	defer cancel()
	prev, err := a.cfg.Overrides.DeleteOverride(sctx, req.Rule, req.Tenant)
	if errors.Is(err, ErrOverrideNotFound) {
		return nil, status.Errorf(codes.NotFound, "no runtime override of rule %q for tenant %q", req.Rule, req.Tenant)
	}
	if err != nil {
		return nil, a.storeError(ctx, c, err, true)
	}
	c.add(zap.String("previous_spec", prev))
	a.refreshAfterWrite(ctx, c)
	return &adminv1.DeleteOverrideResponse{PreviousSpec: prev, PolicyVersion: a.cfg.Policies.Current().Version()}, nil
}

// refreshAfterWrite makes this coordinator use the overrides just written; if the store cannot be
// read now, the next poll will.
func (a *AdminService) refreshAfterWrite(ctx context.Context, c *adminCall) {
	sctx, cancel := a.storeContext(ctx)
	defer cancel()
	if err := a.cfg.Policies.Refresh(sctx); err != nil {
		a.log.Warn("admin call: the overrides were written but not read back; the next poll will", zap.String("method", c.method), zap.Error(err))
	}
	c.add(zap.String("policy_version_after", a.cfg.Policies.Current().Version()))
}
