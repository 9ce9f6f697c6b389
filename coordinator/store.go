package coordinator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
)

// Store holds the global buckets. Each request acts atomically on one key; a batch is one round
// trip to the store where the store allows it. Implementations: coordinator/redisstore (Redis, the
// production store) and coordinator/memstore (in memory: the embedded default and the simulator's
// store). Both pass coordinator/storetest and are differential-tested against each other.
//
// A store returns an error only when the whole batch failed (cancelled context, store
// unreachable); a failure of one key (one Redis Cluster node down) is that result's Err.
type Store interface {
	Take(ctx context.Context, reqs []TakeRequest) ([]TakeResult, error)
	Return(ctx context.Context, reqs []ReturnRequest) ([]ReturnResult, error)
}

// OpID makes a store operation idempotent: a request carrying the same Agent and Seq as the
// last one that agent made on the same key is answered from a record kept inside the key, without
// charging or crediting again. Seq must grow with every new operation of an agent (retries reuse
// it); a Seq below the last recorded one is Stale and does nothing. Records live in the bucket's
// own key, one per agent and kind. When a record is added to a key that then holds more than
// MaxRecords of them, those older than RecordKeep are swept (an agent's next operation rewrites
// its own record and adds none), so a key's bookkeeping is bounded by the agents that used it
// recently. The zero OpID is not idempotent.
type OpID struct {
	Agent string
	Seq   uint64
}

const (
	// RecordKeep is how long an idempotency record is certainly kept: far longer than any retry
	// of a timed-out call (seconds), short enough that records of dead agents go away.
	RecordKeep bucket.Millis = 120_000

	// MaxRecords is the number of agent records a key holds before a sweep removes those older than
	// RecordKeep. The sweep walks only the key's own fields, so it is bounded by this number plus
	// the agents active within RecordKeep. With the bucket's own fields, 120 records stay within
	// Redis's default hash-max-listpack-entries (128): the compact encoding.
	MaxRecords = 120

	// ExpiryMargin is added to a bucket's time to fill to form its key's expiry: long enough that
	// idempotency records outlive any retry, after which the key is a full bucket and needs no state.
	ExpiryMargin = RecordKeep

	// MaxAgentID bounds the agent identifier stored in each record: "a:" plus 60 bytes stays within
	// Redis's default hash-max-listpack-value (64), the compact encoding.
	MaxAgentID = 60

	// MaxKey bounds a bucket key (policy keys are far shorter; see policy.MaxKeyLen).
	MaxKey = 1024
)

// TakeRequest asks key for up to Want microtokens, granting only if at least Min are available
// (State.Take). Limit is the bucket's shape, resolved by the coordinator from its policy.
// Share (permille, 1..1000; 0 means 1000) caps the grant at that share of the tokens available,
// never below Min, and a grant cut below Want is rounded down to whole Units (0 means 1), never
// below Min (State.TakeShare). Credit, if its Amount is positive, is a lease of the same key
// handed back in the same atomic operation, credited (State.Return) before the take.
//
// Debt is a cost settled after the fact (an agent's actual cost beyond its estimate), charged in
// the same atomic operation after the Credit and before the take (State.Charge): even below zero,
// down to -MaxDebt, the rest forgiven (MaxDebt is the rule's max_debt, at most the capacity; 0
// forgives whatever the bucket does not hold). A request may carry only a debt (Want and Min 0):
// it takes nothing.
//
// Demand (µ per second, the agent's) and TTL (the lease lifetime; 0 for direct mode) feed the
// contention rule (lease.Contend): when the bucket holds less than Want, the take is cut to the
// agent's share of the key's demand of what the bucket refills over TTL, and the result's Pace
// says how long the agent should wait before it asks again. The store keeps each agent's last
// demand in its record of the key to sum the key's demand.
//
// AmpleWant (at least Want; 0 for none) replaces Want when the bucket would still hold at least
// three quarters of its capacity after granting it (lease.Ample), before the contention rule: a
// lease of a lifetime's demand where the bucket has plenty to spare. It needs a TTL, and no Period
// or Also.
//
// Also, when set, are other buckets taken in the same atomic operation, all or nothing (a direct
// check of a route with charges: docs/policy.md, "Several limits and tenant budgets"): the grant
// is decided as one take from a bucket holding the least any of them holds (up to Want, at least
// Min, cut to whole Units) and debited from every bucket, or nothing is. Such a take has no share
// cap, credit, contention rule or calendar window; it keeps its idempotency record in Key only,
// and its result names the bucket that refused (TakeResult.Refused). On Redis Cluster every key
// must share one slot (policy keys of buckets charged together hold the tenant's hash tag).
type TakeRequest struct {
	Key       string
	Limit     bucket.Limit
	Want      bucket.Micro
	AmpleWant bucket.Micro
	Min       bucket.Micro
	Share     int64
	Unit      bucket.Micro
	Credit    Credit
	Debt      bucket.Micro
	MaxDebt   bucket.Micro
	Demand    bucket.Micro
	TTL       bucket.Millis
	Period    bucket.Window
	Op        OpID
	Also      []Bucket
}

