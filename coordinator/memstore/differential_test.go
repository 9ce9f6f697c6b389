package memstore_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
)

const (
	day  = bucket.Millis(24 * 3600 * 1000)
	year = 365 * day

	// maxNow keeps the simulated clock well inside the 2^52 ms an injected clock may read.
	maxNow = bucket.Millis(1) << 50
)

// extremes are the bucket shapes every differential sequence draws from, besides random ones.
var extremes = []struct {
	capacity, amount bucket.Micro
	period           bucket.Millis
}{
	{1, 0, 0},            // one microtoken, never refills
	{tok, 0, 0},          // one token, never refills
	{tok, tok, 1},        // one token, a token per millisecond
	{tok, 1, 1},          // one token, a microtoken per millisecond
	{tok, tok, day},      // one token a day: 5 µ per 432 ms
	{7, 5, 432},          // 7 µ
	{10 * tok, tok, 100}, // the common case
	{1_000_000_000 * tok, 1_000_000_000 * tok, day}, // 10^9 tokens a day
	{1_000_000_000 * tok, tok, 1},                   // 10^9 tokens, a token per millisecond
	{1_000_000_000 * tok, 0, 0},                     // 10^9 tokens, never refills
	{1<<51 + 12345, 1<<40 + 1, 4095},                // num*den and 2*capacity near 2^52
	{1<<52 - 1<<41, 1<<40 - 1, 4097},                // 2*capacity + num just below 2^53
}

// source yields the choices of one sequence: a seeded generator, or the bytes of a fuzz input.
type source interface {
	// n returns a number in [0, n) for n >= 1.
	n(n uint64) uint64
	// exhausted reports that a byte source has no more input.
	exhausted() bool
}

type randSource struct{ r *rand.Rand }

func (s randSource) n(n uint64) uint64 { return s.r.Uint64N(n) }
func (s randSource) exhausted() bool   { return false }

type byteSource struct{ b []byte }

func (s *byteSource) n(n uint64) uint64 {
	var buf [8]byte
	k := (64 - bits.LeadingZeros64(n-1) + 7) / 8
	k = copy(buf[:k], s.b)
	s.b = s.b[k:]
	return binary.LittleEndian.Uint64(buf[:]) % n
}
func (s *byteSource) exhausted() bool { return len(s.b) == 0 }

// pick returns one of vals.
func pick[T any](src source, vals ...T) T { return vals[src.n(uint64(len(vals)))] }

// between returns a number in [lo, hi].
func between[T ~int64](src source, lo, hi T) T {
	if hi <= lo {
		return lo
	}
	return lo + T(src.n(uint64(hi-lo)+1))
}

// drawLimit returns one of the extremes or, one time in three, a random representable limit.
func drawLimit(src source) bucket.Limit {
	if src.n(3) == 0 {
		for range 4 {
			capacity := bucket.Micro(between(src, 1, int64(1)<<between(src, 0, int64(52))))
			amount := bucket.Micro(between(src, 0, int64(1)<<between(src, 0, int64(52))))
			period := bucket.Millis(between(src, 1, int64(1)<<between(src, 0, int64(40))))
			if l, err := bucket.NewLimit(capacity, amount, period); err == nil {
				return l
			}
		}
	}
	e := extremes[src.n(uint64(len(extremes)))]
	l, err := bucket.NewLimit(e.capacity, e.amount, e.period)
	if err != nil {
		panic(fmt.Sprintf("extreme limit %+v: %v", e, err))
	}
	return l
}

// diffRun drives one random sequence against both stores and compares every answer.
type diffRun struct {
	t      testing.TB
	rdb    redis.UniversalClient
	src    source
	now    bucket.Millis
	lua    *redisstore.Store
	mem    *memstore.Store
	keys   [2]string
	limits [2]bucket.Limit
	// calendar is the length of the calendar periods of the keys that are counters (counter),
	// 0 if neither is.
	calendar bucket.Millis
	counter  [2]bool
	agents   []string
	maxBatch uint64
	seqs     map[string]uint64 // last sequence number used per agent
	granted  []bucket.Millis   // grant times seen, for Returns
	log      []string          // the steps so far, printed on a mismatch
	records  [2]int            // records held per key after the last step
	prev     [2]memstore.Entry // each key after the last step
	sweeps   int               // batches after which a key held fewer records (a sweep ran)
	paced    int               // takes the contention rule cut (a pace was answered)
	counted  int               // counter takes granted
	resets   int               // counter takes denied until the end of their period
	outside  int               // counter operations refused: the clock outside their window
	indebt   int               // takes that charged a debt and left the key below zero
	multis   int               // takes of both buckets at once granted
	giveBack int               // returns to both buckets at once that credited something
}

