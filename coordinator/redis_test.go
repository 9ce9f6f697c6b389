package coordinator_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zaptest"
	"google.golang.org/protobuf/proto"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// storeTimeout bounds a store batch in these tests: far above a healthy round trip on a loaded
// machine under the race detector, far below the callers' deadlines, so a lost Redis shows as
// STORE_UNAVAILABLE and never as the caller's DEADLINE_EXCEEDED.
const storeTimeout = 2 * time.Second

// redisReplicas starts n coordinators on loopback TCP, each with its own go-redis client from
// newClient, its health following a PING of that client.
func redisReplicas(t *testing.T, n int, set *policy.Set, newClient func() redis.UniversalClient) []*replica {
	t.Helper()
	var rs []*replica
	for range n {
		c := newClient()
		t.Cleanup(func() { _ = c.Close() }) // after the replica's own cleanup, which stops it
		svc := coordinator.NewService(redisstore.New(c), set,
			coordinator.WithStoreTimeout(storeTimeout), coordinator.WithLogger(zaptest.NewLogger(t)))
		rs = append(rs, startReplica(t, svc, coordinator.ServerOptions{
			Probe:         func(ctx context.Context) error { return c.Ping(ctx).Err() },
			ProbeInterval: 50 * time.Millisecond,
		}))
	}
	return rs
}

// clientOptions are the go-redis settings of the tests' coordinators: bounded by the batch's
// context, quick to notice a dead server.
func clientOptions(o *redis.Options) *redis.Options {
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout = 250*time.Millisecond, time.Second, time.Second
	o.ContextTimeoutEnabled = true
	return o
}

// ledger is what agents were granted and credited, by bucket key, as they saw it.
type ledger struct {
	mu      sync.Mutex
	net     map[string]bucket.Micro // granted minus credited
	t0      map[string]bucket.Millis
	denied  map[string]int
	grants  int
	credits int
}

func newLedger() *ledger {
	return &ledger{net: map[string]bucket.Micro{}, t0: map[string]bucket.Millis{}, denied: map[string]int{}}
}

func (l *ledger) grant(key string, r *coordinatorv1.AcquireResult) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch r.Status {
	case coordinatorv1.Status_STATUS_OK:
		l.net[key] += bucket.Micro(r.GrantedMicro)
		l.grants++
	case coordinatorv1.Status_STATUS_DENIED:
		l.denied[key]++
	}
}

func (l *ledger) credit(key string, r *coordinatorv1.ReturnResult) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if r.Status == coordinatorv1.Status_STATUS_OK {
		l.net[key] -= bucket.Micro(r.CreditedMicro)
		l.credits++
	}
}

// prime makes the first grant (1 µ) on every key through one replica, so that each bucket's
// history starts at a known time: its grant time.
func (l *ledger) prime(t *testing.T, r *replica, set *policy.Set, refs []*coordinatorv1.BucketRef) {
	t.Helper()
	var items []*coordinatorv1.AcquireItem
	for _, x := range refs {
		items = append(items, item(x, 1, 1))
	}
	resp, err := r.client.Acquire(ctxFor(t, 30*time.Second), acquire("primer", 1, set.Version(), items...))
	if err != nil {
		t.Fatalf("priming Acquire: %v", err)
	}
	for i, x := range refs {
		res := resp.Results[i]
		if res.Status != coordinatorv1.Status_STATUS_OK || res.GrantedMicro != 1 {
			t.Fatalf("priming %v: %v", x, res)
		}
		k := key(t, set, x)
		l.t0[k] = bucket.Millis(res.GrantedAtMs)
		l.grant(k, res)
	}
}

// bucketState reads a bucket's tokens and key clock (its last refill) from Redis.
func bucketState(t *testing.T, c redis.Cmdable, key string) (bucket.Micro, bucket.Millis) {
	t.Helper()
	v, err := c.HMGet(ctxFor(t, 10*time.Second), key, "t", "l").Result()
	if err != nil {
		t.Fatalf("HMGET %s: %v", key, err)
	}
	var n [2]int64
	for i := range n {
		s, _ := v[i].(string)
		if n[i], err = strconv.ParseInt(s, 10, 64); err != nil {
			t.Fatalf("HMGET %s = %v: %v", key, v, err)
		}
	}
	return bucket.Micro(n[0]), bucket.Millis(n[1])
}

