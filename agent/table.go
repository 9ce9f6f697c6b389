package agent

import (
	"hash/maphash"
	"sync"
	"sync/atomic"
)

// table is the lease table: the entries of one policy view, keyed by (route id, tenant).
//
// It is sharded; each shard is an open-addressing hash table whose slots are atomic pointers, so
// a lookup takes no lock (the hot path: one hash, a few loads). Inserts, deletes and growth take
// the shard's mutex and publish a new slot array when the table grows; a reader holding the old
// array may still find an entry that was deleted since, which is why entries carry a dead flag.
//
// The number of entries is bounded (maxKeys): a full shard evicts with the CLOCK algorithm
// (second chance) run over its slot array, using a touched flag the hot path sets once per sweep. That approximates LRU
// without writing shared state on every check, which a list-based LRU such as golang-lru's would
// do under a lock (and its 96-byte nodes would break the memory budget of a key).
type table struct {
	seed      maphash.Seed
	shards    []shard
	mask      uint64
	onEvicted func(*entry)
}

const (
	// shardsLog2: 64 shards keep inserts of different keys off each other's mutex on a 2-core node
	// and still let a full sweep of the table run shard by shard. A table bounded below 64 keys
	// has fewer shards, so that every shard holds at least one.
	shardsLog2 = 6
	// minSlots is a new shard's slot array; it doubles when live + deleted slots pass half.
	minSlots = 16
)

type shard struct {
	mu    sync.Mutex
	slots atomic.Pointer[slots]
	live  int    // entries in the table
	used  int    // live + tombstones
	limit int    // the shard's share of maxKeys: a full shard evicts before it inserts
	hand  uint64 // the CLOCK hand: the slot the next eviction looks at first

	// armed are the shard's entries that hold something the expiry sweep may have to act on (a
	// lease, or slow state): the sweep walks them, not every slot. An entry is in it exactly when
	// its armed flag is set (under its mu); armMu guards the lists.
	armMu        sync.Mutex
	armed, spare []*entry
	_            [24]byte // keep shards on separate cache lines
}

type slots struct {
	mask uint64
	s    []atomic.Pointer[entry]
}

// tombstone marks a deleted slot; probing continues past it.
var tombstone = &entry{}

// newTable makes a table of at most maxKeys (≥ 1) entries: the shards' limits sum to maxKeys
// exactly, so the bound an operator sets is the bound the table keeps.
func newTable(maxKeys int, onEvicted func(*entry)) *table {
	maxKeys = max(1, maxKeys)
	n := 1 << shardsLog2
	for n > maxKeys {
		n >>= 1
	}
	t := &table{
		seed:      maphash.MakeSeed(),
		shards:    make([]shard, n),
		mask:      uint64(n - 1),
		onEvicted: onEvicted,
	}
	for i := range t.shards {
		t.shards[i].limit = maxKeys / n
		if i < maxKeys%n {
			t.shards[i].limit++
		}
		t.shards[i].slots.Store(newSlots(minSlots))
	}
	return t
}

func newSlots(n int) *slots { return &slots{mask: uint64(n - 1), s: make([]atomic.Pointer[entry], n)} }

func (t *table) hash(route uint32, tenant string) uint64 {
	return maphash.String(t.seed, tenant) ^ routeMix(route)
}

func routeMix(route uint32) uint64 { return (uint64(route) + 1) * 0x9e3779b97f4a7c15 }

// rehash is hash(to, tenant) from h = hash(from, tenant), without hashing the tenant again.
func rehash(h uint64, from, to uint32) uint64 { return h ^ routeMix(from) ^ routeMix(to) }

func (t *table) shardOf(h uint64) *shard { return &t.shards[(h>>32)&t.mask] }

// get finds the live entry of (route, tenant) without locking, or nil.
func (t *table) get(h uint64, route uint32, tenant string) *entry {
	sl := t.shardOf(h).slots.Load()
	for i := h & sl.mask; ; i = (i + 1) & sl.mask {
		e := sl.s[i].Load()
		if e == nil {
			return nil
		}
		if e != tombstone && e.hash == h && e.route == route && e.tenant == tenant {
			return e
		}
	}
}

