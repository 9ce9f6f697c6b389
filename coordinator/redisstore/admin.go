package redisstore

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

//go:embed admin.lua
var adminBody string

// adminLua is admin.lua with refill.lua inserted at its marker (store_bucket needs the clock and
// the arguments admin.lua reads first), after intmath.lua.
var adminLua = func() string {
	head, body, ok := strings.Cut(adminBody, "\n-- refill.lua\n")
	if !ok {
		panic("redisstore: admin.lua has no refill.lua marker")
	}
	return intmathLua + head + "\n" + refillLua + body
}()

var adminScript = redis.NewScript(adminLua)

// runScript runs one script call on key as a pipeline of one command, by digest and, after a
// NOSCRIPT reply, by its source. A pipeline, because a Cluster client asks Redis for command
// metadata (COMMAND, which the coordinator's ACL user is not allowed) before a lone command, not
// before a pipeline.
func (s *Store) runScript(ctx context.Context, sc *redis.Script, src, key string, args ...any) *redis.Cmd {
	keys := []string{key}
	pipe := s.c.Pipeline()
	cmd := pipe.EvalSha(ctx, sc.Hash(), keys, args...)
	_, _ = pipe.Exec(ctx) // the error is the command's
	if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		pipe = s.c.Pipeline()
		cmd = pipe.Eval(ctx, src, keys, args...)
		_, _ = pipe.Exec(ctx)
	}
	return cmd
}

var _ coordinator.AdminStore = (*Store)(nil)

// Inspect implements coordinator.AdminStore: one script call that reads the key's hash and
// Redis TIME (or the injected clock) and writes nothing.
func (s *Store) Inspect(ctx context.Context, key string, l bucket.Limit) (coordinator.Snapshot, error) {
	if err := coordinator.ValidateKey(key, l); err != nil {
		return coordinator.Snapshot{}, fmt.Errorf("redisstore: inspect: %w", err)
	}
	now, err := s.now()
	if err != nil {
		return coordinator.Snapshot{}, err
	}
	vals, err := s.runScript(ctx, adminScript, adminLua, key, "inspect", now).Slice()
	if err != nil {
		return coordinator.Snapshot{}, fmt.Errorf("redisstore: inspect %q: %w", key, err)
	}
	if len(vals) != 2 {
		return coordinator.Snapshot{}, fmt.Errorf("redisstore: inspect %q: script answered %d values, want 2", key, len(vals))
	}
	at, ok := vals[0].(int64)
	if !ok {
		return coordinator.Snapshot{}, fmt.Errorf("redisstore: inspect %q: clock %v is not an integer", key, vals[0])
	}
	snap, err := decodeHash(bucket.Millis(at), vals[1])
	if err != nil {
		return coordinator.Snapshot{}, fmt.Errorf("redisstore: inspect %q: %w", key, err)
	}
	return snap, nil
}

// SetLevel implements coordinator.AdminStore with one script call (admin.lua) on the key.
func (s *Store) SetLevel(ctx context.Context, key string, l bucket.Limit, level bucket.Micro) (before, after coordinator.Snapshot, err error) {
	if err := coordinator.ValidateLevel(key, l, level); err != nil {
		return before, after, fmt.Errorf("redisstore: set level: %w", err)
	}
	now, err := s.now()
	if err != nil {
		return before, after, err
	}
	num, den := l.Rate()
	vals, err := s.runScript(ctx, adminScript, adminLua, key, "set", now,
		int64(l.Capacity()), num, den, int64(level), int64(coordinator.ExpiryMargin)).Slice()
	if err != nil {
		return before, after, fmt.Errorf("redisstore: set level of %q: %w", key, err)
	}
	if len(vals) != 3 {
		return before, after, fmt.Errorf("redisstore: set level of %q: script answered %d values, want 3", key, len(vals))
	}
	at, ok := vals[0].(int64)
	if !ok {
		return before, after, fmt.Errorf("redisstore: set level of %q: clock %v is not an integer", key, vals[0])
	}
	if before, err = decodeHash(bucket.Millis(at), vals[1]); err == nil {
		after, err = decodeHash(bucket.Millis(at), vals[2])
	}
	if err != nil {
		return before, after, fmt.Errorf("redisstore: set level of %q: %w", key, err)
	}
	return before, after, nil
}