// fewAgents is the agent pool of most sequences: replays and stale operations are frequent.
var fewAgents = []string{"a", "b", "agent-with-a-longer-name"}

// crowd returns n agent names: enough for a key to hold more than MaxRecords records.
func crowd(n int) []string {
	agents := make([]string, n)
	for i := range agents {
		agents[i] = "agent-" + strconv.Itoa(i)
	}
	return agents
}

// newDiffRun starts a sequence on two keys; with counters, one or both keys may be calendar
// counters (the admin API works on token buckets only, and its test passes false).
func newDiffRun(t testing.TB, rdb redis.UniversalClient, src source, prefix string, agents []string, maxBatch uint64, counters bool) *diffRun {
	d := &diffRun{t: t, rdb: rdb, src: src, seqs: map[string]uint64{}, agents: agents, maxBatch: maxBatch}
	d.now = between(src, 0, bucket.Millis(1)<<41)
	clock := func() bucket.Millis { return d.now }
	d.lua = redisstore.New(rdb, redisstore.WithClock(clock))
	// Every script loaded: a batch that met NOSCRIPT for one kind of script would resend those
	// calls after the others, and the stores would apply one batch in different orders.
	if err := d.lua.Load(context.Background()); err != nil {
		t.Fatal(err)
	}
	d.mem = memstore.New(memstore.WithClock(clock))
	d.limits[0] = drawLimit(src)
	d.limits[1] = d.limits[0]
	if src.n(2) == 0 {
		d.limits[1] = drawLimit(src)
	}
	d.keys = [2]string{prefix + "/0", prefix + "/1"}
	if counters && src.n(3) == 0 {
		// Calendar counters: one key or both, of a quota that never refills.
		d.calendar = pick(d.src, between(src, 1, bucket.Millis(5000)), day, 31*day)
		for k := range d.counter {
			if k == 1 || src.n(2) == 0 {
				d.counter[k] = true
				d.limits[k] = mustNewLimit(d.limits[k].Capacity(), 0, 0)
			}
		}
	}
	d.logf("start at %d, limits %v %v, counters %v of calendar periods of %d ms", d.now, d.limits[0], d.limits[1], d.counter, d.calendar)
	return d
}

func mustNewLimit(capacity, amount bucket.Micro, period bucket.Millis) bucket.Limit {
	l, err := bucket.NewLimit(capacity, amount, period)
	if err != nil {
		panic(err)
	}
	return l
}

// window is the calendar window of key k for a request: none for a bucket; for a counter, the
// window of a coordinator's clock near the store's, mostly behind it by less than a period
// (the window holds the key's clock), sometimes further away (the stores must both refuse).
func (d *diffRun) window(k uint64) bucket.Window {
	if !d.counter[k] {
		return bucket.Window{}
	}
	p := d.calendar
	t := d.now - between(d.src, 0, p)
	switch d.src.n(8) {
	case 0:
		t = d.now + between(d.src, 1, 2*p) // ahead of the store
	case 1:
		t = d.now - between(d.src, p, 3*p) // far behind
	}
	t = max(t, 0)
	start := t - t%p
	return bucket.Window{Start: start, End: start + p, Next: start + 2*p}
}

func (d *diffRun) logf(format string, args ...any) {
	d.log = append(d.log, fmt.Sprintf(format, args...))
}

func (d *diffRun) fail(format string, args ...any) {
	d.t.Helper()
	d.t.Fatalf("%s\nsteps:\n  %s", fmt.Sprintf(format, args...), strings.Join(d.log, "\n  "))
}