// checkBudget checks every bucket against the budget bound twice: from the grants (net of
// credits) the agents saw, and from Redis' state. Over the bucket's history [t0, last] the
// bucket refilled at most R = ⌊r·(last − t0)⌋, so
//
//	net ≤ C + R               (I5: what agents hold never exceeds the burst plus the refill)
//	C ≤ net + tokens ≤ C + R  (Redis' state agrees: no grant was charged twice or not at all)
func checkBudget(t *testing.T, l *ledger, set *policy.Set, refs []*coordinatorv1.BucketRef, c redis.Cmdable) {
	t.Helper()
	for _, p := range budgetProblems(t, l, set, refs, c) {
		t.Error(p)
	}
}

func budgetProblems(t *testing.T, l *ledger, set *policy.Set, refs []*coordinatorv1.BucketRef, c redis.Cmdable) []string {
	t.Helper()
	var problems []string
	for _, x := range refs {
		k := key(t, set, x)
		lim := limit(t, set, x)
		tokens, last := bucketState(t, c, k)
		num, den := lim.Rate()
		capacity := lim.Capacity()
		refill := bucket.Micro(int64(last-l.t0[k]) * num / den)
		net := l.net[k]
		t.Logf("%s: granted net %d µ over %d ms, bound C + r·t = %d µ, bucket holds %d µ, %d denials",
			x.Tenant, net, last-l.t0[k], capacity+refill, tokens, l.denied[k])
		switch {
		case tokens < 0 || tokens > capacity:
			problems = append(problems, fmt.Sprintf("%s: bucket holds %d µ, outside [0, %d]", k, tokens, capacity))
		case net > capacity+refill:
			problems = append(problems, fmt.Sprintf("%s: agents hold %d µ net, above C + r·t = %d µ", k, net, capacity+refill))
		case net+tokens > capacity+refill:
			problems = append(problems, fmt.Sprintf("%s: %d µ granted net + %d µ in Redis exceeds C + r·t = %d µ: tokens were created",
				k, net, tokens, capacity+refill))
		case net+tokens < capacity:
			problems = append(problems, fmt.Sprintf("%s: %d µ granted net + %d µ in Redis is below C = %d µ: a charge no agent saw",
				k, net, tokens, capacity))
		}
	}
	return problems
}

// budgetAgents runs agents concurrently until the deadline: each Acquires a random subset of
// refs from a random replica, sometimes retries the same call on another replica (which must be
// answered from the first), and returns half of one of its leases a third of the time.
func budgetAgents(t *testing.T, l *ledger, set *policy.Set, refs []*coordinatorv1.BucketRef, rs []*replica, agents int, d time.Duration) {
	t.Helper()
	until := time.Now().Add(d)
	keys := bucketKeys(t, set, refs)
	var wg sync.WaitGroup
	for id := range agents {
		wg.Go(func() { budgetAgent(t, l, set, refs, keys, rs, id, until) })
	}
	wg.Wait()
}

// bucketKeys are the keys of refs (computed on the test's goroutine, which may fail the test).
func bucketKeys(t *testing.T, set *policy.Set, refs []*coordinatorv1.BucketRef) []string {
	t.Helper()
	keys := make([]string, len(refs))
	for i, x := range refs {
		keys[i] = key(t, set, x)
	}
	return keys
}

