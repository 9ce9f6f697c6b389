package coordinator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// MaxItems bounds the items of one Acquire or Return: a batch is one pipelined store round trip.
const MaxItems = 1024

// maxVersion bounds a policy version (a file's version and the runtime overrides' suffix): an
// unknown version is echoed in the error, which must stay small.
const maxVersion = policy.MaxVersionLen

// KeepVersions is how many policy versions a coordinator answers for: the current one and the
// ones before it, so agents that have not reloaded yet during a roll-out keep working.
const KeepVersions = 4

// Service is the coordinator: the CoordinatorService handlers over a Store and the policy. It
// holds no bucket state. The simulator calls the same methods in process.
type Service struct {
	coordinatorv1.UnimplementedCoordinatorServiceServer
	store        Store
	metrics      *Metrics
	log          *zap.Logger
	storeTimeout time.Duration

	mu       sync.RWMutex
	versions []*policy.Set // newest first, at most KeepVersions

	unknownVersion func(version string) bool // see WithUnknownVersion
	now            func() time.Time          // the clock calendar windows are computed from (WithClock)
}

// CalendarSlack is how far behind its own clock the coordinator computes a calendar quota's
// window (the period of that moment and the next one): the store's clock, which decides the
// period, may lag the coordinator's by this much, or lead it by nearly a period, and still fall
// in the window. A store clock outside it fails the item (STORE_UNAVAILABLE), never miscounts.
const CalendarSlack = time.Minute

// WithClock sets the clock calendar windows are computed from (default time.Now); the
// simulator passes its virtual clock.
func WithClock(now func() time.Time) Option { return func(s *Service) { s.now = now } }

// window is the calendar window of l for a store request, or none for a token bucket.
func (s *Service) window(l *policy.Limits) bucket.Window {
	if l.Calendar == nil {
		return bucket.Window{}
	}
	return l.Calendar.Window(s.now().Add(-CalendarSlack))
}

// Option configures a Service.
type Option func(*Service)

// WithMetrics records the service's counters and latencies in m.
func WithMetrics(m *Metrics) Option { return func(s *Service) { s.metrics = m } }

// WithLogger logs store failures (their causes, which clients never see) to log.
func WithLogger(log *zap.Logger) Option { return func(s *Service) { s.log = log } }

// WithStoreTimeout bounds each store batch: a batch not answered within d fails as a whole with
// STORE_UNAVAILABLE (or per item), so an agent applies its failure mode instead of waiting for
// its own deadline. Zero (the default) leaves only the caller's deadline.
func WithStoreTimeout(d time.Duration) Option { return func(s *Service) { s.storeTimeout = d } }

// WithUnknownVersion calls f before a request naming a policy version the Service does not hold
// is answered UNKNOWN_POLICY_VERSION; when f returns true the version is looked up again.
// Policies.Miss is one: the runtime overrides may have changed since it last read them.
func WithUnknownVersion(f func(version string) bool) Option {
	return func(s *Service) { s.unknownVersion = f }
}

// NewService returns a Service over store answering for set.
func NewService(store Store, set *policy.Set, opts ...Option) *Service {
	s := &Service{store: store, log: zap.NewNop(), now: time.Now}
	for _, o := range opts {
		o(s)
	}
	if s.log == nil {
		s.log = zap.NewNop()
	}
	s.SetPolicy(set)
	return s
}

// SetPolicy makes set the current policy; the previous versions stay known.
func (s *Service) SetPolicy(set *policy.Set) {
	s.mu.Lock()
	defer s.mu.Unlock()
	kept := []*policy.Set{set}
	for _, old := range s.versions {
		if old.Version() != set.Version() && len(kept) < KeepVersions {
			kept = append(kept, old)
		}
	}
	s.versions = kept
	s.metrics.setPolicy(set.Version())
}

// Policy is the current policy.
func (s *Service) Policy() *policy.Set {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.versions[0]
}

func (s *Service) policy(version string) *policy.Set {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, set := range s.versions {
		if set.Version() == version {
			return set
		}
	}
	return nil
}

