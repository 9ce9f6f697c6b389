package agent

import (
	"context"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// DefaultOverridesInterval is how often an agent asks a coordinator for the runtime overrides:
// as often as the policy file is read. An answer for an unchanged snapshot is a few bytes.
const DefaultOverridesInterval = 2 * time.Second

// OverridesClient is what a PolicySource needs of the coordinators: their OverridesService.
type OverridesClient interface {
	GetOverrides(ctx context.Context, req *coordinatorv1.GetOverridesRequest) (*coordinatorv1.GetOverridesResponse, error)
}

// NewOverridesClient is the OverridesClient behind a gRPC connection (usually from
// DialCoordinators).
func NewOverridesClient(cc grpc.ClientConnInterface) OverridesClient {
	return overridesClient{coordinatorv1.NewOverridesServiceClient(cc)}
}

type overridesClient struct {
	c coordinatorv1.OverridesServiceClient
}

func (o overridesClient) GetOverrides(ctx context.Context, req *coordinatorv1.GetOverridesRequest) (*coordinatorv1.GetOverridesResponse, error) {
	return o.c.GetOverrides(ctx, req)
}

// PolicySourceConfig configures a PolicySource. File is required.
type PolicySourceConfig struct {
	// File is the policy file's Set at start; SetFile replaces it.
	File *policy.Set
	// Client asks the coordinators for the runtime overrides; nil uses the file alone.
	Client OverridesClient
	// Apply receives every new policy (the Limiter's SetPolicy), in order, on the goroutine that
	// caused the change. It must not call back into the PolicySource.
	Apply func(*policy.Set)
	// CallTimeout bounds one GetOverrides (DefaultCallTimeout if zero).
	CallTimeout time.Duration
	Logger      *zap.Logger
}

// PolicySource is the agent's policy: the policy file's Set with the runtime overrides its
// coordinators serve applied (policy.Set.WithOverrides). The coordinators apply the same
// snapshot to the same file, so the version the agent sends with each call — the file's version
// plus the overrides' digest — is one they know, and means the same limits to both.
//
// The file comes from the policy watcher (SetFile); the overrides from polling a coordinator
// (Run), and from Refresh when a coordinator does not know the agent's version (the
// Refresher's ReloadPolicy). A snapshot that cannot be fetched, or whose entries do not hash to
// the digest the coordinator sent, leaves the one in use; a coordinator without the
// OverridesService (an older version) counts as one without runtime overrides.
type PolicySource struct {
	cfg PolicySourceConfig
	log *zap.Logger

	refreshMu sync.Mutex // one GetOverrides at a time; guards failing, noService
	failing   bool
	noService bool

	mu   sync.Mutex // guards the fields below; held while Apply runs, so policies apply in order
	file *policy.Set
	ov   *policy.Overrides
	cur  *policy.Set
}

// NewPolicySource returns a PolicySource holding cfg.File without overrides.
func NewPolicySource(cfg PolicySourceConfig) *PolicySource {
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = DefaultCallTimeout
	}
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	file := cfg.File.Base()
	return &PolicySource{cfg: cfg, log: log, file: file, cur: file}
}

// Current is the policy in use.
func (p *PolicySource) Current() *policy.Set {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cur
}

// SetFile installs a new Set of the policy file, with the runtime overrides in use.
func (p *PolicySource) SetFile(set *policy.Set) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.file = set.Base()
	p.install()
}

// install applies ov to file and hands a changed policy to Apply. Caller holds p.mu.
func (p *PolicySource) install() {
	set, problems := p.file.WithOverrides(p.ov)
	if set == p.cur {
		return
	}
	for _, pr := range problems {
		p.log.Debug("runtime override does not apply to this policy file", zap.String("rule", pr.Rule),
			zap.String("tenant", pr.Tenant), zap.Error(pr.Err))
	}
	p.cur = set
	if p.cfg.Apply != nil {
		p.cfg.Apply(set)
	}
}

// Refresh asks a coordinator for the runtime overrides once and installs them if they changed.
func (p *PolicySource) Refresh(ctx context.Context) error {
	if p.cfg.Client == nil {
		return nil
	}
	p.refreshMu.Lock()
	defer p.refreshMu.Unlock()
	p.mu.Lock()
	known := p.ov.Digest()
	p.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, p.cfg.CallTimeout)
	defer cancel()
	resp, err := p.cfg.Client.GetOverrides(ctx, &coordinatorv1.GetOverridesRequest{KnownDigest: known})
	switch {
	case status.Code(err) == codes.Unimplemented:
		if !p.noService {
			p.noService = true
			p.log.Info("the coordinator serves no runtime overrides (an older version): using the policy file alone")
		}
		resp = &coordinatorv1.GetOverridesResponse{}
	case err != nil:
		return fmt.Errorf("agent: runtime overrides: %w", err)
	default:
		p.noService = false
	}
	if resp.Unchanged && resp.Digest == known {
		return nil
	}
	entries := make([]policy.RuntimeOverride, len(resp.Overrides))
	for i, o := range resp.Overrides {
		entries[i] = policy.RuntimeOverride{Rule: o.Rule, Tenant: o.Tenant, Spec: o.Spec}
	}
	ov, err := policy.NewOverrides(entries)
	if err != nil {
		return fmt.Errorf("agent: runtime overrides: %w", err)
	}
	if ov.Digest() != resp.Digest {
		// Agent and coordinators would name different content with one version.
		return fmt.Errorf("agent: runtime overrides: %d overrides hash to %.12s, the coordinator says %.12s", ov.Len(), ov.Digest(), resp.Digest)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ov.Digest() == ov.Digest() {
		return nil
	}
	p.ov = ov
	p.install()
	p.log.Info("runtime overrides changed", zap.Int("overrides", ov.Len()), zap.String("digest", ov.Digest()),
		zap.String("policy_version", p.cur.Version()))
	return nil
}

// Run calls Refresh every interval until ctx is done. A failure is logged once until a Refresh
// succeeds; the overrides in use stay.
func (p *PolicySource) Run(ctx context.Context, interval time.Duration) {
	if p.cfg.Client == nil {
		return
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		err := p.Refresh(ctx)
		p.refreshMu.Lock()
		switch {
		case err != nil && ctx.Err() == nil && !p.failing:
			p.failing = true
			p.log.Warn("cannot fetch the runtime overrides from the coordinators; the ones in use stay", zap.Error(err))
		case err == nil && p.failing:
			p.failing = false
			p.log.Info("runtime overrides fetched again")
		}
		p.refreshMu.Unlock()
	}
}