func budgetAgent(t *testing.T, l *ledger, set *policy.Set, refs []*coordinatorv1.BucketRef, refKeys []string, rs []*replica, id int, until time.Time) {
	rng := rand.New(rand.NewPCG(uint64(id), 4))
	name := fmt.Sprintf("agent-%02d", id)
	var seq uint64
	for time.Now().Before(until) {
		seq++
		var items []*coordinatorv1.AcquireItem
		var keys []string
		for _, i := range rng.Perm(len(refs))[:1+rng.IntN(len(refs))] {
			it := item(refs[i], bucket.Micro(1+rng.IntN(8))*tok, tok)
			it.DemandMicroPerSecond = int64(rng.IntN(100)) * int64(tok)
			items = append(items, it)
			keys = append(keys, refKeys[i])
		}
		req := acquire(name, seq, set.Version(), items...)
		resp, err := callRetry(rng, rs, func(c coordinatorv1.CoordinatorServiceClient, ctx context.Context) (*coordinatorv1.AcquireResponse, error) {
			return c.Acquire(ctx, req)
		})
		if err != nil {
			t.Errorf("%s Acquire %d: %v", name, seq, err)
			return
		}
		if rng.IntN(10) == 0 {
			again, err := rs[rng.IntN(len(rs))].client.Acquire(context.Background(), req)
			for i, r := range resp.GetResults() {
				want := proto.Clone(r).(*coordinatorv1.AcquireResult)
				want.Replayed = true
				if err != nil || !proto.Equal(again.Results[i], want) {
					t.Errorf("%s retried Acquire %d item %d = %v, %v, want %v", name, seq, i, again.GetResults(), err, want)
					break
				}
			}
		}
		type held struct {
			ref     *coordinatorv1.BucketRef
			key     string
			granted int64
			at      int64
		}
		var leases []held
		for i, r := range resp.Results {
			l.grant(keys[i], r)
			if r.Status == coordinatorv1.Status_STATUS_OK {
				leases = append(leases, held{items[i].Bucket, keys[i], r.GrantedMicro, r.GrantedAtMs})
			}
		}
		if len(leases) == 0 || rng.IntN(3) != 0 {
			continue
		}
		h := leases[rng.IntN(len(leases))]
		seq++
		ret := &coordinatorv1.ReturnRequest{AgentId: name, Seq: seq, PolicyVersion: set.Version(),
			Items: []*coordinatorv1.ReturnItem{{Bucket: h.ref, UnspentMicro: h.granted / 2, GrantedAtMs: h.at}}}
		rr, err := callRetry(rng, rs, func(c coordinatorv1.CoordinatorServiceClient, ctx context.Context) (*coordinatorv1.ReturnResponse, error) {
			return c.Return(ctx, ret)
		})
		if err != nil {
			t.Errorf("%s Return %d: %v", name, seq, err)
			return
		}
		if rng.IntN(4) == 0 {
			again, err := rs[rng.IntN(len(rs))].client.Return(context.Background(), ret)
			if err != nil || again.Results[0].CreditedMicro != rr.Results[0].CreditedMicro || !again.Results[0].Replayed {
				t.Errorf("%s retried Return %d = %v, %v, want %v replayed", name, seq, again, err, rr.Results[0])
			}
		}
		l.credit(h.key, rr.Results[0])
	}
}

// callRetry calls a random replica, and on an error retries the same request (same seq) on
// another, as an agent whose call timed out may.
func callRetry[R any](rng *rand.Rand, rs []*replica, call func(coordinatorv1.CoordinatorServiceClient, context.Context) (R, error)) (R, error) {
	var err error
	var resp R
	for range 5 {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		resp, err = call(rs[rng.IntN(len(rs))].client, ctx)
		cancel()
		if err == nil {
			return resp, nil
		}
	}
	return resp, err
}

// budgetRefs are the contended buckets of the budget tests: hot (200 tokens/s, burst 50) for
// several tenants, so batches span keys (and, on a cluster, nodes).
func budgetRefs(n int) []*coordinatorv1.BucketRef {
	var refs []*coordinatorv1.BucketRef
	for i := range n {
		refs = append(refs, ref("hot", "tenant-"+strconv.Itoa(i)))
	}
	return refs
}

// budgetDuration is how long the agents of a budget test run: several times the bucket's fill
// time (250 ms), so the bound's r·t term dominates its burst.
const budgetDuration = 2 * time.Second