// getOrInsert returns the entry of (route, tenant), inserting make() if there is none; inserted
// reports whether it did. A full shard first evicts one entry (onEvicted runs under no lock).
func (t *table) getOrInsert(h uint64, route uint32, tenant string, make func() *entry) (e *entry, inserted bool) {
	s := t.shardOf(h)
	var evicted *entry
	s.mu.Lock()
	if e = t.get(h, route, tenant); e == nil {
		if s.live >= s.limit {
			evicted = s.evictOne()
		}
		e = make()
		e.hash, e.route, e.tenant = h, route, tenant
		s.insert(e)
		inserted = true
	}
	s.mu.Unlock()
	if evicted != nil && t.onEvicted != nil {
		t.onEvicted(evicted)
	}
	return e, inserted
}

// each calls f for every live entry, shard by shard, with no lock held during f.
func (t *table) each(f func(*entry)) {
	t.eachHeld(func(e *entry) {
		if !e.dead.Load() { // deleted meanwhile
			f(e)
		}
	})
}

// arm adds e to its shard's armed entries. e.mu is held and e.armed was false.
func (t *table) arm(e *entry) {
	s := t.shardOf(e.hash)
	s.armMu.Lock()
	s.armed = append(s.armed, e)
	s.armMu.Unlock()
}

// sweepArmed calls f for each armed entry of shard i, with no lock held; f reports whether the
// entry stays armed (and sets its flag to match, under its mu). Entries armed meanwhile join
// the list.
func (t *table) sweepArmed(i int, f func(*entry) bool) {
	s := &t.shards[i]
	s.armMu.Lock()
	list := s.armed
	s.armed, s.spare = s.spare[:0], nil
	s.armMu.Unlock()
	kept := list[:0]
	for _, e := range list {
		if f(e) {
			kept = append(kept, e)
		}
	}
	clear(list[len(kept):])
	s.armMu.Lock()
	kept = append(kept, s.armed...)
	clear(s.armed)
	s.armed, s.spare = kept, s.armed[:0]
	s.armMu.Unlock()
}

// eachHeld calls f for every entry still in the table, dead ones included (after Close every
// entry is dead, and some still hold a hand-back). The slot array is immutable once published
// (growth publishes a new one), so it is walked without the lock.
func (t *table) eachHeld(f func(*entry)) {
	for i := range t.shards {
		sl := t.shards[i].slots.Load()
		for j := range sl.s {
			if e := sl.s[j].Load(); e != nil && e != tombstone {
				f(e)
			}
		}
	}
}

// len is the number of live entries.
func (t *table) len() int {
	n := 0
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		n += s.live
		s.mu.Unlock()
	}
	return n
}

func (s *shard) insert(e *entry) {
	sl := s.slots.Load()
	if 2*(s.used+1) > len(sl.s) {
		sl = s.grow(sl)
	}
	i := e.hash & sl.mask
	for {
		if old := sl.s[i].Load(); old == nil || old == tombstone {
			if old == nil {
				s.used++
			}
			sl.s[i].Store(e)
			break
		}
		i = (i + 1) & sl.mask
	}
	s.live++
}

// grow publishes a slot array sized for twice the live entries, without tombstones.
func (s *shard) grow(old *slots) *slots {
	n := minSlots
	for n < 4*(s.live+1) {
		n *= 2
	}
	sl := newSlots(n)
	for i := range old.s {
		e := old.s[i].Load()
		if e == nil || e == tombstone {
			continue
		}
		j := e.hash & sl.mask
		for sl.s[j].Load() != nil {
			j = (j + 1) & sl.mask
		}
		sl.s[j].Store(e)
	}
	s.used = s.live
	s.slots.Store(sl)
	return sl
}

func (s *shard) delete(e *entry) bool {
	sl := s.slots.Load()
	for i := e.hash & sl.mask; ; i = (i + 1) & sl.mask {
		cur := sl.s[i].Load()
		if cur == nil {
			return false
		}
		if cur == e {
			sl.s[i].Store(tombstone)
			break
		}
	}
	s.live--
	e.dead.Store(true)
	return true
}

// evictOne removes the first entry the hand finds untouched, clearing touched flags on its way
// (the second chance). After one full turn every flag is clear, so it finds one within two turns.
func (s *shard) evictOne() *entry {
	sl := s.slots.Load()
	for range 2 * len(sl.s) {
		i := s.hand & sl.mask
		s.hand = i + 1
		e := sl.s[i].Load()
		if e == nil || e == tombstone {
			continue
		}
		if e.touched.Load() {
			e.touched.Store(false)
			continue
		}
		s.delete(e)
		return e
	}
	return nil
}