// run plays steps steps (or until a byte source runs dry), then compares the stored state.
func (d *diffRun) run(steps int) {
	d.t.Helper()
	for range steps {
		if d.src.exhausted() {
			break
		}
		switch d.src.n(13) {
		case 0, 1:
			d.advance(between(d.src, 0, bucket.Millis(2000)))
		case 2:
			d.advance(-between(d.src, 1, bucket.Millis(1_000_000))) // the clock goes back
		case 3:
			d.advance(between(d.src, 0, 30*year))
		case 4:
			if len(d.granted) > 0 { // back to a grant time exactly
				d.now = pick(d.src, d.granted...)
				d.logf("clock = %d", d.now)
			}
		case 5:
			d.advance(coordinator.RecordKeep + between(d.src, -2, bucket.Millis(2)))
		case 6:
			// To a key's logical expiry, or just before it.
			if e, ok := d.mem.Lookup(pick(d.src, d.keys[0], d.keys[1])); ok && e.Expires {
				d.now = min(e.Expiry-between(d.src, 0, bucket.Millis(1)), maxNow)
				d.logf("clock = %d (expiry %d)", d.now, e.Expiry)
			}
		case 7, 8, 9:
			d.takes()
		default:
			d.returns()
		}
		d.countRecords()
	}
	for i, key := range d.keys {
		d.compareState(key, d.limits[i])
	}
}

// countRecords notices a sweep: a key holding fewer records than after the last step although it
// did not expire.
func (d *diffRun) countRecords() {
	for i, key := range d.keys {
		e, ok := d.mem.Lookup(key)
		n := len(e.Takes) + len(e.Returns) + len(e.Multis)
		p := d.prev[i]
		expired := !ok || p.Expires && d.now >= p.Expiry
		if n < d.records[i] && !expired {
			d.sweeps++
		}
		d.records[i], d.prev[i] = n, e
	}
}

func (d *diffRun) advance(by bucket.Millis) {
	d.now = min(max(d.now+by, 0), maxNow)
	d.logf("clock %+d = %d", by, d.now)
}

// op returns no OpID, or an agent's next, repeated, older or arbitrary sequence number.
func (d *diffRun) op() coordinator.OpID {
	if d.src.n(5) < 2 {
		return coordinator.OpID{}
	}
	agent := pick(d.src, d.agents...)
	last := d.seqs[agent]
	var seq uint64
	switch d.src.n(6) {
	case 0, 1:
		seq = last + 1
	case 2:
		seq = max(last, 1) // a retry
	case 3:
		seq = max(1, last-d.src.n(max(last, 1))) // older
	case 4:
		seq = last + 1 + d.src.n(1000)
	default:
		seq = 1 + d.src.n(bucket.MaxExact)
	}
	d.seqs[agent] = max(last, seq)
	return coordinator.OpID{Agent: agent, Seq: seq}
}

func (d *diffRun) amount(capacity bucket.Micro) bucket.Micro {
	switch d.src.n(5) {
	case 0:
		return 1
	case 1:
		return capacity
	case 2:
		return between(d.src, capacity, bucket.MaxExact/2)
	default:
		return between(d.src, 1, capacity)
	}
}

