package audit_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"go.uber.org/zap/zapcore"

	"github.com/leasebucket/leasebucket/agent/audit"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder is a Sink that keeps what it is given; while gate is not nil, Write waits on it.
type recorder struct {
	mu      sync.Mutex
	records []audit.Record
	gate    chan struct{}
	entered chan struct{} // signalled when a Write starts
}

func (r *recorder) Write(rec *audit.Record) error {
	if r.entered != nil {
		select {
		case r.entered <- struct{}{}:
		default:
		}
	}
	if r.gate != nil {
		<-r.gate
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.records = append(r.records, *rec)
	return nil
}

func (r *recorder) Sync() error { return nil }

func (r *recorder) all() []audit.Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]audit.Record(nil), r.records...)
}

func newQueue(t testing.TB, cfg audit.Config) (*audit.Queue, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	if cfg.Clock == nil {
		cfg.Clock = clock.NewManual(0)
	}
	q, err := audit.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = q.Close(context.Background()) })
	return q, reg
}

func counter(t testing.TB, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	next:
		for _, m := range f.Metric {
			for _, l := range m.Label {
				if labels[l.GetName()] != l.GetValue() {
					continue next
				}
			}
			if m.Counter != nil {
				return m.Counter.GetValue()
			}
			return m.Gauge.GetValue()
		}
	}
	return 0
}

func ev(decision string, i int) audit.Event {
	return audit.Event{API: "check", Decision: decision, Rule: "r", Tenant: fmt.Sprint(i)}
}

// TestHighPriorityWins: with the writer stopped, a full queue of sampled allows makes room for
// each deny by evicting the oldest allow; a full queue of denies refuses both kinds. The writer
// then writes the denies first. Every drop is counted by priority and reason.
func TestHighPriorityWins(t *testing.T) {
	rec := &recorder{}
	q, reg := newQueue(t, audit.Config{Capacity: 4, SampleAllow: 1, Sink: rec})
	for i := range 4 {
		if !q.Offer(ev("allow", i), audit.Sampled) {
			t.Fatalf("allow %d refused by an empty queue", i)
		}
	}
	if q.Offer(ev("allow", 4), audit.Sampled) {
		t.Fatal("a sampled allow was queued into a full queue")
	}
	for i := range 3 {
		if !q.Offer(ev("deny", i), audit.High) {
			t.Fatalf("deny %d refused while sampled allows were queued", i)
		}
	}
	// One allow (3, the newest) and three denies are queued; one more deny evicts it.
	if !q.Offer(ev("deny", 3), audit.High) {
		t.Fatal("deny 3 refused while an allow was queued")
	}
	if q.Offer(ev("deny", 4), audit.High) || q.Offer(ev("allow", 5), audit.Sampled) {
		t.Fatal("an event was queued into a queue full of denies")
	}
	for _, c := range []struct {
		priority, reason string
		want             float64
	}{{"sampled", "evicted", 4}, {"sampled", "queue_full", 2}, {"high", "queue_full", 1}} {
		if got := counter(t, reg, "leasebucket_agent_audit_dropped_total", map[string]string{"priority": c.priority, "reason": c.reason}); got != c.want {
			t.Errorf("dropped{%s,%s} = %v, want %v", c.priority, c.reason, got, c.want)
		}
	}
	if got := counter(t, reg, "leasebucket_agent_audit_queue_length", nil); got != 4 {
		t.Errorf("queue length %v, want 4", got)
	}
	q.Start()
	if err := q.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range rec.all() {
		got = append(got, r.Decision+r.Tenant)
	}
	if fmt.Sprint(got) != "[deny0 deny1 deny2 deny3]" {
		t.Fatalf("written %v, want the four denies", got)
	}
	if w := counter(t, reg, "leasebucket_agent_audit_events_total", map[string]string{"priority": "high"}); w != 4 {
		t.Fatalf("written high %v, want 4", w)
	}
	if q.Offer(ev("deny", 9), audit.High) {
		t.Fatal("an event was queued after Close")
	}
	if got := counter(t, reg, "leasebucket_agent_audit_dropped_total", map[string]string{"priority": "high", "reason": "closed"}); got != 1 {
		t.Fatalf("dropped after close %v, want 1", got)
	}
}

