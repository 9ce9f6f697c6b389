package policy

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// ErrVersionUnchanged is reported when a reloaded file means something else but kept its
// version: agents and coordinators compare versions, so one version must mean one content.
var ErrVersionUnchanged = errors.New("policy: content changed but version did not")

// DefaultPollInterval is how often a Watcher reads its file when WatchOptions.Interval is zero:
// an operator's edit takes effect within seconds, and reading a small file this often costs
// nothing measurable.
const DefaultPollInterval = 2 * time.Second

// WatchOptions configures a Watcher. Every field is optional.
type WatchOptions struct {
	Interval time.Duration // poll interval; DefaultPollInterval if zero
	Logger   *zap.Logger
	// Registerer receives the watcher's metrics (leasebucket_policy_reloads_total{result} and
	// leasebucket_policy_last_reload_ok); nil registers nothing.
	Registerer prometheus.Registerer
	// OnChange is called after a new Set replaced the current one.
	OnChange func(old, new *Set)
	// OnError is called when a changed file is rejected; the current Set stays.
	OnError func(error)
}

// Watcher holds the current Set of a policy file and reloads the file when its content changes.
// It polls (reading the file each interval and comparing a hash of its bytes), which works the
// same for in-place edits, renames and the symlink swaps of Kubernetes ConfigMaps.
//
// A reload is accepted only if the file parses and validates and, when its Digest differs, its
// Version differs too. A rejected file keeps the last good Set, is logged, counted and passed to
// OnError once (until the file changes again). Current is safe for concurrent use and lock-free.
type Watcher struct {
	file string
	opts WatchOptions
	log  *zap.Logger

	cur atomic.Pointer[Set]

	mu       sync.Mutex // serializes reloads; guards the fields below
	lastSeen [sha256.Size]byte
	lastRead error // the read error of the last check, if it failed
	lastErr  error // why the file on disk is not the Set in use; nil if it is

	reloads *prometheus.CounterVec
	lastOK  prometheus.Gauge

	startOnce, closeOnce sync.Once
	stop                 chan struct{}
	done                 chan struct{}
}

// NewWatcher loads the file (an error if it is invalid: there is no last good policy yet) and
// returns a Watcher holding it. Start begins polling; Close stops it.
func NewWatcher(filename string, opts WatchOptions) (*Watcher, error) {
	if opts.Interval <= 0 {
		opts.Interval = DefaultPollInterval
	}
	w := &Watcher{file: filename, opts: opts, log: opts.Logger,
		stop: make(chan struct{}), done: make(chan struct{})}
	if w.log == nil {
		w.log = zap.NewNop()
	}
	w.reloads = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "leasebucket", Subsystem: "policy", Name: "reloads_total",
		Help: "Policy file reloads by result: ok (a new policy is in use) or error (rejected; the last good policy stays).",
	}, []string{"result"})
	w.lastOK = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: "leasebucket", Subsystem: "policy", Name: "last_reload_ok",
		Help: "1 if the policy file on disk is the policy in use, 0 if its last change was rejected.",
	})
	w.reloads.WithLabelValues("ok")
	w.reloads.WithLabelValues("error")
	data, sum, err := w.read()
	if err != nil {
		return nil, err
	}
	s, err := Parse(filename, data)
	if err != nil {
		return nil, err
	}
	w.cur.Store(s)
	w.lastSeen = sum
	w.lastOK.Set(1)
	if opts.Registerer != nil {
		if err := opts.Registerer.Register(w.reloads); err != nil {
			return nil, fmt.Errorf("policy: register metrics: %w", err)
		}
		if err := opts.Registerer.Register(w.lastOK); err != nil {
			opts.Registerer.Unregister(w.reloads)
			return nil, fmt.Errorf("policy: register metrics: %w", err)
		}
	}
	return w, nil
}

// Current is the Set in use. Take it once per request and use that snapshot throughout.
func (w *Watcher) Current() *Set { return w.cur.Load() }

// Start polls the file every interval on its own goroutine until Close.
func (w *Watcher) Start() {
	w.startOnce.Do(func() { go w.run() })
}

func (w *Watcher) run() {
	defer close(w.done)
	t := time.NewTicker(w.opts.Interval)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
			_, _ = w.Reload()
		}
	}
}

// Close stops polling and waits for the goroutine to end. It is safe to call more than once, and
// without Start.
func (w *Watcher) Close() {
	w.closeOnce.Do(func() {
		close(w.stop)
		w.startOnce.Do(func() { close(w.done) }) // never started: nothing to wait for
	})
	<-w.done
}

// Reload checks the file now. It reports whether a new Set was installed, and the error that made
// it keep the current one. A rejection is passed to OnError, logged and counted once per distinct
// content (or read error); checking the same bytes again returns the same error without reporting
// it again. OnChange and OnError run on the caller's goroutine and must not call Reload.
func (w *Watcher) Reload() (changed bool, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	data, sum, err := w.read()
	if err != nil {
		if w.lastRead != nil && w.lastRead.Error() == err.Error() {
			return false, w.lastErr // the same read error as last time: already reported
		}
		w.lastRead = err
		return false, w.reject(err)
	}
	if w.lastRead == nil && sum == w.lastSeen {
		return false, w.lastErr
	}
	w.lastSeen, w.lastRead = sum, nil
	s, err := Parse(w.file, data)
	if err != nil {
		return false, w.reject(err)
	}
	old := w.cur.Load()
	if s.Digest() == old.Digest() {
		w.lastOK.Set(1) // reformatted or commented: same policy, nothing to swap
		w.lastErr = nil
		return false, nil
	}
	if s.Version() == old.Version() {
		return false, w.reject(fmt.Errorf("%w: %s still says version %q (digest %s, was %s): bump the version",
			ErrVersionUnchanged, w.file, s.Version(), short(s.Digest()), short(old.Digest())))
	}
	w.cur.Store(s)
	w.lastErr = nil
	w.reloads.WithLabelValues("ok").Inc()
	w.lastOK.Set(1)
	w.log.Info("policy reloaded", zap.String("file", w.file),
		zap.String("old_version", old.Version()), zap.String("version", s.Version()),
		zap.String("digest", s.Digest()))
	if w.opts.OnChange != nil {
		w.opts.OnChange(old, s)
	}
	return true, nil
}

// Err is why the file on disk is not the policy in use (for health and debug endpoints), or nil.
func (w *Watcher) Err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lastErr
}

func (w *Watcher) reject(err error) error {
	w.lastErr = err
	w.reloads.WithLabelValues("error").Inc()
	w.lastOK.Set(0)
	w.log.Error("policy reload rejected; keeping the last good policy", zap.String("file", w.file),
		zap.String("version_in_use", w.cur.Load().Version()), zap.Error(err))
	if w.opts.OnError != nil {
		w.opts.OnError(err)
	}
	return err
}

func (w *Watcher) read() ([]byte, [sha256.Size]byte, error) {
	var sum [sha256.Size]byte
	f, err := os.Open(w.file)
	if err != nil {
		return nil, sum, fmt.Errorf("policy: %w", err)
	}
	defer func() { _ = f.Close() }() // read only: nothing to lose
	var buf bytes.Buffer
	if _, err := io.Copy(&buf, io.LimitReader(f, MaxFileSize+1)); err != nil {
		return nil, sum, fmt.Errorf("policy: read %s: %w", w.file, err)
	}
	return buf.Bytes(), sha256.Sum256(buf.Bytes()), nil
}
