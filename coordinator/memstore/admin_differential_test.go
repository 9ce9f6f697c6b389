package memstore_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
)

// adminRun mixes the admin operations (Inspect, SetLevel) into a differential sequence.
type adminRun struct {
	*diffRun
	sets int // SetLevel calls both stores accepted
}

func (a *adminRun) run(steps int) {
	a.t.Helper()
	for range steps {
		if a.src.exhausted() {
			break
		}
		switch a.src.n(12) {
		case 0, 1:
			a.advance(between(a.src, 0, bucket.Millis(2000)))
		case 2:
			a.advance(-between(a.src, 1, bucket.Millis(1_000_000)))
		case 3:
			a.advance(between(a.src, 0, 30*year))
		case 4:
			if e, ok := a.mem.Lookup(pick(a.src, a.keys[0], a.keys[1])); ok && e.Expires {
				a.now = min(e.Expiry-between(a.src, 0, bucket.Millis(1)), maxNow)
				a.logf("clock = %d (expiry %d)", a.now, e.Expiry)
			}
		case 5, 6:
			a.takes()
		case 7:
			a.returns()
		case 8, 9:
			a.setLevel()
		default:
			a.inspect()
		}
	}
	for i, key := range a.keys {
		a.compareState(key, a.limits[i])
	}
}

func (a *adminRun) inspect() {
	a.t.Helper()
	k := a.src.n(2)
	got, gerr := a.lua.Inspect(context.Background(), a.keys[k], a.limits[k])
	want, werr := a.mem.Inspect(context.Background(), a.keys[k], a.limits[k])
	a.logf("at %d: Inspect(%s) = %s", a.now, a.keys[k], storetest.SnapshotString(want))
	if gerr != nil || werr != nil || !storetest.SameSnapshot(got, want) {
		a.fail("at %d: Inspect(%s) = %s, %v on Redis; want %s, %v as memstore", a.now, a.keys[k],
			storetest.SnapshotString(got), gerr, storetest.SnapshotString(want), werr)
	}
	// Below zero down to -capacity: a debt settled after the fact (max_debt <= capacity).
	if got.Stored && (got.State.Tokens < -a.limits[k].Capacity() || got.State.Tokens > a.limits[k].Capacity()) {
		a.fail("at %d: %s holds %d µ, capacity %d", a.now, a.keys[k], got.State.Tokens, a.limits[k].Capacity())
	}
}

func (a *adminRun) setLevel() {
	a.t.Helper()
	k := a.src.n(2)
	l := a.limits[k]
	var level bucket.Micro
	switch a.src.n(6) {
	case 0:
		level = 0
	case 1:
		level = l.Capacity()
	case 2:
		level = l.Capacity() + between(a.src, 1, bucket.Micro(1000)) // above: both must refuse
	case 3:
		level = -1
	default:
		level = between(a.src, 0, l.Capacity())
	}
	gb, ga, gerr := a.lua.SetLevel(context.Background(), a.keys[k], l, level)
	wb, wa, werr := a.mem.SetLevel(context.Background(), a.keys[k], l, level)
	a.logf("at %d: SetLevel(%s, %d) = %s → %s, %v", a.now, a.keys[k], level,
		storetest.SnapshotString(wb), storetest.SnapshotString(wa), werr)
	invalid := level < 0 || level > l.Capacity()
	switch {
	case invalid && (!errors.Is(gerr, coordinator.ErrInvalidRequest) || !errors.Is(werr, coordinator.ErrInvalidRequest)):
		a.fail("at %d: SetLevel(%s, %d) = %v on Redis, %v as memstore; want both refused", a.now, a.keys[k], level, gerr, werr)
	case invalid:
		return
	case gerr != nil || werr != nil:
		a.fail("at %d: SetLevel(%s, %d) = %v on Redis, %v as memstore", a.now, a.keys[k], level, gerr, werr)
	case !storetest.SameSnapshot(gb, wb) || !storetest.SameSnapshot(ga, wa):
		a.fail("at %d: SetLevel(%s, %d) = %s → %s on Redis; want %s → %s as memstore", a.now, a.keys[k], level,
			storetest.SnapshotString(gb), storetest.SnapshotString(ga), storetest.SnapshotString(wb), storetest.SnapshotString(wa))
	case ga.Level(l) != level:
		a.fail("at %d: SetLevel(%s, %d) left level %d", a.now, a.keys[k], level, ga.Level(l))
	}
	a.sets++
}

// TestAdminDifferential plays random sequences of Take, Return, Inspect and SetLevel on the Lua
// store and on memstore: every answer and the final state of every key must be identical.
func TestAdminDifferential(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	sequences, steps := 1000, 30
	if testing.Short() {
		sequences = 200
	}
	const workers = 4
	var next, sets atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				seed := next.Add(1)
				if seed > int64(sequences) || t.Failed() {
					return
				}
				src := randSource{rand.New(rand.NewPCG(uint64(seed), 0xad317))}
				a := &adminRun{diffRun: newDiffRun(t, rdb, src, "admin/"+strconv.FormatInt(seed, 10), fewAgents, 3, false)}
				a.logf("seed %d", seed)
				a.run(steps)
				sets.Add(int64(a.sets))
			}
		})
	}
	wg.Wait()
	if sets.Load() == 0 {
		t.Fatal("no sequence set a level: the test does not reach SetLevel")
	}
}

// FuzzAdminDifferential decodes a sequence with admin operations from the input.
func FuzzAdminDifferential(f *testing.F) {
	srv := redistest.Start(f)
	rdb := srv.Client(f)
	seeds := rand.New(rand.NewPCG(5, 8))
	for i := range 16 {
		b := make([]byte, 16+i*24)
		for j := range b {
			b[j] = byte(seeds.UintN(256))
		}
		f.Add(b)
	}
	var runs atomic.Int64
	f.Fuzz(func(t *testing.T, data []byte) {
		prefix := "fuzz-admin/" + strconv.FormatInt(runs.Add(1), 10)
		(&adminRun{diffRun: newDiffRun(t, rdb, &byteSource{b: data}, prefix, fewAgents, 3, false)}).run(200)
	})
}
