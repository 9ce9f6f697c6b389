package redisstore_test

import (
	"testing"

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
