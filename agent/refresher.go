package agent

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/clock"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

const (
	// DefaultCallTimeout bounds one Acquire or Return call. The shortest lease lives 200 ms
	// (lease.MinTTL) and a refill normally takes a millisecond or two: a call still unanswered
	// after 500 ms has failed for every check waiting on it (they fell back after MaxWait), and the
	// key's failure mode is the right answer until the coordinator recovers.
	DefaultCallTimeout = 500 * time.Millisecond

	// DefaultMaxInFlight bounds the calls in flight: refills queued meanwhile join the next batch,
	// so a few calls carry any number of keys, and a slow coordinator is not flooded.
	DefaultMaxInFlight = 4

	// DefaultSweepEvery paces the expiry sweep: DefaultSweepShards of the table's 64 shards every
	// 25 ms is the whole table every 400 ms, so an idle key's expired lease goes back within about
	// two of the shortest lease lifetimes, and one tick touches 1/16 of the keys.
	DefaultSweepEvery = 25 * time.Millisecond
	// DefaultSweepShards is how many shards one sweep tick walks.
	DefaultSweepShards = 4

	// reloadEvery throttles policy reloads asked for by coordinators: every Acquire fails while the
	// versions differ, and reading the file once a second is plenty.
	reloadEvery = time.Second

	// timeoutRetries is how often a timed-out call is sent again (same request, same seq: the
	// coordinator answers a repeat from its record, so nothing is charged or credited twice).
	timeoutRetries = 1
)

// RefresherConfig configures a Refresher. Coordinator and Clock are required.
type RefresherConfig struct {
	Coordinator Coordinator
	// Clock is the clock Checks read (a *clock.Coarse in production). If it has a Fresh method,
	// the moment an Acquire is sent is read with it.
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

// Refresher is the Limiter's shell: one goroutine that sends queued refills as batched Acquire
// calls, sends Returns of retired leases and sweeps expired leases, plus one goroutine per call in
// flight. Create it, pass its Notify to the Limiter's Config, then Start it with the Limiter:
//
//	r := agent.NewRefresher(agent.RefresherConfig{Coordinator: c, Clock: clk})
//	lim := agent.New(agent.Config{Notify: r.Notify, Guard: clock.Guard, ...}, set)
//	r.Start(lim)
//	defer r.Stop(ctx) // closes the Limiter and returns its leases
type Refresher struct {
	cfg   RefresherConfig
	fresh func() clock.Nanos
	log   *zap.Logger

	lim  *Limiter
	wake chan struct{}
	done chan struct{} // a call finished: a slot is free
	stop chan struct{}
	exit chan struct{} // the loop has exited

	// calls is the context of every call; Stop cancels it only when its own deadline passes.
	calls  context.Context
	cancel context.CancelFunc
	slots  chan struct{} // one token per call in flight
	wg     sync.WaitGroup

	returning  atomic.Int64 // µ in Return calls in flight
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
		wake:  make(chan struct{}, 1),
		done:  make(chan struct{}, 1),
		stop:  make(chan struct{}),
		exit:  make(chan struct{}),
		slots: make(chan struct{}, cfg.MaxInFlight),
	}
	if f, ok := cfg.Clock.(interface{ Fresh() clock.Nanos }); ok {
		r.fresh = f.Fresh
	}
	r.calls, r.cancel = context.WithCancel(context.Background())
	r.lastReload.Store(int64(cfg.Clock.Now()) - int64(reloadEvery))
	return r
}

// Notify tells the Refresher that refills or returns are queued; it never blocks. Pass it as the
// Limiter's Config.Notify.
func (r *Refresher) Notify() { signal(r.wake) }

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
		go r.run()
	})
}

func (r *Refresher) run() {
	defer close(r.exit)
	sweep := time.NewTicker(r.cfg.SweepEvery)
	defer sweep.Stop()
	from := 0
	for {
		select {
		case <-r.stop:
			return
		case <-r.wake:
		case <-r.done:
		case <-sweep.C:
			from = r.lim.Expire(r.cfg.Clock.Now(), from, r.cfg.SweepShards)
		}
		r.pump()
	}
}

// pump starts calls while slots are free: refills first (checks may be waiting for them), then
// returns.
func (r *Refresher) pump() {
	for {
		select {
		case r.slots <- struct{}{}:
		default:
			return // every slot busy; a finishing call pumps again
		}
		if rf := r.lim.NextAcquire(r.fresh()); rf != nil {
			r.wg.Go(func() { r.acquire(rf); r.release() })
			continue
		}
		if rt := r.lim.NextReturn(); rt != nil {
			r.wg.Go(func() { r.sendReturn(rt); r.release() })
			continue
		}
		<-r.slots
		return
	}
}

