// Package redisstore is the production coordinator.Store: one token bucket per key in Redis
// (standalone, Sentinel or Cluster, through go-redis' UniversalClient), changed only by the
// embedded script bucket.lua; or, for a request with a calendar window, one calendar quota's
// counter per key, changed only by counter.lua; a take of several buckets at once (a direct check
// of a route with charges, coordinator.TakeRequest.Also), and the return of its unspent grant to
// every one of them (coordinator.ReturnRequest.Also), by multi.lua, over keys that share a Cluster
// slot.
//
// The script runs the arithmetic of internal/bucket exactly, in Lua doubles kept below 2^53, and
// keeps the idempotency records of coordinator.OpID inside the bucket's own hash, so each request
// touches exactly one key and Cluster can place keys freely. Its clock is Redis TIME, read inside
// the script: every coordinator shares the same clock for a key.
//
// Key layout, a hash: t tokens (µ; below zero, down to the rule's max_debt, after a cost settled
// after the fact), l last refill (ms, the key clock), x the logical expiry (absent when the key
// never expires), a:<agent> the agent's last Take ("seq granted remaining retry credited pace
// demand debited now", see bucket.lua), r:<agent> its last Return ("seq credited remaining now";
// a return to several buckets keeps it in the first only). With Redis' default
// hash-max-listpack-entries 128 and hash-max-listpack-value 64, a key of a few agents with short
// ids stays in the compact listpack encoding (about 200 bytes with one record).
//
// A batch is one round trip per Redis node involved. On a standalone (or Sentinel) Redis its
// bucket calls run in batch.lua, up to MaxBatchKeys keys per invocation, which saves Redis one
// command's reading, dispatch and reply per key (not the script's work on the key). On Cluster,
// where one script may only touch keys of one slot, each master gets its part as a pipeline of
// one script per key, run side by side; a master that failed a batch is skipped for
// NodeCooldown. On a standalone (or Sentinel) Redis a Store keeps at most DefaultInFlight batches
// out at once (WithInFlight): the batches that arrive meanwhile wait and go together in the next
// round trip (merger). go-redis may resend a command
// after a connection error without knowing whether Redis ran it, so a request without an OpID
// may act twice: a Take charged twice (safe: tokens are lost, never created), a Return credited
// twice (up to capacity). Requests that carry an OpID are answered from their record instead, so
// agents return leases with one. Give the client ContextTimeoutEnabled so that a hung Redis fails
// a batch at its context's deadline rather than at the client's read timeout.
package redisstore

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
)

// intmathLua is the exact integer arithmetic every script of the package uses; commonLua what the
// bucket and counter scripts share besides (their common arguments, the clock, the share of a take,
// the sweep of records). Each script is them followed by its own text, one self-contained EVAL.
//
//go:embed intmath.lua
var intmathLua string

//go:embed common.lua
var commonLua string

// refillLua is a token bucket's refill, for bucket.lua and multi.lua.
//
//go:embed refill.lua
var refillLua string

//go:embed bucket.lua
var bucketBody string

var bucketLua = intmathLua + commonLua + refillLua + bucketBody

var script = redis.NewScript(bucketLua)

//go:embed counter.lua
var counterBody string

var counterLua = intmathLua + commonLua + counterBody

// counterScript runs the requests on calendar counters (those with a Period).
var counterScript = redis.NewScript(counterLua)

//go:embed multi.lua
var multiBody string

var multiLua = intmathLua + commonLua + refillLua + multiBody

// multiScript runs the takes of several buckets at once and the returns to several (the requests
// with Also).
var multiScript = redis.NewScript(multiLua)

//go:embed batch.lua
var batchBody string

// batchLua runs several bucket.lua calls in one invocation: bucket.lua as a function of its keys
// and arguments (intmath.lua stays outside, defined once), then batch.lua's loop over the calls.
var batchLua = intmathLua + "local function one(KEYS, ARGV)\n" + commonLua + refillLua + bucketBody + "\nend\n" + batchBody

// batchScript runs a standalone Redis's bucket calls of a batch (see send).
var batchScript = redis.NewScript(batchLua)

// MaxBatchKeys is the most bucket calls one batch.lua invocation runs by default
// (WithBatchKeys): about a millisecond of Redis time, short enough not to hold up the other
// clients of the server longer than a pipeline of the same calls would.
const MaxBatchKeys = 64