// resolved is one item's bucket: its route, key and limit, or the status that rejects it.
type resolved struct {
	route  policy.Route
	key    string
	limits *policy.Limits
	status coordinatorv1.Status
}

func resolve(set *policy.Set, ref *coordinatorv1.BucketRef) resolved {
	if ref == nil {
		return resolved{status: coordinatorv1.Status_STATUS_INVALID}
	}
	r, ok := set.Lookup(ref.Rule, ref.Route, ref.Operation)
	if !ok {
		return resolved{status: coordinatorv1.Status_STATUS_UNKNOWN_ROUTE}
	}
	lim, err := set.Limits(r, ref.Tenant, ref.Region)
	if err != nil {
		if errors.Is(err, policy.ErrUnknownRegion) {
			return resolved{status: coordinatorv1.Status_STATUS_UNKNOWN_ROUTE}
		}
		return resolved{status: coordinatorv1.Status_STATUS_INVALID}
	}
	return resolved{route: r, key: set.KeyFor(r, ref.Tenant, lim), limits: lim}
}

func (s *Service) validate(agent string, seq uint64, version string, items int) (*policy.Set, error) {
	switch {
	case agent == "" || len(agent) > MaxAgentID:
		return nil, status.Errorf(codes.InvalidArgument, "agent_id must be 1..%d bytes", MaxAgentID)
	case seq == 0 || seq > bucket.MaxExact:
		return nil, status.Error(codes.InvalidArgument, "seq must be in 1..2^53-1")
	case items > MaxItems:
		return nil, status.Errorf(codes.InvalidArgument, "at most %d items per call", MaxItems)
	case len(version) > maxVersion:
		return nil, status.Errorf(codes.InvalidArgument, "policy_version longer than %d bytes", maxVersion)
	}
	set := s.policy(version)
	if set == nil && s.unknownVersion != nil && s.unknownVersion(version) {
		set = s.policy(version)
	}
	if set == nil {
		return nil, coordinatorv1.UnknownPolicyVersionError(version)
	}
	return set, nil
}