// Bucket is another bucket of a TakeRequest with Also: its key and shape.
type Bucket struct {
	Key   string
	Limit bucket.Limit
}

// MaxAlso bounds TakeRequest.Also: a check charges at most policy.MaxCharges buckets besides its
// own.
const MaxAlso = policy.MaxCharges

// TakesNothing reports whether r takes no tokens (Want and Min 0): it only hands a lease back, only
// charges a debt, or both.
func (r *TakeRequest) TakesNothing() bool {
	return r.Want == 0 && r.Min == 0 && (r.Credit.Amount > 0 || r.Debt > 0)
}

// Credit is a lease handed back: Amount unspent microtokens of a lease granted at GrantedAt.
type Credit struct {
	Amount    bucket.Micro
	GrantedAt bucket.Millis
}

// TakeResult is the answer to one TakeRequest.
type TakeResult struct {
	bucket.Result
	// Credited is what the request's Credit was credited (after decay and the capacity cap).
	Credited bucket.Micro
	// Debited is what was charged of the request's Debt (the rest was forgiven: the bucket was
	// at -MaxDebt).
	Debited bucket.Micro
	// Pace is how long the agent should wait before it asks for the key again (lease.Pace): set
	// when the take was contended, 0 otherwise.
	Pace bucket.Millis
	// Now is the key's clock after the operation (Redis TIME, never earlier than the key's last
	// refill): the grant time an agent echoes when it returns the lease.
	Now      bucket.Millis
	Replayed bool  // answered from the idempotency record: nothing was charged
	Stale    bool  // Seq older than the agent's last operation on this key: nothing was done
	Err      error // this key failed; the others may have succeeded
	// Refused, for a denied take with Also, is the bucket that refused, the one of the longest
	// RetryAfter among those that could not cover Min: 0 for Key, i+1 for Also[i]. Such a
	// take's Remaining is the least any of its buckets holds after it.
	Refused int
}

// ReturnRequest credits back Amount unspent microtokens of a lease granted at GrantedAt
// (State.Return; Counter.Return with a Period, as in TakeRequest).
//
// Also, when set, are the other buckets of a take of several (TakeRequest.Also) whose grant went
// unspent (a direct check that stopped waiting before its grant came): each bucket is credited by
// its own State.Return of Amount granted at GrantedAt (its own decay and capacity cap), in one
// atomic operation. Like the take, it keeps its idempotency record in Key only (the record of a
// Return, r:<agent>), has no Period, and on Redis Cluster its keys share one slot. Its result's
// Granted is the sum credited over every bucket (at most bucket.MaxExact, where Lua's doubles stay
// exact) and its Remaining the least any bucket holds.
type ReturnRequest struct {
	Key       string
	Limit     bucket.Limit
	Amount    bucket.Micro
	GrantedAt bucket.Millis
	Period    bucket.Window
	Op        OpID
	Also      []Bucket
}