// loadScripts loads the scripts of the kinds named (on Cluster, into every node).
func loadScripts(ctx context.Context, c redis.Scripter, buckets, batches, counters, multis bool) error {
	if buckets {
		if err := script.Load(ctx, c).Err(); err != nil {
			return err
		}
	}
	if batches {
		if err := batchScript.Load(ctx, c).Err(); err != nil {
			return err
		}
	}
	if multis {
		if err := multiScript.Load(ctx, c).Err(); err != nil {
			return err
		}
	}
	if counters {
		return counterScript.Load(ctx, c).Err()
	}
	return nil
}

// Result flags set by the script.
const (
	flagReplayed = 1
	flagStale    = 2
)

// Store is a coordinator.Store on Redis. It is safe for concurrent use.
type Store struct {
	c     redis.UniversalClient
	clock func() bucket.Millis // nil: Redis TIME inside the script
	nodes *breakers            // Cluster only: masters that failed a batch recently
	// batchKeys: the most bucket calls per batch.lua invocation on a standalone Redis; 1 sends
	// each call as its own script
	batchKeys int
	merge     merger // the batches out to Redis at once, and those waiting to join the next
}

// Option configures a Store.
type Option func(*Store)

// WithClock makes the script take now from clock instead of Redis TIME. For tests and the
// simulator only: production must use Redis TIME, the one clock every coordinator shares for a key.
// With an injected clock the script sets no Redis TTL (the clock is not wall time), so keys stay
// in Redis until deleted; their logical expiry (field x) still applies. clock must read within
// 0..2^52 ms.
func WithClock(clock func() bucket.Millis) Option {
	return func(s *Store) { s.clock = clock }
}

// WithBatchKeys sets the most bucket calls of a batch one batch.lua invocation runs on a
// standalone Redis (default MaxBatchKeys); 1 (or less) runs each call as its own script in a
// pipeline, as on Cluster. The answers are the same either way: it changes only how many
// commands Redis parses and answers per batch.
func WithBatchKeys(n int) Option {
	return func(s *Store) { s.batchKeys = max(n, 1) }
}

// WithInFlight sets the most batches the Store has out to a standalone (or Sentinel) Redis at
// once (default DefaultInFlight); the batches that arrive while that many are out wait and go
// together in the next round trip. 0 (or less) sets no bound: every batch is its own round trip.
// On Cluster every batch is its own round trip whatever the bound: a round trip waits for every
// master it involves, so one hung master would hold up the batches of the others.
func WithInFlight(n int) Option {
	return func(s *Store) { s.merge.most = max(n, 0) }
}

// New returns a Store on c. On a Cluster client the Store skips, for NodeCooldown, the keys of
// a master whose part of a batch failed without a reply (see breakers).
func New(c redis.UniversalClient, opts ...Option) *Store {
	s := &Store{c: c, batchKeys: MaxBatchKeys, merge: merger{most: DefaultInFlight, joinKeys: MaxJoinKeys}}
	for _, o := range opts {
		o(s)
	}
	if cc, ok := c.(*redis.ClusterClient); ok {
		s.nodes = newBreakers(cc, NodeCooldown, time.Now)
		s.merge.most = 0
	}
	s.merge.run = s.run
	return s
}

// Load loads the script into Redis (on Cluster, into every node), so that the first batch does
// not pay a NOSCRIPT round trip. Calling it is optional: a batch that meets NOSCRIPT loads the
// script and resends only the failed commands.
func (s *Store) Load(ctx context.Context) error {
	if err := loadScripts(ctx, s.c, true, true, true, true); err != nil {
		return fmt.Errorf("redisstore: load scripts: %w", err)
	}
	return nil
}

// call is one script invocation of a batch.
type call struct {
	item int // index in the request slice
	key  string
	// counter: a calendar counter's call (counter.lua), else a bucket's (bucket.lua)
	counter bool
	// also: the other keys of a take of, or a return to, several buckets (multi.lua), after key
	also []string
	node string // on Cluster, the address of the key's master ("" if unknown)
	args []any
	cmd  *redis.Cmd
	// batched: sent last in a batch.lua invocation with other bucket calls (send)
	batched bool
}

