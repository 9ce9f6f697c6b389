package coordinator

import (
	"context"
	"errors"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/bucket"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
	"github.com/leasebucket/leasebucket/policy"
)

// MaxItems bounds the items of one Acquire or Return: a batch is one pipelined store round trip.
const MaxItems = 1024

// KeepVersions is how many policy versions a coordinator answers for: the current one and the
// ones before it, so agents that have not reloaded yet during a roll-out keep working.
const KeepVersions = 4

// Service is the coordinator: the CoordinatorService handlers over a Store and the policy. It
// holds no bucket state. The simulator calls the same methods in process.
type Service struct {
	coordinatorv1.UnimplementedCoordinatorServiceServer
	store Store

	mu       sync.RWMutex
	versions []*policy.Set // newest first, at most KeepVersions
}

// NewService returns a Service over store answering for set.
func NewService(store Store, set *policy.Set) *Service {
	s := &Service{store: store}
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

// resolved is one item's bucket: its key and limit, or the status that rejects it.
type resolved struct {
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
	key, err := set.Key(r, ref.Tenant, ref.Region)
	if err != nil {
		return resolved{status: coordinatorv1.Status_STATUS_INVALID}
	}
	return resolved{key: key, limits: lim}
}

func (s *Service) validate(agent string, seq uint64, version string, items int) (*policy.Set, error) {
	switch {
	case agent == "" || len(agent) > MaxAgentID:
		return nil, status.Errorf(codes.InvalidArgument, "agent_id must be 1..%d bytes", MaxAgentID)
	case seq == 0 || seq > bucket.MaxExact:
		return nil, status.Error(codes.InvalidArgument, "seq must be in 1..2^53-1")
	case items > MaxItems:
		return nil, status.Errorf(codes.InvalidArgument, "at most %d items per call", MaxItems)
	}
	set := s.policy(version)
	if set == nil {
		return nil, coordinatorv1.UnknownPolicyVersionError(version)
	}
	return set, nil
}

// Acquire debits the global buckets of many keys in one store round trip and grants leases.
func (s *Service) Acquire(ctx context.Context, req *coordinatorv1.AcquireRequest) (*coordinatorv1.AcquireResponse, error) {
	set, err := s.validate(req.AgentId, req.Seq, req.PolicyVersion, len(req.Items))
	if err != nil {
		return nil, err
	}
	op := OpID{Agent: req.AgentId, Seq: req.Seq}
	results := make([]*coordinatorv1.AcquireResult, len(req.Items))
	plans := make([]Plan, len(req.Items))
	var takes []TakeRequest
	var at []int // takes[j] answers item at[j]
	for i, it := range req.Items {
		res := resolve(set, it.Bucket)
		if res.status != coordinatorv1.Status_STATUS_UNSPECIFIED {
			results[i] = &coordinatorv1.AcquireResult{Status: res.status}
			continue
		}
		p, err := PlanGrant(res.limits.Bucket, bucket.Micro(it.WantMicro), bucket.Micro(it.MinMicro), bucket.Micro(it.DemandMicroPerSecond))
		if err != nil {
			results[i] = &coordinatorv1.AcquireResult{Status: coordinatorv1.Status_STATUS_INVALID}
			continue
		}
		plans[i] = p
		takes = append(takes, TakeRequest{Key: res.key, Limit: res.limits.Bucket, Want: p.Want, Min: p.Min, Share: p.Share, Op: op})
		at = append(at, i)
	}
	if len(takes) > 0 {
		out, err := s.store.Take(ctx, takes)
		if err != nil {
			return nil, storeError(ctx, err)
		}
		for j, r := range out {
			i := at[j]
			results[i] = acquireResult(plans[i], takes[j].Limit, r)
		}
	}
	return &coordinatorv1.AcquireResponse{Results: results}, nil
}

func acquireResult(p Plan, limit bucket.Limit, r TakeResult) *coordinatorv1.AcquireResult {
	switch {
	case r.Err != nil:
		return &coordinatorv1.AcquireResult{Status: coordinatorv1.Status_STATUS_STORE_UNAVAILABLE}
	case r.Stale:
		return &coordinatorv1.AcquireResult{Status: coordinatorv1.Status_STATUS_STALE}
	case r.Granted == 0:
		return &coordinatorv1.AcquireResult{
			Status:         coordinatorv1.Status_STATUS_DENIED,
			RetryAfterMs:   int64(r.RetryAfter),
			RemainingMicro: int64(r.Remaining),
			Scarce:         true,
			Replayed:       r.Replayed,
		}
	}
	return &coordinatorv1.AcquireResult{
		Status:         coordinatorv1.Status_STATUS_OK,
		GrantedMicro:   int64(r.Granted),
		TtlMs:          int64(p.TTL / time.Millisecond),
		RemainingMicro: int64(r.Remaining),
		GrantedAtMs:    int64(r.Now),
		Scarce:         Scarce(p, limit, r.Granted, r.Remaining),
		Replayed:       r.Replayed,
	}
}

// Return credits back unspent tokens of leases (decayed by the refill since their grant).
func (s *Service) Return(ctx context.Context, req *coordinatorv1.ReturnRequest) (*coordinatorv1.ReturnResponse, error) {
	set, err := s.validate(req.AgentId, req.Seq, req.PolicyVersion, len(req.Items))
	if err != nil {
		return nil, err
	}
	op := OpID{Agent: req.AgentId, Seq: req.Seq}
	results := make([]*coordinatorv1.ReturnResult, len(req.Items))
	var rets []ReturnRequest
	var at []int
	for i, it := range req.Items {
		res := resolve(set, it.Bucket)
		switch {
		case res.status != coordinatorv1.Status_STATUS_UNSPECIFIED:
			results[i] = &coordinatorv1.ReturnResult{Status: res.status}
			continue
		case it.UnspentMicro < 0 || it.GrantedAtMs < 0:
			results[i] = &coordinatorv1.ReturnResult{Status: coordinatorv1.Status_STATUS_INVALID}
			continue
		}
		rets = append(rets, ReturnRequest{
			Key: res.key, Limit: res.limits.Bucket,
			Amount: bucket.Micro(it.UnspentMicro), GrantedAt: bucket.Millis(it.GrantedAtMs), Op: op,
		})
		at = append(at, i)
	}
	if len(rets) > 0 {
		out, err := s.store.Return(ctx, rets)
		if err != nil {
			return nil, storeError(ctx, err)
		}
		for j, r := range out {
			res := &coordinatorv1.ReturnResult{Status: coordinatorv1.Status_STATUS_OK, CreditedMicro: int64(r.Granted), Replayed: r.Replayed}
			switch {
			case r.Err != nil:
				res = &coordinatorv1.ReturnResult{Status: coordinatorv1.Status_STATUS_STORE_UNAVAILABLE}
			case r.Stale:
				res = &coordinatorv1.ReturnResult{Status: coordinatorv1.Status_STATUS_STALE}
			}
			results[at[j]] = res
		}
	}
	return &coordinatorv1.ReturnResponse{Results: results}, nil
}

// storeError maps a whole-batch store failure to the gRPC status agents turn into failure modes.
// The status carries a generic message (no store address or shard reaches a client); the cause
// is kept for the server's log through StoreCause.
func storeError(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
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
