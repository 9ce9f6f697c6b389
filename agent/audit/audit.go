// Package audit is the agent's audit trail: every deny, fail-closed, degraded and
// shadow-would-deny decision, and a sample of the allows, written as one JSON object per line.
//
// A check never waits on it. Events go through a bounded queue with two priorities: Offer never
// blocks, and when the queue is full an event is dropped and counted (never silently). High
// priority events win under pressure: one may evict the oldest queued sampled allow, never the
// reverse. One goroutine drains the queue into a Sink, high priority first, and resolves on the
// way what the check path did not spend time on (the route template, the operation entry, the
// route's cost, the wall-clock time).
package audit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
)

// Priority of an event.
type Priority uint8

const (
	// Sampled is an allow that passed the sampling: it may be dropped, or evicted by a High event.
	Sampled Priority = iota
	// High is a deny, an unavailable (fail-closed) answer, a degraded answer or a shadow rule that
	// would have denied: never sampled, never evicted; dropped only when the queue is full of
	// High events.
	High
)

func (p Priority) String() string {
	if p == High {
		return "high"
	}
	return "sampled"
}

// Event is one decision. The check path fills it with what it has at hand (strings it already
// holds, the verdict's fields, the agent clock's now); the writer resolves the rest.
type Event struct {
	At       clock.Nanos // when the check was decided, on Config.Clock
	API      string      // "check", "batch", "stream", "envoy"
	Decision string      // "allow", "deny", "unavailable"
	Rule     string
	Tenant   string
	// Cost in tokens; 0 means the route's cost, which the writer looks up.
	Cost       int64
	RetryAfter time.Duration // deny and unavailable
	Remaining  int64         // whole tokens left as the agent saw them
	Degraded   bool          // answered by the emergency bucket (allow or deny)
	Shadow     bool          // a shadow rule would have denied; the decision is allow
	Replayed   bool          // an idempotent repeat answered with the first decision

	// Policy, Path and Operation are the request as the check saw it. The writer matches them
	// again to name the route template and operation entry; the raw path is never written (it
	// carries ids, and the template is what the rule is about).
	Policy    *policy.Set
	Path      string
	Operation string
}

// Record is an Event as written: what Sink receives.
type Record struct {
	Time       time.Time
	API        string
	Decision   string
	Rule       string
	Route      string // the template as written in the policy; "" for the default rule or if unknown
	Operation  string // the route's operation entry (a class, named operation or method; "*")
	Tenant     string
	Cost       int64
	RetryAfter time.Duration
	Remaining  int64
	Degraded   bool
	Shadow     bool
	Replayed   bool
	Priority   Priority
}

// Sink writes records. Write is called from one goroutine at a time.
type Sink interface {
	Write(*Record) error
	Sync() error
}

// DefaultSampleAllow is the fraction of allows the agent audits unless told otherwise: one in a
// thousand. Denies and degraded answers are all written whatever the rate; allows are the bulk
// of the traffic, and at 20,000 checks a second 0.1 % is 20 lines a second (about 6 KB/s), a
// sample to spot-check by, not a second access log.
const DefaultSampleAllow = 0.001

// pollEvery paces the writer: it wakes on a timer and writes what is queued, rather than
// waiting on the queue. A goroutine waiting on a channel is woken by the sender, which costs the
// check that offers the event a few microseconds (a futex call); on a timer the check only copies
// the event into the channel's buffer. Events wait 5 ms at most; at DefaultCapacity that is 1.6
// million events a second before the queue fills.
//
// A timer wakes an idle process too (two hundred times a second): after idlePolls polls that
// found nothing the writer sleeps until an Offer wakes it. Only the first event after a quiet
// moment pays the wake-up; it is written at once.
const (
	pollEvery = 5 * time.Millisecond
	idlePolls = 20
)

// DefaultCapacity bounds the queue when Config.Capacity is 0. An event is about 200 bytes and
// each priority has a channel of this size, so the queue costs about 3 MiB; the writer drains a
// few hundred thousand events a second, so it fills only when the sink stalls.
const DefaultCapacity = 8192

// Config configures a Queue. Sink and Clock are required.
type Config struct {
	Capacity int // events queued at most, both priorities together; DefaultCapacity if 0
	// SampleAllow is the fraction of allows written, in [0, 1]: 0 writes none, 1 every one.
	SampleAllow float64
	Sink        Sink
	Clock       clock.Clock // the clock of Event.At
	// Registerer receives the queue's metrics; nil: not registered.
	Registerer prometheus.Registerer
	Logger     *zap.Logger // sink errors; nil: none
}

// Drop reasons, the reason label of leasebucket_agent_audit_dropped_total.
const (
	reasonFull    = "queue_full" // no room, and nothing of lower priority to evict
	reasonEvicted = "evicted"    // a sampled allow made room for a high-priority event
	reasonClosed  = "closed"     // offered after Close
)

