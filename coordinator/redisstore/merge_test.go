package redisstore

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
)

// batchOf is a batch of n calls on keys name/0 .. name/n-1.
func batchOf(name string, n int) []call {
	calls := make([]call, n)
	for i := range calls {
		calls[i] = call{item: i, key: fmt.Sprintf("%s/%d", name, i)}
	}
	return calls
}

// answerKeys answers each call with its own key, as a round trip would with the key's reply.
func answerKeys(calls []call) {
	for i := range calls {
		calls[i].cmd = redis.NewCmdResult(calls[i].key, nil)
	}
}

// checkAnswered fails unless every call of calls holds its own key as its answer.
func checkAnswered(t *testing.T, calls []call) {
	t.Helper()
	for _, c := range calls {
		if c.cmd == nil {
			t.Fatalf("%s: no answer", c.key)
		}
		if v, err := c.cmd.Result(); err != nil || v != c.key {
			t.Fatalf("%s answered %v, %v", c.key, v, err)
		}
	}
}

func keysOf(calls []call) []string {
	keys := make([]string, len(calls))
	for i, c := range calls {
		keys[i] = c.key
	}
	return keys
}

// recorder is a run that records the keys of each round trip and holds the first `hold` of
// them until released.
type recorder struct {
	mu      sync.Mutex
	trips   [][]string
	hold    int
	release chan struct{}
	started chan struct{} // one send per round trip, as it starts
}

func newRecorder(hold int) *recorder {
	return &recorder{hold: hold, release: make(chan struct{}), started: make(chan struct{}, 100)}
}

func (r *recorder) run(_ context.Context, calls []call) {
	r.mu.Lock()
	r.trips = append(r.trips, keysOf(calls))
	n := len(r.trips)
	r.mu.Unlock()
	r.started <- struct{}{}
	if n <= r.hold {
		<-r.release
	}
	answerKeys(calls)
}

func (r *recorder) Trips() [][]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.trips)
}

// waitFor polls cond until it holds, for at most 5 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	proctest.WaitFor(t, 5*time.Second, what, cond)
}

// state is how many round trips are out and how many batches wait.
func (m *merger) state() (out, waiting int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.out, len(m.waiting)
}

func (m *merger) waitingNow() int {
	_, n := m.state()
	return n
}

// starter returns a function that sends the named batch of batches through m on a goroutine of
// wg, and fails the test if it is not answered.
func starter(t *testing.T, m *merger, wg *sync.WaitGroup, batches map[string][]call) func(name string) {
	return func(name string) {
		wg.Go(func() {
			if !m.do(context.Background(), batches[name]) {
				t.Errorf("%s: not answered", name)
			}
		})
	}
}

// TestMergerJoinsWaitingBatches: with one round trip out, the batches that arrive meanwhile wait,
// then go together in one round trip, in arrival order, and each gets its own calls' answers.
func TestMergerJoinsWaitingBatches(t *testing.T) {
	rec := newRecorder(1)
	m := &merger{most: 1, run: rec.run}
	var wg sync.WaitGroup
	batches := map[string][]call{"a": batchOf("a", 2), "b": batchOf("b", 1), "c": batchOf("c", 3), "d": batchOf("d", 2)}
	do := starter(t, m, &wg, batches)
	do("a")
	<-rec.started
	for i, name := range []string{"b", "c", "d"} {
		do(name)
		waitFor(t, name+" waiting", func() bool { return m.waitingNow() == i+1 })
	}
	close(rec.release)
	wg.Wait()
	want := [][]string{{"a/0", "a/1"}, {"b/0", "c/0", "c/1", "c/2", "d/0", "d/1"}}
	if got := rec.Trips(); !slices.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("round trips %v, want %v", got, want)
	}
	for _, calls := range batches {
		checkAnswered(t, calls)
	}
	// The last round trip's place is given back after its callers are answered.
	waitFor(t, "every place given back", func() bool { out, waiting := m.state(); return out == 0 && waiting == 0 })
}