func (d *diffRun) takes() {
	d.t.Helper()
	reqs := make([]coordinator.TakeRequest, 1+d.src.n(d.maxBatch))
	for i := range reqs {
		k := d.src.n(2)
		l := d.limits[k]
		want := d.amount(l.Capacity())
		least := want
		switch d.src.n(4) {
		case 0:
			least = 1
		case 1:
			least = between(d.src, 1, want)
		case 2:
			least = between(d.src, min(l.Capacity()+1, want), want) // often above the capacity
		}
		if d.src.n(20) == 0 {
			least = 0 // invalid: both stores must reject it
		}
		share := int64(0)
		if d.src.n(3) == 0 {
			share = between(d.src, 1, int64(bucket.WholeShare))
		}
		var unit bucket.Micro
		if d.src.n(3) == 0 {
			unit = between(d.src, 1, max(1, least))
		}
		reqs[i] = coordinator.TakeRequest{Key: d.keys[k], Limit: l, Want: want, Min: least, Share: share, Unit: unit, Op: d.op(), Period: d.window(k)}
		if d.src.n(2) == 0 {
			// The contention rule's inputs: the agent's demand and the lease lifetime.
			reqs[i].Demand = pick(d.src, bucket.Micro(0), 1, between(d.src, 1, 10*l.Capacity()), lease.MaxShareDemand+between[bucket.Micro](d.src, 0, 1<<40))
			reqs[i].TTL = pick(d.src, bucket.Millis(0), bucket.Millis(lease.MinTTL.Milliseconds()), between[bucket.Millis](d.src, 1, 30_000))
			if d.src.n(2) == 0 {
				// A lease of a lifetime's demand where the bucket stays ample (lease.Ample); with
				// no lifetime, or below want, both stores must reject it.
				reqs[i].AmpleWant = pick(d.src, want, between(d.src, want, 2*want), between(d.src, want, l.Capacity()/4+1), want-1)
			}
		}
		if d.src.n(3) == 0 {
			// A lease of the key handed back in the same operation.
			at := d.now - between(d.src, 0, l.FillTime()+10)
			if len(d.granted) > 0 && d.src.n(2) == 0 {
				at = pick(d.src, d.granted...)
			}
			reqs[i].Credit = coordinator.Credit{Amount: d.amount(l.Capacity()), GrantedAt: max(at, 0)}
			if d.src.n(4) == 0 {
				reqs[i].Want, reqs[i].Min = 0, 0 // only the lease handed back
			}
		}
		if d.src.n(3) == 0 {
			// A cost settled after the fact, charged before the take, down to -MaxDebt.
			reqs[i].Debt = d.amount(l.Capacity())
			reqs[i].MaxDebt = pick(d.src, 0, l.Capacity(), between(d.src, 0, l.Capacity()))
			if d.src.n(4) == 0 {
				reqs[i].Want, reqs[i].Min = 0, 0 // only the debt (and a lease handed back)
			}
			if d.src.n(30) == 0 {
				reqs[i].MaxDebt = l.Capacity() + 1 // invalid: both stores must reject it
			}
		}
		if !d.counter[0] && !d.counter[1] && d.src.n(3) == 0 {
			// A take of both buckets at once, all or nothing (a direct check with charges).
			reqs[i] = coordinator.TakeRequest{Key: d.keys[k], Limit: l, Want: want, Min: least, Unit: unit, Op: reqs[i].Op,
				Also: []coordinator.Bucket{{Key: d.keys[1-k], Limit: d.limits[1-k]}}}
			if d.src.n(20) == 0 {
				reqs[i].Also[0].Key = reqs[i].Key // invalid: both stores must reject it
			}
		}
	}
	d.playTakes(reqs)
}

// playTakes runs one batch of takes on both stores and compares the answers.
func (d *diffRun) playTakes(reqs []coordinator.TakeRequest) {
	d.t.Helper()
	ctx := context.Background()
	got, err := d.lua.Take(ctx, reqs)
	if err != nil {
		d.fail("redisstore Take: %v", err)
	}
	want, err := d.mem.Take(ctx, reqs)
	if err != nil {
		d.fail("memstore Take: %v", err)
	}
	for i, r := range reqs {
		g, w := got[i], want[i]
		d.logf("at %d: %s = %s", d.now, storetest.TakeString(r), storetest.TakeResultString(w))
		if (g.Err == nil) != (w.Err == nil) || g.Err == nil && !sameTake(g, w) {
			d.fail("at %d: %s = %s on Redis, want %s as memstore", d.now, storetest.TakeString(r),
				storetest.TakeResultString(g), storetest.TakeResultString(w))
		}
		if g.Err == nil && g.Granted > 0 {
			d.granted = append(d.granted, g.Now)
		}
		if g.Err == nil && g.Pace > 0 && !g.Replayed {
			d.paced++
		}
		if g.Err == nil && g.Debited > 0 && g.Remaining < 0 && !g.Replayed {
			d.indebt++
		}
		if g.Err == nil && g.Granted > 0 && len(r.Also) > 0 && !g.Replayed {
			d.multis++
		}
		if !r.Period.IsZero() {
			switch {
			case errors.Is(g.Err, bucket.ErrOutsideWindow):
				if !errors.Is(w.Err, bucket.ErrOutsideWindow) {
					d.fail("at %d: %s failed on Redis with %v, on memstore with %v", d.now, storetest.TakeString(r), g.Err, w.Err)
				}
				d.outside++
			case g.Err == nil && g.Granted > 0:
				d.counted++
			case g.Err == nil && g.RetryAfter > 0:
				d.resets++
			}
		}
	}
}