// ReturnResult is the answer to one ReturnRequest; Granted is the amount credited.
type ReturnResult struct {
	bucket.Result
	Now      bucket.Millis
	Replayed bool
	Stale    bool
	Err      error
}

// ErrInvalidRequest is wrapped by Validate errors.
var ErrInvalidRequest = errors.New("coordinator: invalid store request")

// Validate checks what the arithmetic assumes; stores call it before touching a key.
func (r *TakeRequest) Validate() error {
	switch {
	case r.Key == "" || len(r.Key) > MaxKey:
		return fmt.Errorf("%w: key length %d not in 1..%d", ErrInvalidRequest, len(r.Key), MaxKey)
	case r.Limit.Capacity() < 1:
		return fmt.Errorf("%w: key %q has no limit", ErrInvalidRequest, r.Key)
	case r.Debt < 0 || r.Debt > bucket.MaxExact/2:
		return fmt.Errorf("%w: key %q charges a debt of %d µ (need 0..2^52)", ErrInvalidRequest, r.Key, r.Debt)
	case r.MaxDebt < 0 || r.MaxDebt > r.Limit.Capacity():
		return fmt.Errorf("%w: key %q max debt %d µ not in 0..capacity", ErrInvalidRequest, r.Key, r.MaxDebt)
	case r.TakesNothing():
	case r.Min < 1 || r.Want < r.Min:
		return fmt.Errorf("%w: key %q wants %d µ with minimum %d µ (need 1 <= min <= want)",
			ErrInvalidRequest, r.Key, r.Want, r.Min)
	case r.Want > bucket.MaxExact/2:
		return fmt.Errorf("%w: key %q wants %d µ, above 2^52", ErrInvalidRequest, r.Key, r.Want)
	case r.Share < 0 || r.Share > bucket.WholeShare:
		return fmt.Errorf("%w: key %q share %d‰ not in 0..1000", ErrInvalidRequest, r.Key, r.Share)
	case r.Unit < 0 || r.Unit > r.Limit.Capacity():
		return fmt.Errorf("%w: key %q unit %d µ not in 0..capacity", ErrInvalidRequest, r.Key, r.Unit)
	case r.Demand < 0 || r.Demand > bucket.MaxExact:
		return fmt.Errorf("%w: key %q demand %d µ/s", ErrInvalidRequest, r.Key, r.Demand)
	case r.TTL < 0 || r.TTL > bucket.Millis(lease.MaxTTL/time.Millisecond):
		return fmt.Errorf("%w: key %q lease lifetime %d ms not in 0..%d", ErrInvalidRequest, r.Key, r.TTL, lease.MaxTTL/time.Millisecond)
	}
	if r.AmpleWant != 0 && (r.TakesNothing() || r.AmpleWant < r.Want || r.AmpleWant > bucket.MaxExact/2 ||
		r.TTL == 0 || !r.Period.IsZero() || len(r.Also) > 0) {
		return fmt.Errorf("%w: key %q ample want %d µ (need want %d µ <= ample <= 2^52, a lease lifetime, no window or other buckets)",
			ErrInvalidRequest, r.Key, r.AmpleWant, r.Want)
	}
	if err := r.Credit.validate(r.Key); err != nil {
		return err
	}
	if err := validPeriod(r.Key, r.Limit, r.Period); err != nil {
		return err
	}
	if err := r.validateAlso(); err != nil {
		return err
	}
	return r.Op.validate()
}

// validateAlso checks a take of several buckets: an exact take of distinct keys.
func (r *TakeRequest) validateAlso() error {
	if len(r.Also) == 0 {
		return nil
	}
	switch {
	case r.Share != 0 && r.Share != bucket.WholeShare || r.Credit.Amount != 0 || r.Debt != 0 || r.TTL != 0 || !r.Period.IsZero():
		// A debt is charged to one bucket, where it was incurred.
		return fmt.Errorf("%w: key %q takes other buckets: no share, credit, debt, lease lifetime or window", ErrInvalidRequest, r.Key)
	}
	return validOthers(r.Key, r.Also, "takes")
}