func (r *Refresher) release() {
	<-r.slots
	signal(r.done)
}

// acquire sends one Acquire (again, with the same seq, if it timed out) and applies the answer.
func (r *Refresher) acquire(rf *Refill) {
	var (
		resp *coordinatorv1.AcquireResponse
		err  error
	)
	for attempt := 0; ; attempt++ {
		start := time.Now()
		ctx, cancel := context.WithTimeout(r.calls, r.cfg.CallTimeout)
		resp, err = r.cfg.Coordinator.Acquire(ctx, rf.Req)
		cancel()
		r.cfg.Metrics.refillDone(time.Since(start), err)
		if err == nil || attempt == timeoutRetries || !timedOut(err) || r.calls.Err() != nil {
			break
		}
	}
	if err != nil {
		r.log.Warn("acquire failed; the keys are in their failure mode until a refill succeeds",
			zap.Uint64("seq", rf.Req.Seq), zap.Int("keys", len(rf.Req.Items)), zap.Error(err))
	}
	if errors.Is(r.lim.ApplyAcquire(r.cfg.Clock.Now(), rf, resp, err), ErrUnknownPolicy) {
		r.reload()
	}
}

func timedOut(err error) bool {
	return status.Code(err) == codes.DeadlineExceeded || errors.Is(err, context.DeadlineExceeded)
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

// sendReturn sends one Return (again, with the same seq, if it failed in a way a retry may fix)
// and records the answer.
func (r *Refresher) sendReturn(rt *Return) {
	var amount int64
	for _, it := range rt.Req.Items {
		amount += it.UnspentMicro
	}
	r.returning.Add(amount)
	defer r.returning.Add(-amount)
	var (
		resp *coordinatorv1.ReturnResponse
		err  error
	)
	for attempt := 0; ; attempt++ {
		ctx, cancel := context.WithTimeout(r.calls, r.cfg.CallTimeout)
		resp, err = r.cfg.Coordinator.Return(ctx, rt.Req)
		cancel()
		r.cfg.Metrics.callError("return", err)
		if err == nil || attempt == timeoutRetries || r.calls.Err() != nil {
			break
		}
		if c := status.Code(err); c != codes.DeadlineExceeded && c != codes.Unavailable && !timedOut(err) {
			break
		}
	}
	if err != nil {
		r.log.Warn("return failed; the tokens stay out of the global bucket until it refills them",
			zap.Uint64("seq", rt.Req.Seq), zap.Int("keys", len(rt.Req.Items)), zap.Int64("micro", amount), zap.Error(err))
	}
	r.lim.ApplyReturn(rt, resp, err)
}

// Returning is the µ in Return calls in flight: retired, not yet credited.
func (r *Refresher) Returning() int64 { return r.returning.Load() }

// InFlight is the number of calls in flight.
func (r *Refresher) InFlight() int { return len(r.slots) }

// Stop shuts the Refresher down: it stops refilling, closes the Limiter (every lease is retired;
// checks answer ErrClosed), waits for the calls in flight and returns every retired lease. ctx
// bounds all of it; past its deadline the calls are cancelled and what was not returned is
// counted as lost (the error says how much). Stop is idempotent.
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
	// Past ctx's deadline every call is cancelled: what is not returned by then is lost.
	defer context.AfterFunc(ctx, r.cancel)()
	<-r.exit
	r.lim.Close()
	waited := make(chan struct{})
	go func() { r.wg.Wait(); close(waited) }()
	<-waited
	// Refills still queued belong to retired entries: NextAcquire releases their waiters and
	// builds nothing (a closed Limiter acquires no lease).
	for refills, _ := r.lim.Pending(); refills > 0; refills, _ = r.lim.Pending() {
		if rf := r.lim.NextAcquire(r.fresh()); rf != nil {
			_ = r.lim.ApplyAcquire(r.cfg.Clock.Now(), rf, nil, ErrClosed)
		}
	}
	lost := r.lim.Stats().LostMicro.Load()
	var wg sync.WaitGroup
	for range r.cfg.MaxInFlight {
		wg.Go(func() {
			for {
				rt := r.lim.NextReturn()
				if rt == nil {
					return
				}
				if r.calls.Err() != nil {
					r.lim.ApplyReturn(rt, nil, r.calls.Err())
					continue
				}
				r.sendReturn(rt)
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
