package coordinator_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// pending is an agent's call that failed, or whose items partly failed, with what it learnt.
type pending struct {
	req   *coordinatorv1.AcquireRequest
	first *coordinatorv1.AcquireResponse // nil when the whole call failed
}

// storeFailure checks that a failed call carries the distinct store error and no internal detail.
func storeFailure(t *testing.T, err error, addrs []string) {
	t.Helper()
	if status.Code(err) != codes.Unavailable || coordinatorv1.Reason(err) != coordinatorv1.ReasonStoreUnavailable {
		t.Errorf("call failed with %v (reason %q), want UNAVAILABLE with reason STORE_UNAVAILABLE", err, coordinatorv1.Reason(err))
	}
	for _, a := range addrs {
		if strings.Contains(err.Error(), a) {
			t.Errorf("the client sees a store address: %v", err)
		}
	}
}

// killAgents run against rs until each sees a store failure: agent i sends batches over every ref
// with rising seq and stops at its first failed call or failed item, reporting that call. Each
// answered batch is offered on ok, if someone is receiving.
func killAgents(t *testing.T, l *ledger, set *policy.Set, refs []*coordinatorv1.BucketRef, rs []*replica, n int,
	addrs []string, ok chan<- struct{}) []pending {
	keys := bucketKeys(t, set, refs)
	var mu sync.Mutex
	var out []pending
	var wg sync.WaitGroup
	for id := range n {
		wg.Go(func() {
			name := fmt.Sprintf("agent-%02d", id)
			for seq := uint64(1); ; seq++ {
				var items []*coordinatorv1.AcquireItem
				for _, x := range refs {
					items = append(items, item(x, 2*tok, tok))
				}
				req := acquire(name, seq, set.Version(), items...)
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				resp, err := rs[int(seq)%len(rs)].client.Acquire(ctx, req)
				cancel()
				if err != nil {
					storeFailure(t, err, addrs)
					mu.Lock()
					out = append(out, pending{req: req})
					mu.Unlock()
					return
				}
				failed := false
				for _, r := range resp.Results {
					failed = failed || r.Status == coordinatorv1.Status_STATUS_STORE_UNAVAILABLE
				}
				if failed {
					mu.Lock()
					out = append(out, pending{req: req, first: resp})
					mu.Unlock()
					return
				}
				for i, r := range resp.Results {
					l.grant(keys[i], r)
				}
				select {
				case ok <- struct{}{}:
				default:
				}
			}
		})
	}
	wg.Wait()
	return out
}

