package memstore

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
)

var _ coordinator.AdminStore = (*Store)(nil)

// Inspect implements coordinator.AdminStore. It changes nothing (an expired key stays until a
// request or Sweep drops it, and is reported as not stored).
func (s *Store) Inspect(ctx context.Context, key string, l bucket.Limit) (coordinator.Snapshot, error) {
	if err := ctx.Err(); err != nil {
		return coordinator.Snapshot{}, fmt.Errorf("memstore: inspect: %w", err)
	}
	if err := coordinator.ValidateKey(key, l); err != nil {
		return coordinator.Snapshot{}, fmt.Errorf("memstore: inspect: %w", err)
	}
	now := s.clock()
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return snapshot(sh.m[key], now), nil
}

// SetLevel implements coordinator.AdminStore with the semantics of redisstore's admin.lua.
func (s *Store) SetLevel(ctx context.Context, key string, l bucket.Limit, level bucket.Micro) (before, after coordinator.Snapshot, err error) {
	if err := ctx.Err(); err != nil {
		return before, after, fmt.Errorf("memstore: set level: %w", err)
	}
	if err := coordinator.ValidateLevel(key, l, level); err != nil {
		return before, after, fmt.Errorf("memstore: set level: %w", err)
	}
	now := s.clock()
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.live(key, now) // drops a key past its logical expiry
	before = snapshot(e, now)
	if e == nil {
		e = sh.create(key, l, now)
	}
	e.state = bucket.State{Tokens: level, Last: max(e.state.Last, now)}
	e.setExpiry(l)
	return before, snapshot(e, now), nil
}

// snapshot copies e as of now; nil or expired is not stored.
func snapshot(e *entry, now bucket.Millis) coordinator.Snapshot {
	snap := coordinator.Snapshot{Now: now}
	if e == nil || e.expires && now >= e.expiry {
		return snap
	}
	snap.Stored, snap.State, snap.Expires, snap.Expiry = true, e.state, e.expires, e.expiry
	for a, r := range e.takes {
		if snap.Takes == nil {
			snap.Takes = make(map[string]coordinator.TakeRecord, len(e.takes))
		}
		snap.Takes[a] = coordinator.TakeRecord{Seq: r.Seq, Granted: r.Granted, Remaining: r.Remaining, RetryAfter: r.RetryAfter, Now: r.Now}
	}
	for a, r := range e.multis {
		if snap.Multis == nil {
			snap.Multis = make(map[string]coordinator.TakeRecord, len(e.multis))
		}
		snap.Multis[a] = coordinator.TakeRecord{Seq: r.Seq, Granted: r.Granted, Remaining: r.Remaining, RetryAfter: r.RetryAfter, Now: r.Now}
	}
	for a, r := range e.returns {
		if snap.Returns == nil {
			snap.Returns = make(map[string]coordinator.ReturnRecord, len(e.returns))
		}
		snap.Returns[a] = coordinator.ReturnRecord{Seq: r.Seq, Credited: r.Credited, Remaining: r.Remaining, Now: r.Now}
	}
	return snap
}

// Overrides is a coordinator.OverridesStore in memory, with the semantics of redisstore's
// overrides.lua: for a single coordinator on the memory store. It is safe for concurrent use.
type Overrides struct {
	mu      sync.Mutex
	m       map[[2]string]string // (rule, tenant) → spec
	rev     int64
	bytes   int
	created bool
}

var _ coordinator.OverridesStore = (*Overrides)(nil)

// NewOverrides returns an empty Overrides.
func NewOverrides() *Overrides { return &Overrides{m: map[[2]string]string{}} }

// OverridesStamp implements coordinator.OverridesStore.
func (o *Overrides) OverridesStamp(ctx context.Context) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", fmt.Errorf("memstore: overrides stamp: %w", err)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.stamp(), nil
}

func (o *Overrides) stamp() string {
	if !o.created {
		return ""
	}
	return "mem:" + strconv.FormatInt(o.rev, 10)
}

// LoadOverrides implements coordinator.OverridesStore.
func (o *Overrides) LoadOverrides(ctx context.Context) (string, []policy.RuntimeOverride, error) {
	if err := ctx.Err(); err != nil {
		return "", nil, fmt.Errorf("memstore: load overrides: %w", err)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	out := make([]policy.RuntimeOverride, 0, len(o.m))
	for k, spec := range o.m {
		out = append(out, policy.RuntimeOverride{Rule: k[0], Tenant: k[1], Spec: spec})
	}
	slices.SortFunc(out, func(a, b policy.RuntimeOverride) int {
		return strings.Compare(a.Rule+"|"+a.Tenant, b.Rule+"|"+b.Tenant)
	})
	return o.stamp(), out, nil
}

// PutOverride implements coordinator.OverridesStore.
func (o *Overrides) PutOverride(ctx context.Context, ov policy.RuntimeOverride, b coordinator.OverridesBounds) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", fmt.Errorf("memstore: put override: %w", err)
	}
	if err := validField(ov.Rule, ov.Tenant); err != nil {
		return "", err
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	k := [2]string{ov.Rule, ov.Tenant}
	old, had := o.m[k]
	if had && old == ov.Spec {
		return old, nil
	}
	bytes := o.bytes + ov.Size()
	if had {
		bytes -= policy.RuntimeOverride{Rule: ov.Rule, Tenant: ov.Tenant, Spec: old}.Size()
	}
	if !had && len(o.m)+1 > b.Count || bytes > b.Bytes {
		return "", fmt.Errorf("%w: at most %d overrides and %d bytes", coordinator.ErrOverridesFull, b.Count, b.Bytes)
	}
	o.m[k], o.bytes, o.created = ov.Spec, bytes, true
	o.rev++
	return old, nil
}

// DeleteOverride implements coordinator.OverridesStore.
func (o *Overrides) DeleteOverride(ctx context.Context, rule, tenant string) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", fmt.Errorf("memstore: delete override: %w", err)
	}
	if err := validField(rule, tenant); err != nil {
		return "", err
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	k := [2]string{rule, tenant}
	old, had := o.m[k]
	if !had {
		return "", fmt.Errorf("%w: rule %q, tenant %q", coordinator.ErrOverrideNotFound, rule, tenant)
	}
	delete(o.m, k)
	o.bytes -= policy.RuntimeOverride{Rule: rule, Tenant: tenant, Spec: old}.Size()
	o.rev++
	return old, nil
}

// validField rejects what redisstore's hash field could not hold unambiguously, so both stores
// accept the same overrides.
func validField(rule, tenant string) error {
	if rule == "" || strings.ContainsRune(rule, '|') || strings.HasPrefix(rule, "#") || tenant == "" {
		return fmt.Errorf("memstore: override of rule %q for tenant %q: need a rule name without '|' or a leading '#', and a tenant", rule, tenant)
	}
	return nil
}