// validOthers checks the other buckets of an operation on key: at most MaxAlso, distinct keys
// besides key, each with a limit.
func validOthers(key string, also []Bucket, verb string) error {
	if len(also) > MaxAlso {
		return fmt.Errorf("%w: key %q %s %d other buckets, at most %d", ErrInvalidRequest, key, verb, len(also), MaxAlso)
	}
	for i, b := range also {
		switch {
		case b.Key == "" || len(b.Key) > MaxKey:
			return fmt.Errorf("%w: key %q: other bucket %d key length %d not in 1..%d", ErrInvalidRequest, key, i, len(b.Key), MaxKey)
		case b.Limit.Capacity() < 1:
			return fmt.Errorf("%w: key %q: other bucket %q has no limit", ErrInvalidRequest, key, b.Key)
		case b.Key == key || slices.ContainsFunc(also[:i], func(o Bucket) bool { return o.Key == b.Key }):
			return fmt.Errorf("%w: key %q: bucket %q twice", ErrInvalidRequest, key, b.Key)
		}
	}
	return nil
}

// validPeriod checks a counter's window and that its quota does not refill.
func validPeriod(key string, l bucket.Limit, w bucket.Window) error {
	if w.IsZero() {
		return nil
	}
	if err := w.Validate(); err != nil {
		return fmt.Errorf("%w: key %q: %w", ErrInvalidRequest, key, err)
	}
	if l.Refills() {
		return fmt.Errorf("%w: key %q is a calendar counter with a refilling limit %v", ErrInvalidRequest, key, l)
	}
	return nil
}

func (c Credit) validate(key string) error {
	switch {
	case c.Amount < 0 || c.Amount > bucket.MaxExact/2:
		return fmt.Errorf("%w: key %q returns %d µ", ErrInvalidRequest, key, c.Amount)
	case c.GrantedAt < 0 || c.GrantedAt > bucket.MaxExact/2:
		return fmt.Errorf("%w: key %q returns a lease granted at %d ms", ErrInvalidRequest, key, c.GrantedAt)
	}
	return nil
}

// Validate checks what the arithmetic assumes; stores call it before touching a key.
func (r *ReturnRequest) Validate() error {
	switch {
	case r.Key == "" || len(r.Key) > MaxKey:
		return fmt.Errorf("%w: key length %d not in 1..%d", ErrInvalidRequest, len(r.Key), MaxKey)
	case r.Limit.Capacity() < 1:
		return fmt.Errorf("%w: key %q has no limit", ErrInvalidRequest, r.Key)
	}
	if err := (Credit{r.Amount, r.GrantedAt}).validate(r.Key); err != nil {
		return err
	}
	if err := validPeriod(r.Key, r.Limit, r.Period); err != nil {
		return err
	}
	if len(r.Also) > 0 && !r.Period.IsZero() {
		return fmt.Errorf("%w: key %q returns to other buckets: no window", ErrInvalidRequest, r.Key)
	}
	if err := validOthers(r.Key, r.Also, "returns to"); err != nil {
		return err
	}
	return r.Op.validate()
}

func (o OpID) validate() error {
	switch {
	case len(o.Agent) > MaxAgentID:
		return fmt.Errorf("%w: agent id longer than %d bytes", ErrInvalidRequest, MaxAgentID)
	case o.Agent != "" && (o.Seq == 0 || o.Seq > bucket.MaxExact):
		return fmt.Errorf("%w: agent %q sequence %d not in 1..2^53-1", ErrInvalidRequest, o.Agent, o.Seq)
	case o.Agent == "" && o.Seq != 0:
		return fmt.Errorf("%w: sequence %d without an agent id", ErrInvalidRequest, o.Seq)
	}
	return nil
}
