package policy

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// watchPolicy renders a small policy: version, the orders limit and the writes limit.
func watchPolicy(version string, ordersPerMin, writesPerMin int) string {
	return fmt.Sprintf(`version: %s
default: {limit: 10/minute}
rules:
  - name: orders
    routes: [/orders, "/orders/{id}"]
    operations: [read]
    limit: %d/minute
    burst: 20
  - name: writes
    routes: [/orders]
    operations: [write]
    limit: %d/minute
    burst: 5
    on_failure: deny
`, version, ordersPerMin, writesPerMin)
}

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	// Write then rename, as deployment tools do, so a reader never sees half a file.
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

type recorder struct {
	mu      sync.Mutex
	changes [][2]string // old, new versions
	errs    []error
}

func (r *recorder) onChange(old, new *Set) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.changes = append(r.changes, [2]string{old.Version(), new.Version()})
}

func (r *recorder) onError(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, err)
}

func (r *recorder) counts() (changes, errs int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.changes), len(r.errs)
}

func newTestWatcher(t *testing.T, content string) (*Watcher, string, *recorder, *prometheus.Registry) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "policy.yaml")
	writeFile(t, path, content)
	rec := &recorder{}
	reg := prometheus.NewRegistry()
	w, err := NewWatcher(path, WatchOptions{
		Interval:   time.Hour, // tests call Reload; TestWatcherPolls covers polling
		Logger:     zaptest.NewLogger(t),
		Registerer: reg,
		OnChange:   rec.onChange,
		OnError:    rec.onError,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.Close)
	return w, path, rec, reg
}

