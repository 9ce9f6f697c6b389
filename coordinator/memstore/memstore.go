// Package memstore is the in-memory coordinator.Store: the embedded default of `make run` and the
// simulator's store. It has exactly the semantics of coordinator/redisstore (bucket arithmetic,
// idempotency records, stale and replayed operations, logical expiry, the record sweep), which a
// differential test between the two checks.
//
// Keys are spread over shards by a hash of the key, each shard a map under its own mutex, so
// requests on different keys rarely contend. Expired keys are dropped when touched and by Sweep,
// which the owner runs periodically so that memory stays bounded by the keys used within their
// time to fill plus coordinator.ExpiryMargin.
package memstore

import (
	"context"
	"fmt"
	"hash/maphash"
	"strings"
	"sync"
	"time"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
)

// shardCount is a power of two well above the cores of a coordinator host, so two requests on
// different keys rarely wait for the same mutex.
const shardCount = 64

// Store is a coordinator.Store in memory. It is safe for concurrent use.
type Store struct {
	clock  func() bucket.Millis
	seed   maphash.Seed
	shards [shardCount]shard
}

type shard struct {
	mu sync.Mutex
	m  map[string]*entry
	_  [48]byte // keep shards on separate cache lines (mutex 8 + map 8 + 48 = 64 bytes)
}

// entry is one key: what redisstore keeps in the key's hash.
type entry struct {
	state bucket.State
	// competeUntil is the key clock until which its agents compete (lease.Contend), once a take
	// was contended (competes): the field c of bucket.lua.
	competeUntil bucket.Millis
	competes     bool
	expiry       bucket.Millis // the logical expiry on the key clock, when expires
	expires      bool
	// A calendar quota's counter (bucket.Counter) keeps its tokens and clock in state (Frac 0)
	// and the start of its period in period: the field p of counter.lua.
	counter bool
	period  bucket.Millis
	takes   map[string]takeRecord   // by agent; nil until the first idempotent Take
	returns map[string]returnRecord // by agent; nil until the first idempotent Return
	multis  map[string]multiRecord  // by agent; nil until the first idempotent take of several buckets (multi.go)
}

// takeRecord is an agent's last idempotent Take on a key.
type takeRecord struct {
	Seq        uint64
	Granted    bucket.Micro
	Credited   bucket.Micro
	Debited    bucket.Micro
	Remaining  bucket.Micro
	RetryAfter bucket.Millis
	Pace       bucket.Millis
	Demand     bucket.Micro // the agent's last demand (clamped to lease.MaxShareDemand)
	Now        bucket.Millis
}

// returnRecord is an agent's last idempotent Return on a key.
type returnRecord struct {
	Seq       uint64
	Credited  bucket.Micro
	Remaining bucket.Micro
	Now       bucket.Millis
}

// Option configures a Store.
type Option func(*Store)

// WithClock sets the store's clock (milliseconds). The default is wall-clock time
// (time.Now().UnixMilli()); tests and the simulator inject theirs.
func WithClock(clock func() bucket.Millis) Option {
	return func(s *Store) { s.clock = clock }
}

// New returns an empty Store.
func New(opts ...Option) *Store {
	s := &Store{clock: wallClock, seed: maphash.MakeSeed()}
	for _, o := range opts {
		o(s)
	}
	for i := range s.shards {
		s.shards[i].m = make(map[string]*entry)
	}
	return s
}

func wallClock() bucket.Millis { return bucket.Millis(time.Now().UnixMilli()) }

func (s *Store) shard(key string) *shard {
	return &s.shards[s.shardIndex(key)]
}

// Take implements coordinator.Store. The clock is read once per batch.
func (s *Store) Take(ctx context.Context, reqs []coordinator.TakeRequest) ([]coordinator.TakeResult, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("memstore: take: %w", err)
	}
	now := s.clock()
	res := make([]coordinator.TakeResult, len(reqs))
	for i := range reqs {
		r := &reqs[i]
		if err := r.Validate(); err != nil {
			res[i].Err = fmt.Errorf("memstore: take: %w", err)
			continue
		}
		if len(r.Also) > 0 {
			res[i] = s.takeAll(r, now)
			continue
		}
		sh := s.shard(r.Key)
		sh.mu.Lock()
		res[i] = sh.take(r, now)
		sh.mu.Unlock()
	}
	return res, nil
}

