package redisstore_test

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
)

func TestAdminConformance(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	storetest.RunAdmin(t, func(t *testing.T, clock func() bucket.Millis) storetest.AdminStore {
		if err := rdb.FlushAll(ctx(t)).Err(); err != nil {
			t.Fatal(err)
		}
		return redisstore.New(rdb, redisstore.WithClock(clock))
	})
}

func TestOverridesConformance(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	storetest.RunOverrides(t, func(t *testing.T) coordinator.OverridesStore {
		if err := rdb.FlushAll(ctx(t)).Err(); err != nil {
			t.Fatal(err)
		}
		return redisstore.New(rdb)
	})
}

// TestAdminCluster runs both suites on a Redis Cluster: every key in its own slot, the admin
// and overrides scripts routed by their key.
func TestAdminCluster(t *testing.T) {
	cl := redistest.StartCluster(t, 3)
	rdb := cl.Client(t)
	flush := func(t *testing.T) {
		err := rdb.ForEachMaster(ctx(t), func(ctx context.Context, m *redis.Client) error { return m.FlushAll(ctx).Err() })
		if err != nil {
			t.Fatal(err)
		}
	}
	storetest.RunAdmin(t, func(t *testing.T, clock func() bucket.Millis) storetest.AdminStore {
		flush(t)
		return redisstore.New(rdb, redisstore.WithClock(clock))
	})
	storetest.RunOverrides(t, func(t *testing.T) coordinator.OverridesStore {
		flush(t)
		return redisstore.New(rdb)
	})
}
