package memstore

import (
	"hash/maphash"
	"slices"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

// multiRecord is an agent's last idempotent take of several buckets, kept in the first bucket's
// entry (the field m:<agent> of multi.lua).
type multiRecord struct {
	Seq        uint64
	Granted    bucket.Micro
	Remaining  bucket.Micro
	RetryAfter bucket.Millis
	Refused    int
	Now        bucket.Millis
}

// takeAll is take for a request with Also: every bucket is charged the same grant or none is,
// under the locks of every shard involved (lockAll). It follows multi.lua: a denial stores only the
// first bucket's refilled state and the record, a grant stores every bucket.
func (s *Store) takeAll(r *coordinator.TakeRequest, now bucket.Millis) coordinator.TakeResult {
	keys, limits := buckets(r.Key, r.Limit, r.Also)
	defer s.lockAll(keys)()

	first := s.shard(r.Key).live(r.Key, now)
	if first != nil && r.Op.Agent != "" {
		if rec, ok := first.multis[r.Op.Agent]; ok {
			switch {
			case rec.Seq == r.Op.Seq:
				return coordinator.TakeResult{
					Result:   bucket.Result{Granted: rec.Granted, Remaining: rec.Remaining, RetryAfter: rec.RetryAfter},
					Now:      rec.Now,
					Replayed: true,
					Refused:  rec.Refused,
				}
			case rec.Seq > r.Op.Seq:
				return coordinator.TakeResult{Result: bucket.Result{Remaining: first.state.Tokens}, Now: first.state.Last, Stale: true}
			}
		}
	}
	// The other buckets only now: a repeat or a stale take leaves them as they are, even expired
	// (multi.lua reads them after the record).
	entries := s.liveAll(first, keys, now)
	// Refill every bucket (on copies) and see which cannot cover Min.
	states := make([]bucket.State, len(keys))
	res := bucket.Result{Granted: r.Want}
	refused := 0
	low := bucket.Micro(bucket.MaxExact) // the least any bucket holds
	for i := range keys {
		if entries[i] != nil {
			states[i] = entries[i].state
		} else {
			states[i] = bucket.Full(limits[i], now)
		}
		states[i].Refill(limits[i], now)
		low = min(low, states[i].Tokens)
		if states[i].Tokens >= r.Min {
			continue
		}
		probe := states[i]
		retry := probe.Take(limits[i], now, r.Min, r.Min).RetryAfter
		if res.Granted != 0 || longer(retry, res.RetryAfter) {
			res.RetryAfter, refused = retry, i
		}
		res.Granted = 0
	}
	commit := 1 // a denial stores the first bucket's refill and the record
	if res.Granted != 0 {
		// State.TakeShare without a share cap, from a bucket holding the least of them (refilled:
		// Last is now).
		least := bucket.State{Tokens: low, Last: now}
		res.Granted = least.TakeShare(limits[0], now, r.Want, r.Min, bucket.WholeShare, max(1, r.Unit)).Granted
		commit = len(keys) // a grant stores every bucket
		for i := range states {
			states[i].Tokens -= res.Granted
		}
	}
	res.Remaining = low - res.Granted // every bucket gave the same grant
	for i := range commit {
		e := entries[i]
		if e == nil {
			e = s.shard(keys[i]).create(keys[i], limits[i], now)
			entries[i] = e
		}
		e.state = states[i]
		e.setExpiry(limits[i])
	}
	e := entries[0]
	if r.Op.Agent != "" {
		if keepRecord(&e.multis, r.Op.Agent, multiRecord{Seq: r.Op.Seq, Granted: res.Granted, Remaining: res.Remaining,
			RetryAfter: res.RetryAfter, Refused: refused, Now: e.state.Last}) {
			e.sweepRecords()
		}
	}
	return coordinator.TakeResult{Result: res, Now: e.state.Last, Refused: refused}
}

// returnAll is ret for a request with Also: every bucket is credited by its own State.Return of
// the amount, under the locks of every shard involved (lockAll), and the agent's ordinary Return
// record is kept in the first. It follows multi.lua's 'return': Granted is the sum of the credits
// (at most bucket.MaxExact, where the script's doubles stop being exact), Remaining the least any
// bucket holds after them, Now the first bucket's clock.
func (s *Store) returnAll(r *coordinator.ReturnRequest, now bucket.Millis) coordinator.ReturnResult {
	keys, limits := buckets(r.Key, r.Limit, r.Also)
	defer s.lockAll(keys)()

	first := s.shard(r.Key).live(r.Key, now)
	if res, ok := replayReturn(first, r.Op); ok {
		return res
	}
	entries := s.liveAll(first, keys, now)
	var res bucket.Result
	for i, e := range entries {
		if e == nil {
			e = s.shard(keys[i]).create(keys[i], limits[i], now)
			entries[i] = e
		}
		c := e.state.Return(limits[i], now, r.Amount, r.GrantedAt)
		res.Granted = min(res.Granted+c.Granted, bucket.MaxExact) // each credit < 2^52: no overflow
		if i == 0 || c.Remaining < res.Remaining {
			res.Remaining = c.Remaining
		}
		e.setExpiry(limits[i])
	}
	first = entries[0]
	if r.Op.Agent != "" {
		first.recordReturn(r.Op, returnRecord{Seq: r.Op.Seq, Credited: res.Granted, Remaining: res.Remaining, Now: first.state.Last})
	}
	return coordinator.ReturnResult{Result: res, Now: first.state.Last}
}

// buckets are the keys and limits of an operation on key and also, key first.
func buckets(key string, l bucket.Limit, also []coordinator.Bucket) ([]string, []bucket.Limit) {
	keys := make([]string, 0, 1+len(also))
	limits := make([]bucket.Limit, 0, 1+len(also))
	keys, limits = append(keys, key), append(limits, l)
	for _, b := range also {
		keys, limits = append(keys, b.Key), append(limits, b.Limit)
	}
	return keys, limits
}

// lockAll locks the shards of keys, each once, in shard order, so that two operations on several
// buckets never deadlock, and returns the function that unlocks them.
func (s *Store) lockAll(keys []string) (unlock func()) {
	var idx []int
	for _, k := range keys {
		if i := s.shardIndex(k); !slices.Contains(idx, i) {
			idx = append(idx, i)
		}
	}
	slices.Sort(idx)
	for _, i := range idx {
		s.shards[i].mu.Lock()
	}
	return func() {
		for _, i := range idx {
			s.shards[i].mu.Unlock()
		}
	}
}

// liveAll returns the entries of keys, first (keys[0]'s, already looked up) and then each other
// key's, dropping those expired by now. Caller holds every shard's lock (lockAll).
func (s *Store) liveAll(first *entry, keys []string, now bucket.Millis) []*entry {
	entries := make([]*entry, len(keys))
	entries[0] = first
	for i := 1; i < len(keys); i++ {
		entries[i] = s.shard(keys[i]).live(keys[i], now)
	}
	return entries
}

// longer reports whether retry a is longer than b (bucket.Never is the longest).
func longer(a, b bucket.Millis) bool {
	switch {
	case b == bucket.Never:
		return false
	case a == bucket.Never:
		return true
	}
	return a > b
}

// shardIndex is the index of key's shard.
func (s *Store) shardIndex(key string) int {
	return int(maphash.String(s.seed, key) & (shardCount - 1))
}
