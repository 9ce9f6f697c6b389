package chaos

import (
	"fmt"
	"time"
)

// Step is one fault of a schedule: Do injects it, the harness holds it for Hold, Undo restores
// the system, and the harness lets it settle before the next step.
type Step struct {
	Name   string // what is done, for the fault matrix
	Expect string // the promised behaviour
	Hold   time.Duration
	// Outage: from the moment Do returns until Undo starts, the global state is unreachable for
	// the keys of Nodes (nil: every key). The checker holds the failure modes to it.
	Outage bool
	Nodes  []int
	// Quiesce pauses the ledger key's checks on every agent, and waits until no refill of it is in
	// flight, before Do: a grant in flight when a coordinator or Redis connection breaks, or
	// when a batch outlives the store timeout, may have been debited without the agent learning
	// it, which the ledger's exact account cannot tell from a lost token (docs/reliability.md).
	// The ledger resumes after the step settles.
	Quiesce bool
	Do      func(r *runner) error
	Undo    func(r *runner) error
}

// Expected behaviours, as the fault matrix states them.
const (
	expectOutage = "leases serve until they expire (τ); then fail-closed rules answer 503 with their Retry-After and " +
		"the emergency rule allows degraded within each agent's emergency bucket; no allow without a lease; recovery after restore"
	expectLatency = "checks on live leases unaffected; a check that waits for a refill longer than --max-wait (50 ms) " +
		"gets its rule's failure mode; every bound holds"
)

// AgentKill kills agent i with SIGKILL (or stops it with SIGTERM) and restarts it after hold.
func AgentKill(i int, graceful bool, hold time.Duration) Step {
	name, expect := fmt.Sprintf("agent %d SIGKILL, restart", i),
		"its clients get UNAVAILABLE until it restarts; other agents unaffected; it strands at most its outstanding leases"
	if graceful {
		name, expect = fmt.Sprintf("agent %d SIGTERM, restart", i),
			"checks in flight answered, every lease returned (nothing stranded); clients get UNAVAILABLE until it restarts"
	}
	return Step{Name: name, Expect: expect, Hold: hold,
		Do: func(r *runner) error { return r.stopAgent(i, graceful) },
		Undo: func(r *runner) error {
			r.s.StartAgent(i)
			r.load.ResumeLedger(i)
			r.load.ResumeMulti(i)
			return nil
		}}
}

// CoordinatorKill stops coordinator i (SIGKILL or SIGTERM) and restarts it after hold.
func CoordinatorKill(i int, graceful bool, hold time.Duration) Step {
	sig := "SIGKILL"
	if graceful {
		sig = "SIGTERM"
	}
	return Step{Name: fmt.Sprintf("coordinator %d %s, restart", i, sig), Hold: hold, Quiesce: !graceful,
		Expect: "agents fail over to the other coordinators (round robin, health checks, retries with the same seq); " +
			"no failure-mode answers beyond a refill in flight",
		Do:   func(r *runner) error { return r.s.StopCoordinator(i, graceful) },
		Undo: func(r *runner) error { r.s.StartCoordinator(i); return nil }}
}

// AllCoordinatorsKill kills every coordinator and restarts them after hold: an outage.
func AllCoordinatorsKill(hold time.Duration) Step {
	return Step{Name: "every coordinator SIGKILL, restart", Hold: hold, Outage: true, Quiesce: true, Expect: expectOutage,
		Do: func(r *runner) error {
			for i := range r.s.Coordinators {
				if err := r.s.StopCoordinator(i, false); err != nil {
					return err
				}
			}
			return nil
		},
		Undo: func(r *runner) error {
			for i := range r.s.Coordinators {
				r.s.StartCoordinator(i)
			}
			return nil
		}}
}

// RedisKill kills Redis node n (the standalone server, or one master of the cluster) and
// restarts it after hold; its append-only file keeps every acknowledged write.
func RedisKill(n int, cluster bool, hold time.Duration) Step {
	st := Step{Name: "Redis SIGKILL, restart (appendfsync always)", Hold: hold, Outage: true, Quiesce: true,
		Expect: expectOutage + "; the restarted Redis holds every bucket as acknowledged (no refill from the restart)",
		Do:     func(r *runner) error { r.s.RedisNodes[n].Kill(); return nil },
		Undo:   func(r *runner) error { r.s.RestartRedis(n); return nil }}
	if cluster {
		st.Name = fmt.Sprintf("Redis master %d SIGKILL, restart", n)
		st.Nodes = []int{n}
		st.Expect = "keys of that master: " + expectOutage + "; keys of the other masters still granted item by item " +
			"(a check waiting on a batch the failed master holds may still fall back: measured)"
	}
	return st
}

