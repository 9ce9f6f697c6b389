package agent

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/leasebucket/leasebucket/internal/clock"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

const (
	// DefaultCallTimeout bounds one coordinator call. The shortest lease lives 200 ms
	// (lease.MinTTL) and a refill normally takes a millisecond or two: a call still unanswered
	// after 500 ms has failed for every check waiting on it (they fell back after MaxWait), and the
	// key's failure mode is the right answer until the coordinator recovers.
	DefaultCallTimeout = 500 * time.Millisecond

	// DefaultMaxInFlight bounds the calls in flight (cmd/agent's --calls-in-flight). A refill is
	// sent as soon as it is queued while a slot is free, so a check on a cold key waits one round
	// trip; refills queued while every slot is busy join the next call, so a few calls carry any
	// number of keys and a slow coordinator is not flooded. A call's own cost (its gRPC call, the
	// coordinator's handling, the wake-ups on both sides) is most of what a cold check costs, so
	// fewer slots make fuller, cheaper calls, and more slots make a refill less likely to wait
	// for one. Under a busy gateway's cold keys (64 checks outstanding on the stack benchmark) 16
	// slots sent calls of 2–3 keys and 4 calls of 7–9, for about a tenth less CPU per check at
	// the same latency. Two send calls of 15 for 15–20 % less CPU again where the node's CPU is
	// what holds checks up (the stack benchmark's two cores), but where the round trip is what
	// they wait for a cold check waits for a slot more often: the simulator's benchmark cases
	// (3 ms round trips, CPU free) answered cold checks 15–25 % later at p50 and p99. Four keeps
	// a cold check at about one round trip; --calls-in-flight 2 suits nodes short of CPU.
	DefaultMaxInFlight = 4

	// DefaultSweepEvery paces the expiry sweep: DefaultSweepShards of the table's 64 shards every
	// 25 ms is the whole table every 400 ms, so an idle key's expired lease goes back within about
	// two of the shortest lease lifetimes, and one tick visits 1/16 of the keys that hold
	// something (Limiter.Expire). The sweep runs on its own goroutine: it never delays a refill.
	DefaultSweepEvery = 25 * time.Millisecond
	// DefaultSweepShards is how many shards one sweep tick walks.
	DefaultSweepShards = 4

	// reloadEvery throttles policy reloads asked for by coordinators: every Acquire fails while the
	// versions differ, and reading the file once a second is plenty.
	reloadEvery = time.Second
)

// RefresherConfig configures a Refresher. Coordinator and Clock are required.
type RefresherConfig struct {
	Coordinator Coordinator
	// Clock is the clock Checks read (a *clock.Coarse in production). If it has a Fresh method,
	// the moment a call is sent is read with it.
	Clock       clock.Clock
	CallTimeout time.Duration // DefaultCallTimeout if zero
	MaxInFlight int           // DefaultMaxInFlight if zero
	SweepEvery  time.Duration // DefaultSweepEvery if zero
	SweepShards int           // DefaultSweepShards if zero
	// ReloadPolicy is called (on a call's goroutine, at most once a second) when a coordinator does
	// not know the agent's policy version or one of its routes: reread the policy file and pass a
	// changed Set to Limiter.SetPolicy. Until the versions agree each route is in its failure mode.
	ReloadPolicy func()
	Metrics      *Metrics // nil: none
	Logger       *zap.Logger
}

