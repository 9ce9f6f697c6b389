package chaos

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

// DebtLevel is the lowest level Redis showed for a bucket whose rule allows debt (max_debt),
// sampled through the run.
type DebtLevel struct {
	Key     string
	Lowest  float64 // tokens
	MaxDebt float64 // tokens
	Samples int
}

// debtWatch samples the Redis level of the buckets that may go into debt, every debtEvery, until
// stopped: the level never goes below −max_debt (docs/leases.md, "Debt").
type debtWatch struct {
	s    *Stack
	keys []*Key
	stop chan struct{}
	wg   sync.WaitGroup

	mu     sync.Mutex
	lowest map[int]bucket.Micro
	counts map[int]int
}

const debtEvery = 20 * time.Millisecond

func watchDebt(s *Stack, keys []*Key) *debtWatch {
	w := &debtWatch{s: s, keys: keys, stop: make(chan struct{}), lowest: map[int]bucket.Micro{}, counts: map[int]int{}}
	if len(keys) == 0 {
		return w
	}
	w.wg.Go(w.run)
	return w
}

func (w *debtWatch) run() {
	t := time.NewTicker(debtEvery)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
		}
		for _, k := range w.keys {
			w.sample(k)
		}
	}
}

func (w *debtWatch) sample(k *Key) {
	i, err := w.s.NodeOf(k.Name)
	if err != nil {
		return
	}
	c := w.s.RedisClient(i)
	defer func() { _ = c.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	v, err := c.HGet(ctx, k.Name, "t").Result()
	if err != nil {
		return // no key yet (a full bucket), or the node is down in a fault
	}
	level, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if low, ok := w.lowest[k.ID]; !ok || bucket.Micro(level) < low {
		w.lowest[k.ID] = bucket.Micro(level)
	}
	w.counts[k.ID]++
}

// Stop stops the sampling and returns the lowest levels, with a violation for each bucket whose
// level went below −max_debt.
func (w *debtWatch) Stop() ([]DebtLevel, []Violation) {
	select {
	case <-w.stop:
	default:
		close(w.stop)
	}
	w.wg.Wait()
	w.mu.Lock()
	defer w.mu.Unlock()
	var ls []DebtLevel
	var vs []Violation
	for _, k := range w.keys {
		low, ok := w.lowest[k.ID]
		if !ok {
			continue
		}
		l := DebtLevel{Key: k.Name, Lowest: tokensOf(low), MaxDebt: k.MaxDebt, Samples: w.counts[k.ID]}
		ls = append(ls, l)
		vs = append(vs, checkDebtLevel(l)...)
	}
	return ls, vs
}

// checkDebtLevel: a bucket's level never goes below −max_debt.
func checkDebtLevel(l DebtLevel) []Violation {
	if l.Lowest < -l.MaxDebt {
		return []Violation{{Check: "debt", Detail: fmt.Sprintf("key %s: level %.6f tokens in Redis, below −max_debt = %.0f",
			l.Key, l.Lowest, -l.MaxDebt)}}
	}
	return nil
}