// newCall is the script invocation for request item on key: op and the limit, op's operands
// (take: want, least, share, and unit and the lease handed back first; return: amount,
// granted_at), the operation id, the clock, the bounds of the idempotency records, and for a take
// the demand and the lease lifetime, the debt charged before it (with its max_debt) and the ample
// want, in the order of bucket.lua's ARGV.
func newCall(item int, key, op string, l bucket.Limit, a, b, c int64, id coordinator.OpID, now any, unit int64, back coordinator.Credit, ls leaseArgs, debt debt) call {
	num, den := l.Rate()
	return call{item: item, key: key, args: []any{
		op, int64(l.Capacity()), num, den, int64(l.FillTime()),
		a, b, c,
		id.Agent, id.Seq, now,
		int64(coordinator.RecordKeep), coordinator.MaxRecords, int64(coordinator.ExpiryMargin),
		unit, int64(back.Amount), int64(back.GrantedAt), int64(min(ls.demand, lease.MaxShareDemand)), int64(ls.ttl),
		int64(debt.amount), int64(debt.max), int64(ls.ample),
	}}
}

// leaseArgs are what a take tells bucket.lua of the lease it plans: the agent's demand and the
// lifetime (the contention rule's inputs), and the ample want (lease.Ample). Zero for a return
// and for direct mode.
type leaseArgs struct {
	demand bucket.Micro
	ttl    bucket.Millis
	ample  bucket.Micro
}

// debt is a take's cost settled after the fact and how far below zero it may take the key.
type debt struct {
	amount, max bucket.Micro
}

// newCounterCall is counter.lua's invocation for request item on key: op, the quota and the
// window, op's operands (as newCall), the operation id, the clock, the bounds of the idempotency
// records, and for a take the unit, the lease handed back first and the debt charged before it.
func newCounterCall(item int, key, op string, l bucket.Limit, w bucket.Window, a, b, c int64, id coordinator.OpID, now any, unit int64, back coordinator.Credit, debt debt) call {
	return call{item: item, key: key, counter: true, args: []any{
		op, int64(l.Capacity()), int64(w.Start), int64(w.End), int64(w.Next),
		a, b, c,
		id.Agent, id.Seq, now,
		int64(coordinator.RecordKeep), coordinator.MaxRecords, int64(coordinator.ExpiryMargin),
		unit, int64(back.Amount), int64(back.GrantedAt), int64(debt.amount), int64(debt.max),
	}}
}

// newMultiCall is multi.lua's invocation for request r (with Also): newCall's arguments of a take
// from r.Key without a share cap, then the limit of each other bucket.
func newMultiCall(item int, r *coordinator.TakeRequest, now any) call {
	c := newCall(item, r.Key, "multi", r.Limit, int64(r.Want), int64(r.Min), bucket.WholeShare, r.Op, now, int64(max(1, r.Unit)), coordinator.Credit{}, leaseArgs{}, debt{})
	return withOthers(c, r.Also)
}

// newMultiReturnCall is multi.lua's invocation for return r (with Also): newCall's arguments of a
// return to r.Key, then the limit of each other bucket.
func newMultiReturnCall(item int, r *coordinator.ReturnRequest, now any) call {
	c := newCall(item, r.Key, "return", r.Limit, int64(r.Amount), int64(r.GrantedAt), 0, r.Op, now, 1, coordinator.Credit{}, leaseArgs{}, debt{})
	return withOthers(c, r.Also)
}

// withOthers makes c, a bucket call on the first of several buckets, multi.lua's: its arguments
// end after ARGV 17 (no demand, lease lifetime, debt or ample want) and the limit of each other bucket
// follows, its key among the call's keys.
func withOthers(c call, also []coordinator.Bucket) call {
	c.args = c.args[:17]
	for _, b := range also {
		num, den := b.Limit.Rate()
		c.args = append(c.args, int64(b.Limit.Capacity()), num, den, int64(b.Limit.FillTime()))
		c.also = append(c.also, b.Key)
	}
	return c
}

// reply is the script's answer.
type reply struct {
	bucket.Result
	credited        bucket.Micro
	debited         bucket.Micro
	pace            bucket.Millis
	now             bucket.Millis
	replayed, stale bool
}