// Refresher is the Limiter's shell: one goroutine that starts the calls the Limiter has due (as
// soon as Wake says so, while fewer than MaxInFlight are out), one that sweeps expired leases,
// and MaxInFlight senders. Create the Limiter, then start a Refresher with it:
//
//	lim := agent.New(agent.Config{Guard: clock.Guard, ...}, set)
//	r := agent.NewRefresher(agent.RefresherConfig{Coordinator: c, Clock: clk})
//	r.Start(lim)
//	defer r.Stop(ctx) // closes the Limiter and hands back its leases
type Refresher struct {
	cfg   RefresherConfig
	fresh func() clock.Nanos
	log   *zap.Logger

	lim  *Limiter
	done chan struct{} // a call finished: a slot is free
	stop chan struct{}
	exit sync.WaitGroup // the loops

	// calls is the context of every call; Stop cancels it only when its own deadline passes.
	calls  context.Context
	cancel context.CancelFunc
	slots  chan struct{} // one token per call in flight
	work   chan *Call    // calls for the senders, one per slot taken
	wg     sync.WaitGroup

	returning  atomic.Int64 // µ handed back in calls in flight
	lastReload atomic.Int64 // clock.Nanos of the last ReloadPolicy
	startOnce  sync.Once
	stopOnce   sync.Once
	stopErr    error
}

// NewRefresher returns a Refresher; Start runs it.
func NewRefresher(cfg RefresherConfig) *Refresher {
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = DefaultCallTimeout
	}
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = DefaultMaxInFlight
	}
	if cfg.SweepEvery <= 0 {
		cfg.SweepEvery = DefaultSweepEvery
	}
	if cfg.SweepShards <= 0 {
		cfg.SweepShards = DefaultSweepShards
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	r := &Refresher{
		cfg:   cfg,
		fresh: cfg.Clock.Now,
		log:   cfg.Logger,
		done:  make(chan struct{}, 1),
		stop:  make(chan struct{}),
		slots: make(chan struct{}, cfg.MaxInFlight),
		work:  make(chan *Call, cfg.MaxInFlight),
	}
	if f, ok := cfg.Clock.(interface{ Fresh() clock.Nanos }); ok {
		r.fresh = f.Fresh
	}
	r.calls, r.cancel = context.WithCancel(context.Background())
	r.lastReload.Store(int64(cfg.Clock.Now()) - int64(reloadEvery))
	return r
}

func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// Start runs the Refresher for lim until Stop.
func (r *Refresher) Start(lim *Limiter) {
	r.startOnce.Do(func() {
		r.lim = lim
		r.exit.Add(2)
		go r.run()
		go r.sweep()
		// MaxInFlight senders that live as long as the Refresher: a goroutine per call would grow
		// its stack through gRPC's client on every call (a tenth of a busy agent's CPU).
		for range r.cfg.MaxInFlight {
			go r.sender()
		}
	})
}

// run sends the calls that are due: at once when the Limiter wakes it or a slot frees up, and at
// the ReturnLinger pace for leases waiting to be handed back alone.
func (r *Refresher) run() {
	defer r.exit.Done()
	tick := time.NewTicker(ReturnLinger)
	defer tick.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-r.lim.Wake():
		case <-r.done:
		case <-tick.C:
		}
		r.pump()
	}
}

func (r *Refresher) sweep() {
	defer r.exit.Done()
	t := time.NewTicker(r.cfg.SweepEvery)
	defer t.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-t.C:
			r.lim.Expire(r.fresh(), r.cfg.SweepShards) // an exact reading: the sweep does not keep the coarse clock awake
		}
	}
}

// pump starts calls while slots are free.
func (r *Refresher) pump() {
	for {
		select {
		case r.slots <- struct{}{}:
		default:
			return // every slot busy; a finishing call pumps again
		}
		c := r.lim.NextCall(r.fresh())
		if c == nil {
			<-r.slots
			return
		}
		r.wg.Add(1)
		r.work <- c // never blocks: a slot was free, so a sender is
	}
}

// sender sends the calls pump hands it until Stop.
func (r *Refresher) sender() {
	for c := range r.work {
		r.send(c)
		r.release()
		r.wg.Done()
	}
}

func (r *Refresher) release() {
	<-r.slots
	signal(r.done)
}

