package storetest

import (
	"context"
	"sync"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

// Levels is a coordinator.Store that passes every call to another store and remembers, per key,
// what the store said the bucket held after the last operation on it: the Remaining of each result
// that is neither failed nor Replayed (a replay answers from a record, not from the bucket). For
// tests of the store's users (what a coordinator or an agent charged and returned); what a store
// itself does is Run's business.
//
// Calls are serialized, so the levels follow the order the store applied the operations in. It is
// safe for concurrent use.
type Levels struct {
	mu     sync.Mutex
	store  coordinator.Store
	levels map[string]bucket.Micro
}

var _ coordinator.Store = (*Levels)(nil)

// NewLevels returns a Levels in front of store.
func NewLevels(store coordinator.Store) *Levels {
	return &Levels{store: store, levels: map[string]bucket.Micro{}}
}

// Take implements coordinator.Store.
func (l *Levels) Take(ctx context.Context, reqs []coordinator.TakeRequest) ([]coordinator.TakeResult, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	res, err := l.store.Take(ctx, reqs)
	if err == nil {
		for i, r := range res {
			if len(reqs[i].Also) > 0 {
				l.forget(reqs[i].Key, reqs[i].Also)
				continue
			}
			l.note(reqs[i].Key, r.Result, r.Err, r.Replayed)
		}
	}
	return res, err
}

// Return implements coordinator.Store.
func (l *Levels) Return(ctx context.Context, reqs []coordinator.ReturnRequest) ([]coordinator.ReturnResult, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	res, err := l.store.Return(ctx, reqs)
	if err == nil {
		for i, r := range res {
			if len(reqs[i].Also) > 0 {
				l.forget(reqs[i].Key, reqs[i].Also)
				continue
			}
			l.note(reqs[i].Key, r.Result, r.Err, r.Replayed)
		}
	}
	return res, err
}

// forget drops the levels of an operation on several buckets: its result holds the least level
// of them, so none is known.
func (l *Levels) forget(key string, also []coordinator.Bucket) {
	delete(l.levels, key)
	for _, b := range also {
		delete(l.levels, b.Key)
	}
}

func (l *Levels) note(key string, r bucket.Result, err error, replayed bool) {
	if err == nil && !replayed {
		l.levels[key] = r.Remaining
	}
}

// Level returns the microtokens key held after the last operation on it, as the store reported
// them (not refilled since), and whether any operation reached key.
func (l *Levels) Level(key string) (bucket.Micro, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	v, ok := l.levels[key]
	return v, ok
}