// TestMergerCallerGivesUp: a batch whose caller's context ends while it waits is answered
// false at once and never sent.
func TestMergerCallerGivesUp(t *testing.T) {
	rec := newRecorder(1)
	m := &merger{most: 1, run: rec.run}
	a := batchOf("a", 1)
	var wg sync.WaitGroup
	wg.Go(func() { m.do(context.Background(), a) })
	<-rec.started
	ctx, cancel := context.WithCancel(context.Background())
	gaveUp := make(chan bool)
	go func() { gaveUp <- m.do(ctx, batchOf("b", 2)) }()
	waitFor(t, "b waiting", func() bool { return m.waitingNow() == 1 })
	cancel()
	if <-gaveUp {
		t.Fatal("a batch whose caller gave up while it waited was answered")
	}
	if n := m.waitingNow(); n != 0 {
		t.Fatalf("%d batches still wait after their caller gave up", n)
	}
	close(rec.release)
	wg.Wait()
	c := batchOf("c", 1)
	if !m.do(context.Background(), c) {
		t.Fatal("c not answered")
	}
	want := [][]string{{"a/0"}, {"c/0"}}
	if got := rec.Trips(); !slices.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("round trips %v, want %v: the batch given up was sent", got, want)
	}
	checkAnswered(t, a)
	checkAnswered(t, c)
}

// TestMergerLeaderReturns: the caller whose round trip carried others returns as soon as its own
// batch is answered, while the batches that arrived meanwhile go out without it.
func TestMergerLeaderReturns(t *testing.T) {
	rec := newRecorder(2) // holds a's round trip, then b's
	m := &merger{most: 1, run: rec.run}
	a := batchOf("a", 1)
	aDone := make(chan struct{})
	go func() {
		m.do(context.Background(), a)
		close(aDone)
	}()
	<-rec.started
	bDone := make(chan struct{})
	go func() {
		m.do(context.Background(), batchOf("b", 1))
		close(bDone)
	}()
	waitFor(t, "b waiting", func() bool { return m.waitingNow() == 1 })
	rec.release <- struct{}{} // a's round trip answers
	<-rec.started             // b's goes out
	select {
	case <-aDone:
	case <-time.After(5 * time.Second):
		t.Fatal("a's caller still held while b's round trip is out")
	}
	checkAnswered(t, a)
	close(rec.release)
	<-bDone
}

// TestMergerNoBound: with no bound every batch is its own round trip, side by side.
func TestMergerNoBound(t *testing.T) {
	var in atomic.Int64
	m := &merger{run: func(_ context.Context, calls []call) {
		in.Add(1)
		for deadline := time.Now().Add(5 * time.Second); in.Load() < 2; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Error("one round trip out alone for 5 s: the other waited for it")
				break
			}
		}
		answerKeys(calls)
	}}
	a, b := batchOf("a", 1), batchOf("b", 1)
	var wg sync.WaitGroup
	wg.Go(func() { m.do(context.Background(), a) })
	wg.Go(func() { m.do(context.Background(), b) })
	wg.Wait()
	checkAnswered(t, a)
	checkAnswered(t, b)
}

