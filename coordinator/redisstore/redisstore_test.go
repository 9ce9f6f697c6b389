package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/policy"
)

var _ coordinator.Store = (*redisstore.Store)(nil)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const tok = bucket.PerToken

func ctx(t testing.TB) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

func mustLimit(t testing.TB, capacity, amount bucket.Micro, period bucket.Millis) bucket.Limit {
	t.Helper()
	l, err := bucket.NewLimit(capacity, amount, period)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestConformance(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	storetest.Run(t, func(t *testing.T, clock func() bucket.Millis) coordinator.Store {
		if err := rdb.FlushAll(ctx(t)).Err(); err != nil {
			t.Fatal(err)
		}
		return redisstore.New(rdb, redisstore.WithClock(clock))
	})
}

// TestKeyLayout checks the hash the script writes: integer fields in decimal, one record per agent
// and kind, and a hash small enough for Redis' compact listpack encoding.
func TestKeyLayout(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	now := bucket.Millis(1_700_000_000_000)
	s := redisstore.New(rdb, redisstore.WithClock(func() bucket.Millis { return now }))
	l := mustLimit(t, 1<<51+12345, 1<<40+1, 4095) // values near 2^52, beyond %.14g
	take := coordinator.TakeRequest{Key: "k", Limit: l, Want: 1<<50 + 3, Min: 1, Op: coordinator.OpID{Agent: "agent-1", Seq: 1<<53 - 1}}
	if res, err := s.Take(ctx(t), []coordinator.TakeRequest{take}); err != nil || res[0].Err != nil {
		t.Fatalf("Take: %v %v", err, res)
	}
	now += 3
	ret := coordinator.ReturnRequest{Key: "k", Limit: l, Amount: 5, GrantedAt: now - 3, Op: coordinator.OpID{Agent: "agent-1", Seq: 2}}
	if res, err := s.Return(ctx(t), []coordinator.ReturnRequest{ret}); err != nil || res[0].Err != nil {
		t.Fatalf("Return: %v %v", err, res)
	}
	got, err := rdb.HGetAll(ctx(t), "k").Result()
	if err != nil {
		t.Fatal(err)
	}
	// The same operations on internal/bucket give the values the hash must hold.
	st := bucket.Full(l, now-3)
	tr := st.Take(l, now-3, take.Want, take.Min)
	rr := st.Return(l, now, ret.Amount, ret.GrantedAt)
	ttf, _ := st.TimeToFull(l)
	d := func(v int64) string { return strconv.FormatInt(v, 10) }
	want := map[string]string{
		"t":         d(int64(st.Tokens)),
		"l":         d(int64(now)),
		"f":         d(st.Frac),
		"x":         d(int64(now + ttf + coordinator.ExpiryMargin)),
		"a:agent-1": "9007199254740991 " + d(int64(tr.Granted)) + " " + d(int64(tr.Remaining)) + " 0 0 0 0 0 " + d(int64(now-3)),
		"r:agent-1": "2 " + d(int64(rr.Granted)) + " " + d(int64(rr.Remaining)) + " " + d(int64(now)),
	}
	if st.Tokens < 1<<50 || ttf <= 0 {
		t.Fatalf("test values too small: tokens %d, time to full %d", st.Tokens, ttf)
	}
	if !maps.Equal(got, want) {
		t.Fatalf("HGETALL k = %v, want %v", got, want)
	}
	// A typical key (token-sized numbers, short agent ids, a few agents) stays a listpack:
	// Redis' defaults allow 128 fields of at most 64 bytes.
	typical := mustLimit(t, 100*tok, 100*tok, 60_000)
	for i := range 8 {
		agent := coordinator.OpID{Agent: "node-" + strconv.Itoa(i) + ".eu-west-1", Seq: 123456}
		_, err1 := s.Take(ctx(t), []coordinator.TakeRequest{{Key: "typical", Limit: typical, Want: 20 * tok, Min: tok, Op: agent}})
		_, err2 := s.Return(ctx(t), []coordinator.ReturnRequest{{Key: "typical", Limit: typical, Amount: 7 * tok, GrantedAt: now, Op: agent}})
		if err1 != nil || err2 != nil {
			t.Fatal(err1, err2)
		}
	}
	if enc, err := rdb.ObjectEncoding(ctx(t), "typical").Result(); err != nil || enc != "listpack" {
		t.Fatalf("OBJECT ENCODING of a key with 16 records = %q, %v, want listpack", enc, err)
	}
	// An injected clock is not wall time: no Redis TTL.
	if ttl, err := rdb.PTTL(ctx(t), "k").Result(); err != nil || ttl != -1 {
		t.Fatalf("PTTL k with an injected clock = %v, %v, want none (-1)", ttl, err)
	}
}

// TestOlderRecordsReplay checks that take records written before a take record held the debt
// charged (and before it held the credit, pace and demand) still answer their repeat, as taking
// nothing more and charging no debt: a rolling upgrade keeps every retry idempotent.
func TestOlderRecordsReplay(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	now := bucket.Millis(1_700_000_000_000)
	s := redisstore.New(rdb, redisstore.WithClock(func() bucket.Millis { return now }))
	l := mustLimit(t, 10*tok, tok, 100)
	d := func(v int64) string { return strconv.FormatInt(v, 10) }
	at := d(int64(now - 5))
	for _, tc := range []struct {
		record string
		want   coordinator.TakeResult
	}{
		{"7 3000000 7000000 0 2000000 40 5000000 " + at, coordinator.TakeResult{Credited: 2 * tok, Pace: 40}},
		{"7 3000000 7000000 0 2000000 " + at, coordinator.TakeResult{Credited: 2 * tok}},
		{"7 3000000 7000000 0 " + at, coordinator.TakeResult{}},
	} {
		fields := map[string]any{"t": d(int64(7 * tok)), "l": at, "f": 0, "a:agent": tc.record}
		if err := rdb.HSet(ctx(t), "old", fields).Err(); err != nil {
			t.Fatal(err)
		}
		r := coordinator.TakeRequest{Key: "old", Limit: l, Want: 3 * tok, Min: tok, Debt: 5 * tok, MaxDebt: 5 * tok,
			Op: coordinator.OpID{Agent: "agent", Seq: 7}}
		got, err := s.Take(ctx(t), []coordinator.TakeRequest{r})
		if err != nil {
			t.Fatal(err)
		}
		want := tc.want
		want.Result = bucket.Result{Granted: 3 * tok, Remaining: 7 * tok}
		want.Now, want.Replayed = now-5, true
		if got[0] != want {
			t.Fatalf("repeat of a take recorded as %q = %+v, want %+v", tc.record, got[0], want)
		}
		if tokens, err := rdb.HGet(ctx(t), "old", "t").Result(); err != nil || tokens != d(int64(7*tok)) {
			t.Fatalf("the repeat changed the bucket: t = %q, %v", tokens, err)
		}
	}
	// A counter's record of the previous layout ("seq granted remaining retry credited 0 0 now").
	w := bucket.Window{Start: now - 1000, End: now + 1000, Next: now + 3000}
	q := mustLimit(t, 10*tok, 0, 0)
	fields := map[string]any{"t": d(int64(7 * tok)), "l": at, "p": d(int64(w.Start)), "x": d(int64(w.End + coordinator.ExpiryMargin)),
		"a:agent": "7 3000000 7000000 0 0 0 0 " + at}
	if err := rdb.HSet(ctx(t), "oldc", fields).Err(); err != nil {
		t.Fatal(err)
	}
	r := coordinator.TakeRequest{Key: "oldc", Limit: q, Want: 3 * tok, Min: tok, Debt: 5 * tok, Period: w,
		Op: coordinator.OpID{Agent: "agent", Seq: 7}}
	got, err := s.Take(ctx(t), []coordinator.TakeRequest{r})
	if err != nil {
		t.Fatal(err)
	}
	if want := (coordinator.TakeResult{Result: bucket.Result{Granted: 3 * tok, Remaining: 7 * tok}, Now: now - 5, Replayed: true}); got[0] != want {
		t.Fatalf("repeat of a counter's take recorded in the previous layout = %+v, want %+v", got[0], want)
	}
}

// TestRealClock checks Redis TIME as the clock and the PEXPIRE that lets Redis drop idle keys.
func TestRealClock(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	s := redisstore.New(rdb)
	l := mustLimit(t, 10*tok, tok, 100) // full again 100 ms after a one-token take
	before := bucket.Millis(time.Now().UnixMilli())
	res, err := s.Take(ctx(t), []coordinator.TakeRequest{{Key: "k", Limit: l, Want: tok, Min: tok}})
	if err != nil || res[0].Err != nil {
		t.Fatalf("Take: %v %v", err, res)
	}
	after := bucket.Millis(time.Now().UnixMilli())
	if res[0].Now < before-1000 || res[0].Now > after+1000 {
		t.Fatalf("Now = %d, want Redis TIME, near the wall clock [%d, %d]", res[0].Now, before, after)
	}
	pttl, err := rdb.PTTL(ctx(t), "k").Result()
	if err != nil {
		t.Fatal(err)
	}
	hi := time.Duration(100+coordinator.ExpiryMargin) * time.Millisecond
	if pttl > hi || pttl < hi-5*time.Second {
		t.Fatalf("PTTL after a Take = %v, want about time to full + ExpiryMargin = %v", pttl, hi)
	}

	// A bucket that never refills: no TTL once not full; ExpiryMargin while full.
	margin := time.Duration(coordinator.ExpiryMargin) * time.Millisecond
	once := mustLimit(t, 3*tok, 0, 0)
	res, err = s.Take(ctx(t), []coordinator.TakeRequest{
		{Key: "full", Limit: once, Want: 4 * tok, Min: 4 * tok}, // denied: stays full
		{Key: "once", Limit: once, Want: 4 * tok, Min: 4 * tok},
		{Key: "once", Limit: once, Want: tok, Min: tok},
	})
	if err != nil || res[0].Err != nil || res[2].Err != nil || res[2].Granted != tok {
		t.Fatalf("Take: %v %v", err, res)
	}
	if pttl, err := rdb.PTTL(ctx(t), "full").Result(); err != nil || pttl > margin || pttl < margin-5*time.Second {
		t.Fatalf("PTTL of a full bucket that never refills = %v, %v, want about %v", pttl, err, margin)
	}
	if pttl, err := rdb.PTTL(ctx(t), "once").Result(); err != nil || pttl != -1 {
		t.Fatalf("PTTL of a used bucket that never refills = %v, %v, want none (-1)", pttl, err)
	}
	if x, err := rdb.HExists(ctx(t), "once", "x").Result(); err != nil || x {
		t.Fatalf("HEXISTS once x = %v, %v, want false", x, err)
	}
}

// TestCommandsPerTake: a take on a key that holds the agent's record already runs HMGET, HSET and
// PEXPIRE and nothing else on the key (the batch adds TIME once); records are counted (HLEN) only
// when one is added to a key that held state.
func TestCommandsPerTake(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	s := redisstore.New(rdb)
	l := mustLimit(t, 100*tok, tok, 10) // 100 a second
	batch := func(agent string, seq uint64, keys ...string) {
		t.Helper()
		reqs := make([]coordinator.TakeRequest, len(keys))
		for i, k := range keys {
			reqs[i] = coordinator.TakeRequest{Key: k, Limit: l, Want: tok, Min: tok, Op: coordinator.OpID{Agent: agent, Seq: seq}}
		}
		res, err := s.Take(ctx(t), reqs)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range res {
			if r.Err != nil || r.Granted != tok {
				t.Fatalf("Take: %+v", r)
			}
		}
	}
	calls := func() map[string]float64 {
		t.Helper()
		out := map[string]float64{}
		for cmd, c := range commandStats(t, rdb) {
			out[cmd] = c.Calls
		}
		return out
	}
	batch("a", 1, "k1", "k2") // creates both keys and a's records: no HLEN either, as they were new
	if n := calls()["hlen"]; n != 0 {
		t.Fatalf("HLEN ran %v times creating keys", n)
	}
	if err := rdb.ConfigResetStat(ctx(t)).Err(); err != nil {
		t.Fatal(err)
	}
	for seq := uint64(2); seq <= 11; seq++ {
		batch("a", seq, "k1", "k2")
	}
	got := calls()
	for cmd, want := range map[string]float64{"hmget": 20, "hset": 20, "pexpire": 20, "time": 10, "hlen": 0, "hgetall": 0} {
		if got[cmd] != want {
			t.Errorf("%s ran %v times in 10 batches of 2 takes on keys holding the agent's record, want %v (all: %v)", cmd, got[cmd], want, got)
		}
	}
	batch("b", 1, "k1") // a new record on a key that held state: counted
	if n := calls()["hlen"]; n != 1 {
		t.Errorf("HLEN ran %v times after a record was added to a key, want 1", n)
	}
}

// tripCounter counts round trips (pipelines and single script commands) and script loads per node
// address.
type tripCounter struct {
	mu    sync.Mutex
	trips map[string]int
	loads int
}

func newTripCounter() *tripCounter { return &tripCounter{trips: map[string]int{}} }

// countedStore is a Store on a fresh redis-server (srv's address is where counter counts), its
// client, and a counter of its round trips and script loads.
func countedStore(tb testing.TB) (*redisstore.Store, *redis.Client, *tripCounter, string) {
	srv := redistest.Start(tb)
	rdb := srv.Client(tb)
	counter := newTripCounter()
	rdb.AddHook(counter.hook(srv.Addr()))
	return redisstore.New(rdb), rdb, counter, srv.Addr()
}

func (c *tripCounter) hook(addr string) redis.Hook { return counterHook{c, addr} }

// reset returns the counts so far and starts again from zero.
func (c *tripCounter) reset() (trips map[string]int, loads int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	trips, loads = c.trips, c.loads
	c.trips, c.loads = map[string]int{}, 0
	return trips, loads
}

type counterHook struct {
	c    *tripCounter
	addr string
}

func (h counterHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h counterHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.c.mu.Lock()
		switch cmd.Name() {
		case "script":
			h.c.loads++
		case "evalsha", "eval":
			h.c.trips[h.addr]++
		}
		h.c.mu.Unlock()
		return next(ctx, cmd)
	}
}

