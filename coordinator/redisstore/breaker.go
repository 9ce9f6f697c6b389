package redisstore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// NodeCooldown is how long a Cluster master whose part of a batch failed without a reply (it
// hung until the batch's deadline, refused connections, or reset them) is not asked again.
//
// An agent's refill batch mixes keys of every master, and a batch is answered as a whole: without
// this, every batch holding a key of a hung master would wait for the coordinator's store timeout,
// and the keys of the healthy masters in it would fall into their failure modes on the agents as
// surely as the failed master's. During the cooldown that master's keys fail at once with
// ErrNodeUnavailable (nothing is sent, so nothing is debited) and the other keys of the batch are
// served at the speed of their masters. After it, the next batch asks the master again (one
// batch per cooldown pays the timeout while the master stays down).
const NodeCooldown = time.Second

// ErrNodeUnavailable is the error of a key whose Cluster master failed a batch less than
// NodeCooldown ago: the key was not sent to Redis.
var ErrNodeUnavailable = errors.New("redisstore: the key's Redis master failed recently; not asked")

// breakers remembers, per Cluster master, until when its keys are not sent. A nil *breakers (a
// standalone or Sentinel client) admits every call.
type breakers struct {
	cc       *redis.ClusterClient
	cooldown time.Duration
	now      func() time.Time

	mu   sync.Mutex
	open map[string]time.Time // master address → its keys are skipped until then
}

func newBreakers(cc *redis.ClusterClient, cooldown time.Duration, now func() time.Time) *breakers {
	return &breakers{cc: cc, cooldown: cooldown, now: now, open: map[string]time.Time{}}
}

// admit finds each call's master and returns the indexes of the calls to send, or nil for all of
// them. A call of a master in its cooldown gets a failed command with ErrNodeUnavailable instead.
// A master whose cooldown ended is admitted again, and its cooldown starts over at once, so that
// only one batch per cooldown probes a master that is still down; observe closes it on success.
func (b *breakers) admit(ctx context.Context, calls []call) []int {
	if b == nil {
		return nil
	}
	for i := range calls {
		if c, err := b.cc.MasterForKey(ctx, calls[i].key); err == nil {
			calls[i].node = c.Options().Addr
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.open) == 0 {
		return nil
	}
	now := b.now()
	skip := map[string]bool{}
	for node, until := range b.open {
		if now.Before(until) {
			skip[node] = true
		} else {
			b.open[node] = now.Add(b.cooldown) // this batch probes it
		}
	}
	only := make([]int, 0, len(calls))
	for i := range calls {
		if skip[calls[i].node] {
			cmd := redis.NewCmd(ctx)
			cmd.SetErr(fmt.Errorf("%w (%s)", ErrNodeUnavailable, calls[i].node))
			calls[i].cmd = cmd
			continue
		}
		only = append(only, i)
	}
	return only
}

// observe opens the breaker of every master none of whose sent calls got a reply, and closes it
// for every master that answered one. A batch its caller canceled says nothing of the masters.
func (b *breakers) observe(ctx context.Context, calls []call, only []int) {
	if b == nil || errors.Is(ctx.Err(), context.Canceled) {
		return
	}
	answered, failed := map[string]bool{}, map[string]bool{}
	look := func(c *call) {
		if c.node == "" {
			return
		}
		var reply redis.Error
		if err := c.cmd.Err(); err == nil || errors.As(err, &reply) {
			answered[c.node] = true
		} else {
			failed[c.node] = true
		}
	}
	if only == nil {
		for i := range calls {
			look(&calls[i])
		}
	} else {
		for _, i := range only {
			look(&calls[i])
		}
	}
	if len(failed) == 0 && len(answered) == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for node := range answered {
		delete(b.open, node)
	}
	now := b.now()
	for node := range failed {
		if !answered[node] {
			b.open[node] = now.Add(b.cooldown)
		}
	}
}
