package sim

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
)

// RNG streams: each agent draws its arrivals and its crashes from its own generators, seeded from
// the scenario seed and its number, so that a change in one part (a crash rate) leaves the others
// (the traffic) as they were.
const (
	streamArrivals = iota + 1
	streamCrashes
	streamNetwork
	streamSettles
)

func rng(seed uint64, stream, n int) *rand.Rand {
	return rand.New(rand.NewPCG(seed, uint64(stream)<<32|uint64(n)))
}

func newWorld(sc *Scenario, opts Options) (*world, error) {
	w := &world{
		sc:        sc,
		set:       sc.policy,
		opts:      opts,
		end:       int64(sc.Duration),
		tick:      int64(sc.Tick),
		keyIdx:    map[string]*key{},
		byRef:     map[refKey]*key{},
		net:       rng(sc.Seed, streamNetwork, 0),
		horizon:   never,
		violSeen:  map[string]bool{},
		overgrant: sc.Faults.OvergrantFactor,
	}
	w.res = Result{
		Scenario: sc.Name, Description: sc.Description, Question: sc.Question,
		Seed: sc.Seed, Duration: sc.Duration.D(), Agents: sc.numAgents(),
	}
	w.timeline = make([]Second, (w.end+int64(time.Second)-1)/int64(time.Second))
	home := 0
	for i, r := range sc.Regions {
		if r.Name == sc.Home {
			home = i
		}
		w.regions = append(w.regions, &region{idx: i, name: r.Name, coordinators: r.Coordinators})
	}
	clk := memstore.WithClock(func() bucket.Millis { return bucket.Millis(w.now / int64(time.Millisecond)) })
	w.stores = append(w.stores, &store{name: "global (" + sc.Home + ")", outageName: "global", region: home, mem: memstore.New(clk)})
	for _, g := range w.regions {
		w.stores = append(w.stores, &store{name: "regional " + g.name, outageName: g.name, region: g.idx, mem: memstore.New(clk)})
	}
	for _, g := range w.regions {
		g.svc = coordinator.NewService(&storeShell{w: w, region: g.idx}, w.set)
	}
	groups := map[string][]int32{}
	identIdx := map[string]int32{}
	for gi := range sc.Identities {
		reqs, err := w.addGroup(&sc.Identities[gi], identIdx)
		if err != nil {
			return nil, err
		}
		groups[sc.Identities[gi].Name] = reqs
	}
	for i := range sc.numAgents() {
		w.nodes = append(w.nodes, &node{
			idx:     i,
			rng:     rng(sc.Seed, streamArrivals, i),
			crashes: rng(sc.Seed, streamCrashes, i),
			settles: rng(sc.Seed, streamSettles, i),
		})
	}
	first := 0
	for gi, r := range sc.Regions {
		for _, n := range w.nodes[first : first+r.Agents] {
			n.region = w.regions[gi]
		}
		first += r.Agents
	}
	for ti := range sc.Traffic {
		t := &sc.Traffic[ti]
		reqs := groups[t.Identities]
		if t.Cost != nil {
			var err error
			if reqs, err = w.settledRequests(ti, reqs, t.Cost); err != nil {
				return nil, err
			}
		}
		for _, ni := range t.nodes {
			for _, ri := range reqs {
				if w.reqs[ri].keys[w.nodes[ni].region.idx] < 0 {
					return nil, fmt.Errorf("sim: %s: traffic[%d]: rule %q has no slice for region %s",
						sc.Name, ti, w.idents[w.reqs[ri].ident].rule, w.nodes[ni].region.name)
				}
			}
		}
		p := newPicker(reqs, t.Skew)
		per := float64(t.Rate) / float64(len(t.nodes))
		for _, ni := range t.nodes {
			n := w.nodes[ni]
			n.streams = append(n.streams, newStream(t, per, p, n.rng))
		}
	}
	for _, n := range w.nodes {
		w.start(n)
		w.scheduleBatch(n)
	}
	for _, c := range sc.Crashes.Schedule {
		if int64(c.At) < w.end {
			n := w.nodes[c.Agent]
			w.schedule(event{at: int64(c.At), kind: evCrash, own: true, node: n})
		}
	}
	if len(w.keys) > agent.DefaultMaxKeys {
		// An agent's lease table would evict keys in an order that follows a random hash seed.
		return nil, fmt.Errorf("sim: %s: %d bucket keys; at most %d (agent.DefaultMaxKeys)", sc.Name, len(w.keys), agent.DefaultMaxKeys)
	}
	for _, k := range w.keys {
		w.stores[k.store].keys++
	}
	return w, nil
}