// Acquire debits the global buckets of many keys in one store round trip and grants leases, and
// credits the leases handed back with it, in the same round trip: a key's own lease in its item
// (one atomic operation: credit, then the item's debt, then take), other keys' in req.Returns
// (takes that only credit). An item's debt_micro is a cost settled after the fact, charged even
// below zero down to its bucket's max_debt (the rest forgiven); an item with needed_micro and
// min_micro 0 and a debt only charges it (STATUS_OK, nothing granted). Items whose reference
// the policy does not hold, malformed items and a second item on a key already in the call (it
// would be answered from the first one's idempotency record) are rejected per item without
// touching the store.
func (s *Service) Acquire(ctx context.Context, req *coordinatorv1.AcquireRequest) (*coordinatorv1.AcquireResponse, error) {
	set, err := s.validate(req.AgentId, req.Seq, req.PolicyVersion, len(req.Items)+len(req.Returns))
	if err != nil {
		return nil, err
	}
	s.metrics.batchSize(methodAcquire, len(req.Items))
	op := OpID{Agent: req.AgentId, Seq: req.Seq}
	results := make([]*coordinatorv1.AcquireResult, len(req.Items))
	plans := make([]lease.Plan, len(req.Items))
	takes := make([]TakeRequest, 0, len(req.Items))
	at := make([]int, 0, len(req.Items)) // takes[j] answers item at[j]
	var seen keySet
	for i, it := range req.Items {
		res := resolve(set, it.Bucket)
		if res.status != coordinatorv1.Status_STATUS_UNSPECIFIED {
			results[i] = &coordinatorv1.AcquireResult{Status: res.status}
			continue
		}
		if it.DebtMicro < 0 || (it.DebtMicro > 0 && len(it.Also) > 0) {
			// A debt is charged to one bucket: an item of several takes none.
			results[i] = &coordinatorv1.AcquireResult{Status: coordinatorv1.Status_STATUS_INVALID}
			continue
		}
		var also []Bucket
		var p lease.Plan
		var err error
		if !debtOnly(it) {
			var ok bool
			if also, ok = resolveAlso(set, res, it.Bucket, it.Also); !ok {
				results[i] = &coordinatorv1.AcquireResult{Status: coordinatorv1.Status_STATUS_INVALID}
				continue
			}
			// A take of several buckets (a direct route's: only its size counts) covers the grant
			// in each: planned on the one of the smallest capacity.
			lim := res.limits.Bucket
			for _, b := range also {
				if b.Limit.Capacity() < lim.Capacity() {
					lim = b.Limit
				}
			}
			cost := bucket.Micro(set.Cost(res.route)) * bucket.PerToken
			p, err = PlanGrant(lim, cost, res.route.Rule.Direct, lease.Ask{
				Needed: bucket.Micro(it.NeededMicro), Least: bucket.Micro(it.MinMicro), Demand: bucket.Micro(it.DemandMicroPerSecond),
				Regular: it.Regular,
				Scarce:  it.Scarce,
			})
		}
		if errors.Is(err, ErrCostAboveCapacity) {
			// No wait can satisfy it: denied for good, nothing charged (a lease handed back or a debt
			// sent with it is lost: an agent never sends one with a cost the policy refuses).
			results[i] = &coordinatorv1.AcquireResult{Status: coordinatorv1.Status_STATUS_DENIED,
				RetryAfterMs: int64(bucket.Never)}
			continue
		}
		t := TakeRequest{Key: res.key, Limit: res.limits.Bucket, Want: p.Want, Min: p.Least, Share: p.Share, Unit: p.Unit,
			Credit: Credit{Amount: bucket.Micro(it.ReturnMicro), GrantedAt: bucket.Millis(it.ReturnGrantedAtMs)},
			Debt:   bucket.Micro(it.DebtMicro), MaxDebt: res.limits.MaxDebt,
			Demand: bucket.Micro(it.DemandMicroPerSecond), TTL: bucket.Millis(p.TTL / time.Millisecond), Op: op,
			Period: s.window(res.limits), Also: also}
		if t.Period.IsZero() && len(also) == 0 {
			t.AmpleWant = p.AmpleWant // a lease of a lifetime's demand where the bucket has plenty
		}
		if err != nil || t.Validate() != nil || !seen.add(res.key) {
			results[i] = &coordinatorv1.AcquireResult{Status: coordinatorv1.Status_STATUS_INVALID}
			continue
		}
		plans[i] = p
		takes = append(takes, t)
		at = append(at, i)
	}
	// Leases of other keys ride in the same store batch: a take that only credits.
	rets, retAt, retResults := s.returnRequests(set, op, req.Returns, &seen, false)
	for _, r := range rets {
		takes = append(takes, TakeRequest{Key: r.Key, Limit: r.Limit, Credit: Credit{Amount: r.Amount, GrantedAt: r.GrantedAt}, Op: op, Period: r.Period})
	}
	var out []TakeResult
	if len(takes) > 0 {
		sctx, cancel := s.storeContext(ctx)
		start := time.Now()
		out, err = s.store.Take(sctx, takes)
		cancel()
		if err == nil && len(out) != len(takes) {
			err = fmt.Errorf("coordinator: store answered %d of %d takes", len(out), len(takes))
		}
		s.metrics.store(methodAcquire, time.Since(start), err)
		if err != nil {
			return nil, s.storeError(ctx, "acquire", err)
		}
	}
	var itemErr error
	for j, r := range out[:len(at)] {
		i := at[j]
		results[i] = acquireResult(plans[i], &takes[j], r)
		if r.Err != nil && !errors.Is(r.Err, ErrInvalidRequest) {
			s.metrics.storeItemError(methodAcquire)
			itemErr = cmp.Or(itemErr, r.Err)
		}
		s.metrics.granted(r)
		s.metrics.debt(r, takes[j].Debt)
		if r.Err == nil && !r.Stale && takes[j].Credit.Amount > 0 {
			s.metrics.returned(ReturnResult{Result: bucket.Result{Granted: r.Credited}, Replayed: r.Replayed}, takes[j].Credit.Amount)
		}
	}
	s.logItemError("acquire", itemErr)
	for _, r := range results {
		s.metrics.item(methodAcquire, r.Status)
	}
	resp := &coordinatorv1.AcquireResponse{Results: results}
	if len(req.Returns) > 0 {
		retOut := make([]ReturnResult, len(rets))
		for j, r := range out[len(at):] {
			retOut[j] = ReturnResult{Result: bucket.Result{Granted: r.Credited, Remaining: r.Remaining}, Now: r.Now,
				Replayed: r.Replayed, Stale: r.Stale, Err: r.Err}
		}
		resp.Returns = s.returnResults(retResults, rets, retAt, retOut)
	}
	return resp, nil
}

