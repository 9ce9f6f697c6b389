package memstore_test

import (
	"testing"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

func TestAdminConformance(t *testing.T) {
	storetest.RunAdmin(t, func(t *testing.T, clock func() bucket.Millis) storetest.AdminStore {
		return memstore.New(memstore.WithClock(clock))
	})
}

func TestOverridesConformance(t *testing.T) {
	storetest.RunOverrides(t, func(*testing.T) coordinator.OverridesStore { return memstore.NewOverrides() })
}