// Take implements coordinator.Store.
func (s *Store) Take(ctx context.Context, reqs []coordinator.TakeRequest) ([]coordinator.TakeResult, error) {
	res := make([]coordinator.TakeResult, len(reqs))
	now, err := s.now()
	if err != nil {
		return nil, err
	}
	calls := make([]call, 0, len(reqs))
	for i := range reqs {
		r := &reqs[i]
		if err := r.Validate(); err != nil {
			res[i].Err = fmt.Errorf("redisstore: take: %w", err)
			continue
		}
		share := r.Share
		if share == 0 {
			share = bucket.WholeShare
		}
		d := debt{r.Debt, r.MaxDebt}
		if !r.Period.IsZero() {
			calls = append(calls, newCounterCall(i, r.Key, "take", r.Limit, r.Period, int64(r.Want), int64(r.Min), share, r.Op, now, int64(max(1, r.Unit)), r.Credit, d))
			continue
		}
		if len(r.Also) > 0 {
			calls = append(calls, newMultiCall(i, r, now))
			continue
		}
		calls = append(calls, newCall(i, r.Key, "take", r.Limit, int64(r.Want), int64(r.Min), share, r.Op, now, int64(max(1, r.Unit)), r.Credit, leaseArgs{r.Demand, r.TTL, r.AmpleWant}, d))
	}
	if err := s.exec(ctx, calls); err != nil {
		return nil, fmt.Errorf("redisstore: take: %w", err)
	}
	for _, c := range calls {
		rep, err := c.answer("take")
		if err != nil {
			res[c.item].Err = err
			continue
		}
		if c.also != nil {
			// multi.lua answers the refusing bucket where the others answer the credit.
			res[c.item] = coordinator.TakeResult{Result: rep.Result, Now: rep.now, Replayed: rep.replayed, Stale: rep.stale,
				Refused: int(rep.credited)}
			continue
		}
		res[c.item] = coordinator.TakeResult{Result: rep.Result, Credited: rep.credited, Debited: rep.debited, Pace: rep.pace,
			Now: rep.now, Replayed: rep.replayed, Stale: rep.stale}
	}
	return res, nil
}

// Return implements coordinator.Store.
func (s *Store) Return(ctx context.Context, reqs []coordinator.ReturnRequest) ([]coordinator.ReturnResult, error) {
	res := make([]coordinator.ReturnResult, len(reqs))
	now, err := s.now()
	if err != nil {
		return nil, err
	}
	calls := make([]call, 0, len(reqs))
	for i := range reqs {
		r := &reqs[i]
		if err := r.Validate(); err != nil {
			res[i].Err = fmt.Errorf("redisstore: return: %w", err)
			continue
		}
		if !r.Period.IsZero() {
			calls = append(calls, newCounterCall(i, r.Key, "return", r.Limit, r.Period, int64(r.Amount), int64(r.GrantedAt), 0, r.Op, now, 1, coordinator.Credit{}, debt{}))
			continue
		}
		if len(r.Also) > 0 {
			// One multi.lua call: every bucket credited in one atomic operation, the record in
			// r.Key. It stays out of batch.lua (isBucket) and shares the multi script's NOSCRIPT
			// handling (exec).
			calls = append(calls, newMultiReturnCall(i, r, now))
			continue
		}
		calls = append(calls, newCall(i, r.Key, "return", r.Limit, int64(r.Amount), int64(r.GrantedAt), 0, r.Op, now, 1, coordinator.Credit{}, leaseArgs{}, debt{}))
	}
	if err := s.exec(ctx, calls); err != nil {
		return nil, fmt.Errorf("redisstore: return: %w", err)
	}
	for _, c := range calls {
		rep, err := c.answer("return")
		if err != nil {
			res[c.item].Err = err
			continue
		}
		res[c.item] = coordinator.ReturnResult{
			Result:   bucket.Result{Granted: rep.Granted, Remaining: rep.Remaining},
			Now:      rep.now,
			Replayed: rep.replayed,
			Stale:    rep.stale,
		}
	}
	return res, nil
}

// maxClock bounds an injected clock reading so that now + fill time + margin stays below 2^53.
const maxClock = bucket.MaxExact / 2

// now is the script's clock argument: "" for Redis TIME, else the injected reading.
func (s *Store) now() (any, error) {
	if s.clock == nil {
		return "", nil
	}
	now := s.clock()
	if now < 0 || now > maxClock {
		return nil, fmt.Errorf("redisstore: injected clock reads %d ms, outside 0..2^52", now)
	}
	return int64(now), nil
}

// exec runs calls in one round trip per node, with the calls of other batches that wait for one
// (merger), and returns the error of the whole batch (batchErr).
func (s *Store) exec(ctx context.Context, calls []call) error {
	if len(calls) == 0 {
		return nil
	}
	if !s.merge.do(ctx, calls) {
		return ctx.Err()
	}
	return batchErr(ctx, calls)
}