func (d *diffRun) returns() {
	d.t.Helper()
	reqs := make([]coordinator.ReturnRequest, 1+d.src.n(d.maxBatch))
	for i := range reqs {
		k := d.src.n(2)
		l := d.limits[k]
		at := d.now - between(d.src, 0, l.FillTime()+10)
		if len(d.granted) > 0 && d.src.n(2) == 0 {
			at = pick(d.src, d.granted...)
		}
		if d.src.n(10) == 0 {
			at = between(d.src, 0, bucket.Millis(bucket.MaxExact/2)) // far in the past or the future
		}
		amount := d.amount(l.Capacity())
		if d.src.n(6) == 0 {
			amount = 0
		}
		reqs[i] = coordinator.ReturnRequest{Key: d.keys[k], Limit: l, Amount: amount, GrantedAt: max(at, 0), Op: d.op(), Period: d.window(k)}
		if d.src.n(20) == 0 {
			reqs[i].Amount = -1 // invalid
		}
		if !d.counter[0] && !d.counter[1] && d.src.n(3) == 0 {
			// The unspent grant of a take of both buckets, handed back to both.
			reqs[i].Also = []coordinator.Bucket{{Key: d.keys[1-k], Limit: d.limits[1-k]}}
			if d.src.n(20) == 0 {
				reqs[i].Also[0].Key = reqs[i].Key // invalid: both stores must reject it
			}
		}
	}
	d.playReturns(reqs)
}

// playReturns runs one batch of returns on both stores and compares the answers.
func (d *diffRun) playReturns(reqs []coordinator.ReturnRequest) {
	d.t.Helper()
	ctx := context.Background()
	got, err := d.lua.Return(ctx, reqs)
	if err != nil {
		d.fail("redisstore Return: %v", err)
	}
	want, err := d.mem.Return(ctx, reqs)
	if err != nil {
		d.fail("memstore Return: %v", err)
	}
	for i, r := range reqs {
		g, w := got[i], want[i]
		d.logf("at %d: %s = %s", d.now, storetest.ReturnString(r), storetest.ReturnResultString(w))
		if (g.Err == nil) != (w.Err == nil) || g.Err == nil && !sameReturn(g, w) {
			d.fail("at %d: %s = %s on Redis, want %s as memstore", d.now, storetest.ReturnString(r),
				storetest.ReturnResultString(g), storetest.ReturnResultString(w))
		}
		if g.Err == nil && g.Granted > 0 && len(r.Also) > 0 && !g.Replayed {
			d.giveBack++
		}
	}
}

func sameTake(a, b coordinator.TakeResult) bool {
	return a.Result == b.Result && a.Credited == b.Credited && a.Debited == b.Debited && a.Pace == b.Pace && a.Now == b.Now && a.Replayed == b.Replayed && a.Stale == b.Stale &&
		a.Refused == b.Refused
}

func sameReturn(a, b coordinator.ReturnResult) bool {
	return a.Result == b.Result && a.Now == b.Now && a.Replayed == b.Replayed && a.Stale == b.Stale
}

// compareState checks that the Redis hash holds what memstore holds for key.
func (d *diffRun) compareState(key string, l bucket.Limit) {
	d.t.Helper()
	want, held := d.mem.Lookup(key)
	fields, err := d.rdb.HGetAll(context.Background(), key).Result()
	if err != nil {
		d.fail("HGETALL %s: %v", key, err)
	}
	if !held {
		if len(fields) != 0 {
			d.fail("key %s: Redis holds %v, memstore nothing", key, fields)
		}
		return
	}
	got, err := parseHash(fields)
	if err != nil {
		d.fail("key %s: %v", key, err)
	}
	if !reflect.DeepEqual(got, want) {
		d.fail("key %s (%v): Redis holds %+v, memstore %+v", key, l, got, want)
	}
	if got.State.Tokens < -l.Capacity() {
		d.fail("key %s: tokens %d below -capacity", key, got.State.Tokens)
	}
}