// Return implements coordinator.Store. The clock is read once per batch.
func (s *Store) Return(ctx context.Context, reqs []coordinator.ReturnRequest) ([]coordinator.ReturnResult, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("memstore: return: %w", err)
	}
	now := s.clock()
	res := make([]coordinator.ReturnResult, len(reqs))
	for i := range reqs {
		r := &reqs[i]
		if err := r.Validate(); err != nil {
			res[i].Err = fmt.Errorf("memstore: return: %w", err)
			continue
		}
		if len(r.Also) > 0 {
			res[i] = s.returnAll(r, now)
			continue
		}
		sh := s.shard(r.Key)
		sh.mu.Lock()
		res[i] = sh.ret(r, now)
		sh.mu.Unlock()
	}
	return res, nil
}

// live returns key's entry, dropping it first if it expired by now. Caller holds sh.mu.
func (sh *shard) live(key string, now bucket.Millis) *entry {
	e := sh.m[key]
	if e != nil && e.expires && now >= e.expiry {
		delete(sh.m, key)
		return nil
	}
	return e
}

// create stores a full bucket for key (bucket.Full). Caller holds sh.mu.
func (sh *shard) create(key string, l bucket.Limit, now bucket.Millis) *entry {
	e := &entry{state: bucket.Full(l, now)}
	sh.m[strings.Clone(key)] = e // do not pin the caller's buffer
	return e
}

func (sh *shard) take(r *coordinator.TakeRequest, now bucket.Millis) coordinator.TakeResult {
	e := sh.live(r.Key, now)
	idem := r.Op.Agent != ""
	if e != nil && idem {
		if rec, ok := e.takes[r.Op.Agent]; ok {
			switch {
			case rec.Seq == r.Op.Seq:
				return coordinator.TakeResult{
					Result:   bucket.Result{Granted: rec.Granted, Remaining: rec.Remaining, RetryAfter: rec.RetryAfter},
					Credited: rec.Credited,
					Debited:  rec.Debited,
					Pace:     rec.Pace,
					Now:      rec.Now,
					Replayed: true,
				}
			case rec.Seq > r.Op.Seq:
				return coordinator.TakeResult{
					Result: bucket.Result{Remaining: e.state.Tokens}, Now: e.state.Last, Stale: true,
				}
			}
		}
	}
	if !r.Period.IsZero() {
		return sh.count(e, r, now)
	}
	if e == nil {
		e = sh.create(r.Key, r.Limit, now)
	}
	share := r.Share
	if share == 0 {
		share = bucket.WholeShare
	}
	var credited bucket.Micro
	if r.Credit.Amount > 0 {
		credited = e.state.Return(r.Limit, now, r.Credit.Amount, r.Credit.GrantedAt).Granted
	}
	var debited bucket.Micro
	if r.Debt > 0 {
		debited = e.state.Charge(r.Limit, now, r.Debt, r.MaxDebt).Granted
	}
	res := bucket.Result{Remaining: e.state.Tokens}
	var pace bucket.Millis
	demand := min(r.Demand, lease.MaxShareDemand)
	if !r.TakesNothing() {
		e.state.Refill(r.Limit, now)
		unit, want := max(1, r.Unit), r.Want
		var mine int64
		contended, perCheck := false, false
		competing := e.competes && e.state.Last < e.competeUntil
		if r.AmpleWant > want && lease.Ample(r.Limit, e.state.Tokens, r.AmpleWant) {
			want = r.AmpleWant
		}
		if r.TTL > 0 && demand > 0 && (competing || lease.Low(r.Limit, e.state.Tokens, want)) {
			var since bucket.Millis // since this agent's last take (0: none)
			if prev, ok := e.takes[r.Op.Agent]; ok && r.Op.Agent != "" {
				since = e.state.Last - prev.Now
			}
			total, others := e.totalDemand(r.Op.Agent, demand, e.state.Last, r.TTL)
			want, mine, contended, perCheck = lease.Contend(r.Limit, e.state.Tokens, want, r.Min, unit, demand,
				total, others, r.TTL, since, competing)
		}
		if contended {
			e.competes, e.competeUntil = true, e.state.Last+lease.FreshLeases*r.TTL
			share = bucket.WholeShare // the contention rule applied the share cap to the pool
		}
		res = e.state.TakeShare(r.Limit, now, want, r.Min, share, unit)
		if contended && (res.Granted == 0 || !perCheck) {
			// Paced: what it got, or, denied, what it needs. A grant taken per check is not.
			amount := res.Granted
			if amount == 0 {
				amount = r.Min
			}
			pace = lease.Pace(r.Limit, amount, mine, r.TTL)
		}
	}
	e.setExpiry(r.Limit)
	if idem {
		e.recordTake(r.Op, takeRecord{Seq: r.Op.Seq, Granted: res.Granted, Credited: credited, Debited: debited,
			Remaining: res.Remaining, RetryAfter: res.RetryAfter, Pace: pace, Demand: demand, Now: e.state.Last})
	}
	return coordinator.TakeResult{Result: res, Credited: credited, Debited: debited, Pace: pace, Now: e.state.Last}
}