// run sends calls in one round trip per node (send: one command where one suffices, else a
// pipeline; on Cluster each master its own part, sendByNode). A NOSCRIPT reply
// (Redis restarted or its script cache flushed) loads the script (into every node on Cluster) and
// resends only the failed calls (after the others: the calls of a batch are independent, and
// that once a batch may apply them out of order); steady state costs no extra round trip. The
// error of one call is left in its command.
func (s *Store) run(ctx context.Context, calls []call) {
	only := s.nodes.admit(ctx, calls) // nil: every call
	s.sendByNode(ctx, calls, only, false)
	var missing []int
	var buckets, batches, counters, multis bool // the scripts missing
	for i := range calls {
		if c := &calls[i]; redis.HasErrorPrefix(c.cmd.Err(), "NOSCRIPT") {
			missing = append(missing, i)
			counters = counters || c.counter
			multis = multis || c.also != nil
			batches = batches || c.batched
			buckets = buckets || isBucket(c) && !c.batched
		}
	}
	if len(missing) > 0 {
		// If a node cannot load it (a Cluster replica down), send the source instead.
		loaded := loadScripts(ctx, s.c, buckets, batches, counters, multis) == nil
		s.sendByNode(ctx, calls, missing, !loaded)
	}
	s.nodes.observe(ctx, calls, only)
}

// sendByNode is send, on a Cluster as one pipeline per master run side by side: go-redis fails
// every command of a Cluster pipeline when the retry of one node's part meets the deadline, so
// a hung master would take the answers of the masters that replied with it.
func (s *Store) sendByNode(ctx context.Context, calls []call, only []int, source bool) {
	if s.nodes == nil {
		s.send(ctx, calls, only, source)
		return
	}
	groups := map[string][]int{}
	if only == nil {
		for i := range calls {
			groups[calls[i].node] = append(groups[calls[i].node], i)
		}
	} else {
		for _, i := range only {
			groups[calls[i].node] = append(groups[calls[i].node], i)
		}
	}
	var wg sync.WaitGroup
	for _, idx := range groups {
		wg.Go(func() { s.send(ctx, calls, idx, source) })
	}
	wg.Wait()
}

// evaler is what send needs of a client or a pipeline.
type evaler interface {
	Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd
	EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd
}

// send runs the calls at the indexes only (all calls if only is nil), by digest or, with source,
// by sending the script itself, in one round trip: one command when there is one, else a pipeline.
// On a standalone Redis the bucket calls go in batch.lua invocations of up to s.batchKeys keys
// (a Cluster script may only touch keys of one slot, and a batch's keys are spread over slots).
func (s *Store) send(ctx context.Context, calls []call, only []int, source bool) {
	run := func(e evaler, c *call) {
		keys := []string{c.key}
		src, sc := bucketLua, script
		switch {
		case c.counter:
			src, sc = counterLua, counterScript
		case c.also != nil:
			keys = append(keys, c.also...)
			src, sc = multiLua, multiScript
		}
		if source {
			c.cmd = e.Eval(ctx, src, keys, c.args...)
		} else {
			c.cmd = e.EvalSha(ctx, sc.Hash(), keys, c.args...)
		}
	}
	idx := only
	if idx == nil {
		idx = make([]int, len(calls))
		for i := range idx {
			idx[i] = i
		}
	}
	var units [][]int // what goes as one command: a call, or a batch of bucket calls
	if s.nodes == nil && s.batchKeys > 1 {
		units = batchUnits(calls, idx, s.batchKeys)
	} else {
		units = make([][]int, len(idx))
		for k := range idx {
			units[k] = idx[k : k+1]
		}
	}
	var e evaler = s.c
	var pipe redis.Pipeliner
	if len(units) > 1 {
		pipe = s.c.Pipeline()
		e = pipe
	}
	cmds := make([]*redis.Cmd, len(units)) // a batch's command
	for j, u := range units {
		if len(u) == 1 {
			calls[u[0]].batched = false
			run(e, &calls[u[0]])
			continue
		}
		keys := make([]string, len(u))
		args := make([]any, 0, len(u)*len(calls[u[0]].args))
		for k, i := range u {
			calls[i].batched = true
			keys[k] = calls[i].key
			args = append(args, calls[i].args...)
		}
		if source {
			cmds[j] = e.Eval(ctx, batchLua, keys, args...)
		} else {
			cmds[j] = e.EvalSha(ctx, batchScript.Hash(), keys, args...)
		}
	}
	if pipe != nil {
		_, _ = pipe.Exec(ctx) // per-command errors are read by the caller
	}
	for j, u := range units {
		if len(u) > 1 {
			splitBatch(cmds[j], calls, u)
		}
	}
}

