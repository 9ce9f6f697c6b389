package redisstore

import (
	"context"
	"sync"
	"time"
)

// DefaultInFlight is the most batches a Store has out to Redis at once by default (WithInFlight).
// Redis runs one script at a time, so a third batch out at once would only wait in its queue;
// two keep it busy (one running, the next on its way) while the batches that arrive meanwhile
// join one round trip. Each Acquire or Return of an agent is a batch of the keys it had queued,
// and with many agents most carry a few keys: what a round trip costs (the coordinator's
// command, Redis' reading, dispatch and reply, a system call or two on each side) is then most of
// what a key costs, whatever the key's own work.
const DefaultInFlight = 2

// MaxJoinKeys is about how many calls one joined round trip carries: the batches waiting go in
// arrival order, whole, while they fit (a batch larger alone goes alone), and the rest wait for
// the next place. Four batch.lua runs, a few milliseconds of Redis, so that under a flood the
// batches that came first are not held for the answers of all that came after; as many keys as
// an agent's largest call (agent.MaxBatch).
const MaxJoinKeys = 4 * MaxBatchKeys

// merger joins the batches that arrive while the Store has its most out to Redis: they wait, and
// the next round trip carries them, up to joinKeys calls (batching only what is already queued:
// no timer, and a batch that finds a free place goes at once).
type merger struct {
	most     int                           // 0: no bound
	joinKeys int                           // the most calls of a joined round trip (MaxJoinKeys); 0: no bound
	run      func(context.Context, []call) // one round trip (Store.run)
	mu       sync.Mutex
	out      int        // round trips out
	waiting  []*pending // batches that found none free, in arrival order
}

// pending is one batch's calls waiting for a round trip, and its caller's context.
type pending struct {
	ctx   context.Context
	calls []call
	done  chan struct{} // closed once every call holds its answer
}

// do runs calls in one round trip with any other batches waiting then. It reports
// whether they hold their answers: false when ctx was done first, and then calls must not be read
// (a round trip that already left still writes them). A caller that gives up leaves its calls in
// the round trip if it already left, and out of it if it had not: a take that ran for nobody
// loses its tokens (they are never created), as a take whose answer was lost would.
func (m *merger) do(ctx context.Context, calls []call) bool {
	if m.most <= 0 {
		m.run(ctx, calls)
		return true
	}
	p := &pending{ctx: ctx, calls: calls, done: make(chan struct{})}
	m.mu.Lock()
	m.waiting = append(m.waiting, p)
	lead := m.out < m.most
	if lead {
		m.out++
	}
	m.mu.Unlock()
	if lead {
		m.lead()
	}
	select {
	case <-p.done:
		return true
	case <-ctx.Done():
		m.drop(p)
		select {
		case <-p.done: // answered as the deadline came: keep the answers (a hung node's keys failed, the others' were applied)
			return true
		default:
			return false
		}
	}
}

// drop takes p out of the batches waiting, if it still waits.
func (m *merger) drop(p *pending) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for i, q := range m.waiting {
		if q == p {
			m.waiting = append(m.waiting[:i], m.waiting[i+1:]...)
			return
		}
	}
}

// lead holds one of the places out to Redis: it sends the batches waiting (take) in one round
// trip and hands each its answers. If batches wait after it (left by take, or arrived meanwhile),
// a new goroutine takes the place over, so that the caller who led returns as soon as its own
// batch is answered. (Batches wait only while every place is out: one that finds a place free
// leads, so every batch waiting has a round trip ahead of it that will take it or leave it to
// the next.)
func (m *merger) lead() {
	m.mu.Lock()
	all := m.take()
	m.mu.Unlock()
	batch := all[:0]
	for _, p := range all {
		if p.ctx.Err() != nil {
			continue // its caller is gone, or going: done stays open, so it reads nothing
		}
		batch = append(batch, p)
	}
	if len(batch) > 0 {
		m.send(batch)
	}
	m.mu.Lock()
	if len(m.waiting) > 0 {
		m.mu.Unlock()
		go m.lead()
		return
	}
	m.out--
	m.mu.Unlock()
}

// take removes from the batches waiting those the next round trip carries: in arrival order,
// whole, while their calls fit in joinKeys, and at least one. Called with mu held.
func (m *merger) take() []*pending {
	n, calls := 0, 0
	for n < len(m.waiting) && (n == 0 || m.joinKeys <= 0 || calls+len(m.waiting[n].calls) <= m.joinKeys) {
		calls += len(m.waiting[n].calls)
		n++
	}
	batch := m.waiting[:n:n]
	if m.waiting = m.waiting[n:]; len(m.waiting) == 0 {
		m.waiting = nil
	}
	return batch
}

// send runs the calls of batch as one, then hands each batch its calls' answers. The round trip's
// context ends with the last deadline among the batches (none if one has none).
func (m *merger) send(batch []*pending) {
	if len(batch) == 1 {
		m.run(batch[0].ctx, batch[0].calls)
		close(batch[0].done)
		return
	}
	n := 0
	for _, p := range batch {
		n += len(p.calls)
	}
	all := make([]call, 0, n)
	for _, p := range batch {
		all = append(all, p.calls...)
	}
	ctx, cancel := joinContexts(batch)
	m.run(ctx, all)
	cancel()
	k := 0
	for _, p := range batch {
		for i := range p.calls {
			p.calls[i].cmd = all[k].cmd // the answer; the rest run sets (batched, node) only run reads
			k++
		}
		close(p.done)
	}
}

// joinContexts is the context of a round trip that carries batch: the first batch's values, and
// the latest of their deadlines, none if one has none. One caller giving up does not cancel it.
func joinContexts(batch []*pending) (context.Context, context.CancelFunc) {
	base := context.WithoutCancel(batch[0].ctx)
	var last time.Time
	for _, p := range batch {
		d, ok := p.ctx.Deadline()
		if !ok {
			return base, func() {}
		}
		if d.After(last) {
			last = d
		}
	}
	return context.WithDeadline(base, last)
}