// RedisProxy sets the proxies of Redis nodes (nil: all) to mode for hold.
func RedisProxy(mode Mode, delay, hold time.Duration, nodes []int) Step {
	st := Step{Hold: hold, Nodes: nodes,
		Do:   func(r *runner) error { r.setRedisProxies(nodes, mode, delay); return nil },
		Undo: func(r *runner) error { r.setRedisProxies(nodes, Pass, 0); return nil }}
	where := "coordinators → Redis"
	if nodes != nil {
		where = fmt.Sprintf("coordinators → Redis master %v", nodes)
	}
	switch mode {
	case Delay:
		st.Name, st.Expect, st.Quiesce = fmt.Sprintf("%s: +%v each way", where, delay), expectLatency, true
		st.Nodes = nil
	case Blackhole:
		st.Name, st.Outage, st.Quiesce = where+": hung (nothing forwarded)", true, true
		st.Expect = "store batches time out (--store-timeout 300 ms) as STORE_UNAVAILABLE; " + expectOutage
	case Cut:
		st.Name, st.Outage, st.Quiesce = where+": connections reset and refused", true, true
		st.Expect = expectOutage
	}
	if nodes != nil && mode != Delay {
		st.Expect = "keys of that master: " + st.Expect + "; keys of the other masters still granted item by item " +
			"(a check waiting on a batch the master holds may still fall back: measured)"
	}
	return st
}

// CoordinatorProxy sets every agent → coordinator proxy to mode for hold.
func CoordinatorProxy(mode Mode, delay, hold time.Duration) Step {
	st := Step{Hold: hold,
		Do:   func(r *runner) error { r.setCoordinatorProxies(mode, delay); return nil },
		Undo: func(r *runner) error { r.setCoordinatorProxies(Pass, 0); return nil }}
	switch mode {
	case Delay:
		st.Name, st.Expect, st.Quiesce = fmt.Sprintf("agents → coordinators: +%v each way", delay), expectLatency, true
	case Blackhole:
		st.Name, st.Outage, st.Quiesce = "agents → coordinators: hung", true, true
		st.Expect = "Acquire calls time out (--call-timeout 500 ms); " + expectOutage
	case Cut:
		st.Name, st.Outage, st.Quiesce = "agents → coordinators: connections reset and refused", true, true
		st.Expect = expectOutage
	}
	return st
}

// ShortSchedule is the fault schedule of the short form (standalone Redis, two coordinators,
// three agents): every kind of fault once.
func ShortSchedule() []Step {
	const outage = 1500 * time.Millisecond
	return []Step{
		AgentKill(1, false, 500*time.Millisecond),
		AgentKill(2, true, 300*time.Millisecond),
		CoordinatorKill(0, false, 700*time.Millisecond),
		RedisProxy(Delay, 40*time.Millisecond, 2*time.Second, nil),
		RedisKill(0, false, outage),
		CoordinatorProxy(Delay, 50*time.Millisecond, 2*time.Second),
		RedisProxy(Blackhole, 0, outage, nil),
		AllCoordinatorsKill(outage),
		CoordinatorProxy(Cut, 0, outage),
	}
}

// FullSchedule is `make chaos`'s schedule on a standalone Redis: every fault, agents and
// coordinators stopped both ways, outages held longer.
func FullSchedule(coordinators, agents int) []Step {
	const outage = 3 * time.Second
	st := []Step{
		AgentKill(1%agents, false, time.Second),
		AgentKill(2%agents, true, 500*time.Millisecond),
		CoordinatorKill(0, false, time.Second),
		CoordinatorKill(1%coordinators, true, time.Second),
		RedisProxy(Delay, 40*time.Millisecond, 3*time.Second, nil),
		RedisKill(0, false, outage),
		AgentKill(0, false, time.Second),
		CoordinatorProxy(Delay, 50*time.Millisecond, 3*time.Second),
		RedisProxy(Blackhole, 0, outage, nil),
		AllCoordinatorsKill(outage),
		CoordinatorProxy(Cut, 0, outage),
		RedisProxy(Cut, 0, outage, nil),
		CoordinatorProxy(Blackhole, 0, outage),
		AgentKill((agents-1)%agents, false, time.Second),
	}
	return st
}

// ClusterSchedule is `make chaos`'s schedule on a 3-master Redis Cluster: masters die and hang
// one at a time (an outage of their keys only), besides the faults of the other tiers.
func ClusterSchedule(agents int) []Step {
	const outage = 3 * time.Second
	return []Step{
		RedisKill(0, true, outage),
		AgentKill(1%agents, false, time.Second),
		RedisProxy(Blackhole, 0, outage, []int{1}),
		CoordinatorKill(0, false, time.Second),
		RedisProxy(Delay, 40*time.Millisecond, 3*time.Second, nil),
		RedisKill(2, true, outage),
		RedisProxy(Cut, 0, outage, []int{0}),
		AllCoordinatorsKill(outage),
	}
}