// decodeHash reads a bucket's hash (HGETALL's flat field, value list) as of now. Fields of the
// layout (see the package doc) are decoded; records that do not parse and fields this version
// does not know are listed in Other. A key without t and l, or past its logical expiry, is not
// stored: a full bucket without records, as bucket.lua and memstore treat it.
func decodeHash(now bucket.Millis, v any) (coordinator.Snapshot, error) {
	snap := coordinator.Snapshot{Now: now}
	flat, ok := v.([]any)
	if !ok || len(flat)%2 != 0 {
		return snap, fmt.Errorf("hash reply %T of %d values, want field, value pairs", v, len(flat))
	}
	fields := make(map[string]string, len(flat)/2)
	for i := 0; i < len(flat); i += 2 {
		k, kok := flat[i].(string)
		val, vok := flat[i+1].(string)
		if !kok || !vok {
			return snap, errors.New("hash reply holds a value that is not a string")
		}
		fields[k] = val
	}
	num := func(name string) (int64, bool, error) {
		s, ok := fields[name]
		if !ok {
			return 0, false, nil
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, false, fmt.Errorf("field %s = %q is not an integer", name, s)
		}
		return n, true, nil
	}
	t, hasT, err := num("t")
	if err != nil {
		return snap, err
	}
	last, hasL, err := num("l")
	if err != nil {
		return snap, err
	}
	frac, _, err := num("f")
	if err != nil {
		return snap, err
	}
	x, hasX, err := num("x")
	if err != nil {
		return snap, err
	}
	if !hasT || !hasL || hasX && now >= bucket.Millis(x) {
		return snap, nil
	}
	snap.Stored = true
	snap.State = bucket.State{Tokens: bucket.Micro(t), Last: bucket.Millis(last), Frac: frac}
	if hasX {
		snap.Expires, snap.Expiry = true, bucket.Millis(x)
	}
	for name, val := range fields {
		switch {
		case name == "t" || name == "l" || name == "f" || name == "x" || name == "c":
		case strings.HasPrefix(name, "a:"):
			// "seq granted remaining retry [credited] now": the time is always the last word.
			if n, ok := ints(val, 5); ok {
				if snap.Takes == nil {
					snap.Takes = map[string]coordinator.TakeRecord{}
				}
				snap.Takes[name[2:]] = coordinator.TakeRecord{Seq: uint64(n[0]), Granted: bucket.Micro(n[1]),
					Remaining: bucket.Micro(n[2]), RetryAfter: bucket.Millis(n[3]), Now: bucket.Millis(n[len(n)-1])}
				continue
			}
			snap.Other = append(snap.Other, name)
		case strings.HasPrefix(name, "m:"):
			// multi.lua: "seq granted remaining retry refused now"
			if n, ok := ints(val, 6); ok {
				if snap.Multis == nil {
					snap.Multis = map[string]coordinator.TakeRecord{}
				}
				snap.Multis[name[2:]] = coordinator.TakeRecord{Seq: uint64(n[0]), Granted: bucket.Micro(n[1]),
					Remaining: bucket.Micro(n[2]), RetryAfter: bucket.Millis(n[3]), Now: bucket.Millis(n[len(n)-1])}
				continue
			}
			snap.Other = append(snap.Other, name)
		case strings.HasPrefix(name, "r:"):
			if n, ok := ints(val, 4); ok {
				if snap.Returns == nil {
					snap.Returns = map[string]coordinator.ReturnRecord{}
				}
				snap.Returns[name[2:]] = coordinator.ReturnRecord{Seq: uint64(n[0]), Credited: bucket.Micro(n[1]),
					Remaining: bucket.Micro(n[2]), Now: bucket.Millis(n[3])}
				continue
			}
			snap.Other = append(snap.Other, name)
		default:
			snap.Other = append(snap.Other, name)
		}
	}
	slices.Sort(snap.Other)
	return snap, nil
}

// ints reads the space-separated integers of a record, at least n of them.
func ints(s string, n int) ([]int64, bool) {
	words := strings.Fields(s)
	if len(words) < n {
		return nil, false
	}
	out := make([]int64, len(words))
	for i := range out {
		v, err := strconv.ParseInt(words[i], 10, 64)
		if err != nil {
			return nil, false
		}
		out[i] = v
	}
	return out, true
}