// TestOfferNeverBlocks: with the sink stuck, offers keep returning at once: the queue fills,
// then every offer is a counted drop; what was offered is written, dropped or evicted, exactly.
func TestOfferNeverBlocks(t *testing.T) {
	rec := &recorder{gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	q, reg := newQueue(t, audit.Config{Capacity: 64, SampleAllow: 1, Sink: rec})
	q.Start()
	q.Offer(ev("deny", -1), audit.High)
	<-rec.entered // the writer holds one event in the stuck sink
	const goroutines, each = 8, 20_000
	var wg sync.WaitGroup
	start := time.Now()
	for g := range goroutines {
		wg.Go(func() {
			for i := range each {
				if (g+i)%3 == 0 {
					q.Offer(ev("deny", i), audit.High)
				} else {
					q.Offer(ev("allow", i), audit.Sampled)
				}
			}
		})
	}
	wg.Wait()
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("%d offers took %v with the sink stuck", goroutines*each, took)
	}
	close(rec.gate)
	if err := q.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	offered := map[string]float64{"high": 1, "sampled": 0}
	for g := range goroutines {
		for i := range each {
			if (g+i)%3 == 0 {
				offered["high"]++
			} else {
				offered["sampled"]++
			}
		}
	}
	for p, n := range offered {
		written := counter(t, reg, "leasebucket_agent_audit_events_total", map[string]string{"priority": p})
		var dropped float64
		for _, reason := range []string{"queue_full", "evicted", "closed"} {
			dropped += counter(t, reg, "leasebucket_agent_audit_dropped_total", map[string]string{"priority": p, "reason": reason})
		}
		if written+dropped != n {
			t.Errorf("%s: %v written + %v dropped != %v offered", p, written, dropped, n)
		}
		if p == "sampled" && dropped == 0 {
			t.Errorf("no sampled event dropped with the sink stuck")
		}
	}
	if got := len(rec.all()); got > 65 {
		t.Fatalf("%d events written, more than the queue (64) and the one in the sink", got)
	}
}

// TestSample: SampleAllow 0 samples nothing, 1 everything, and 0.25 about a quarter.
func TestSample(t *testing.T) {
	for _, rate := range []float64{0, 0.25, 1} {
		q, _ := newQueue(t, audit.Config{SampleAllow: rate, Sink: &recorder{}})
		const n = 200_000
		hits := 0
		for range n {
			if q.Sample() {
				hits++
			}
		}
		// 6 standard deviations of a binomial: never flaky, still tight.
		tol := 6 * math.Sqrt(n*rate*(1-rate))
		if math.Abs(float64(hits)-n*rate) > tol {
			t.Errorf("rate %v: %d of %d sampled", rate, hits, n)
		}
	}
	var nilQueue *audit.Queue
	if nilQueue.Sample() || nilQueue.Offer(ev("deny", 0), audit.High) {
		t.Fatal("a nil queue (audit off) samples or queues")
	}
	for _, bad := range []float64{-0.1, 1.5, math.NaN()} {
		if _, err := audit.New(audit.Config{SampleAllow: bad, Sink: &recorder{}, Clock: clock.NewManual(0)}); err == nil {
			t.Errorf("sample rate %v accepted", bad)
		}
	}
}