// Queue is the bounded, prioritised, non-blocking audit queue.
//
// Invariant: the events in both channels never exceed capacity. size counts them plus the
// reservations of Offers in progress; an Offer sends only after reserving within capacity, or
// after evicting one sampled event (a high-priority Offer over capacity), so a send never blocks.
type Queue struct {
	cfg       Config
	high, low chan Event
	size      atomic.Int64
	capacity  int64
	threshold uint64 // an allow is sampled when a random uint64 is below it
	all       bool   // SampleAllow is 1
	closed    atomic.Bool
	asleep    atomic.Bool   // the writer waits for wake (idlePolls found nothing)
	wake      chan struct{} // an Offer wakes the sleeping writer

	stop      chan struct{}
	done      chan struct{}
	startOnce sync.Once
	stopOnce  sync.Once

	written  [2]prometheus.Counter
	dropped  [2]map[string]prometheus.Counter
	writeErr prometheus.Counter
	log      *zap.Logger
}

// New returns a Queue; Start runs its writer.
func New(cfg Config) (*Queue, error) {
	if cfg.Sink == nil || cfg.Clock == nil {
		return nil, errors.New("audit: a sink and a clock are required")
	}
	if cfg.SampleAllow < 0 || cfg.SampleAllow > 1 || math.IsNaN(cfg.SampleAllow) {
		return nil, fmt.Errorf("audit: sample rate %v is not in [0, 1]", cfg.SampleAllow)
	}
	if cfg.Capacity < 0 {
		return nil, fmt.Errorf("audit: capacity %d is negative", cfg.Capacity)
	}
	if cfg.Capacity == 0 {
		cfg.Capacity = DefaultCapacity
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	q := &Queue{
		cfg:      cfg,
		high:     make(chan Event, cfg.Capacity),
		low:      make(chan Event, cfg.Capacity),
		capacity: int64(cfg.Capacity),
		all:      cfg.SampleAllow == 1,
		wake:     make(chan struct{}, 1),
		stop:     make(chan struct{}),
		done:     make(chan struct{}),
		log:      cfg.Logger,
	}
	if !q.all {
		// 2^64 · rate is below 2^64 for rate < 1, so the conversion cannot overflow.
		q.threshold = uint64(cfg.SampleAllow * (1 << 64))
	}
	if err := q.metrics(cfg.Registerer); err != nil {
		return nil, err
	}
	return q, nil
}

func (q *Queue) metrics(reg prometheus.Registerer) error {
	written := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "leasebucket", Subsystem: "agent", Name: "audit_events_total",
		Help: "Audit events written, by priority (high: deny, unavailable, degraded, shadow-would-deny; sampled: allows).",
	}, []string{"priority"})
	dropped := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "leasebucket", Subsystem: "agent", Name: "audit_dropped_total",
		Help: "Audit events dropped, by priority and reason (queue_full; evicted: a sampled allow made room for a high-priority event; closed).",
	}, []string{"priority", "reason"})
	q.writeErr = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "leasebucket", Subsystem: "agent", Name: "audit_write_errors_total",
		Help: "Audit events the sink failed to write.",
	})
	length := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "leasebucket", Subsystem: "agent", Name: "audit_queue_length",
		Help: "Audit events waiting to be written.",
	}, func() float64 { return float64(len(q.high) + len(q.low)) })
	for _, p := range []Priority{Sampled, High} {
		q.written[p] = written.WithLabelValues(p.String())
		q.dropped[p] = map[string]prometheus.Counter{}
		for _, r := range []string{reasonFull, reasonEvicted, reasonClosed} {
			if p == High && r == reasonEvicted {
				continue // never happens: nothing evicts a high-priority event
			}
			q.dropped[p][r] = dropped.WithLabelValues(p.String(), r)
		}
	}
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{written, dropped, q.writeErr, length} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("audit: metrics: %w", err)
		}
	}
	return nil
}

// Sample decides whether an allow is audited. It is the only cost audit adds to an allow that
// is not sampled: a per-thread random number. A nil Queue samples nothing.
func (q *Queue) Sample() bool {
	if q == nil {
		return false
	}
	if q.all {
		return true
	}
	return q.threshold != 0 && rand.Uint64() < q.threshold
}

// Offer queues ev without blocking and reports whether it was queued. When the queue is full a
// High event evicts the oldest Sampled one if there is one; otherwise the offered event is
// dropped. Every drop is counted. A nil Queue drops everything, uncounted (audit is off).
func (q *Queue) Offer(ev Event, p Priority) bool {
	if q == nil {
		return false
	}
	if q.size.Add(1) > q.capacity {
		if p != High || !q.evictSampled() {
			q.size.Add(-1)
			q.dropped[p][reasonFull].Inc()
			return false
		}
	}
	if q.closed.Load() {
		q.size.Add(-1)
		q.dropped[p][reasonClosed].Inc()
		return false
	}
	ch := q.low
	if p == High {
		ch = q.high
	}
	select {
	case ch <- ev:
		if q.asleep.Load() && q.asleep.CompareAndSwap(true, false) {
			select {
			case q.wake <- struct{}{}:
			default:
			}
		}
		return true
	default: // not reached: size bounds the channels (see Queue); counted rather than blocking
		q.size.Add(-1)
		q.dropped[p][reasonFull].Inc()
		return false
	}
}

