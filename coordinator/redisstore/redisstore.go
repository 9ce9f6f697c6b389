// Package redisstore is the production coordinator.Store: one token bucket per key in Redis
// (standalone, Sentinel or Cluster, through go-redis' UniversalClient), changed only by the
// embedded script bucket.lua.
//
// The script runs the arithmetic of internal/bucket exactly, in Lua doubles kept below 2^53, and
// keeps the idempotency records of coordinator.OpID inside the bucket's own hash, so each request
// touches exactly one key and Cluster can place keys freely. Its clock is Redis TIME, read inside
// the script: every coordinator shares the same clock for a key.
//
// Key layout, a hash: t tokens (µ), l last refill (ms, the key clock), x the logical expiry (absent
// when the key never expires), a:<agent> the agent's last Take ("seq granted remaining retry now"),
// r:<agent> its last Return ("seq credited remaining now"). With Redis' default
// hash-max-listpack-entries 128 and hash-max-listpack-value 64, a key of a few agents with short
// ids stays in the compact listpack encoding (about 200 bytes with one record).
//
// A batch is one pipeline: one round trip per Redis node involved. go-redis may resend a command
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
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

//go:embed bucket.lua
var bucketLua string

var script = redis.NewScript(bucketLua)

// Result flags set by the script.
const (
	flagReplayed = 1
	flagStale    = 2
)

// Store is a coordinator.Store on Redis. It is safe for concurrent use.
type Store struct {
	c     redis.UniversalClient
	clock func() bucket.Millis // nil: Redis TIME inside the script
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

// New returns a Store on c.
func New(c redis.UniversalClient, opts ...Option) *Store {
	s := &Store{c: c}
	for _, o := range opts {
		o(s)
	}
	return s
}

// Load loads the script into Redis (on Cluster, into every node), so that the first batch does
// not pay a NOSCRIPT round trip. Calling it is optional: a batch that meets NOSCRIPT loads the
// script and resends only the failed commands.
func (s *Store) Load(ctx context.Context) error {
	if err := script.Load(ctx, s.c).Err(); err != nil {
		return fmt.Errorf("redisstore: load script: %w", err)
	}
	return nil
}

// call is one script invocation of a batch.
type call struct {
	item int // index in the request slice
	key  string
	args []any
	cmd  *redis.Cmd
}

// reply is the script's answer.
type reply struct {
	granted, remaining, retry, now int64
	flags                          int64
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
		num, den := r.Limit.Rate()
		calls = append(calls, call{item: i, key: r.Key, args: []any{
			"take", int64(r.Limit.Capacity()), num, den, int64(r.Limit.FillTime()),
			int64(r.Want), int64(r.Min), share,
			r.Op.Agent, r.Op.Seq, now,
			int64(coordinator.RecordKeep), coordinator.MaxRecords, int64(coordinator.ExpiryMargin),
		}})
	}
	if err := s.exec(ctx, calls); err != nil {
		return nil, fmt.Errorf("redisstore: take: %w", err)
	}
	for _, c := range calls {
		rep, err := decode(c.cmd)
		if err != nil {
			res[c.item].Err = fmt.Errorf("redisstore: take %q: %w", c.key, err)
			continue
		}
		res[c.item] = coordinator.TakeResult{
			Result: bucket.Result{
				Granted:    bucket.Micro(rep.granted),
				Remaining:  bucket.Micro(rep.remaining),
				RetryAfter: bucket.Millis(rep.retry),
			},
			Now:      bucket.Millis(rep.now),
			Replayed: rep.flags&flagReplayed != 0,
			Stale:    rep.flags&flagStale != 0,
		}
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
		num, den := r.Limit.Rate()
		calls = append(calls, call{item: i, key: r.Key, args: []any{
			"return", int64(r.Limit.Capacity()), num, den, int64(r.Limit.FillTime()),
			int64(r.Amount), int64(r.GrantedAt), 0,
			r.Op.Agent, r.Op.Seq, now,
			int64(coordinator.RecordKeep), coordinator.MaxRecords, int64(coordinator.ExpiryMargin),
		}})
	}
	if err := s.exec(ctx, calls); err != nil {
		return nil, fmt.Errorf("redisstore: return: %w", err)
	}
	for _, c := range calls {
		rep, err := decode(c.cmd)
		if err != nil {
			res[c.item].Err = fmt.Errorf("redisstore: return %q: %w", c.key, err)
			continue
		}
		res[c.item] = coordinator.ReturnResult{
			Result:   bucket.Result{Granted: bucket.Micro(rep.granted), Remaining: bucket.Micro(rep.remaining)},
			Now:      bucket.Millis(rep.now),
			Replayed: rep.flags&flagReplayed != 0,
			Stale:    rep.flags&flagStale != 0,
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

// exec runs calls in one round trip per node: one command for a single call (cheaper than a
// pipeline of one), else one pipeline, which go-redis splits by node on Cluster. A NOSCRIPT reply
// (Redis restarted or its script cache flushed) loads the script (into every node on Cluster) and
// resends only the failed calls; steady state costs no extra round trip. exec returns an error
// only when the whole batch failed; the error of one call is left in its command.
func (s *Store) exec(ctx context.Context, calls []call) error {
	if len(calls) == 0 {
		return nil
	}
	s.send(ctx, calls, nil, false)
	var missing []int
	for i := range calls {
		if redis.HasErrorPrefix(calls[i].cmd.Err(), "NOSCRIPT") {
			missing = append(missing, i)
		}
	}
	if len(missing) > 0 {
		// If a node cannot load it (a Cluster replica down), send the source instead.
		loaded := script.Load(ctx, s.c).Err() == nil
		s.send(ctx, calls, missing, !loaded)
	}
	return batchErr(ctx, calls)
}

// evaler is what send needs of a client or a pipeline.
type evaler interface {
	Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd
	EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd
}

// send runs the calls at the indexes only (all calls if only is nil), by digest or, with source,
// by sending the script itself.
func (s *Store) send(ctx context.Context, calls []call, only []int, source bool) {
	run := func(e evaler, c *call) {
		keys := []string{c.key}
		if source {
			c.cmd = e.Eval(ctx, bucketLua, keys, c.args...)
		} else {
			c.cmd = e.EvalSha(ctx, script.Hash(), keys, c.args...)
		}
	}
	switch {
	case len(calls) == 1 && only == nil || len(only) == 1:
		i := 0
		if only != nil {
			i = only[0]
		}
		run(s.c, &calls[i])
	default:
		pipe := s.c.Pipeline()
		if only == nil {
			for i := range calls {
				run(pipe, &calls[i])
			}
		} else {
			for _, i := range only {
				run(pipe, &calls[i])
			}
		}
		_, _ = pipe.Exec(ctx) // per-command errors are read by the caller
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

func decode(cmd *redis.Cmd) (reply, error) {
	vals, err := cmd.Slice()
	if err != nil {
		return reply{}, err
	}
	if len(vals) != 5 {
		return reply{}, fmt.Errorf("script answered %d values, want 5", len(vals))
	}
	var n [5]int64
	for i, v := range vals {
		x, ok := v.(int64)
		if !ok {
			return reply{}, fmt.Errorf("script answered %T %v at %d, want an integer", v, v, i)
		}
		n[i] = x
	}
	return reply{granted: n[0], remaining: n[1], retry: n[2], now: n[3], flags: n[4]}, nil
}