// TestJSONSink: a record is one JSON object per line with every documented field, the template
// (never the raw path), the route's cost when the check gave none, and the wall-clock time of the
// decision.
func TestJSONSink(t *testing.T) {
	set, err := policy.Load("../../examples/policy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	clk := clock.NewManual(clock.Of(time.Hour))
	q, _ := newQueue(t, audit.Config{Sink: audit.NewJSONSink(zapcore.AddSync(&buf), "node-1"), Clock: clk})
	q.Start()
	q.Offer(audit.Event{At: clk.Now() - clock.Of(2*time.Second), API: "envoy", Decision: "deny", Rule: "orders-export", Tenant: "acme",
		RetryAfter: 1500 * time.Microsecond, Policy: set, Path: "/orders?id=q7Zx", Operation: "export"}, audit.High)
	q.Offer(audit.Event{At: clk.Now(), API: "check", Decision: "allow", Rule: "catalog-read", Tenant: "bigcorp", Cost: 2, Remaining: 7,
		Degraded: true, Replayed: true, Policy: set, Path: "/products/sku-991", Operation: "GET"}, audit.High)
	if err := q.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	lines := bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n"))
	if len(lines) != 2 {
		t.Fatalf("%d lines:\n%s", len(lines), buf.String())
	}
	if bytes.Contains(buf.Bytes(), []byte("q7Zx")) || bytes.Contains(buf.Bytes(), []byte("sku-991")) {
		t.Fatalf("the raw path was written:\n%s", buf.String())
	}
	var first, second map[string]any
	if err := errors.Join(json.Unmarshal(lines[0], &first), json.Unmarshal(lines[1], &second)); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"agent_id": "node-1", "api": "envoy", "decision": "deny", "rule": "orders-export", "route": "/orders",
		"operation": "export", "tenant": "acme", "cost": 10.0, "retry_after_ms": 2.0, "remaining": 0.0, "degraded": false,
		"shadow": false, "replayed": false, "priority": "high"}
	for k, v := range want {
		if first[k] != v {
			t.Errorf("%s = %v, want %v", k, first[k], v)
		}
	}
	if len(first) != len(want)+1 {
		t.Errorf("fields %v, want %d", first, len(want)+1)
	}
	ts, err := time.Parse(time.RFC3339Nano, fmt.Sprint(first["ts"]))
	if err != nil || time.Since(ts) < 2*time.Second || time.Since(ts) > time.Minute {
		t.Errorf("ts %v (%v), want about 2 s ago", first["ts"], err)
	}
	for k, v := range map[string]any{"route": "/products/{sku}", "operation": "read", "cost": 2.0, "remaining": 7.0, "degraded": true, "replayed": true} {
		if second[k] != v {
			t.Errorf("second record %s = %v, want %v", k, second[k], v)
		}
	}
}

// TestCloseBounded: Close with a stuck sink gives up at its context's end and counts what it
// could not write.
func TestCloseBounded(t *testing.T) {
	rec := &recorder{gate: make(chan struct{})}
	q, reg := newQueue(t, audit.Config{Capacity: 8, SampleAllow: 1, Sink: rec})
	for i := range 8 {
		q.Offer(ev("deny", i), audit.High)
	}
	q.Start()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- q.Close(ctx) }()
	time.Sleep(200 * time.Millisecond)
	close(rec.gate) // the writer's Write in progress returns; Close must not wait for the rest
	if err := <-done; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Close = %v, want the deadline", err)
	}
	// The write in progress is counted once the writer's Write returns, on the writer's
	// goroutine: wait for it (a second at most) rather than read the counters at once.
	var written, dropped float64
	for deadline := time.Now().Add(time.Second); ; time.Sleep(time.Millisecond) {
		written = counter(t, reg, "leasebucket_agent_audit_events_total", map[string]string{"priority": "high"})
		dropped = counter(t, reg, "leasebucket_agent_audit_dropped_total", map[string]string{"priority": "high", "reason": "closed"})
		if written+dropped >= 8 || time.Now().After(deadline) {
			break
		}
	}
	if written+dropped != 8 || dropped == 0 {
		t.Fatalf("%v written, %v dropped at close, want 8 in all with some dropped", written, dropped)
	}
}

// TestWriterSleeps: offers in bursts with quiet moments between them, long enough for the writer
// to fall asleep (idlePolls empty polls), from several goroutines at once: every event is written
// without Close's drain, so no Offer leaves an event to a writer that sleeps on.
func TestWriterSleeps(t *testing.T) {
	rec := &recorder{}
	q, _ := newQueue(t, audit.Config{Sink: rec, SampleAllow: 1})
	q.Start()
	const writers, bursts, perBurst = 4, 6, 50
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for b := range bursts {
				for i := range perBurst {
					if !q.Offer(ev("deny", (w*bursts+b)*perBurst+i), audit.High) {
						t.Error("an Offer was refused")
						return
					}
				}
				time.Sleep(time.Duration(120+w*37) * time.Millisecond) // beyond 20 polls of 5 ms
			}
		})
	}
	wg.Wait()
	deadline := time.Now().Add(5 * time.Second)
	for n := len(rec.all()); n < writers*bursts*perBurst; n = len(rec.all()) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d events written 5 s after the last Offer: the writer slept on queued events", n, writers*bursts*perBurst)
		}
		time.Sleep(time.Millisecond)
	}
}
