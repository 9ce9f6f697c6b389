package memstore

import "github.com/leasebucket/leasebucket/internal/bucket"

// The records of an Entry, as the differential test builds them from a Redis hash.
type (
	TakeRecord   = takeRecord
	ReturnRecord = returnRecord
	MultiRecord  = multiRecord
)

// Entry is a copy of one key's state, for the tests.
type Entry struct {
	State   bucket.State
	Expiry  bucket.Millis // the logical expiry on the key clock; 0 unless Expires
	Expires bool
	// CompeteUntil is the key clock until which its agents compete, when Competes.
	CompeteUntil bucket.Millis
	Competes     bool
	// Counter: a calendar counter, whose period starts at Period.
	Counter bool
	Period  bucket.Millis
	Takes   map[string]takeRecord   // the last idempotent Take of each agent
	Returns map[string]returnRecord // the last idempotent Return of each agent
	Multis  map[string]multiRecord  // the last idempotent take of several buckets of each agent
}

// Lookup returns a copy of key's state as stored, without applying its expiry (an expired key is
// reported until a request or Sweep drops it), and whether the key is held.
func (s *Store) Lookup(key string) (Entry, bool) {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e, ok := sh.m[key]
	if !ok {
		return Entry{}, false
	}
	out := Entry{State: e.state, Expiry: e.expiry, Expires: e.expires, CompeteUntil: e.competeUntil, Competes: e.competes,
		Counter: e.counter, Period: e.period,
		Takes: make(map[string]takeRecord, len(e.takes)), Returns: make(map[string]returnRecord, len(e.returns)),
		Multis: make(map[string]multiRecord, len(e.multis))}
	for a, r := range e.multis {
		out.Multis[a] = r
	}
	for a, r := range e.takes {
		out.Takes[a] = r
	}
	for a, r := range e.returns {
		out.Returns[a] = r
	}
	return out, true
}