// retryPending resends each failed call with its own seq until it is answered: items answered
// before come back replayed and equal; failed items are either replayed (Redis recorded them
// before it died) or granted now (it did not), never both. It returns how many failed items had
// been recorded.
func retryPending(t *testing.T, l *ledger, set *policy.Set, refs []*coordinatorv1.BucketRef, rs []*replica, ps []pending) (recorded, fresh int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for _, p := range ps {
		var resp *coordinatorv1.AcquireResponse
		for attempt := 0; ; attempt++ {
			var err error
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			resp, err = rs[attempt%len(rs)].client.Acquire(ctx, p.req)
			cancel()
			unavailable := err != nil
			for _, r := range resp.GetResults() {
				unavailable = unavailable || r.Status == coordinatorv1.Status_STATUS_STORE_UNAVAILABLE
			}
			if !unavailable {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("retry of %s/%d not answered 30 s after Redis came back: %v %v", p.req.AgentId, p.req.Seq, resp, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
		for i, r := range resp.Results {
			if r.Status != coordinatorv1.Status_STATUS_OK {
				t.Errorf("retry of %s/%d item %d: %v", p.req.AgentId, p.req.Seq, i, r)
				continue
			}
			if p.first != nil && p.first.Results[i].Status == coordinatorv1.Status_STATUS_OK {
				if f := p.first.Results[i]; !r.Replayed || r.GrantedMicro != f.GrantedMicro || r.GrantedAtMs != f.GrantedAtMs {
					t.Errorf("retry of %s/%d item %d = %v, want the first answer %v replayed", p.req.AgentId, p.req.Seq, i, r, f)
				}
			} else if r.Replayed {
				recorded++
			} else {
				fresh++
			}
			l.grant(key(t, set, refs[i]), r)
		}
	}
	return recorded, fresh
}

// TestRedisKilledMidRun: Redis dies (SIGKILL) under load from agents on three coordinators. Every
// failed call carries the distinct store error, health turns NOT_SERVING; when Redis restarts
// (from its append-only file, fsynced on every write) health turns SERVING again and each
// failed call, retried with its seq, is answered. Every key then holds exactly what the agents
// were granted: each batch was recorded or not per key, never charged twice, never lost.
func TestRedisKilledMidRun(t *testing.T) {
	srv := redistest.Start(t, redistest.WithConfig("appendonly", "yes"), redistest.WithConfig("appendfsync", "always"))
	set := mustPolicy(t, "v1")
	rs := redisReplicas(t, 3, set, func() redis.UniversalClient {
		o := clientOptions(srv.Options())
		o.MaxRetries = 1
		return redis.NewClient(o)
	})
	var refs []*coordinatorv1.BucketRef
	for i := range 8 {
		refs = append(refs, ref("slow", fmt.Sprintf("tenant-%d", i)))
	}
	l := newLedger()
	l.prime(t, rs[0], set, refs)
	health := watchHealth(t, rs[0], "")
	await(t, health, healthpb.HealthCheckResponse_SERVING)

	ok := make(chan struct{})
	killed := make(chan []pending, 1)
	go func() { killed <- killAgents(t, l, set, refs, rs, 6, []string{srv.Addr()}, ok) }()
	for range 40 { // let some batches through
		select {
		case <-ok:
		case ps := <-killed:
			t.Fatalf("the agents stopped before Redis died: %d calls failed", len(ps))
		case <-time.After(30 * time.Second):
			t.Fatal("fewer than 40 batches answered in 30 s")
		}
	}
	srv.Kill()
	ps := <-killed // the agents report success without waiting for a reader
	if len(ps) != 6 {
		t.Fatalf("%d agents saw the failure, want 6", len(ps))
	}
	await(t, health, healthpb.HealthCheckResponse_NOT_SERVING)

	srv.Restart()
	await(t, health, healthpb.HealthCheckResponse_SERVING)
	recorded, fresh := retryPending(t, l, set, refs, rs, ps)
	t.Logf("failed items recorded before Redis died: %d; granted on retry: %d", recorded, fresh)
	checkBudget(t, l, set, refs, srv.Client(t))
}

// TestSentinelFailover: the master dies; the coordinators answer STORE_UNAVAILABLE until Sentinel
// promotes the replica and go-redis follows it, then serve again. Debits replicated before the
// failover survive it: a retried call is answered from its record, and every bucket holds
// exactly what agents were granted (docs/leases.md, "Failover", for debits not yet replicated).
func TestSentinelFailover(t *testing.T) {
	s := redistest.StartSentinel(t)
	set := mustPolicy(t, "v1")
	rs := redisReplicas(t, 2, set, func() redis.UniversalClient {
		return redis.NewUniversalClient(&redis.UniversalOptions{
			MasterName: redistest.MasterName, Addrs: s.SentinelAddrs(),
			DialTimeout: 250 * time.Millisecond, ReadTimeout: time.Second, WriteTimeout: time.Second,
			ContextTimeoutEnabled: true,
		})
	})
	var refs []*coordinatorv1.BucketRef
	for i := range 4 {
		refs = append(refs, ref("slow", fmt.Sprintf("tenant-%d", i)))
	}
	l := newLedger()
	l.prime(t, rs[0], set, refs)
	var items []*coordinatorv1.AcquireItem
	for _, x := range refs {
		items = append(items, item(x, 2*tok, tok))
	}
	var last *coordinatorv1.AcquireRequest
	var lastResp *coordinatorv1.AcquireResponse
	for seq := uint64(1); seq <= 20; seq++ {
		last = acquire("agent", seq, set.Version(), items...)
		var err error
		lastResp, err = rs[seq%2].client.Acquire(ctxFor(t, 30*time.Second), last)
		if err != nil {
			t.Fatal(err)
		}
		for i, r := range lastResp.Results {
			l.grant(key(t, set, refs[i]), r)
		}
	}
	// Let the replica catch up, so the test measures the failover, not replication lag.
	master, replica := s.Node(0).Client(t), s.Node(1).Client(t)
	proctest.WaitFor(t, 10*time.Second, "replica in sync", func() bool {
		for _, x := range refs {
			a, _ := master.HGetAll(ctxFor(t, 5*time.Second), key(t, set, x)).Result()
			b, _ := replica.HGetAll(ctxFor(t, 5*time.Second), key(t, set, x)).Result()
			if fmt.Sprint(a) != fmt.Sprint(b) {
				return false
			}
		}
		return true
	})

	s.Node(0).Kill()
	start := time.Now()
	failures := 0
	for {
		resp, err := rs[failures%2].client.Acquire(ctxFor(t, 30*time.Second), last)
		if err != nil {
			storeFailure(t, err, append(s.SentinelAddrs(), s.Node(0).Addr(), s.Node(1).Addr()))
		}
		if err == nil && !itemUnavailable(resp) {
			// The retry of the last call before the failover is answered from its replicated record.
			for i, r := range resp.Results {
				if f := lastResp.Results[i]; !r.Replayed || r.GrantedMicro != f.GrantedMicro {
					t.Errorf("retry across the failover, item %d = %v, want %v replayed", i, r, f)
				}
			}
			break
		}
		failures++
		if time.Since(start) > 60*time.Second {
			t.Fatalf("still unavailable 60 s after the master died: %v %v", resp, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("unavailable for %v (%d failed calls) until the replica was promoted", time.Since(start).Round(time.Millisecond), failures)
	s.WaitMaster(s.Node(1))
	for seq := uint64(21); seq <= 25; seq++ {
		// Each coordinator follows the promotion on its own (Sentinel's switch-master message, or
		// its next lookup): one may still dial the old master a moment after the other served. A
		// repeat of the seq is answered from its record, so asking again charges nothing twice.
		var resp *coordinatorv1.AcquireResponse
		var err error
		for {
			resp, err = rs[seq%2].client.Acquire(ctxFor(t, 30*time.Second), acquire("agent", seq, set.Version(), items...))
			if status.Code(err) != codes.Unavailable && !itemUnavailable(resp) || time.Since(start) > 60*time.Second {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if err != nil {
			t.Fatalf("Acquire after the failover: %v", err)
		}
		for i, r := range resp.Results {
			if r.Status != coordinatorv1.Status_STATUS_OK {
				t.Errorf("Acquire %d after the failover, item %d: %v", seq, i, r)
			}
			l.grant(key(t, set, refs[i]), r)
		}
	}
	checkBudget(t, l, set, refs, replica)
}

// itemUnavailable reports whether an item of resp (nil: none) found the store unavailable.
func itemUnavailable(resp *coordinatorv1.AcquireResponse) bool {
	for _, r := range resp.GetResults() {
		if r.Status == coordinatorv1.Status_STATUS_STORE_UNAVAILABLE {
			return true
		}
	}
	return false
}