// debtOnly reports whether an item only charges a cost settled after the fact: it needs nothing
// and carries a debt.
func debtOnly(it *coordinatorv1.AcquireItem) bool {
	return it.NeededMicro == 0 && it.MinMicro == 0 && it.DebtMicro > 0
}

// resolveAlso resolves the other buckets refs of an item on bucket own (AcquireItem.also,
// ReturnItem.also): for a direct route with charges, exactly its charges, in the policy's order,
// of the item's tenant and region; for any other route, none. ok is false when the item names
// others than those.
func resolveAlso(set *policy.Set, res resolved, own *coordinatorv1.BucketRef, refs []*coordinatorv1.BucketRef) (also []Bucket, ok bool) {
	charges := res.route.Charges()
	if !res.route.Rule.Direct || len(charges) == 0 {
		return nil, len(refs) == 0
	}
	if len(refs) != len(charges) {
		return nil, false
	}
	also = make([]Bucket, len(charges))
	for j, ref := range refs {
		c := resolve(set, ref)
		if c.status != coordinatorv1.Status_STATUS_UNSPECIFIED || c.route.ID != charges[j] ||
			ref.Tenant != own.Tenant || ref.Region != own.Region || c.limits.Calendar != nil {
			return nil, false
		}
		also[j] = Bucket{Key: c.key, Limit: c.limits.Bucket}
	}
	return also, true
}

// acquireResult is the answer to one granted, denied or failed take t. A calendar quota's lease
// (t.Period set) lives at most until its period ends on the key clock: the agent counts its
// lifetime from before the grant, so no token of a period is spent in the next one. A take of
// nothing (only a debt) is answered OK with nothing granted.
func acquireResult(p lease.Plan, t *TakeRequest, r TakeResult) *coordinatorv1.AcquireResult {
	w := t.Period
	switch {
	case errors.Is(r.Err, ErrInvalidRequest):
		return &coordinatorv1.AcquireResult{Status: coordinatorv1.Status_STATUS_INVALID}
	case r.Err != nil:
		return &coordinatorv1.AcquireResult{Status: coordinatorv1.Status_STATUS_STORE_UNAVAILABLE}
	case r.Stale:
		return &coordinatorv1.AcquireResult{Status: coordinatorv1.Status_STATUS_STALE}
	}
	// What every answer of a take that reached the bucket carries.
	res := &coordinatorv1.AcquireResult{
		Status:           coordinatorv1.Status_STATUS_OK,
		RemainingMicro:   int64(r.Remaining),
		GrantedAtMs:      int64(r.Now),
		Replayed:         r.Replayed,
		CreditedMicro:    int64(r.Credited),
		DebtChargedMicro: int64(r.Debited),
	}
	switch {
	case t.TakesNothing():
		return res
	case r.Granted == 0:
		res.Status, res.RetryAfterMs, res.PaceMs, res.RefusedBucket = coordinatorv1.Status_STATUS_DENIED, int64(r.RetryAfter), int64(r.Pace), uint32(r.Refused)
		return res
	}
	ttl := int64(p.TTL / time.Millisecond)
	if !w.IsZero() && ttl > 0 {
		end := w.End
		if r.Now >= w.End {
			end = w.Next
		}
		ttl = min(ttl, int64(end-r.Now))
	}
	res.GrantedMicro, res.TtlMs, res.PaceMs = int64(r.Granted), ttl, int64(r.Pace)
	return res
}

