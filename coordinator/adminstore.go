package coordinator

import (
	"context"
	"errors"
	"fmt"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
)

// AdminStore is what the admin API needs of a store besides Store: read one bucket without
// changing it, and set its level. Each acts atomically on one key, like Take and Return.
// Implementations: redisstore (the script admin.lua) and memstore; storetest.RunAdmin checks
// them and a differential test compares them.
type AdminStore interface {
	// Inspect reads key as one atomic operation and changes nothing.
	Inspect(ctx context.Context, key string, limit bucket.Limit) (Snapshot, error)

	// SetLevel sets key's level to level microtokens (0 <= level <= capacity; ValidateLevel) as
	// one atomic operation, and returns the key as it was just before and just after. A key past
	// its logical expiry is dropped first, as Take drops it (a full bucket, no records). The new
	// level is as of the key clock, max(last refill, now), with no fraction of a microtoken
	// carried; the expiry is recomputed as Take computes it. The agents' idempotency records and
	// any field the store does not know are kept.
	SetLevel(ctx context.Context, key string, limit bucket.Limit, level bucket.Micro) (before, after Snapshot, err error)
}

// Snapshot is one bucket as its store holds it.
type Snapshot struct {
	// Stored is false when the store holds nothing for the key, or only state past its logical
	// expiry: a full bucket without records.
	Stored  bool
	State   bucket.State  // as stored, at State.Last; zero unless Stored
	Expiry  bucket.Millis // the logical expiry on the key clock; 0 unless Expires
	Expires bool
	// Now is the store's clock when the key was read (Redis TIME, or the injected clock).
	Now     bucket.Millis
	Takes   map[string]TakeRecord   // each agent's last idempotent Take
	Returns map[string]ReturnRecord // each agent's last idempotent Return
	// Multis are each agent's last idempotent take of several buckets of which this is the first
	// (TakeRequest.Also): its seq, what it was answered (Remaining the least of its buckets) and
	// when.
	Multis map[string]TakeRecord
	// Other lists the fields of the key the store does not know (written by a newer script),
	// sorted. SetLevel keeps them.
	Other []string
}

// Level is the bucket's tokens at s.Now: the stored tokens refilled since the last refill, or
// the capacity for a bucket with no state.
func (s Snapshot) Level(l bucket.Limit) bucket.Micro {
	if !s.Stored {
		return l.Capacity()
	}
	st := s.State
	st.Refill(l, s.Now)
	return st.Tokens
}

// TakeRecord is an agent's last idempotent Take on a key: its seq and what it was answered.
type TakeRecord struct {
	Seq        uint64
	Granted    bucket.Micro
	Remaining  bucket.Micro
	RetryAfter bucket.Millis
	Now        bucket.Millis // the key clock at the grant
}

// ReturnRecord is an agent's last idempotent Return on a key.
type ReturnRecord struct {
	Seq       uint64
	Credited  bucket.Micro
	Remaining bucket.Micro
	Now       bucket.Millis
}

// ErrLevelAboveCapacity is wrapped (with ErrInvalidRequest) when a level to set exceeds the
// bucket's capacity.
var ErrLevelAboveCapacity = errors.New("coordinator: level above the bucket's capacity")

// ValidateKey checks a key as Take does; stores call it before Inspect touches a key.
func ValidateKey(key string, l bucket.Limit) error {
	switch {
	case key == "" || len(key) > MaxKey:
		return fmt.Errorf("%w: key length %d not in 1..%d", ErrInvalidRequest, len(key), MaxKey)
	case l.Capacity() < 1:
		return fmt.Errorf("%w: key %q has no limit", ErrInvalidRequest, key)
	}
	return nil
}

// ValidateLevel checks a SetLevel request; stores call it before touching a key.
func ValidateLevel(key string, l bucket.Limit, level bucket.Micro) error {
	if err := ValidateKey(key, l); err != nil {
		return err
	}
	switch {
	case level < 0:
		return fmt.Errorf("%w: level %d µ is negative", ErrInvalidRequest, level)
	case level > l.Capacity():
		return fmt.Errorf("%w: %w: %d µ, capacity %d µ", ErrInvalidRequest, ErrLevelAboveCapacity, level, l.Capacity())
	}
	return nil
}

// OverridesStore holds the runtime overrides (policy.RuntimeOverride), one per rule and tenant,
// where every coordinator reads them: redisstore keeps them in one hash (OverridesKey),
// memstore in memory. Writes are atomic and enforce the bounds they are given.
// storetest.RunOverrides checks the implementations.
type OverridesStore interface {
	// OverridesStamp changes whenever the overrides change; coordinators poll it, so it is cheap
	// (one small read). It is "" while none were ever written.
	OverridesStamp(ctx context.Context) (string, error)

	// LoadOverrides reads every override and the stamp of that content, atomically.
	LoadOverrides(ctx context.Context) (stamp string, overrides []policy.RuntimeOverride, err error)

	// PutOverride creates or replaces the override of (o.Rule, o.Tenant) and returns the spec it
	// replaced ("" if none). It fails with ErrOverridesFull, changing nothing, if the overrides
	// would then exceed b. Writing the spec already held changes nothing (not even the stamp).
	PutOverride(ctx context.Context, o policy.RuntimeOverride, b OverridesBounds) (previous string, err error)

	// DeleteOverride removes the override of (rule, tenant) and returns its spec; it fails with
	// ErrOverrideNotFound if there is none.
	DeleteOverride(ctx context.Context, rule, tenant string) (previous string, err error)
}

// OverridesBounds bound the runtime overrides a store holds: Count overrides, Bytes in all (the
// sum of policy.RuntimeOverride.Size).
type OverridesBounds struct {
	Count, Bytes int
}

// DefaultOverridesBounds are the bounds of the policy package, which every agent and
// coordinator accepts in one snapshot.
var DefaultOverridesBounds = OverridesBounds{Count: policy.MaxRuntimeOverrides, Bytes: policy.MaxOverridesBytes}

var (
	// ErrOverridesFull is returned when a new or larger override would pass the bounds.
	ErrOverridesFull = errors.New("coordinator: runtime overrides are full")
	// ErrOverrideNotFound is returned when there is no override to delete.
	ErrOverrideNotFound = errors.New("coordinator: no such runtime override")
)