func (h counterHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.c.mu.Lock()
		h.c.trips[h.addr]++
		h.c.mu.Unlock()
		return next(ctx, cmds)
	}
}

// TestNoScriptCostsOneExtraRoundTripOnce flushes the script cache: the next batch loads the script
// and resends only the failed commands; the batch after it is one round trip again. Nothing is
// charged twice. A batch of one is a single command rather than a pipeline, with the same rule.
func TestNoScriptCostsOneExtraRoundTripOnce(t *testing.T) {
	s, rdb, counter, addr := countedStore(t)
	l := mustLimit(t, 100*tok, 0, 0)
	for _, n := range []int{3, 1} {
		var batch []coordinator.TakeRequest
		for i := range n {
			key := strconv.Itoa(n) + "-" + strconv.Itoa(i)
			batch = append(batch, coordinator.TakeRequest{Key: key, Limit: l, Want: tok, Min: tok})
		}
		// Warm up: the first pipeline also opens a connection, whose handshake is a pipeline too.
		if _, err := s.Take(ctx(t), batch); err != nil {
			t.Fatal(err)
		}
		for i, tc := range []struct {
			flush       bool
			trips, load int
		}{{true, 2, 1}, {false, 1, 0}, {true, 2, 1}, {false, 1, 0}} {
			if tc.flush {
				if err := rdb.ScriptFlush(ctx(t)).Err(); err != nil {
					t.Fatal(err)
				}
			}
			counter.reset()
			res, err := s.Take(ctx(t), batch)
			if err != nil {
				t.Fatalf("batch of %d, %d: %v", n, i, err)
			}
			for j, r := range res {
				if r.Err != nil || r.Granted != tok || r.Remaining != bucket.Micro(98-i)*tok {
					t.Fatalf("batch of %d, %d, item %d: %s, want one token granted, %d left", n, i, j, storetest.TakeResultString(r), 98-i)
				}
			}
			trips, loads := counter.reset()
			if trips[addr] != tc.trips || loads != tc.load {
				t.Fatalf("batch of %d, %d (script flushed: %v): %d round trips and %d loads, want %d and %d",
					n, i, tc.flush, trips[addr], loads, tc.trips, tc.load)
			}
		}
	}
}