func keyOf(t *testing.T, s *Set, rule, tmpl, op string) string {
	t.Helper()
	r, ok := s.Lookup(rule, tmpl, op)
	if !ok {
		t.Fatalf("Lookup(%s, %s, %s) failed", rule, tmpl, op)
	}
	k, err := s.Key(r, "acme", "")
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestWatcherReload(t *testing.T) {
	w, path, rec, _ := newTestWatcher(t, watchPolicy("v1", 100, 30))
	v1 := w.Current()
	if v1.Version() != "v1" {
		t.Fatalf("Current().Version() = %q", v1.Version())
	}
	reloads := w.reloads

	// Unchanged bytes: nothing to do.
	if changed, err := w.Reload(); changed || err != nil {
		t.Errorf("Reload() of the same file = %v, %v; want false, nil", changed, err)
	}

	// A new version changing only the writes rule: the orders keys stay, the writes key changes.
	writeFile(t, path, watchPolicy("v2", 100, 60))
	if changed, err := w.Reload(); !changed || err != nil {
		t.Fatalf("Reload() of v2 = %v, %v; want true, nil", changed, err)
	}
	v2 := w.Current()
	if v2.Version() != "v2" {
		t.Fatalf("Current().Version() = %q, want v2", v2.Version())
	}
	for _, tmpl := range []string{"/orders", "/orders/{id}"} {
		if a, b := keyOf(t, v1, "orders", tmpl, "read"), keyOf(t, v2, "orders", tmpl, "read"); a != b {
			t.Errorf("unchanged rule's key changed: %s → %s", a, b)
		}
	}
	if a, b := keyOf(t, v1, "writes", "/orders", "write"), keyOf(t, v2, "writes", "/orders", "write"); a == b {
		t.Errorf("changed rule kept its key %s", a)
	}

	// A broken file keeps the last good policy and is reported once.
	writeFile(t, path, strings.Replace(watchPolicy("v3", 100, 60), "burst: 20", "burst: -1", 1))
	changed, err := w.Reload()
	var pe *ParseError
	if changed || !errors.As(err, &pe) || !strings.Contains(err.Error(), path+":8: rules[0].burst: -1 must be at least 1") {
		t.Errorf("Reload() of a broken file = %v, %v; want a ParseError at line 8", changed, err)
	}
	if w.Current() != v2 {
		t.Error("a broken file replaced the policy")
	}
	if got := value(t, reloads.WithLabelValues("error")); got != 1 {
		t.Errorf("error reloads = %v, want 1", got)
	}
	if got := value(t, w.lastOK); got != 0 {
		t.Errorf("last_reload_ok = %v, want 0", got)
	}
	if _, err2 := w.Reload(); !errors.Is(err2, err) || !errors.Is(w.Err(), err) {
		t.Errorf("second Reload() of the same broken file = %v (Err() %v), want the same error %v", err2, w.Err(), err)
	}
	if got := value(t, reloads.WithLabelValues("error")); got != 1 {
		t.Errorf("error reloads after a repeat = %v, want still 1", got)
	}

	// New content under the same version is rejected: equal versions must mean equal content.
	writeFile(t, path, watchPolicy("v2", 100, 90))
	if changed, err := w.Reload(); changed || !errors.Is(err, ErrVersionUnchanged) {
		t.Errorf("Reload() with an unchanged version = %v, %v; want ErrVersionUnchanged", changed, err)
	}
	if w.Current() != v2 {
		t.Error("content under an unchanged version replaced the policy")
	}

	// Reformatting and comments do not change the policy, and clear the error state.
	writeFile(t, path, "# reformatted\n"+strings.ReplaceAll(watchPolicy("v2", 100, 60), "burst: ", "burst:    "))
	if changed, err := w.Reload(); changed || err != nil {
		t.Errorf("Reload() of a reformatted file = %v, %v; want false, nil", changed, err)
	}
	if got := value(t, w.lastOK); got != 1 || w.Err() != nil {
		t.Errorf("last_reload_ok = %v, Err() = %v after the good file is back, want 1 and nil", got, w.Err())
	}

	// A missing file keeps the policy.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if changed, err := w.Reload(); changed || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Reload() of a missing file = %v, %v; want os.ErrNotExist", changed, err)
	}
	if changed, err := w.Reload(); changed || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("second Reload() of a missing file = %v, %v; want os.ErrNotExist again", changed, err)
	}
	if w.Current() != v2 {
		t.Error("a missing file replaced the policy")
	}

	// A version bump alone is a change (agents and coordinators compare versions); keys stay.
	writeFile(t, path, watchPolicy("v4", 100, 60))
	if changed, err := w.Reload(); !changed || err != nil {
		t.Errorf("Reload() of v4 = %v, %v; want true, nil", changed, err)
	}
	if a, b := keyOf(t, v2, "writes", "/orders", "write"), keyOf(t, w.Current(), "writes", "/orders", "write"); a != b {
		t.Errorf("a version bump changed a key: %s → %s", a, b)
	}

	changes, errs := rec.counts()
	if changes != 2 || errs != 3 {
		t.Errorf("OnChange called %d times, OnError %d times; want 2 and 3", changes, errs)
	}
	if rec.changes[0] != [2]string{"v1", "v2"} || rec.changes[1] != [2]string{"v2", "v4"} {
		t.Errorf("OnChange got %v", rec.changes)
	}
	if got := value(t, reloads.WithLabelValues("ok")); got != 2 {
		t.Errorf("ok reloads = %v, want 2", got)
	}
}

func TestWatcherMetricsRegistered(t *testing.T) {
	_, _, _, reg := newTestWatcher(t, watchPolicy("v1", 100, 30))
	families, err := reg.Gather()
	n := 0
	for _, f := range families {
		if f.GetName() == "leasebucket_policy_reloads_total" || f.GetName() == "leasebucket_policy_last_reload_ok" {
			n += len(f.GetMetric())
		}
	}
	if err != nil || n != 3 {
		t.Errorf("gathered %d series (%v), want 3 (reloads ok, reloads error, last_reload_ok)", n, err)
	}
	// A second watcher on the same registry is an error, not a silent loss of metrics.
	path := filepath.Join(t.TempDir(), "p.yaml")
	writeFile(t, path, watchPolicy("v1", 100, 30))
	if _, err := NewWatcher(path, WatchOptions{Registerer: reg}); err == nil {
		t.Error("a second watcher registered on the same registry")
	}
}

func TestNewWatcherRejectsInvalidFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "p.yaml")
	writeFile(t, path, "version: v1\n")
	if _, err := NewWatcher(path, WatchOptions{}); err == nil || !strings.Contains(err.Error(), "default: required") {
		t.Errorf("NewWatcher(invalid) = %v, want the parse error", err)
	}
	if _, err := NewWatcher(filepath.Join(t.TempDir(), "missing"), WatchOptions{}); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("NewWatcher(missing) = %v, want os.ErrNotExist", err)
	}
}

func TestWatcherPolls(t *testing.T) {
	path := filepath.Join(t.TempDir(), "p.yaml")
	writeFile(t, path, watchPolicy("v1", 100, 30))
	changed := make(chan string, 4)
	w, err := NewWatcher(path, WatchOptions{Interval: 5 * time.Millisecond,
		OnChange: func(_, s *Set) { changed <- s.Version() }})
	if err != nil {
		t.Fatal(err)
	}
	w.Start()
	w.Start() // idempotent
	writeFile(t, path, watchPolicy("v2", 100, 30))
	select {
	case v := <-changed:
		if v != "v2" {
			t.Errorf("OnChange with %s, want v2", v)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the watcher did not pick up the change")
	}
	w.Close()
	w.Close() // idempotent
}

func TestWatcherCloseWithoutStart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "p.yaml")
	writeFile(t, path, watchPolicy("v1", 100, 30))
	w, err := NewWatcher(path, WatchOptions{})
	if err != nil {
		t.Fatal(err)
	}
	w.Close()
	w.Start() // after Close: does nothing
	w.Close()
}

// TestWatcherConcurrentReads reloads while readers resolve requests; run with -race.
func TestWatcherConcurrentReads(t *testing.T) {
	path := filepath.Join(t.TempDir(), "p.yaml")
	writeFile(t, path, watchPolicy("v0", 100, 30))
	w, err := NewWatcher(path, WatchOptions{Interval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	w.Start()
	defer w.Close()

	var (
		stop    atomic.Bool
		wg      sync.WaitGroup
		checked atomic.Int64
	)
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; !stop.Load(); i++ {
				s := w.Current() // one snapshot per request
				r, err := s.Match(fmt.Sprintf("/orders/%d", i), []string{"GET", "POST"}[(i+g)%2])
				if err != nil {
					t.Error(err)
					return
				}
				l, err := s.Limits(r, "acme", "")
				if err != nil {
					t.Error(err)
					return
				}
				want := int64(100 + 10*parseVersion(s.Version()))
				if r.Rule.Name == "orders" && l.Requests != want {
					t.Errorf("version %s serves %d/min, want %d: a snapshot mixed two policies", s.Version(), l.Requests, want)
					return
				}
				if _, err := s.Key(r, "acme", ""); err != nil {
					t.Error(err)
					return
				}
				checked.Add(1)
			}
		}()
	}
	for v := 1; v <= 30; v++ {
		writeFile(t, path, watchPolicy(fmt.Sprintf("v%d", v), 100+10*v, 30))
		if _, err := w.Reload(); err != nil {
			t.Fatal(err)
		}
		if v%10 == 0 { // a broken file now and then; the poller may see it first
			writeFile(t, path, "version: broken\n")
			_, _ = w.Reload()
			if got, want := w.Current().Version(), fmt.Sprintf("v%d", v); got != want {
				t.Fatalf("after a broken file the version is %s, want %s", got, want)
			}
		}
	}
	stop.Store(true)
	wg.Wait()
	if w.Current().Version() != "v30" {
		t.Errorf("final version %s, want v30", w.Current().Version())
	}
	if checked.Load() == 0 {
		t.Error("readers checked nothing")
	}
}

// value reads a counter or gauge.
func value(t *testing.T, m prometheus.Metric) float64 {
	t.Helper()
	var d dto.Metric
	if err := m.Write(&d); err != nil {
		t.Fatal(err)
	}
	if d.Counter != nil {
		return d.Counter.GetValue()
	}
	return d.Gauge.GetValue()
}

func parseVersion(v string) int {
	var n int
	fmt.Sscanf(v, "v%d", &n)
	return n
}