// recordTake keeps rec as op's agent's last Take on the key and, when the record is new, sweeps
// old records.
func (e *entry) recordTake(op coordinator.OpID, rec takeRecord) {
	if keepRecord(&e.takes, op.Agent, rec) {
		e.sweepRecords()
	}
}

// recordReturn keeps rec as op's agent's last Return on the key and, when the record is new,
// sweeps old records.
func (e *entry) recordReturn(op coordinator.OpID, rec returnRecord) {
	if keepRecord(&e.returns, op.Agent, rec) {
		e.sweepRecords()
	}
}

// keepRecord sets agent's record in *m, allocating the map and a copy of the agent's id (it may
// point into a request) only when they are new, and reports whether the record is new.
func keepRecord[R any](m *map[string]R, agent string, rec R) (added bool) {
	if *m == nil {
		*m = make(map[string]R, 1)
	}
	if _, ok := (*m)[agent]; ok {
		(*m)[agent] = rec
		return false
	}
	(*m)[strings.Clone(agent)] = rec
	return true
}

// counterOf is the calendar counter held by e, or a fresh one when e is nil (counter.lua's
// reading of a missing key).
func counterOf(e *entry, quota bucket.Micro, now bucket.Millis) bucket.Counter {
	if e == nil {
		return bucket.FreshCounter(quota, now)
	}
	return bucket.Counter{Tokens: e.state.Tokens, Last: e.state.Last, Period: e.period}
}

// setCounter stores c in key's entry (creating it) with its logical expiry: the end of its period
// plus the margin. Caller holds sh.mu.
func (sh *shard) setCounter(e *entry, key string, c bucket.Counter, w bucket.Window) *entry {
	if e == nil {
		e = &entry{}
		sh.m[strings.Clone(key)] = e
	}
	e.state, e.period, e.counter = bucket.State{Tokens: c.Tokens, Last: c.Last}, c.Period, true
	e.expires, e.expiry = true, c.Expiry(w, coordinator.ExpiryMargin)
	return e
}

// count is take on a calendar counter (e nil for a missing key). A clock outside the request's
// window fails the request and changes nothing.
func (sh *shard) count(e *entry, r *coordinator.TakeRequest, now bucket.Millis) coordinator.TakeResult {
	q := r.Limit.Capacity()
	c := counterOf(e, q, now)
	var credited bucket.Micro
	if r.Credit.Amount > 0 {
		cr, err := c.Return(q, r.Period, now, r.Credit.Amount, r.Credit.GrantedAt)
		if err != nil {
			return coordinator.TakeResult{Err: fmt.Errorf("memstore: take %q: %w", r.Key, err)}
		}
		credited = cr.Granted
	}
	var debited bucket.Micro
	if r.Debt > 0 {
		cr, err := c.Charge(q, r.Period, now, r.Debt, r.MaxDebt)
		if err != nil {
			return coordinator.TakeResult{Err: fmt.Errorf("memstore: take %q: %w", r.Key, err)}
		}
		debited = cr.Granted
	}
	res := bucket.Result{Remaining: c.Tokens}
	if !r.TakesNothing() {
		share := r.Share
		if share == 0 {
			share = bucket.WholeShare
		}
		var err error
		if res, err = c.Take(q, r.Period, now, r.Want, r.Min, share, max(1, r.Unit)); err != nil {
			return coordinator.TakeResult{Err: fmt.Errorf("memstore: take %q: %w", r.Key, err)}
		}
	}
	e = sh.setCounter(e, r.Key, c, r.Period)
	if r.Op.Agent != "" {
		e.recordTake(r.Op, takeRecord{Seq: r.Op.Seq, Granted: res.Granted, Credited: credited, Debited: debited,
			Remaining: res.Remaining, RetryAfter: res.RetryAfter, Now: c.Last})
	}
	return coordinator.TakeResult{Result: res, Credited: credited, Debited: debited, Now: c.Last}
}