// parseHash reads the script's key layout into memstore's view of a key.
func parseHash(fields map[string]string) (memstore.Entry, error) {
	e := memstore.Entry{Takes: map[string]memstore.TakeRecord{}, Returns: map[string]memstore.ReturnRecord{}, Multis: map[string]memstore.MultiRecord{}}
	for f, v := range fields {
		nums, err := parseInts(v)
		if err != nil {
			return e, fmt.Errorf("field %s: %w", f, err)
		}
		switch {
		case f == "t" && len(nums) == 1:
			e.State.Tokens = bucket.Micro(nums[0])
		case f == "l" && len(nums) == 1:
			e.State.Last = bucket.Millis(nums[0])
		case f == "f" && len(nums) == 1:
			e.State.Frac = nums[0]
		case f == "x" && len(nums) == 1:
			e.Expiry, e.Expires = bucket.Millis(nums[0]), true
		case f == "c" && len(nums) == 1:
			e.CompeteUntil, e.Competes = bucket.Millis(nums[0]), true
		case f == "p" && len(nums) == 1:
			e.Period, e.Counter = bucket.Millis(nums[0]), true
		case strings.HasPrefix(f, "a:") && len(nums) == 9:
			e.Takes[f[2:]] = memstore.TakeRecord{Seq: uint64(nums[0]), Granted: bucket.Micro(nums[1]),
				Remaining: bucket.Micro(nums[2]), RetryAfter: bucket.Millis(nums[3]), Credited: bucket.Micro(nums[4]),
				Pace: bucket.Millis(nums[5]), Demand: bucket.Micro(nums[6]), Debited: bucket.Micro(nums[7]), Now: bucket.Millis(nums[8])}
		case strings.HasPrefix(f, "m:") && len(nums) == 6:
			e.Multis[f[2:]] = memstore.MultiRecord{Seq: uint64(nums[0]), Granted: bucket.Micro(nums[1]),
				Remaining: bucket.Micro(nums[2]), RetryAfter: bucket.Millis(nums[3]), Refused: int(nums[4]), Now: bucket.Millis(nums[5])}
		case strings.HasPrefix(f, "r:") && len(nums) == 4:
			e.Returns[f[2:]] = memstore.ReturnRecord{Seq: uint64(nums[0]), Credited: bucket.Micro(nums[1]),
				Remaining: bucket.Micro(nums[2]), Now: bucket.Millis(nums[3])}
		default:
			return e, fmt.Errorf("unexpected field %s = %q", f, v)
		}
	}
	return e, nil
}

// parseInts parses space-separated decimal integers, rejecting any other form (such as the
// %.14g of Lua's tostring).
func parseInts(s string) ([]int64, error) {
	var out []int64
	for w := range strings.FieldsSeq(s) {
		n, err := strconv.ParseInt(w, 10, 64)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

// TestDifferential plays thousands of random sequences on the Lua store and on memstore: every
// answer and the final state of every key must be identical. The differential tests live beside
// memstore, not redisstore, because they read memstore's state (export_test.go).
func TestDifferential(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	sequences, steps := 3000, 30
	if testing.Short() {
		sequences = 300
	}
	const workers = 4
	var next atomic.Int64
	var paced, counted, resets, outside, indebt, multis, giveBack atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				seed := next.Add(1)
				if seed > int64(sequences) || t.Failed() {
					return
				}
				src := randSource{rand.New(rand.NewPCG(uint64(seed), 0x1ea5eb0c7e7))}
				d := newDiffRun(t, rdb, src, "diff/"+strconv.FormatInt(seed, 10), fewAgents, 3, true)
				d.logf("seed %d", seed)
				d.run(steps)
				paced.Add(int64(d.paced))
				counted.Add(int64(d.counted))
				resets.Add(int64(d.resets))
				outside.Add(int64(d.outside))
				indebt.Add(int64(d.indebt))
				multis.Add(int64(d.multis))
				giveBack.Add(int64(d.giveBack))
			}
		})
	}
	wg.Wait()
	if !t.Failed() && paced.Load() == 0 {
		t.Fatal("no take was contended: the test does not reach the contention rule")
	}
	if !t.Failed() && indebt.Load() == 0 {
		t.Fatal("no debt took a key below zero: the test does not reach the debt")
	}
	if !t.Failed() && multis.Load() == 0 {
		t.Fatal("no take of both buckets was granted: the test does not reach multi.lua")
	}
	if !t.Failed() && giveBack.Load() == 0 {
		t.Fatal("no return to both buckets credited anything: the test does not reach multi.lua's return")
	}
	if !t.Failed() && (counted.Load() == 0 || resets.Load() == 0 || outside.Load() == 0) {
		t.Fatalf("counters: %d takes granted, %d denied until a period ends, %d outside their window; the test must reach all three",
			counted.Load(), resets.Load(), outside.Load())
	}
	t.Logf("%d takes of both buckets granted, %d returns to both credited; %d debts below zero; %d contended takes; counters: %d takes granted, %d denied until a period ends, %d outside their window",
		multis.Load(), giveBack.Load(), indebt.Load(), paced.Load(), counted.Load(), resets.Load(), outside.Load())
}