// evictSampled drops the oldest queued sampled event to make room for a high-priority one.
func (q *Queue) evictSampled() bool {
	select {
	case <-q.low:
		q.size.Add(-1)
		q.dropped[Sampled][reasonEvicted].Inc()
		return true
	default:
		return false
	}
}

// Start runs the writer goroutine until Close.
func (q *Queue) Start() {
	q.startOnce.Do(func() { go q.run() })
}

func (q *Queue) run() {
	defer close(q.done)
	tick := time.NewTicker(pollEvery)
	defer tick.Stop()
	for idle := 0; ; {
		if idle++; q.writeQueued() {
			idle = 0
		}
		if idle >= idlePolls {
			idle = 0
			// An Offer sends, then looks at asleep; the writer sets asleep, then looks at what is
			// queued: one of them sees the other, so no event waits for a writer that sleeps on.
			q.asleep.Store(true)
			if q.size.Load() == 0 {
				tick.Stop()
				select {
				case <-q.stop:
					return
				case <-q.wake:
				}
				tick.Reset(pollEvery)
			}
			q.asleep.Store(false)
			continue
		}
		select {
		case <-q.stop:
			return
		case <-tick.C:
		}
	}
}

// writeQueued writes what is queued, high priority first: a burst of denies is written before
// the sampled allows queued with it. It reports whether it wrote anything.
func (q *Queue) writeQueued() (wrote bool) {
	for {
		select {
		case ev := <-q.high:
			q.write(&ev, High)
			wrote = true
			continue
		default:
		}
		select {
		case ev := <-q.low:
			q.write(&ev, Sampled)
			wrote = true
		case <-q.stop:
			return wrote
		default:
			return wrote
		}
	}
}

// Close stops taking events, writes those queued (until ctx ends: the rest are counted as
// dropped) and syncs the sink. It is idempotent; without Start it writes what is queued itself.
// A sink stuck in a write does not hold Close past ctx.
func (q *Queue) Close(ctx context.Context) error {
	var err error
	q.stopOnce.Do(func() {
		q.closed.Store(true)
		close(q.stop)
		q.startOnce.Do(func() { close(q.done) }) // never started: nothing to wait for
		select {
		case <-q.done:
		case <-ctx.Done():
			q.dropQueued()
			err = fmt.Errorf("audit: closed with events unwritten (the sink is stuck): %w", ctx.Err())
			return
		}
		err = q.drain(ctx)
		if serr := q.cfg.Sink.Sync(); serr != nil && err == nil {
			err = fmt.Errorf("audit: sync: %w", serr)
		}
	})
	return err
}

// drain writes what is queued after the writer stopped, waiting for Offers that reserved room
// before Close to either send or give up.
func (q *Queue) drain(ctx context.Context) error {
	for q.size.Load() > 0 {
		select {
		case ev := <-q.high:
			q.write(&ev, High)
		case ev := <-q.low:
			q.write(&ev, Sampled)
		case <-ctx.Done():
			q.dropQueued()
			return fmt.Errorf("audit: closed with events unwritten: %w", ctx.Err())
		case <-time.After(time.Millisecond):
			// an Offer between its reservation and its send or undo
		}
	}
	return nil
}

// dropQueued counts what is still queued as dropped at close.
func (q *Queue) dropQueued() {
	for {
		select {
		case <-q.high:
			q.size.Add(-1)
			q.dropped[High][reasonClosed].Inc()
		case <-q.low:
			q.size.Add(-1)
			q.dropped[Sampled][reasonClosed].Inc()
		default:
			return
		}
	}
}

// write resolves ev and hands it to the sink.
func (q *Queue) write(ev *Event, p Priority) {
	q.size.Add(-1)
	rec := Record{
		Time:       time.Now().Add(time.Duration(ev.At - q.cfg.Clock.Now())),
		API:        ev.API,
		Decision:   ev.Decision,
		Rule:       ev.Rule,
		Tenant:     ev.Tenant,
		Cost:       ev.Cost,
		RetryAfter: ev.RetryAfter,
		Remaining:  ev.Remaining,
		Degraded:   ev.Degraded,
		Shadow:     ev.Shadow,
		Replayed:   ev.Replayed,
		Priority:   p,
	}
	if ev.Policy != nil {
		// The route the check was charged to, found again: the same policy Set and input give
		// the same route. A rule name that differs means the policy was swapped between the
		// decision and the snapshot taken for the event; the template is then left out.
		if r, err := ev.Policy.Match(ev.Path, ev.Operation); err == nil && r.Rule.Name == ev.Rule {
			rec.Route, rec.Operation = r.Template(), r.Operation()
			if rec.Cost == 0 {
				rec.Cost = ev.Policy.Cost(r)
			}
		}
	}
	if err := q.cfg.Sink.Write(&rec); err != nil {
		q.writeErr.Inc()
		q.log.Warn("audit event not written", zap.Error(err))
		return
	}
	q.written[p].Inc()
}