// totalDemand is the key's demand for the contention rule: agent's own and the last demand of
// every other agent whose take is fresh (within lease.FreshLeases lifetimes of ttl at now);
// others says there is such an agent.
func (e *entry) totalDemand(agent string, own bucket.Micro, now, ttl bucket.Millis) (total bucket.Micro, others bool) {
	total = own
	for a, rec := range e.takes {
		if a != agent && now-rec.Now <= lease.FreshLeases*ttl {
			total += rec.Demand
			others = true
		}
	}
	return total, others
}

// replayReturn answers a return of op on e (nil: no live entry) from the agent's return record:
// a repeat as recorded, an older one stale (nothing done); ok is false for a new return.
func replayReturn(e *entry, op coordinator.OpID) (res coordinator.ReturnResult, ok bool) {
	if e == nil || op.Agent == "" {
		return res, false
	}
	rec, found := e.returns[op.Agent]
	switch {
	case !found:
		return res, false
	case rec.Seq == op.Seq:
		return coordinator.ReturnResult{
			Result:   bucket.Result{Granted: rec.Credited, Remaining: rec.Remaining},
			Now:      rec.Now,
			Replayed: true,
		}, true
	case rec.Seq > op.Seq:
		return coordinator.ReturnResult{
			Result: bucket.Result{Remaining: e.state.Tokens}, Now: e.state.Last, Stale: true,
		}, true
	}
	return res, false
}

func (sh *shard) ret(r *coordinator.ReturnRequest, now bucket.Millis) coordinator.ReturnResult {
	e := sh.live(r.Key, now)
	idem := r.Op.Agent != ""
	if res, ok := replayReturn(e, r.Op); ok {
		return res
	}
	var res bucket.Result
	if r.Period.IsZero() {
		if e == nil {
			e = sh.create(r.Key, r.Limit, now)
		}
		res = e.state.Return(r.Limit, now, r.Amount, r.GrantedAt)
		e.setExpiry(r.Limit)
	} else {
		c := counterOf(e, r.Limit.Capacity(), now)
		var err error
		if res, err = c.Return(r.Limit.Capacity(), r.Period, now, r.Amount, r.GrantedAt); err != nil {
			return coordinator.ReturnResult{Err: fmt.Errorf("memstore: return %q: %w", r.Key, err)}
		}
		e = sh.setCounter(e, r.Key, c, r.Period)
	}
	if idem {
		e.recordReturn(r.Op, returnRecord{Seq: r.Op.Seq, Credited: res.Granted, Remaining: res.Remaining, Now: e.state.Last})
	}
	return coordinator.ReturnResult{Result: res, Now: e.state.Last}
}

// setExpiry sets the key's logical expiry after a change: once full plus the margin, the key is a
// full bucket again. A bucket that is not full and never refills does not expire.
func (e *entry) setExpiry(l bucket.Limit) {
	ttf, ok := e.state.TimeToFull(l)
	e.expires = ok
	e.expiry = 0
	if ok {
		e.expiry = e.state.Last + ttf + coordinator.ExpiryMargin
	}
}

// sweepRecords drops the records older than RecordKeep on the key clock once the key holds more
// than MaxRecords of them (the rule of bucket.lua). It runs when a record is added: only then can
// there be more.
func (e *entry) sweepRecords() {
	if len(e.takes)+len(e.returns)+len(e.multis) <= coordinator.MaxRecords {
		return
	}
	last := e.state.Last
	for a, rec := range e.multis {
		if last-rec.Now > coordinator.RecordKeep {
			delete(e.multis, a)
		}
	}
	for a, rec := range e.takes {
		if last-rec.Now > coordinator.RecordKeep {
			delete(e.takes, a)
		}
	}
	for a, rec := range e.returns {
		if last-rec.Now > coordinator.RecordKeep {
			delete(e.returns, a)
		}
	}
}

// Sweep drops every key whose logical expiry is at or before now and reports how many it dropped.
// The owner runs it periodically with the store's clock; it locks one shard at a time.
func (s *Store) Sweep(now bucket.Millis) int {
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for k, e := range sh.m {
			if e.expires && now >= e.expiry {
				delete(sh.m, k)
				n++
			}
		}
		sh.mu.Unlock()
	}
	return n
}

// Len is the number of keys held, expired ones not yet swept included.
func (s *Store) Len() int {
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n += len(sh.m)
		sh.mu.Unlock()
	}
	return n
}