// TestBudgetThreeCoordinators: many agents' concurrent Acquires and Returns through three
// coordinator replicas, each with its own go-redis client, sharing one Redis, never get more
// than C + r·t of any bucket, checked from the grants and from Redis' state.
func TestBudgetThreeCoordinators(t *testing.T) {
	srv := redistest.Start(t)
	set := mustPolicy(t, "v1")
	rs := redisReplicas(t, 3, set, func() redis.UniversalClient { return redis.NewClient(clientOptions(srv.Options())) })
	refs := budgetRefs(4)
	l := newLedger()
	l.prime(t, rs[0], set, refs)
	budgetAgents(t, l, set, refs, rs, 24, budgetDuration)
	checkBudget(t, l, set, refs, srv.Client(t))
	for _, x := range refs {
		if l.denied[key(t, set, x)] == 0 {
			t.Errorf("%s was never denied: the bucket was not contended and the bound not approached", x.Tenant)
		}
	}
	t.Logf("%d grants, %d credits", l.grants, l.credits)
}

// TestBudgetRedisCluster is TestBudgetThreeCoordinators on a three-master Redis Cluster: a batch
// spans keys on several masters, and go-redis pipelines it per node.
func TestBudgetRedisCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	set := mustPolicy(t, "v1")
	rs := redisReplicas(t, 3, set, func() redis.UniversalClient {
		o := cluster.Options()
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.ContextTimeoutEnabled = 250*time.Millisecond, time.Second, time.Second, true
		return redis.NewClusterClient(o)
	})
	refs := budgetRefs(6)
	masters := map[*redistest.Server]bool{}
	for _, x := range refs {
		masters[cluster.MasterForKey(key(t, set, x))] = true
	}
	if len(masters) < 2 {
		t.Fatalf("the test's %d keys live on %d master(s); a batch must span nodes", len(refs), len(masters))
	}
	l := newLedger()
	l.prime(t, rs[0], set, refs)
	budgetAgents(t, l, set, refs, rs, 18, budgetDuration)
	checkBudget(t, l, set, refs, cluster.Client(t))
	for _, x := range refs {
		if l.denied[key(t, set, x)] == 0 {
			t.Errorf("%s was never denied: the bucket was not contended and the bound not approached", x.Tenant)
		}
	}
	t.Logf("%d grants, %d credits over %d masters", l.grants, l.credits, len(masters))
}

// TestCheckBudgetCatches shows the budget check is not vacuous. On the slow bucket (it refills
// less than a token during the test) the check's bounds are tight to within that refill, so it
// must reject a ledger holding one token more than Redis debited, or one token less, or more
// than the bound.
func TestCheckBudgetCatches(t *testing.T) {
	srv := redistest.Start(t)
	set := mustPolicy(t, "v1")
	rs := redisReplicas(t, 1, set, func() redis.UniversalClient { return redis.NewClient(clientOptions(srv.Options())) })
	refs := []*coordinatorv1.BucketRef{ref("slow", "acme")}
	k := key(t, set, refs[0])
	for _, tc := range []struct {
		name  string
		skew  bucket.Micro
		wrong bool
	}{
		{"exact", 0, false},
		{"a grant Redis never charged", tok, true},
		{"a charge no agent saw", -tok, true},
		{"more than the bound", limit(t, set, refs[0]).Capacity() + tok, true},
	} {
		l := newLedger()
		l.prime(t, rs[0], set, refs)
		budgetAgents(t, l, set, refs, rs, 2, 50*time.Millisecond)
		l.net[k] += tc.skew
		if problems := budgetProblems(t, l, set, refs, srv.Client(t)); (len(problems) > 0) != tc.wrong {
			t.Errorf("%s: problems %q, want some: %t", tc.name, problems, tc.wrong)
		}
		if err := srv.Client(t).Del(ctxFor(t, 10*time.Second), k).Err(); err != nil {
			t.Fatal(err)
		}
	}
}
