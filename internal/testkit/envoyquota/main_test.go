package envoyquota

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain checks that a closed Filter leaves no goroutine behind (its reports, its stream).
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