// TestDifferentialCrowded plays sequences where hundreds of agents use the same keys, so that
// keys hold more than MaxRecords records and sweeps run.
func TestDifferentialCrowded(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	sweeps := 0
	for seed := range uint64(24) {
		src := randSource{rand.New(rand.NewPCG(seed, 0xc20d))}
		d := newDiffRun(t, rdb, src, "crowd/"+strconv.FormatUint(seed, 10), crowd(400), 40, true)
		d.logf("seed %d", seed)
		d.run(150)
		sweeps += d.sweeps
	}
	if sweeps == 0 {
		t.Fatal("no sequence swept records: the test does not reach the sweep")
	}
	t.Logf("%d sweeps observed", sweeps)
}

// TestDifferentialOthersExpired: a repeated or stale operation on several buckets is answered from
// its record in the first and reads no other: another bucket past its logical expiry stays as
// stored in both stores (multi.lua answers before it reads the others), until an operation that
// reads it finds it expired.
func TestDifferentialOthersExpired(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	d := &diffRun{t: t, rdb: rdb, now: 1_700_000_000_000}
	clock := func() bucket.Millis { return d.now }
	d.lua = redisstore.New(rdb, redisstore.WithClock(clock))
	d.mem = memstore.New(memstore.WithClock(clock))
	slow := mustNewLimit(10*tok, tok, 1000) // 10 s from empty to full
	fast := mustNewLimit(10*tok, tok, 10)   // 100 ms
	d.keys, d.limits = [2]string{"exp/a", "exp/b"}, [2]bucket.Limit{slow, fast}
	also := []coordinator.Bucket{{Key: "exp/b", Limit: fast}}
	op := func(seq uint64) coordinator.OpID { return coordinator.OpID{Agent: "ag", Seq: seq} }
	take := coordinator.TakeRequest{Key: "exp/a", Limit: slow, Want: 5 * tok, Min: 5 * tok, Op: op(2), Also: also}
	back := coordinator.ReturnRequest{Key: "exp/a", Limit: slow, Amount: tok, GrantedAt: d.now, Op: op(2), Also: also}
	d.playTakes([]coordinator.TakeRequest{take})
	d.playReturns([]coordinator.ReturnRequest{back})
	b, ok := d.mem.Lookup("exp/b")
	if a, _ := d.mem.Lookup("exp/a"); !ok || !b.Expires || !a.Expires || a.Expiry <= b.Expiry {
		t.Fatalf("exp/b must expire before exp/a: %+v, %+v", b, a)
	}
	d.now = b.Expiry
	d.logf("clock = %d (exp/b's expiry)", d.now)
	// Repeats, then older operations: answered from exp/a alone.
	d.playTakes([]coordinator.TakeRequest{take})
	d.playReturns([]coordinator.ReturnRequest{back})
	take.Op, back.Op = op(1), op(1)
	d.playTakes([]coordinator.TakeRequest{take})
	d.playReturns([]coordinator.ReturnRequest{back})
	if _, ok := d.mem.Lookup("exp/b"); !ok {
		d.fail("memstore dropped exp/b on a repeat or a stale operation that does not read it")
	}
	for i, key := range d.keys {
		d.compareState(key, d.limits[i])
	}
	// A new return reads exp/b: expired, a full bucket with no state, in both.
	back.Op = op(3)
	d.playReturns([]coordinator.ReturnRequest{back})
	for i, key := range d.keys {
		d.compareState(key, d.limits[i])
	}
}

// FuzzDifferential decodes a sequence of operations from the input and plays it on both stores.
func FuzzDifferential(f *testing.F) {
	srv := redistest.Start(f)
	rdb := srv.Client(f)
	seeds := rand.New(rand.NewPCG(2, 3))
	for i := range 24 {
		b := make([]byte, 16+i*24)
		for j := range b {
			b[j] = byte(seeds.UintN(256))
		}
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0, 5, 5, 5, 5, 5, 5})
	var runs atomic.Int64
	f.Fuzz(func(t *testing.T, data []byte) {
		prefix := "fuzz/" + strconv.FormatInt(runs.Add(1), 10)
		agents := fewAgents
		if len(data) > 0 && data[0] == 0xff {
			agents = crowd(200)
		}
		newDiffRun(t, rdb, &byteSource{b: data}, prefix, agents, 3, true).run(200)
	})
}
