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
// under the locks of every shard involved (taken in shard order, so two such takes never
// deadlock). It follows multi.lua: a denial stores only the first bucket's refilled state and the
// record, a grant stores every bucket.
func (s *Store) takeAll(r *coordinator.TakeRequest, now bucket.Millis) coordinator.TakeResult {
	keys := make([]string, 0, 1+len(r.Also))
	limits := make([]bucket.Limit, 0, 1+len(r.Also))
	keys, limits = append(keys, r.Key), append(limits, r.Limit)
	for _, b := range r.Also {
		keys, limits = append(keys, b.Key), append(limits, b.Limit)
	}
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
	defer func() {
		for _, i := range idx {
			s.shards[i].mu.Unlock()
		}
	}()

	entries := make([]*entry, len(keys))
	for i, k := range keys {
		entries[i] = s.shard(k).live(k, now)
	}
	first := entries[0]
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
		keepRecord(&e.multis, r.Op.Agent, multiRecord{Seq: r.Op.Seq, Granted: res.Granted, Remaining: res.Remaining,
			RetryAfter: res.RetryAfter, Refused: refused, Now: e.state.Last})
		e.sweepRecords()
	}
	return coordinator.TakeResult{Result: res, Now: e.state.Last, Refused: refused}
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