// TestNoScriptMultiReturn: a return to several buckets is a multi.lua call of its own; after a
// flush of the script cache it loads the script and is resent once, crediting each bucket once.
func TestNoScriptMultiReturn(t *testing.T) {
	s, rdb, counter, addr := countedStore(t)
	l := mustLimit(t, 100*tok, 0, 0) // never refills: nothing decays between the calls
	also := []coordinator.Bucket{{Key: "b", Limit: l}}
	for i, flush := range []bool{true, false} {
		take := coordinator.TakeRequest{Key: "a", Limit: l, Want: 5 * tok, Min: 5 * tok, Also: also}
		res, err := s.Take(ctx(t), []coordinator.TakeRequest{take})
		if err != nil || res[0].Err != nil || res[0].Granted != 5*tok {
			t.Fatalf("take %d: %v %+v", i, err, res)
		}
		if flush {
			if err := rdb.ScriptFlush(ctx(t)).Err(); err != nil {
				t.Fatal(err)
			}
		}
		counter.reset()
		back := coordinator.ReturnRequest{Key: "a", Limit: l, Amount: 5 * tok, GrantedAt: res[0].Now, Also: also,
			Op: coordinator.OpID{Agent: "agent", Seq: uint64(i + 1)}}
		got, err := s.Return(ctx(t), []coordinator.ReturnRequest{back})
		if err != nil || got[0].Err != nil || got[0].Granted != 10*tok || got[0].Remaining != 100*tok || got[0].Replayed {
			t.Fatalf("return %d: %v %+v, want 5 tokens credited to each bucket", i, err, got)
		}
		trips, loads := counter.reset()
		if want := map[bool]int{true: 2, false: 1}[flush]; trips[addr] != want || loads != map[bool]int{true: 1}[flush] {
			t.Fatalf("return %d (script flushed: %v): %d round trips and %d loads", i, flush, trips[addr], loads)
		}
		for _, k := range []string{"a", "b"} {
			if got, err := rdb.HGet(ctx(t), k, "t").Int64(); err != nil || got != int64(100*tok) {
				t.Fatalf("after return %d %s holds %d µ (%v), want %d", i, k, got, err, 100*tok)
			}
		}
	}
}