// Return credits back unspent tokens of leases (decayed by the refill since their grant).
// Rejections per item are those of Acquire.
func (s *Service) Return(ctx context.Context, req *coordinatorv1.ReturnRequest) (*coordinatorv1.ReturnResponse, error) {
	set, err := s.validate(req.AgentId, req.Seq, req.PolicyVersion, len(req.Items))
	if err != nil {
		return nil, err
	}
	var seen keySet
	rets, at, results := s.returnRequests(set, OpID{Agent: req.AgentId, Seq: req.Seq}, req.Items, &seen, true)
	var out []ReturnResult
	if len(rets) > 0 {
		if out, err = s.storeReturn(ctx, rets); err != nil {
			return nil, s.storeError(ctx, "return", err)
		}
	}
	return &coordinatorv1.ReturnResponse{Results: s.returnResults(results, rets, at, out)}, nil
}

// returnRequests resolves the items of a Return (alone), or the returns of an Acquire, whose keys
// are in seen already: the store requests, the item each answers, and the results of the items
// rejected without touching the store (nil for the others). Only a Return alone may hand back
// the grant of a take of several buckets (ReturnItem.also): an Acquire's returns ride in its
// store batch as takes that credit, and a take of several buckets credits nothing.
func (s *Service) returnRequests(set *policy.Set, op OpID, items []*coordinatorv1.ReturnItem, seen *keySet, alone bool) ([]ReturnRequest, []int, []*coordinatorv1.ReturnResult) {
	if len(items) == 0 {
		return nil, nil, nil
	}
	s.metrics.batchSize(methodReturn, len(items))
	results := make([]*coordinatorv1.ReturnResult, len(items))
	rets := make([]ReturnRequest, 0, len(items))
	at := make([]int, 0, len(items))
	for i, it := range items {
		res := resolve(set, it.Bucket)
		if res.status != coordinatorv1.Status_STATUS_UNSPECIFIED {
			results[i] = &coordinatorv1.ReturnResult{Status: res.status}
			continue
		}
		// Without also, a direct route's grant goes back to its own bucket only (an agent of an
		// earlier version hands back so: under-use, never overshoot).
		also, ok := []Bucket(nil), true
		if len(it.Also) > 0 {
			also, ok = resolveAlso(set, res, it.Bucket, it.Also)
		}
		r := ReturnRequest{
			Key: res.key, Limit: res.limits.Bucket,
			Amount: bucket.Micro(it.UnspentMicro), GrantedAt: bucket.Millis(it.GrantedAtMs), Op: op,
			Period: s.window(res.limits), Also: also,
		}
		// A key is named once per call (its record answers the call's seq); the other buckets of
		// a return hold no record of it.
		if !ok || (len(also) > 0 && !alone) || r.Validate() != nil || !seen.add(res.key) {
			results[i] = &coordinatorv1.ReturnResult{Status: coordinatorv1.Status_STATUS_INVALID}
			continue
		}
		rets = append(rets, r)
		at = append(at, i)
	}
	return rets, at, results
}

// storeReturn runs one batch of returns against the store.
func (s *Service) storeReturn(ctx context.Context, rets []ReturnRequest) ([]ReturnResult, error) {
	sctx, cancel := s.storeContext(ctx)
	start := time.Now()
	out, err := s.store.Return(sctx, rets)
	cancel()
	if err == nil && len(out) != len(rets) {
		err = fmt.Errorf("coordinator: store answered %d of %d returns", len(out), len(rets))
	}
	s.metrics.store(methodReturn, time.Since(start), err)
	return out, err
}

