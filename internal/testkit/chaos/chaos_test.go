package chaos_test

import (
	"context"
	"flag"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/testkit/chaos"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
)

var (
	full = flag.Bool("chaos.full", false,
		"run make chaos's variants: every fault on a standalone Redis with 3 coordinators and 5 agents, and on a 3-master Redis Cluster")
	soak = flag.Duration("chaos.soak", 0, "run the soak for this long (make soak: 30m); 0 skips it")
	out  = flag.String("chaos.out", "", "write each run's report (report.md, report.json), the decision log and the processes' logs under this directory")
	keys = flag.Int("chaos.maxkeys", 0, "the agents' --max-keys instead of each run's own (docs/reliability.md, findings)")
)

// maxKeys is the agents' --max-keys of a run: def, or -chaos.maxkeys.
func maxKeys(def int) int {
	if *keys > 0 {
		return *keys
	}
	return def
}

// bins are the processes a run starts, built once per test binary.
var bins = proctest.NewBinaries(map[string]string{"agent": "../../../cmd/agent", "coordinator": "../../../cmd/coordinator"})

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.Cleanup(func(int) { bins.Remove() }))
}

func binaries(t *testing.T) chaos.Binaries {
	t.Helper()
	redistest.Require(t)
	return chaos.Binaries{Agent: bins.Path(t, "agent"), Coordinator: bins.Path(t, "coordinator")}
}

// shortLoad is the load of the short form: about 700 checks a second over three agents, the hot
// key offered about twice its rate, and enough new tenants (churn) that each agent's lease table
// passes its --max-keys of 1024 within the run; the long tail (2000 tenants, each back on an agent
// every 67 s and on some agent every 22 s, while its lease lives 500 ms) and the direct rule's key
// offered 90 checks a second against its 50/s; the multi rule's three tenants offered 30, 20 and
// 10 checks a second against its per-second limit of 20/s and its tenant budget of 10/s, and the
// same tenants 10 checks a second of the dmulti rule (direct mode, under the same budget); beside
// them, each agent's Envoy-faithful quota filter decides 100 requests a second for two tenants of
// the quota rule (40/s each): far above. Every fifth check goes through Envoy's API, every third
// of the others through the client package's CheckStream batches (partial answers).
var shortLoad = chaos.LoadConfig{Hot: 65, Cold: 35, ColdTenants: 200, Churn: 30, Closed: 10, Emergency: 10, Ledger: 10,
	Tail: 30, TailTenants: 2000, Direct: 30, Multi: 20, MultiTenants: 3, DMulti: 10, Settled: 10, SettledTenants: 2, EnvoyEvery: 5, IdemEvery: 4, StreamEvery: 3, Quota: 100, QuotaTenants: 2}

// fullLoad is the load of `make chaos` and `make soak`, per agent: with 5 agents the long tail is
// 200 checks a second over 4000 tenants (each back on an agent every 100 s), the direct key is
// offered three times its rate and the multi rule's tenants 50, 33 and 17 checks a second; with 3
// (the Cluster run, the soak), 120 over 4000, 1.8 times, and 30, 20 and 10.
var fullLoad = chaos.LoadConfig{Hot: 50, Cold: 40, ColdTenants: 300, Churn: 25, Closed: 10, Emergency: 10, Ledger: 10,
	Tail: 40, TailTenants: 4000, Direct: 30, Multi: 20, MultiTenants: 3, DMulti: 10, Settled: 10, SettledTenants: 2, EnvoyEvery: 5, IdemEvery: 4, StreamEvery: 3, Quota: 200, QuotaTenants: 3}

func report(t *testing.T, rep *chaos.Report) {
	t.Helper()
	t.Log("\n" + rep.Summary())
	if len(rep.Violations) > 0 {
		t.Errorf("%d violations (report: %s)", len(rep.Violations), *out)
	}
	// Every path the load offers carried checks: a path that carried none was not checked.
	if rep.EnvoyChecks == 0 || rep.StreamChecks == 0 {
		t.Errorf("%d checks through Envoy's API and %d through the client package's stream: a path carried none", rep.EnvoyChecks, rep.StreamChecks)
	}
}

