package coordinator

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

const (
	// DefaultOverridesPoll is how often a coordinator reads the runtime overrides' stamp: a change
	// made through another coordinator takes effect here within it. The read is one small HMGET.
	DefaultOverridesPoll = 2 * time.Second

	// MissRefreshEvery bounds how often a request with an unknown policy version makes a
	// coordinator read the runtime overrides at once (Policies.Miss): an agent may have learnt a
	// change from a coordinator that polled earlier than this one.
	MissRefreshEvery = time.Second

	// logProblems bounds the overrides that did not apply logged by one change.
	logProblems = 10
)

// Policies keeps a Service's policy: the policy file's Set with the runtime overrides of an
// OverridesStore applied (policy.Set.WithOverrides), so that its version names both. The file
// comes from the policy watcher (SetFile); the overrides from the store, read when their stamp
// changes (Run polls it; the admin API calls Refresh after a write; Miss reads it when an agent
// names a version of this file with other overrides). Overrides is the snapshot the Service
// answers with, which OverridesServer gives agents.
type Policies struct {
	svc     *Service
	store   OverridesStore
	log     *zap.Logger
	timeout time.Duration

	refreshMu sync.Mutex // one store read at a time; guards lastMiss, failing
	lastMiss  time.Time
	failing   bool // the last poll failed (logged once until one succeeds)

	mu    sync.Mutex // guards the fields below and their installation in svc
	file  *policy.Set
	ov    *policy.Overrides
	stamp string
}

// NewPolicies returns the Policies of svc, starting from the file's Set without overrides (Refresh
// or Run read them). timeout bounds a Miss's store read (the store timeout).
func NewPolicies(svc *Service, file *policy.Set, store OverridesStore, log *zap.Logger, timeout time.Duration) *Policies {
	if log == nil {
		log = zap.NewNop()
	}
	if timeout <= 0 {
		timeout = time.Second
	}
	p := &Policies{svc: svc, store: store, log: log, timeout: timeout, file: file.Base()}
	p.install()
	return p
}

// SetFile installs a new Set of the policy file, with the current runtime overrides.
func (p *Policies) SetFile(set *policy.Set) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.file = set.Base()
	p.install()
}

// install makes file with ov the Service's policy. Caller holds p.mu.
func (p *Policies) install() {
	set, problems := p.file.WithOverrides(p.ov)
	for i, pr := range problems {
		if i == logProblems {
			p.log.Warn("more runtime overrides do not apply to the policy", zap.Int("count", len(problems)-logProblems))
			break
		}
		p.log.Warn("runtime override does not apply to the policy; it is left out", zap.String("policy_version", p.file.Version()),
			zap.String("rule", pr.Rule), zap.String("tenant", pr.Tenant), zap.Error(pr.Err))
	}
	if p.svc.Policy() != set {
		p.svc.SetPolicy(set)
	}
}

// Current is the Service's policy: the file's Set with the runtime overrides applied.
func (p *Policies) Current() *policy.Set { return p.svc.Policy() }

// Overrides is the runtime overrides snapshot in use (nil for none).
func (p *Policies) Overrides() *policy.Overrides {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ov
}

// Refresh reads the overrides' stamp and, if it changed, the overrides, and installs them. A
// snapshot that cannot be read or is out of bounds leaves the current one in use.
func (p *Policies) Refresh(ctx context.Context) error {
	p.refreshMu.Lock()
	defer p.refreshMu.Unlock()
	return p.refresh(ctx)
}

func (p *Policies) refresh(ctx context.Context) error {
	stamp, err := p.store.OverridesStamp(ctx)
	if err != nil {
		return fmt.Errorf("coordinator: runtime overrides: %w", err)
	}
	p.mu.Lock()
	same := stamp == p.stamp
	p.mu.Unlock()
	if same {
		return nil
	}
	stamp, entries, err := p.store.LoadOverrides(ctx)
	if err != nil {
		return fmt.Errorf("coordinator: runtime overrides: %w", err)
	}
	ov, err := policy.NewOverrides(entries)
	if err != nil {
		return fmt.Errorf("coordinator: runtime overrides: %w", err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	old := p.ov
	p.stamp = stamp
	if old.Digest() == ov.Digest() {
		return nil
	}
	p.ov = ov
	p.install()
	p.log.Info("runtime overrides changed", zap.Int("overrides", ov.Len()), zap.Int("bytes", ov.Bytes()),
		zap.String("digest", ov.Digest()), zap.String("policy_version", p.svc.Policy().Version()))
	return nil
}

// Run polls the store every interval until ctx is done. A failed read is logged once until a
// read succeeds again; the overrides in use stay.
func (p *Policies) Run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, max(interval, p.timeout))
		err := p.Refresh(rctx)
		cancel()
		p.refreshMu.Lock()
		switch {
		case err != nil && ctx.Err() == nil && !p.failing:
			p.failing = true
			p.log.Warn("cannot read the runtime overrides; the ones in use stay", zap.Error(err))
		case err == nil && p.failing:
			p.failing = false
			p.log.Info("runtime overrides readable again")
		}
		p.refreshMu.Unlock()
	}
}

// Miss is the Service's WithUnknownVersion hook: when version is this policy file's version with
// other runtime overrides than the ones in use (an agent learnt of a change from a coordinator
// that read the store first), it reads the overrides at once, at most once per MissRefreshEvery.
// It reports whether the Service should look the version up again.
func (p *Policies) Miss(version string) bool {
	p.mu.Lock()
	fileVersion := p.file.Version()
	p.mu.Unlock()
	if version != fileVersion && !strings.HasPrefix(version, fileVersion+"+o") {
		return false // another policy file: the overrides cannot help
	}
	p.refreshMu.Lock()
	defer p.refreshMu.Unlock()
	if time.Since(p.lastMiss) < MissRefreshEvery {
		return true // read recently, maybe by a request that waited with this one
	}
	p.lastMiss = time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), p.timeout)
	defer cancel()
	if err := p.refresh(ctx); err != nil {
		p.log.Debug("reading the runtime overrides for an unknown policy version failed", zap.String("version", version), zap.Error(err))
		return false
	}
	return true
}

// OverridesServer is the OverridesService agents poll: the snapshot of runtime overrides the
// coordinator's policy holds.
type OverridesServer struct {
	coordinatorv1.UnimplementedOverridesServiceServer
	p *Policies
}

// NewOverridesServer serves p's snapshot.
func NewOverridesServer(p *Policies) *OverridesServer { return &OverridesServer{p: p} }

// maxDigest bounds the digest an agent sends (a SHA-256 in hex is 64 characters).
const maxDigest = 128

// GetOverrides answers with the snapshot, or unchanged when the agent holds it already.
func (s *OverridesServer) GetOverrides(_ context.Context, req *coordinatorv1.GetOverridesRequest) (*coordinatorv1.GetOverridesResponse, error) {
	if len(req.KnownDigest) > maxDigest {
		return nil, status.Errorf(codes.InvalidArgument, "known_digest longer than %d bytes", maxDigest)
	}
	ov := s.p.Overrides()
	resp := &coordinatorv1.GetOverridesResponse{Digest: ov.Digest()}
	if req.KnownDigest == ov.Digest() {
		resp.Unchanged = true
		return resp, nil
	}
	for _, e := range ov.Entries() {
		resp.Overrides = append(resp.Overrides, &coordinatorv1.RuntimeOverride{Rule: e.Rule, Tenant: e.Tenant, Spec: e.Spec})
	}
	return resp, nil
}
