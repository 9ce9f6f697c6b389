package agent

import (
	"errors"
	"fmt"
	"hash/maphash"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/leasebucket/leasebucket/internal/clock"
)

const (
	// DefaultIdempotencyWindow is how long a repeat of an idempotency key is answered with the
	// first decision. Gateways and clients retry within seconds; two minutes covers a retry
	// after a slow upstream timeout and its backoff, and keeps the window's memory small.
	DefaultIdempotencyWindow = 2 * time.Minute
	// DefaultIdempotencyKeys bounds the remembered keys: about 300 bytes each (the bucket key, the
	// idempotency key, the record and the LRU's node), so 20 MiB at most.
	DefaultIdempotencyKeys = 1 << 16
	// MaxIdempotencyKey bounds an idempotency key's length (a UUID is 36 bytes; a request hash
	// in hex 64): longer keys are INVALID_ARGUMENT, never truncated (two keys would collide).
	MaxIdempotencyKey = 256

	// idemShards: keys spread over this many LRUs, each with its own lock, so concurrent
	// idempotent checks rarely wait on each other.
	idemShards = 16
)

var (
	// ErrInvalidIdempotencyKey is wrapped when a key is longer than MaxIdempotencyKey.
	ErrInvalidIdempotencyKey = errors.New("agent: invalid idempotency key")
	// ErrIdempotencyPending is returned when a check with the same bucket and idempotency key is
	// still being decided after the wait bound. Nothing was charged for this one; the caller
	// retries.
	ErrIdempotencyPending = errors.New("agent: a check with the same idempotency key is still being decided")
)

// idemKey is the identity of a repeat: the bucket key (tenant, route, operation, key version,
// region) and the caller's idempotency key.
type idemKey struct {
	bucket, key string
}

// idemRecord is the first check of an idempotency key. Until done is closed it is being decided;
// afterwards ok says whether its decision is remembered (then v is it).
type idemRecord struct {
	expires clock.Nanos
	done    chan struct{}
	ok      bool
	v       Verdict
}

// idempotency remembers the allows of idempotent checks for a window, in size-bounded LRUs.
//
// Only allows are remembered: an allow charged the bucket, and its repeat must not charge
// again. A deny or an unavailable answer charged nothing, so a repeat is decided afresh (and a
// client that waited its Retry-After gets in); the deny cache keeps such repeats cheap.
//
// Records expire at first insertion plus the window. Lookups do not refresh recency (Peek),
// so each shard's LRU order is insertion order and expired records are the oldest: an insert
// first pops the expired ones. The size bound holds whatever the rate; the window holds when
// the size bound is large enough for the rate of keys (DefaultIdempotencyKeys keys in
// DefaultIdempotencyWindow is 546 new keys a second before the oldest leave early).
//
// golang-lru's expirable LRU would expire records on its own, but in v2.0.7 its cleanup
// goroutine can never be stopped (its Close is not implemented): it would outlive every Server.
type idempotency struct {
	window clock.Nanos
	seed   maphash.Seed
	shards [idemShards]idemShard
}

type idemShard struct {
	mu  sync.Mutex
	lru *simplelru.LRU[idemKey, *idemRecord]
	_   [40]byte // keep the shards' locks on separate cache lines
}

func newIdempotency(window time.Duration, keys int) *idempotency {
	per := max(1, (keys+idemShards-1)/idemShards)
	m := &idempotency{window: clock.Of(window), seed: maphash.MakeSeed()}
	for i := range m.shards {
		lru, err := simplelru.NewLRU[idemKey, *idemRecord](per, nil)
		if err != nil {
			panic(fmt.Sprintf("agent: idempotency LRU of %d: %v", per, err)) // per >= 1 never fails
		}
		m.shards[i].lru = lru
	}
	return m
}

func (m *idempotency) shard(k idemKey) *idemShard {
	h := maphash.String(m.seed, k.bucket) ^ maphash.String(m.seed, k.key)*0x9e3779b97f4a7c15
	return &m.shards[h%idemShards]
}

// begin finds the live record of k or inserts a new one. leader reports that the caller
// inserted it: it decides the check and calls finish. Otherwise the record is either decided
// and remembered (done is closed and ok is true) or still being decided by its leader.
func (m *idempotency) begin(now clock.Nanos, k idemKey) (rec *idemRecord, leader bool) {
	s := m.shard(k)
	s.mu.Lock()
	defer s.mu.Unlock()
	if rec, ok := s.lru.Peek(k); ok {
		if now < rec.expires {
			return rec, false
		}
		s.lru.Remove(k)
	}
	for {
		_, old, ok := s.lru.GetOldest()
		if !ok || now < old.expires {
			break
		}
		s.lru.RemoveOldest()
	}
	rec = &idemRecord{expires: now + m.window, done: make(chan struct{})}
	s.lru.Add(k, rec)
	return rec, true
}

// finish completes the record its leader decided: an allow is remembered, anything else
// (a deny, an unavailable answer, an error) forgets the record, and whoever waits for it decides
// afresh.
func (m *idempotency) finish(k idemKey, rec *idemRecord, v Verdict, err error) {
	s := m.shard(k)
	s.mu.Lock()
	if err == nil && v.Outcome == Allow {
		v.Ticket = nil
		rec.ok, rec.v = true, v
	} else if cur, ok := s.lru.Peek(k); ok && cur == rec {
		s.lru.Remove(k)
	}
	s.mu.Unlock()
	close(rec.done)
}

// len is the number of records held (expired ones not yet popped included).
func (m *idempotency) len() int {
	n := 0
	for i := range m.shards {
		s := &m.shards[i]
		s.mu.Lock()
		n += s.lru.Len()
		s.mu.Unlock()
	}
	return n
}