// TestMergerUnderLoad: many callers at once never have more round trips out than the bound, nor
// more calls in one than joinKeys (batches of at most 5 calls), and every call is answered with
// its own answer, once.
func TestMergerUnderLoad(t *testing.T) {
	const most, joinKeys, callers, each = 2, 8, 32, 100
	var out, peak, trips, sent atomic.Int64
	run := func(_ context.Context, calls []call) {
		n := out.Add(1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		if len(calls) > joinKeys {
			t.Errorf("a round trip of %d calls, bound %d", len(calls), joinKeys)
		}
		trips.Add(1)
		sent.Add(int64(len(calls)))
		if rand.IntN(4) == 0 {
			time.Sleep(time.Duration(rand.IntN(200)) * time.Microsecond)
		}
		answerKeys(calls)
		out.Add(-1)
	}
	m := &merger{most: most, joinKeys: joinKeys, run: run}
	var wg sync.WaitGroup
	for c := range callers {
		wg.Go(func() {
			for i := range each {
				calls := batchOf(fmt.Sprintf("%d.%d", c, i), 1+rand.IntN(5))
				if !m.do(context.Background(), calls) {
					t.Error("not answered")
					return
				}
				checkAnswered(t, calls)
			}
		})
	}
	wg.Wait()
	if p := peak.Load(); p > most {
		t.Fatalf("%d round trips out at once, bound %d", p, most)
	}
	if trips.Load() >= callers*each {
		t.Errorf("%d round trips for %d batches: none joined another", trips.Load(), callers*each)
	}
	t.Logf("%d batches (%d calls) in %d round trips, at most %d out at once", callers*each, sent.Load(), trips.Load(), peak.Load())
}

// TestJoinContexts: a round trip lasts until the last deadline of its batches (none if one has
// none), and one caller giving up does not end it.
func TestJoinContexts(t *testing.T) {
	now := time.Now()
	early, cancelEarly := context.WithDeadline(context.Background(), now.Add(time.Second))
	late, cancelLate := context.WithDeadline(context.Background(), now.Add(time.Minute))
	defer cancelLate()
	p := func(ctx context.Context) *pending { return &pending{ctx: ctx} }

	ctx, cancel := joinContexts([]*pending{p(early), p(late)})
	defer cancel()
	if d, ok := ctx.Deadline(); !ok || !d.Equal(now.Add(time.Minute)) {
		t.Fatalf("deadline %v %v, want the later one", d, ok)
	}
	cancelEarly()
	if ctx.Err() != nil {
		t.Fatal("the round trip ended with one of its callers")
	}
	none, cancelNone := joinContexts([]*pending{p(late), p(context.Background())})
	defer cancelNone()
	if d, ok := none.Deadline(); ok {
		t.Fatalf("deadline %v, want none: a batch had none", d)
	}
}

// TestMergerJoinKeys: a joined round trip takes the batches waiting in arrival order, whole, while
// they fit in joinKeys calls; the rest go in the next.
func TestMergerJoinKeys(t *testing.T) {
	rec := newRecorder(3) // holds the first three round trips
	m := &merger{most: 2, joinKeys: 4, run: rec.run}
	var wg sync.WaitGroup
	batches := map[string][]call{
		"a": batchOf("a", 1), "b": batchOf("b", 1), // hold both places
		"c": batchOf("c", 3), "d": batchOf("d", 1), "e": batchOf("e", 2), "f": batchOf("f", 5),
	}
	do := starter(t, m, &wg, batches)
	do("a")
	<-rec.started
	do("b")
	<-rec.started
	for i, name := range []string{"c", "d", "e", "f"} {
		do(name)
		waitFor(t, name+" waiting", func() bool { return m.waitingNow() == i+1 })
	}
	rec.release <- struct{}{} // a place frees: c and d (4 calls) go, e and f wait
	<-rec.started
	waitFor(t, "e and f waiting", func() bool { return m.waitingNow() == 2 })
	close(rec.release) // both places free: e goes, and f (more than 4 calls) alone
	wg.Wait()
	waitFor(t, "every place given back", func() bool { out, waiting := m.state(); return out == 0 && waiting == 0 })
	trips := rec.Trips()
	if len(trips) != 5 || !slices.Equal(trips[2], []string{"c/0", "c/1", "c/2", "d/0"}) {
		t.Fatalf("round trips %v, want a and b, then c and d together, then e and f", trips)
	}
	last := [][]string{trips[3], trips[4]}
	slices.SortFunc(last, func(x, y []string) int { return len(x) - len(y) })
	if want := [][]string{{"e/0", "e/1"}, {"f/0", "f/1", "f/2", "f/3", "f/4"}}; !slices.EqualFunc(last, want, slices.Equal) {
		t.Fatalf("round trips %v, want e and f apart after c and d", trips)
	}
	for _, calls := range batches {
		checkAnswered(t, calls)
	}
}
