package agent

import (
	"sync"
	"sync/atomic"

	"github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

// parking keeps the emergency buckets of evicted entries. An emergency bucket lives in its key's
// entry; if the table's bound evicted the entry during an outage and a check brought the key back,
// a new entry would start with a full emergency bucket and the agent could allow more than
// C_e + r_e·w degraded on the key. So an evicted entry whose emergency bucket is not full leaves
// it here, and the key's next entry takes it back. A full bucket needs no state: a new entry
// starts full anyway.
//
// It is bounded (maxParked, least recently parked dropped first) and only touched on evictions
// and inserts, never by a check on a live entry; an insert looks at it only while it holds
// something, so outside outages it costs one atomic load per new key.
type parking struct {
	n   atomic.Int64
	mu  sync.Mutex
	lru *simplelru.LRU[parkKey, bucket.State]
}

// maxParked bounds the parked emergency buckets: MaxKeys, at most this many (about 100 bytes
// each). Beyond it the oldest is dropped, and that key's emergency bound holds again only from
// its next entry's full bucket.
const maxParked = 1 << 16

// parkKey is an entry's identity within a view; the view is part of it, since a policy change
// retires every entry and the new view's limits may differ.
type parkKey struct {
	view   *view
	route  uint32
	tenant string
}

func newParking(maxKeys int) *parking {
	lru, err := simplelru.NewLRU[parkKey, bucket.State](min(maxKeys, maxParked), nil)
	if err != nil {
		panic(err) // size ≥ 1
	}
	return &parking{lru: lru}
}

// park keeps e's emergency bucket if it is not full. e.mu is held.
func (p *parking) park(e *entry) {
	f := e.fail
	if f == nil || !f.emergencyOn || e.lim.Emergency == nil || f.emergency.Tokens >= e.lim.Emergency.Bucket.Capacity() {
		return
	}
	p.mu.Lock()
	p.lru.Add(parkKey{e.view, e.route, e.tenant}, f.emergency)
	p.n.Store(int64(p.lru.Len()))
	p.mu.Unlock()
}

// restore gives a new entry of (view, route, tenant) the emergency bucket parked for it, if any.
// Nobody else holds e yet.
func (p *parking) restore(e *entry) {
	if p.n.Load() == 0 {
		return
	}
	p.mu.Lock()
	k := parkKey{e.view, e.route, e.tenant}
	st, ok := p.lru.Get(k)
	if ok {
		p.lru.Remove(k)
		p.n.Store(int64(p.lru.Len()))
	}
	p.mu.Unlock()
	if ok {
		e.fail = &fails{emergency: st, emergencyOn: true}
	}
}

// purge drops every parked bucket (a policy change: the old view's entries are gone).
func (p *parking) purge() {
	p.mu.Lock()
	p.lru.Purge()
	p.n.Store(0)
	p.mu.Unlock()
}