// TestChaos is the harness: by default its short form (part of `make test`): a standalone Redis,
// two coordinators, three agents, every kind of fault once, the bad input, and a 20 s steady
// phase. With -chaos.full (`make chaos`) it runs the full schedule on a standalone Redis and on a
// Redis Cluster instead.
func TestChaos(t *testing.T) {
	bin := binaries(t)
	if !*full {
		report(t, chaos.Run(t, chaos.Options{Name: "short", Coordinators: 2, Agents: 3, MaxKeys: maxKeys(1024), Load: shortLoad,
			Warmup: 3 * time.Second, Schedule: chaos.ShortSchedule(), Settle: time.Second, Abuse: true,
			Steady: 20 * time.Second, SampleEvery: 500 * time.Millisecond, Bin: bin, OutDir: *out, Seed: 1}))
		return
	}
	t.Run("standalone", func(t *testing.T) {
		report(t, chaos.Run(t, chaos.Options{Name: "standalone", Coordinators: 3, Agents: 5, MaxKeys: maxKeys(1024), Load: fullLoad,
			Warmup: 5 * time.Second, Schedule: chaos.FullSchedule(3, 5), Settle: 1500 * time.Millisecond, Abuse: true,
			Steady: 30 * time.Second, SampleEvery: time.Second, Bin: bin, OutDir: *out, Seed: 2}))
	})
	t.Run("cluster", func(t *testing.T) {
		report(t, chaos.Run(t, chaos.Options{Name: "cluster", Cluster: true, Coordinators: 2, Agents: 3, MaxKeys: maxKeys(1024),
			Load: fullLoad, Warmup: 5 * time.Second, Schedule: chaos.ClusterSchedule(3), Settle: 1500 * time.Millisecond,
			Abuse: true, Steady: 20 * time.Second, SampleEvery: time.Second, Bin: bin, OutDir: *out, Seed: 3}))
	})
}

// TestSoak runs the steady phase for -chaos.soak (`make soak`: 30 minutes) after the short
// fault schedule, with a short fault that restarts nothing every minute, and checks that no
// process grows.
func TestSoak(t *testing.T) {
	if *soak <= 0 {
		t.Skip("-chaos.soak not set (make soak)")
	}
	report(t, chaos.Run(t, chaos.Options{Name: "soak", Coordinators: 2, Agents: 3, MaxKeys: maxKeys(1024), Load: fullLoad,
		Warmup: 5 * time.Second, Schedule: chaos.ShortSchedule(), Settle: time.Second, Abuse: true,
		Steady: *soak, SampleEvery: 10 * time.Second, Blips: time.Minute, Bin: binaries(t), OutDir: *out, Seed: 4}))
}

// overGrant is a broken grant rule for the negative test: the agent is told it got factor times
// what the Redis store debited. It lives in this test only.
type overGrant struct {
	coordinator.Store
	factor int64
}

func (o overGrant) Take(ctx context.Context, reqs []coordinator.TakeRequest) ([]coordinator.TakeResult, error) {
	res, err := o.Store.Take(ctx, reqs)
	for i := range res {
		if res[i].Granted > 0 && res[i].Err == nil {
			res[i].Granted *= bucket.Micro(o.factor)
		}
	}
	return res, err
}

// TestOverGrantingRuleIsCaught breaks the grant rule on purpose (coordinators in this process,
// over a store that grants three times what it debits) and runs the same load and checker: it
// must report the admission bound broken on the hot key, on the direct rule's key (its checks
// are served the surplus of over-granted takes, and the rest is handed back and credited: the
// bucket is refilled with tokens it never held), and on the quota key (what Envoy-faithful
// filters admit from assignments of over-granted leases), on the multi rule's per-second limit and
// its tenant budget (each bucket of a check of several over-granted), and the ledger. A checker
// that passed this would pass anything.
func TestOverGrantingRuleIsCaught(t *testing.T) {
	bin := binaries(t)
	rep := chaos.Run(t, chaos.Options{Name: "overgrant", Coordinators: 1, Agents: 2, MaxKeys: 1024,
		Load:   chaos.LoadConfig{Hot: 100, Ledger: 20, Direct: 60, Quota: 300, QuotaTenants: 1, Multi: 40, MultiTenants: 1},
		Warmup: 6 * time.Second, SampleEvery: time.Second, Bin: bin, OutDir: *out, Seed: 5,
		WrapStore: func(s coordinator.Store) coordinator.Store { return overGrant{Store: s, factor: 3} }})
	t.Log("the broken rule, as the checker reports it:\n" + rep.Summary())
	found := map[string]bool{}
	for _, v := range rep.Violations {
		switch {
		case v.Check == "admission" && strings.Contains(v.Detail, "|/hot|"):
			found["hot admission"] = true
		case v.Check == "admission" && strings.Contains(v.Detail, "|/quota/"):
			found["quota admission"] = true
		case v.Check == "admission" && strings.Contains(v.Detail, "|/d/"):
			found["direct admission"] = true
		case v.Check == "admission" && strings.Contains(v.Detail, "(bucket multi#2)"):
			found["multi#2 admission"] = true
		case v.Check == "admission" && strings.Contains(v.Detail, "(bucket mbudget)"):
			found["tenant budget admission"] = true
		case v.Check == "ledger" && strings.Contains(v.Detail, "created"):
			found["ledger"] = true
		}
	}
	for _, want := range []string{"hot admission", "direct admission", "quota admission", "multi#2 admission", "tenant budget admission", "ledger"} {
		if !found[want] {
			t.Errorf("the checker did not catch the over-granting rule on the %s; violations: %v", want, rep.Violations)
		}
	}
	if !slices.ContainsFunc(rep.Violations, func(v chaos.Violation) bool { return v.Check == "admission" }) {
		t.Error("no admission violation at all")
	}
}
