package redisstore

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/policy"
)

// OverridesKey is the hash holding the runtime overrides: field "<rule>|<tenant>", value the
// spec, plus the bookkeeping fields #epoch, #rev and #bytes (see overrides.lua). It lies under
// the prefix of the bucket keys, so the coordinator's ACL user needs no other key pattern, and
// cannot be a bucket key: those always hold '|' after the tenant.
const OverridesKey = policy.KeyPrefix + "overrides"

//go:embed overrides.lua
var overridesLua string

var overridesScript = redis.NewScript(overridesLua)

var _ coordinator.OverridesStore = (*Store)(nil)

// OverridesStamp implements coordinator.OverridesStore: the script reads the bookkeeping fields
// (one HMGET).
func (s *Store) OverridesStamp(ctx context.Context) (string, error) {
	vals, err := s.runScript(ctx, overridesScript, overridesLua, OverridesKey, "stamp").StringSlice()
	if err != nil {
		return "", fmt.Errorf("redisstore: overrides stamp: %w", err)
	}
	if len(vals) != 2 {
		return "", fmt.Errorf("redisstore: overrides stamp: script answered %d values, want 2", len(vals))
	}
	return stamp(vals[0], vals[1]), nil
}

func stamp(epoch, rev string) string {
	if epoch == "" {
		return ""
	}
	return epoch + ":" + rev
}

// LoadOverrides implements coordinator.OverridesStore: the script reads the hash (one HGETALL).
func (s *Store) LoadOverrides(ctx context.Context) (string, []policy.RuntimeOverride, error) {
	flat, err := s.runScript(ctx, overridesScript, overridesLua, OverridesKey, "load").StringSlice()
	if err != nil {
		return "", nil, fmt.Errorf("redisstore: load overrides: %w", err)
	}
	if len(flat)%2 != 0 {
		return "", nil, fmt.Errorf("redisstore: load overrides: %d values, want field, value pairs", len(flat))
	}
	m := make(map[string]string, len(flat)/2)
	for i := 0; i < len(flat); i += 2 {
		m[flat[i]] = flat[i+1]
	}
	out := make([]policy.RuntimeOverride, 0, len(m))
	for field, spec := range m {
		if strings.HasPrefix(field, "#") {
			continue
		}
		rule, tenant, ok := strings.Cut(field, "|")
		if !ok {
			return "", nil, fmt.Errorf("redisstore: load overrides: field %q of %s is not <rule>|<tenant>", field, OverridesKey)
		}
		out = append(out, policy.RuntimeOverride{Rule: rule, Tenant: tenant, Spec: spec})
	}
	return stamp(m["#epoch"], m["#rev"]), out, nil
}

// PutOverride implements coordinator.OverridesStore with one script call (overrides.lua).
func (s *Store) PutOverride(ctx context.Context, o policy.RuntimeOverride, b coordinator.OverridesBounds) (string, error) {
	if err := validField(o.Rule, o.Tenant); err != nil {
		return "", err
	}
	status, prev, err := s.overridesOp(ctx, "put", o.Rule+"|"+o.Tenant, o.Spec, b.Count, b.Bytes)
	if err != nil {
		return "", err
	}
	if status == "full" {
		return "", fmt.Errorf("%w: at most %d overrides and %d bytes", coordinator.ErrOverridesFull, b.Count, b.Bytes)
	}
	return prev, nil
}

// DeleteOverride implements coordinator.OverridesStore with one script call (overrides.lua).
func (s *Store) DeleteOverride(ctx context.Context, rule, tenant string) (string, error) {
	if err := validField(rule, tenant); err != nil {
		return "", err
	}
	status, prev, err := s.overridesOp(ctx, "delete", rule+"|"+tenant)
	if err != nil {
		return "", err
	}
	if status == "missing" {
		return "", fmt.Errorf("%w: rule %q, tenant %q", coordinator.ErrOverrideNotFound, rule, tenant)
	}
	return prev, nil
}

// validField rejects what the hash field could not hold unambiguously.
func validField(rule, tenant string) error {
	if rule == "" || strings.ContainsRune(rule, '|') || strings.HasPrefix(rule, "#") || tenant == "" {
		return fmt.Errorf("redisstore: override of rule %q for tenant %q: need a rule name without '|' or a leading '#', and a tenant", rule, tenant)
	}
	return nil
}

func (s *Store) overridesOp(ctx context.Context, args ...any) (status, prev string, err error) {
	vals, err := s.runScript(ctx, overridesScript, overridesLua, OverridesKey, args...).StringSlice()
	if err != nil {
		return "", "", fmt.Errorf("redisstore: %s override: %w", args[0], err)
	}
	if len(vals) != 3 {
		return "", "", errors.New("redisstore: overrides script answered " + fmt.Sprint(len(vals)) + " values, want 3")
	}
	return vals[0], vals[1], nil
}
