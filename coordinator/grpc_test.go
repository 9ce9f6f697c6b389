package coordinator_test

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// backend is a store shared by coordinator replicas, and a look at a key's tokens.
type backend struct {
	name string
	// store returns the store of one more replica (a Redis store with its own client).
	store  func(t *testing.T) coordinator.Store
	tokens func(t *testing.T, key string) bucket.Micro
}

// backends are the stores the idempotency tests run on: one in memory shared by the replicas,
// and a Redis (started here, on the top-level test) that each replica reaches with its own client.
func backends(t *testing.T) []backend {
	mem := storetest.NewLevels(memstore.New())
	srv := redistest.Start(t)
	return []backend{{
		name:  "memory",
		store: func(*testing.T) coordinator.Store { return mem },
		tokens: func(t *testing.T, key string) bucket.Micro {
			lvl, ok := mem.Level(key)
			if !ok {
				t.Fatalf("no key %s", key)
			}
			return lvl
		},
	}, {
		name: "redis",
		store: func(t *testing.T) coordinator.Store {
			c := redis.NewClient(srv.Options())
			t.Cleanup(func() { _ = c.Close() })
			return redisstore.New(c)
		},
		tokens: func(t *testing.T, key string) bucket.Micro {
			return redisTokens(t, srv.Client(t), key)
		},
	}}
}

func redisTokens(t testing.TB, c redis.Cmdable, key string) bucket.Micro {
	t.Helper()
	v, err := c.HGet(ctxFor(t, 10*time.Second), key, "t").Result()
	if err != nil {
		t.Fatalf("HGET %s t: %v", key, err)
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return bucket.Micro(n)
}

// TestIdempotencyOverGRPC: an Acquire retried with the same (agent, seq) on another replica is
// answered with the first grant and charges nothing; a retried Return credits nothing; an older
// seq is stale and does nothing.
func TestIdempotencyOverGRPC(t *testing.T) {
	set := mustPolicy(t, "v1")
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			a := startReplica(t, coordinator.NewService(b.store(t), set), coordinator.ServerOptions{})
			c := startReplica(t, coordinator.NewService(b.store(t), set), coordinator.ServerOptions{})
			slow := ref("slow", "idem-"+b.name)
			k := key(t, set, slow)
			ctx := ctxFor(t, 30*time.Second)

			req := acquire("agent-1", 5, "v1", item(slow, 7*tok, tok))
			first, err := a.client.Acquire(ctx, req)
			if err != nil || first.Results[0].Status != coordinatorv1.Status_STATUS_OK || first.Results[0].Replayed {
				t.Fatalf("Acquire: %v, %v", first, err)
			}
			g := bucket.Micro(first.Results[0].GrantedMicro)
			before := b.tokens(t, k)
			again, err := c.client.Acquire(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			want := proto.Clone(first.Results[0]).(*coordinatorv1.AcquireResult)
			want.Replayed = true
			if !proto.Equal(again.Results[0], want) {
				t.Errorf("retried Acquire = %v, want %v", again.Results[0], want)
			}
			if after := b.tokens(t, k); after != before || before > 100_000*tok-g {
				t.Errorf("tokens %d µ after the grant of %d µ and %d µ after its retry: charged twice or not at all", before, g, after)
			}

			ret := &coordinatorv1.ReturnRequest{AgentId: "agent-1", Seq: 6, PolicyVersion: "v1", Items: []*coordinatorv1.ReturnItem{
				{Bucket: slow, UnspentMicro: int64(g), GrantedAtMs: first.Results[0].GrantedAtMs},
			}}
			credited, err := c.client.Return(ctx, ret)
			if err != nil || credited.Results[0].Status != coordinatorv1.Status_STATUS_OK || credited.Results[0].CreditedMicro <= 0 {
				t.Fatalf("Return: %v, %v", credited, err)
			}
			before = b.tokens(t, k)
			for _, r := range []*replica{a, c} {
				again, err := r.client.Return(ctx, ret)
				if err != nil || again.Results[0].CreditedMicro != credited.Results[0].CreditedMicro || !again.Results[0].Replayed {
					t.Errorf("retried Return = %v, %v, want credited %d µ, replayed", again, err, credited.Results[0].CreditedMicro)
				}
			}
			if after := b.tokens(t, k); after != before {
				t.Errorf("tokens %d µ after the Return, %d µ after its retries: credited twice", before, after)
			}

			stale, err := a.client.Acquire(ctx, acquire("agent-1", 4, "v1", item(slow, 7*tok, tok)))
			if err != nil || stale.Results[0].Status != coordinatorv1.Status_STATUS_STALE {
				t.Errorf("Acquire with an older seq: %v, %v, want STATUS_STALE", stale, err)
			}
			if after := b.tokens(t, k); after != before {
				t.Errorf("a stale Acquire changed the bucket from %d µ to %d µ", before, after)
			}
		})
	}
}

// TestPolicyVersionOverGRPC: an unknown version is FAILED_PRECONDITION with reason
// UNKNOWN_POLICY_VERSION on the wire; after a reload the previous version still works.
func TestPolicyVersionOverGRPC(t *testing.T) {
	svc := coordinator.NewService(memstore.New(), mustPolicy(t, "v1"))
	r := startReplica(t, svc, coordinator.ServerOptions{})
	ctx := ctxFor(t, 10*time.Second)
	_, err := r.client.Acquire(ctx, acquire("a", 1, "v2", item(ref("hot", "a"), tok, tok)))
	if status.Code(err) != codes.FailedPrecondition || coordinatorv1.Reason(err) != coordinatorv1.ReasonUnknownPolicyVersion {
		t.Fatalf("Acquire under an unknown version: %v (reason %q)", err, coordinatorv1.Reason(err))
	}
	_, err = r.client.Return(ctx, &coordinatorv1.ReturnRequest{AgentId: "a", Seq: 2, PolicyVersion: "v2"})
	if status.Code(err) != codes.FailedPrecondition || coordinatorv1.Reason(err) != coordinatorv1.ReasonUnknownPolicyVersion {
		t.Fatalf("Return under an unknown version: %v (reason %q)", err, coordinatorv1.Reason(err))
	}
	// A reload that changes the limit: both versions are served, each with its own limits.
	v2, err := policy.Parse("v2.yaml", []byte(strings.Replace(testPolicy("v2"), "limit: 200/second", "limit: 20/second", 1)))
	if err != nil {
		t.Fatal(err)
	}
	svc.SetPolicy(v2)
	for seq, set := range []*policy.Set{mustPolicy(t, "v1"), v2} {
		// Each version's lease lifetime follows its own limit: 200 ms (the floor) under v1, C/(4r) =
		// 625 ms under v2.
		resp, err := r.client.Acquire(ctx, acquire("a", uint64(seq+3), set.Version(), item(ref("hot", "a"), tok, tok)))
		if err != nil || resp.Results[0].Status != coordinatorv1.Status_STATUS_OK {
			t.Errorf("Acquire under %s after the reload to v2: %v, %v", set.Version(), resp, err)
			continue
		}
		if got, want := resp.Results[0].TtlMs, lease.TTL(limit(t, set, ref("hot", "a"))).Milliseconds(); got != want {
			t.Errorf("lease under %s lives %d ms, want %d ms", set.Version(), got, want)
		}
	}
	if key(t, mustPolicy(t, "v1"), ref("hot", "a")) == key(t, v2, ref("hot", "a")) {
		t.Error("a changed limit kept its bucket key")
	}
}