// TestWholeBatchFailure: an unreachable or hung Redis fails the batch, not its items.
func TestWholeBatchFailure(t *testing.T) {
	srv := redistest.Start(t)
	o := srv.Options()
	o.MaxRetries, o.ContextTimeoutEnabled, o.DialerRetries = -1, true, 1
	rdb := redis.NewClient(o)
	defer rdb.Close()
	s := redisstore.New(rdb)
	l := mustLimit(t, 10*tok, tok, 100)
	reqs := []coordinator.TakeRequest{{Key: "a", Limit: l, Want: tok, Min: tok}, {Key: "b", Limit: l, Want: tok, Min: tok}}
	if err := s.Load(ctx(t)); err != nil {
		t.Fatal(err)
	}

	srv.Pause()
	short, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	res, err := s.Take(short, reqs)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || res != nil {
		t.Fatalf("Take on a hung Redis = %v, %v, want context.DeadlineExceeded", res, err)
	}
	srv.Resume()

	srv.Kill()
	res, err = s.Take(ctx(t), reqs)
	var ne *net.OpError
	if !errors.As(err, &ne) || res != nil {
		t.Fatalf("Take on a dead Redis = %v, %v, want a connection error", res, err)
	}
	if _, err := s.Return(ctx(t), []coordinator.ReturnRequest{{Key: "a", Limit: l, Amount: 1}}); !errors.As(err, &ne) {
		t.Fatalf("Return on a dead Redis: %v, want a connection error", err)
	}
	// Invalid items are answered without Redis.
	res, err = s.Take(ctx(t), []coordinator.TakeRequest{{Key: "a", Limit: l}})
	if err != nil || !errors.Is(res[0].Err, coordinator.ErrInvalidRequest) {
		t.Fatalf("Take of an invalid item on a dead Redis = %v, %v, want the item's ErrInvalidRequest", res, err)
	}
}

// TestInjectedClockRange: a reading the script could not use exactly is refused.
func TestInjectedClockRange(t *testing.T) {
	srv := redistest.Start(t)
	for _, now := range []bucket.Millis{-1, 1<<52 + 1} {
		s := redisstore.New(srv.Client(t), redisstore.WithClock(func() bucket.Millis { return now }))
		l := mustLimit(t, 10*tok, tok, 100)
		if _, err := s.Take(ctx(t), []coordinator.TakeRequest{{Key: "a", Limit: l, Want: 1, Min: 1}}); err == nil {
			t.Errorf("Take with the clock at %d: no error", now)
		}
	}
}