// send sends one call (again, with the same seq, when Retry says so) and applies its reply.
func (r *Refresher) send(c *Call) {
	back := c.HandedBack()
	r.returning.Add(back)
	defer r.returning.Add(-back)
	var (
		acq *coordinatorv1.AcquireResponse
		ret *coordinatorv1.ReturnResponse
		err error
	)
	for attempt := 0; ; attempt++ {
		start := time.Now()
		ctx, cancel := context.WithTimeout(r.calls, r.cfg.CallTimeout)
		if c.Acquire != nil {
			acq, err = r.cfg.Coordinator.Acquire(ctx, c.Acquire)
			r.cfg.Metrics.refillDone(time.Since(start), err)
		} else {
			ret, err = r.cfg.Coordinator.Return(ctx, c.Return)
			r.cfg.Metrics.callError("return", err)
		}
		cancel()
		if !Retry(c, attempt, err) || r.calls.Err() != nil {
			break
		}
	}
	if err != nil {
		r.log.Warn("coordinator call failed; its keys are in their failure mode until a refill succeeds",
			zap.Uint64("seq", c.Seq()), zap.Int("keys", c.Keys()), zap.Int64("handed_back_micro", back), zap.Error(err))
	}
	if errors.Is(r.lim.Apply(r.cfg.Clock.Now(), c, Reply{Failure: Classify(err), Acquire: acq, Return: ret}), ErrUnknownPolicy) {
		r.reload()
	}
}

func (r *Refresher) reload() {
	if r.cfg.ReloadPolicy == nil {
		return
	}
	now := int64(r.cfg.Clock.Now())
	last := r.lastReload.Load()
	if now-last < int64(reloadEvery) || !r.lastReload.CompareAndSwap(last, now) {
		return
	}
	r.log.Info("a coordinator does not know this agent's policy; reloading the policy file",
		zap.String("version", r.lim.Policy().Version()))
	r.cfg.ReloadPolicy()
}

// Returning is the µ handed back in calls in flight: retired, not yet credited.
func (r *Refresher) Returning() int64 { return r.returning.Load() }

// InFlight is the number of calls in flight.
func (r *Refresher) InFlight() int { return len(r.slots) }

// Stop shuts the Refresher down: it stops refilling, closes the Limiter (every lease is retired;
// checks answer ErrClosed), waits for the calls in flight and hands back every retired lease.
// ctx bounds all of it; past its deadline the calls are cancelled and what was not handed back
// is counted as lost (the error says how much). Stop is idempotent.
func (r *Refresher) Stop(ctx context.Context) error {
	r.stopOnce.Do(func() { r.stopErr = r.shutdown(ctx) })
	return r.stopErr
}

func (r *Refresher) shutdown(ctx context.Context) error {
	defer r.cancel()
	close(r.stop)
	if r.lim == nil {
		return nil // never started
	}
	// Past ctx's deadline every call is cancelled: what is not handed back by then is lost.
	defer context.AfterFunc(ctx, r.cancel)()
	r.exit.Wait()
	r.lim.Close()
	r.wg.Wait()
	close(r.work) // nothing pumps once the loops are gone: the senders end
	lost := r.lim.Stats().LostMicro.Load()
	var wg sync.WaitGroup
	for range r.cfg.MaxInFlight {
		wg.Go(func() {
			// Refills still queued belong to retired entries: NextCall releases their waiting
			// checks and builds no Acquire (a closed Limiter acquires nothing); what is left are
			// Returns, due at once.
			for c := r.lim.NextCall(r.fresh()); c != nil; c = r.lim.NextCall(r.fresh()) {
				if err := r.calls.Err(); err != nil {
					_ = r.lim.Apply(r.cfg.Clock.Now(), c, Reply{Failure: MaybeApplied})
					continue
				}
				r.send(c)
			}
		})
	}
	wg.Wait()
	if lost = r.lim.Stats().LostMicro.Load() - lost; lost > 0 {
		return &ReturnError{LostMicro: lost}
	}
	return nil
}

// ReturnError reports the leases Stop could not hand back.
type ReturnError struct {
	LostMicro uint64
}

func (e *ReturnError) Error() string {
	return "agent: shutdown could not return " + microString(int64(e.LostMicro)) + " tokens of unspent leases"
}