// returnResults fills in the results of the returns the store answered (out[j] answers rets[j],
// item at[j]).
func (s *Service) returnResults(results []*coordinatorv1.ReturnResult, rets []ReturnRequest, at []int, out []ReturnResult) []*coordinatorv1.ReturnResult {
	var itemErr error
	for j, i := range at {
		r := out[j]
		res := &coordinatorv1.ReturnResult{Status: coordinatorv1.Status_STATUS_OK, CreditedMicro: int64(r.Granted), Replayed: r.Replayed}
		switch {
		case errors.Is(r.Err, ErrInvalidRequest):
			res = &coordinatorv1.ReturnResult{Status: coordinatorv1.Status_STATUS_INVALID}
		case r.Err != nil:
			res = &coordinatorv1.ReturnResult{Status: coordinatorv1.Status_STATUS_STORE_UNAVAILABLE}
			s.metrics.storeItemError(methodReturn)
			itemErr = cmp.Or(itemErr, r.Err)
		case r.Stale:
			res = &coordinatorv1.ReturnResult{Status: coordinatorv1.Status_STATUS_STALE}
		default:
			// A return to several buckets handed the amount back to each; Granted is their sum.
			s.metrics.returned(r, rets[j].Amount*bucket.Micro(1+len(rets[j].Also)))
		}
		results[i] = res
	}
	s.logItemError("return", itemErr)
	for _, r := range results {
		s.metrics.item(methodReturn, r.Status)
	}
	return results
}

// storeContext is ctx bounded by the store timeout, if one is set.
func (s *Service) storeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if s.storeTimeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.storeTimeout)
}

// logItemError logs the first per-key store failure of a batch (the response says only
// STATUS_STORE_UNAVAILABLE).
func (s *Service) logItemError(op string, err error) {
	if err != nil {
		s.log.Warn("store failed for some keys of a batch", zap.String("op", op), zap.Error(err))
	}
}

// keySet detects a key that occurs twice in one batch: a linear scan while the batch is small,
// a map beyond.
type keySet struct {
	keys []string
	m    map[string]struct{}
}

// linearKeys is the batch size up to which a scan beats hashing every key.
const linearKeys = 16

// add reports whether key was new, and records it.
func (k *keySet) add(key string) bool {
	if k.m == nil {
		if slices.Contains(k.keys, key) {
			return false
		}
		if len(k.keys) < linearKeys {
			k.keys = append(k.keys, key)
			return true
		}
		k.m = make(map[string]struct{}, 2*linearKeys)
		for _, x := range k.keys {
			k.m[x] = struct{}{}
		}
	}
	if _, dup := k.m[key]; dup {
		return false
	}
	k.m[key] = struct{}{}
	return true
}

// storeError maps a whole-batch store failure to the gRPC status agents turn into failure modes:
// the caller's own cancellation or deadline as such, anything else (including the store timeout)
// as UNAVAILABLE with reason STORE_UNAVAILABLE. The status carries a generic message (no store
// address or shard reaches a client); the cause is logged and kept for StoreCause.
func (s *Service) storeError(ctx context.Context, op string, err error) error {
	if ctx.Err() != nil {
		s.log.Debug("store batch abandoned by the caller", zap.String("op", op), zap.Error(err))
		return status.FromContextError(ctx.Err()).Err()
	}
	s.log.Warn("store failed for a whole batch", zap.String("op", op), zap.Error(err))
	return &storeFailure{status: coordinatorv1.StoreUnavailableError(), cause: err}
}

// storeFailure is a gRPC status error that remembers its cause for logging.
type storeFailure struct {
	status error
	cause  error
}

func (e *storeFailure) Error() string              { return e.status.Error() }
func (e *storeFailure) GRPCStatus() *status.Status { return status.Convert(e.status) }
func (e *storeFailure) Unwrap() error              { return e.cause }

// StoreCause returns the store error behind a handler's error, for logs; nil if there is none.
func StoreCause(err error) error {
	var f *storeFailure
	if errors.As(err, &f) {
		return f.cause
	}
	return nil
}