// raceTakes runs 64 goroutines over the clients, each taking one token at a time from one bucket
// of 100 tokens that never refills, until denied. Exactly 100 tokens are granted, and every
// remaining count from 99 down to 0 is seen exactly once: the script serializes the key.
func raceTakes(t *testing.T, clients []redis.UniversalClient, key string) {
	l := mustLimit(t, 100*tok, 0, 0)
	var granted atomic.Int64
	var mu sync.Mutex
	seen := map[bucket.Micro]int{}
	var wg sync.WaitGroup
	for g := range 64 {
		s := redisstore.New(clients[g%len(clients)])
		wg.Go(func() {
			req := []coordinator.TakeRequest{{Key: key, Limit: l, Want: tok, Min: tok}}
			for {
				res, err := s.Take(context.Background(), req)
				if err == nil {
					err = res[0].Err
				}
				if err != nil {
					t.Errorf("Take: %v", err)
					return
				}
				r := res[0]
				if r.Remaining < 0 {
					t.Errorf("remaining %d µ: negative", r.Remaining)
				}
				if r.Granted == 0 {
					if r.RetryAfter != bucket.Never {
						t.Errorf("denied with retry %d, want Never", r.RetryAfter)
					}
					return
				}
				granted.Add(int64(r.Granted))
				mu.Lock()
				seen[r.Remaining]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if got := granted.Load(); got != int64(100*tok) {
		t.Fatalf("granted %d µ in total, want exactly %d", got, 100*tok)
	}
	for i := range 100 {
		if n := seen[bucket.Micro(i)*tok]; n != 1 {
			t.Fatalf("remaining %d tokens seen %d times, want once", i, n)
		}
	}
}

func TestAtomicStandalone(t *testing.T) {
	srv := redistest.Start(t)
	clients := make([]redis.UniversalClient, 4)
	for i := range clients {
		clients[i] = srv.Client(t)
	}
	raceTakes(t, clients, "hot")
}

// TestCluster runs the atomicity race on a 3-master cluster, shows that a batch whose keys live on
// every master costs one round trip per master, and that a master down fails only its keys.
func TestCluster(t *testing.T) {
	cl := redistest.StartCluster(t, 3)
	t.Run("Atomic", func(t *testing.T) {
		clients := make([]redis.UniversalClient, 4)
		for i := range clients {
			clients[i] = cl.Client(t)
		}
		raceTakes(t, clients, "hot")
	})
	t.Run("Debt", func(t *testing.T) {
		// Costs settled after the fact on keys of every master, in one batch: each key goes below
		// zero down to its max_debt, the rest forgiven, and then refuses takes.
		s := redisstore.New(cl.Client(t))
		l := mustLimit(t, 10*tok, 0, 0)
		var reqs []coordinator.TakeRequest
		for i := range 12 {
			reqs = append(reqs, coordinator.TakeRequest{Key: "debt-" + strconv.Itoa(i), Limit: l, Debt: 12 * tok, MaxDebt: 5 * tok,
				Op: coordinator.OpID{Agent: "a", Seq: 1}})
		}
		for _, want := range []struct {
			seq                uint64
			debited, remaining bucket.Micro
			replayed           bool
		}{{1, 12 * tok, -2 * tok, false}, {1, 12 * tok, -2 * tok, true}, {2, 3 * tok, -5 * tok, false}} {
			for i := range reqs {
				reqs[i].Op.Seq = want.seq
			}
			res, err := s.Take(ctx(t), reqs)
			if err != nil {
				t.Fatal(err)
			}
			for i, r := range res {
				if r.Err != nil || r.Debited != want.debited || r.Remaining != want.remaining || r.Granted != 0 || r.Replayed != want.replayed {
					t.Fatalf("debt on %s (seq %d) = %+v, want debited %d, remaining %d", reqs[i].Key, want.seq, r, want.debited, want.remaining)
				}
			}
		}
		res, err := s.Take(ctx(t), []coordinator.TakeRequest{{Key: "debt-0", Limit: l, Want: tok, Min: tok}})
		if err != nil || res[0].Err != nil || res[0].Granted != 0 || res[0].RetryAfter != bucket.Never {
			t.Fatalf("take from a key in debt that never refills = %+v, %v; want denied for good", res, err)
		}
	})

	counter := newTripCounter()
	o := cl.Options()
	o.MaxRedirects, o.DialerRetries = 1, 1 // a dead node fails fast
	o.NewClient = func(o *redis.Options) *redis.Client {
		c := redis.NewClient(o)
		c.AddHook(counter.hook(o.Addr))
		return c
	}
	cc := redis.NewClusterClient(o)
	defer cc.Close()
	s := redisstore.New(cc)
	l := mustLimit(t, 10*tok, 0, 0)

	// 30 keys spread over the three masters.
	var reqs []coordinator.TakeRequest
	perMaster := map[string]int{}
	owner := map[string]*redistest.Server{}
	for i := range 30 {
		key := "tenant-" + strconv.Itoa(i)
		m := cl.MasterForKey(key)
		owner[key] = m
		perMaster[m.Addr()]++
		reqs = append(reqs, coordinator.TakeRequest{Key: key, Limit: l, Want: tok, Min: tok})
	}
	if len(perMaster) != 3 {
		t.Fatalf("30 keys on %d masters, want 3: %v", len(perMaster), perMaster)
	}

	t.Run("OneRoundTripPerMaster", func(t *testing.T) {
		// Warm up: the first pipeline to a node also opens a connection, whose handshake is a
		// pipeline too. Then empty the script caches: the next batch meets NOSCRIPT everywhere.
		if _, err := s.Take(ctx(t), reqs); err != nil {
			t.Fatal(err)
		}
		if err := cc.ScriptFlush(ctx(t)).Err(); err != nil {
			t.Fatal(err)
		}
		for i, wantLoads := range []int{1, 0} {
			counter.reset()
			res, err := s.Take(ctx(t), reqs)
			if err != nil {
				t.Fatal(err)
			}
			for j, r := range res {
				if r.Err != nil || r.Granted != tok || r.Remaining != bucket.Micro(8-i)*tok {
					t.Fatalf("batch %d %s = %s, want one token, %d left", i, storetest.TakeString(reqs[j]), storetest.TakeResultString(r), 8-i)
				}
			}
			trips, loads := counter.reset()
			for addr := range perMaster {
				if want := 1 + wantLoads; trips[addr] != want {
					t.Errorf("batch %d: master %s saw %d round trips, want %d", i, addr, trips[addr], want)
				}
			}
			if loads != 3*wantLoads { // one SCRIPT LOAD per master
				t.Errorf("batch %d: %d script loads, want %d", i, loads, 3*wantLoads)
			}
			t.Logf("batch %d: 30 keys, round trips per node %v, script loads %d", i, trips, loads)
		}
	})

	t.Run("HungMasterSkipped", func(t *testing.T) {
		o := cl.Options()
		o.ContextTimeoutEnabled = true // as cmd/coordinator: a hung master fails at the batch's deadline
		hc := redis.NewClusterClient(o)
		defer hc.Close()
		s := redisstore.New(hc)
		// Keys of its own (the other subtests count tokens on theirs), on every master.
		reqs := slices.Clone(reqs)
		owner := map[string]*redistest.Server{}
		for i := range reqs {
			reqs[i].Key = "hung-" + reqs[i].Key
			owner[reqs[i].Key] = cl.MasterForKey(reqs[i].Key)
		}
		if _, err := s.Take(ctx(t), reqs); err != nil { // connections to every master
			t.Fatal(err)
		}
		hung := owner[reqs[0].Key]
		level := func() map[string]string {
			m := map[string]string{}
			for _, r := range reqs {
				if owner[r.Key] == hung {
					m[r.Key] = hc.HGet(ctx(t), r.Key, "t").Val()
				}
			}
			return m
		}
		before := level()
		take := func() []coordinator.TakeResult {
			t.Helper()
			c, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			res, err := s.Take(c, reqs)
			if err != nil {
				t.Fatalf("a batch with one master hung: %v, want per-item errors", err)
			}
			return res
		}
		check := func(batch string, res []coordinator.TakeResult, onHung func(error) bool) {
			t.Helper()
			for j, r := range res {
				if owner[reqs[j].Key] == hung {
					if !onHung(r.Err) {
						t.Errorf("%s: %s on the hung master = %s", batch, reqs[j].Key, storetest.TakeResultString(r))
					}
				} else if r.Err != nil || r.Granted != tok {
					t.Errorf("%s: %s on a healthy master = %s, want a token", batch, reqs[j].Key, storetest.TakeResultString(r))
				}
			}
		}
		hung.Pause()
		resumed := false
		defer func() {
			if !resumed {
				hung.Resume()
			}
		}()
		// The first batch waits for its deadline on the hung master's keys.
		res := take()
		check("first batch", res, func(err error) bool { return err != nil && !errors.Is(err, redisstore.ErrNodeUnavailable) })
		// The next ones skip that master: its keys fail with ErrNodeUnavailable, not sent (had they
		// been, they would have failed at the deadline like the first batch's).
		for i := range 3 {
			check("batch "+strconv.Itoa(i+2), take(), func(err error) bool { return errors.Is(err, redisstore.ErrNodeUnavailable) })
		}
		hung.Resume()
		resumed = true
		// Skipped keys were not charged: at most the first batch's take (sent before its deadline,
		// which Redis may run when it wakes) is missing from each.
		after := level()
		for key, b := range before {
			bt, _ := strconv.ParseInt(b, 10, 64)
			at, _ := strconv.ParseInt(after[key], 10, 64)
			if d := bt - at; d != 0 && d != int64(tok) {
				t.Errorf("%s: %d µ debited while its master hung, want at most the first batch's token", key, d)
			}
		}
		// After the cooldown the master is asked again, and answers.
		deadline := time.Now().Add(5 * time.Second)
		for {
			res, err := s.Take(ctx(t), reqs)
			if err == nil && !slices.ContainsFunc(res, func(r coordinator.TakeResult) bool { return r.Err != nil }) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the resumed master's keys still fail: %v %v", err, res)
			}
			time.Sleep(100 * time.Millisecond)
		}
	})

	t.Run("MasterDown", func(t *testing.T) {
		down := cl.MasterForKey(reqs[0].Key)
		down.Kill()
		res, err := s.Take(ctx(t), reqs)
		if err != nil {
			t.Fatalf("a batch with one master down: %v, want per-item errors", err)
		}
		for j, r := range res {
			onDown := owner[reqs[j].Key] == down
			if onDown != (r.Err != nil) || !onDown && r.Granted != tok {
				t.Errorf("%s on %s (down: %v) = %s", storetest.TakeString(reqs[j]), owner[reqs[j].Key].Addr(), onDown, storetest.TakeResultString(r))
			}
		}
		// A batch whose keys all live on the dead master failed as a whole.
		var onDown []coordinator.TakeRequest
		for _, r := range reqs {
			if owner[r.Key] == down {
				onDown = append(onDown, r)
			}
		}
		if res, err := s.Take(ctx(t), onDown); err == nil {
			t.Fatalf("a batch on the dead master only = %v, want an error", res)
		}
	})
}

// TestSentinelFailover takes from a bucket through a Sentinel failover client, kills the master,
// and takes again once the replica is promoted: the bucket's state followed the failover.
func TestSentinelFailover(t *testing.T) {
	sn := redistest.StartSentinel(t)
	o := sn.Options()
	o.DialerRetries = 1
	rdb := redis.NewFailoverClient(o)
	defer rdb.Close()
	s := redisstore.New(rdb)
	l := mustLimit(t, 10*tok, 0, 0)
	take := []coordinator.TakeRequest{{Key: "k", Limit: l, Want: 3 * tok, Min: tok}}
	if res, err := s.Take(ctx(t), take); err != nil || res[0].Err != nil || res[0].Remaining != 7*tok {
		t.Fatalf("Take = %v, %v, want 3 tokens granted, 7 left", res, err)
	}
	if err := rdb.Do(ctx(t), "wait", 1, 5000).Err(); err != nil { // the replica has the write
		t.Fatal(err)
	}
	sn.Master().Kill()
	deadline := time.Now().Add(45 * time.Second)
	for {
		res, err := s.Take(ctx(t), take)
		if err == nil && res[0].Err == nil {
			if res[0].Remaining != 4*tok {
				t.Fatalf("Take after failover = %s, want 3 tokens granted, 4 left", storetest.TakeResultString(res[0]))
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no Take succeeded 45 s after the master was killed: %v %v", err, res)
		}
		time.Sleep(100 * time.Millisecond)
	}
	sn.WaitMaster(sn.Node(1)) // every sentinel names the old replica
}

// TestClusterMulti: a direct check of a route with charges is one script over keys the policy
// gives the tenant's hash tag, so they share a slot on every master; the take is all or nothing
// there too. Keys in different slots fail their item (CROSSSLOT), not the batch.
func TestClusterMulti(t *testing.T) {
	cl := redistest.StartCluster(t, 3)
	rdb := cl.Client(t)
	s := redisstore.New(rdb)
	set, err := policy.Parse("p.yaml", []byte(`version: v1
default: {limit: 100/minute}
rules:
  - name: chat
    routes: [/chat]
    operations: [write]
    lease: off
    limits: [{limit: 10/second, burst: 20}, {limit: 1000/hour}]
  - name: budget
    scope: tenant
    operations: [write]
    limit: 100/hour
    burst: 5
`))
	if err != nil {
		t.Fatal(err)
	}
	route, _ := set.Match("/chat", "POST")
	masters := map[string]bool{}
	for i := range 12 {
		tenant := "tenant-" + strconv.Itoa(i)
		key, _ := set.Key(route, tenant, "")
		lim, _ := set.Limits(route, tenant, "")
		r := coordinator.TakeRequest{Key: key, Limit: lim.Bucket, Want: tok, Min: tok,
			Op: coordinator.OpID{Agent: "agent", Seq: uint64(i + 1)}}
		for _, id := range route.Charges() {
			c := set.RouteByID(id)
			k, _ := set.Key(c, tenant, "")
			l, _ := set.Limits(c, tenant, "")
			r.Also = append(r.Also, coordinator.Bucket{Key: k, Limit: l.Bucket})
			if a, b := rdb.ClusterKeySlot(ctx(t), key).Val(), rdb.ClusterKeySlot(ctx(t), k).Val(); a != b {
				t.Fatalf("%s in slot %d, %s in slot %d", key, a, k, b)
			}
		}
		masters[cl.MasterForKey(key).Addr()] = true
		// The budget's burst is 5: five takes, then a refusal by the budget that spends nothing.
		for range 5 {
			res, err := s.Take(ctx(t), []coordinator.TakeRequest{r})
			if err != nil || res[0].Err != nil || res[0].Granted != tok {
				t.Fatalf("%s: %v %+v", tenant, err, res)
			}
			r.Op.Seq += 100
		}
		res, err := s.Take(ctx(t), []coordinator.TakeRequest{r})
		if err != nil || res[0].Err != nil || res[0].Granted != 0 || res[0].Refused != len(r.Also) {
			t.Fatalf("%s: sixth take %v %+v, want refused by the budget", tenant, err, res)
		}
		// At most what refilled meanwhile: the route's own bucket 10 a second, the others a few an
		// hour, so they show that the refusal charged nothing.
		for k, want := range map[string][2]bucket.Micro{key: {15 * tok, 5 * tok}, r.Also[0].Key: {995 * tok, tok / 10}, r.Also[1].Key: {0, tok / 10}} {
			got, err := rdb.HGet(ctx(t), k, "t").Int64()
			if err != nil || bucket.Micro(got) < want[0] || bucket.Micro(got) > want[0]+want[1] {
				t.Errorf("%s holds %d µ (%v), want %d µ and at most %d µ more", k, got, err, want[0], want[1])
			}
		}
	}
	if len(masters) < 2 {
		t.Errorf("12 tenants on %d masters: tenants do not spread", len(masters))
	}
	// The unspent grant of such a take goes back to every bucket in one script on the slot's
	// master, recorded in the route's key only. The script cache is flushed on every master before
	// each return: it meets NOSCRIPT, loads the script and is resent.
	now := bucket.Millis(1_700_000_000_000)
	sc := redisstore.New(rdb, redisstore.WithClock(func() bucket.Millis { return now }))
	for i := range 6 {
		tenant := "returning-" + strconv.Itoa(i)
		key, _ := set.Key(route, tenant, "")
		lim, _ := set.Limits(route, tenant, "")
		take := coordinator.TakeRequest{Key: key, Limit: lim.Bucket, Want: 3 * tok, Min: 3 * tok,
			Op: coordinator.OpID{Agent: "agent", Seq: 1}}
		least := lim.Bucket.Capacity()
		for _, id := range route.Charges() {
			c := set.RouteByID(id)
			k, _ := set.Key(c, tenant, "")
			l, _ := set.Limits(c, tenant, "")
			take.Also = append(take.Also, coordinator.Bucket{Key: k, Limit: l.Bucket})
			least = min(least, l.Bucket.Capacity())
		}
		res, err := sc.Take(ctx(t), []coordinator.TakeRequest{take})
		if err != nil || res[0].Err != nil || res[0].Granted != 3*tok {
			t.Fatalf("%s: take %v %+v", tenant, err, res)
		}
		if err := rdb.ForEachMaster(ctx(t), func(ctx context.Context, m *redis.Client) error {
			return m.ScriptFlush(ctx).Err()
		}); err != nil {
			t.Fatal(err)
		}
		back := coordinator.ReturnRequest{Key: key, Limit: lim.Bucket, Amount: 2 * tok, GrantedAt: res[0].Now, Also: take.Also,
			Op: coordinator.OpID{Agent: "agent", Seq: 1}}
		want := coordinator.ReturnResult{Result: bucket.Result{Granted: bucket.Micro(1+len(take.Also)) * 2 * tok, Remaining: least - tok}, Now: now}
		for _, replayed := range []bool{false, true} {
			got, err := sc.Return(ctx(t), []coordinator.ReturnRequest{back})
			want.Replayed = replayed
			if err != nil || got[0] != want {
				t.Fatalf("%s: return (replayed: %v) %v %+v, want %+v", tenant, replayed, err, got, want)
			}
		}
		for j, b := range append([]coordinator.Bucket{{Key: key, Limit: lim.Bucket}}, take.Also...) {
			h, err := rdb.HGetAll(ctx(t), b.Key).Result()
			if err != nil || h["t"] != strconv.FormatInt(int64(b.Limit.Capacity()-tok), 10) {
				t.Fatalf("%s holds %v (%v), want %d µ", b.Key, h, err, b.Limit.Capacity()-tok)
			}
			if rec, ok := h["r:agent"]; ok != (j == 0) {
				t.Fatalf("%s: return record %q; want one in the route's key only", b.Key, rec)
			}
		}
	}
	// Keys without a common tag: that item fails, the batch does not.
	l := mustLimit(t, 10*tok, tok, 1000)
	var a, b string
	for i := 0; a == "" || b == ""; i++ {
		k := "x" + strconv.Itoa(i)
		if a == "" {
			a = k
		} else if cl.MasterForKey(k) == cl.MasterForKey(a) && rdb.ClusterKeySlot(ctx(t), k).Val() != rdb.ClusterKeySlot(ctx(t), a).Val() {
			b = k
		}
	}
	res, err := s.Take(ctx(t), []coordinator.TakeRequest{
		{Key: a, Limit: l, Want: tok, Min: tok, Also: []coordinator.Bucket{{Key: b, Limit: l}}},
		{Key: a, Limit: l, Want: tok, Min: tok},
	})
	if err != nil || res[0].Err == nil || !strings.Contains(res[0].Err.Error(), "CROSSSLOT") || res[1].Granted != tok {
		t.Fatalf("cross-slot take: %v %+v", err, res)
	}
	back, err := s.Return(ctx(t), []coordinator.ReturnRequest{
		{Key: a, Limit: l, Amount: tok, GrantedAt: res[1].Now, Also: []coordinator.Bucket{{Key: b, Limit: l}}},
		{Key: a, Limit: l, Amount: tok, GrantedAt: res[1].Now},
	})
	if err != nil || back[0].Err == nil || !strings.Contains(back[0].Err.Error(), "CROSSSLOT") || back[1].Err != nil {
		t.Fatalf("cross-slot return: %v %+v", err, back)
	}
}

// TestInFlightJoinsBatches: with its one batch out to a Redis that does not answer, a Store
// holds the batches that arrive meanwhile and sends them in one round trip when Redis answers:
// one script run for all, each batch answered its own grants, a key in two of them debited
// twice, in order.
func TestInFlightJoinsBatches(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	s := redisstore.New(rdb, redisstore.WithInFlight(1))
	if err := s.Load(ctx(t)); err != nil {
		t.Fatal(err)
	}
	l := mustLimit(t, 10*tok, 10*tok, 60_000)
	take := func(want bucket.Micro, keys ...string) []coordinator.TakeRequest {
		reqs := make([]coordinator.TakeRequest, len(keys))
		for i, k := range keys {
			reqs[i] = coordinator.TakeRequest{Key: k, Limit: l, Want: want, Min: want}
		}
		return reqs
	}
	batches := [][]coordinator.TakeRequest{
		take(1*tok, "first"),
		take(2*tok, "b1", "shared"),
		take(3*tok, "shared", "c1", "c2"),
		take(4*tok, "d1"),
	}
	if err := rdb.ConfigResetStat(ctx(t)).Err(); err != nil {
		t.Fatal(err)
	}
	srv.Pause()
	resumed := false
	defer func() {
		if !resumed {
			srv.Resume()
		}
	}()
	results := make([][]coordinator.TakeResult, len(batches))
	var wg sync.WaitGroup
	send := func(i int) {
		wg.Go(func() {
			var err error
			if results[i], err = s.Take(ctx(t), batches[i]); err != nil {
				t.Errorf("batch %d: %v", i, err)
			}
		})
	}
	waitMerging := func(out, waiting int) {
		t.Helper()
		proctest.WaitFor(t, 5*time.Second, fmt.Sprintf("%d batches out and %d waiting", out, waiting), func() bool {
			o, w := s.Merging()
			return o == out && w == waiting
		})
	}
	send(0)
	waitMerging(1, 0)
	for i := 1; i < len(batches); i++ {
		send(i)
		waitMerging(1, i)
	}
	srv.Resume()
	resumed = true
	wg.Wait()
	waitMerging(0, 0)
	for i, res := range results {
		for j, r := range res {
			if want := batches[i][j].Want; r.Err != nil || r.Granted != want {
				t.Errorf("batch %d, %s: %s, want %d µ granted", i, batches[i][j].Key, storetest.TakeResultString(r), want)
			}
		}
	}
	if got := results[2][0].Remaining; got != 5*tok {
		t.Errorf("shared: %d µ left after the third batch, want %d: the second batch's take first, then the third's", got, 5*tok)
	}
	if scripts := scriptRuns(t, rdb); scripts != 2 {
		t.Errorf("%v script runs for 4 batches, want 2: the first alone, the three that waited together", scripts)
	}
}