// batchUnits splits the calls at idx, in order, into what send sends as one command: a batch of
// up to most consecutive bucket calls for batch.lua, or a call alone (a counter's, a take of or
// a return to several buckets, a bucket call with no other beside it). The order of the calls is
// kept.
func batchUnits(calls []call, idx []int, most int) [][]int {
	units := make([][]int, 0, len(idx))
	for start := 0; start < len(idx); {
		end := start + 1
		if isBucket(&calls[idx[start]]) {
			for end < len(idx) && end-start < most && isBucket(&calls[idx[end]]) {
				end++
			}
		}
		units = append(units, idx[start:end:end])
		start = end
	}
	return units
}

// isBucket reports whether c is a bucket.lua call.
func isBucket(c *call) bool { return !c.counter && c.also == nil }

// splitBatch gives each call of batch b its part of batch.lua's answer cmd: its reply or error, or
// the whole command's error (NOSCRIPT, a lost connection) when there is no answer.
func splitBatch(cmd *redis.Cmd, calls []call, b []int) {
	vals, err := cmd.Slice()
	if err == nil && len(vals) != len(b) {
		err = fmt.Errorf("batch script answered %d replies for %d keys", len(vals), len(b))
	}
	for k, i := range b {
		var v any
		e := err
		if e == nil {
			v = vals[k]
			if re, ok := v.(error); ok { // the key's own error reply
				v, e = nil, re
			}
		}
		calls[i].cmd = redis.NewCmdResult(v, e)
	}
}

// batchErr is the error of the whole batch: a failure of every call that is not a Redis reply
// (every node unreachable, or the context done before any answered). Redis error replies and
// failures of some calls belong to their items: when one Cluster node hangs until the deadline,
// the keys of the nodes that answered keep their results (they were applied).
func batchErr(ctx context.Context, calls []call) error {
	var first error
	for _, c := range calls {
		err := c.cmd.Err()
		var reply redis.Error
		if err == nil || errors.As(err, &reply) {
			return nil
		}
		if first == nil {
			first = err
		}
	}
	if err := ctx.Err(); err != nil {
		if first == nil {
			return err
		}
		return fmt.Errorf("%w: %w", err, first)
	}
	// A client with ContextTimeoutEnabled sets the context's deadline on its sockets: the socket
	// can time out a moment before the context reports it.
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
		return fmt.Errorf("%w: %w", context.DeadlineExceeded, first)
	}
	return first
}

// answer decodes the script's reply to c; the error names op and the key.
func (c *call) answer(op string) (reply, error) {
	rep, err := decode(c.cmd)
	if redis.HasErrorPrefix(err, "OUTSIDE_WINDOW") {
		return reply{}, fmt.Errorf("redisstore: %s %q: %w (%w)", op, c.key, bucket.ErrOutsideWindow, err)
	}
	if err != nil {
		return reply{}, fmt.Errorf("redisstore: %s %q: %w", op, c.key, err)
	}
	return rep, nil
}

func decode(cmd *redis.Cmd) (reply, error) {
	vals, err := cmd.Slice()
	if err != nil {
		return reply{}, err
	}
	if len(vals) != 8 {
		return reply{}, fmt.Errorf("script answered %d values, want 8", len(vals))
	}
	var n [8]int64
	for i, v := range vals {
		x, ok := v.(int64)
		if !ok {
			return reply{}, fmt.Errorf("script answered %T %v at %d, want an integer", v, v, i)
		}
		n[i] = x
	}
	return reply{
		Result:   bucket.Result{Granted: bucket.Micro(n[0]), Remaining: bucket.Micro(n[1]), RetryAfter: bucket.Millis(n[2])},
		credited: bucket.Micro(n[5]),
		debited:  bucket.Micro(n[7]),
		pace:     bucket.Millis(n[6]),
		now:      bucket.Millis(n[3]),
		replayed: n[4]&flagReplayed != 0,
		stale:    n[4]&flagStale != 0,
	}, nil
}