// addGroup resolves an identity group through the policy: one request kind per tenant, its
// identity (the oracle's bucket) and its bucket key in each region.
func (w *world) addGroup(g *Identities, identIdx map[string]int32) ([]int32, error) {
	set := w.set
	path, err := policy.Normalize(g.Path)
	if err != nil {
		return nil, fmt.Errorf("sim: %s: identities %s: %w", w.sc.Name, g.Name, err)
	}
	route, err := set.Match(path, g.Operation)
	if err != nil {
		return nil, fmt.Errorf("sim: %s: identities %s: %w", w.sc.Name, g.Name, err)
	}
	cost := g.Cost
	if cost == 0 {
		cost = set.Cost(route)
	}
	var out []int32
	for _, tenant := range g.names {
		name := fmt.Sprintf("%s %s %s %s", route.Rule.Name, route.Template(), route.Operation(), tenant)
		ii, ok := identIdx[name]
		if !ok {
			limit, err := w.oracleLimit(route, tenant)
			if err != nil {
				return nil, fmt.Errorf("sim: %s: identities %s: %w", w.sc.Name, g.Name, err)
			}
			ii = int32(len(w.idents))
			identIdx[name] = ii
			w.idents = append(w.idents, identity{
				name: name, tenant: tenant, rule: route.Rule.Name, rule32: w.ruleIndex(route.Rule), limit: limit,
				ideal: bucket.Full(limit, 0), counts: make([]Counts, len(w.regions)),
			})
		}
		rq := request{
			query: agent.Query{Tenant: tenant, Path: path, Operation: g.Operation, Cost: g.Cost},
			ident: ii, rule: w.ruleIndex(route.Rule), cost: cost, micro: cost * int64(bucket.PerToken),
			keys: make([]int32, len(w.regions)),
		}
		for _, rg := range w.regions {
			rq.keys[rg.idx] = -1
			lim, err := set.Limits(route, tenant, rg.name)
			if errors.Is(err, policy.ErrUnknownRegion) {
				continue
			} else if err != nil {
				return nil, fmt.Errorf("sim: %s: identities %s: %w", w.sc.Name, g.Name, err)
			}
			if rq.micro > int64(lim.Bucket.Capacity()) {
				return nil, fmt.Errorf("sim: %s: identities %s: a request costs %d tokens, more than the burst of rule %s",
					w.sc.Name, g.Name, cost, route.Rule.Name)
			}
			name, err := set.Key(route, tenant, rg.name)
			if err != nil {
				return nil, fmt.Errorf("sim: %s: identities %s: %w", w.sc.Name, g.Name, err)
			}
			k := w.keyIdx[name]
			if k == nil {
				st := 0
				if lim.Scope == policy.Regional {
					st = 1 + rg.idx
				}
				k = newKey(name, st, lim.Bucket, lim.MaxDebt)
				if route.Rule.Direct {
					k.direct(w.sc.Agent.MaxWait.D())
				}
				k.idx = int32(len(w.keys))
				w.keyIdx[name] = k
				w.keys = append(w.keys, k)
			}
			rq.keys[rg.idx] = k.idx
			w.byRef[refKey{route.Rule.Name, route.Template(), route.Operation(), tenant, lim.Region}] = k
		}
		out = append(out, int32(len(w.reqs)))
		w.reqs = append(w.reqs, rq)
	}
	return out, nil
}

// settledRequests are copies of reqs whose checks are estimates settled after the response: the
// estimate must fit the bucket, and every actual cost Settle's bound (capacity plus max_debt).
func (w *world) settledRequests(ti int, reqs []int32, c *SettledCost) ([]int32, error) {
	out := make([]int32, 0, len(reqs))
	for _, ri := range reqs {
		rq := w.reqs[ri]
		rule := w.rules[rq.rule]
		if rule.Direct {
			return nil, fmt.Errorf("sim: %s: traffic[%d]: rule %s has lease: off; settled costs are simulated on leases", w.sc.Name, ti, rule.Name)
		}
		rq.query.Cost, rq.query.Settle = c.Estimate, true
		rq.cost, rq.micro, rq.settle = c.Estimate, c.Estimate*int64(bucket.PerToken), c
		for _, ki := range rq.keys {
			if ki < 0 {
				continue
			}
			k := w.keys[ki]
			k.settled = true
			if capacity := int64(k.limit.Capacity()); rq.micro > capacity {
				return nil, fmt.Errorf("sim: %s: traffic[%d]: cost.estimate %d is more than the burst of rule %s",
					w.sc.Name, ti, c.Estimate, rule.Name)
			} else if most := (capacity + k.maxDebt) / int64(bucket.PerToken); c.Actual.most() > float64(most) {
				return nil, fmt.Errorf("sim: %s: traffic[%d]: cost.actual reaches %g tokens, more than %d, the burst plus max_debt of rule %s (Settle refuses it)",
					w.sc.Name, ti, c.Actual.most(), most, rule.Name)
			}
		}
		out = append(out, int32(len(w.reqs)))
		w.reqs = append(w.reqs, rq)
	}
	return out, nil
}

// ruleIndex is the index of rule in w.rules, adding it and its groups (one per region) if new.
func (w *world) ruleIndex(rule *policy.Rule) int32 {
	for i, r := range w.rules {
		if r == rule {
			return int32(i)
		}
	}
	w.rules = append(w.rules, rule)
	for _, g := range w.regions {
		w.groups = append(w.groups, &Group{Rule: rule.Name, Region: g.name, Scope: rule.Scope.String()})
	}
	return int32(len(w.rules) - 1)
}

// oracleLimit is the bucket the ideal limiter applies to a tenant on a route: the tenant's limit
// for a global rule, the sum of its region slices for a regional one.
func (w *world) oracleLimit(route policy.Route, tenant string) (bucket.Limit, error) {
	if route.Rule.Scope == policy.Global {
		lim, err := w.set.Limits(route, tenant, "")
		if err != nil {
			return bucket.Limit{}, err
		}
		return lim.Bucket, nil
	}
	var capacity bucket.Micro
	num, den := int64(0), int64(1)
	for _, rq := range route.Rule.Regions {
		lim, err := w.set.Limits(route, tenant, rq.Region)
		if err != nil {
			return bucket.Limit{}, err
		}
		capacity += lim.Bucket.Capacity()
		n, d := lim.Bucket.Rate()
		l := lcm(den, d)
		num, den = num*(l/den)+n*(l/d), l
	}
	return bucket.NewLimit(capacity, bucket.Micro(num), bucket.Millis(den))
}

func lcm(a, b int64) int64 {
	x, y := a, b
	for y != 0 {
		x, y = y, x%y
	}
	return a / x * b
}
