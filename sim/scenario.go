package sim

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/policy"
)

// Scenario is one simulation as a YAML file describes it (docs/simulator.md is the reference).
// Load fills in the defaults and validates it; a Scenario is not changed by a run.
type Scenario struct {
	Name        string   `yaml:"name"`
	Description string   `yaml:"description"`
	Question    string   `yaml:"question"` // what the scenario answers, shown in the report
	Seed        uint64   `yaml:"seed"`
	Duration    Duration `yaml:"duration"`
	// Warmup is left out of the steady-state load figures (the first lease of every key).
	Warmup Duration `yaml:"warmup"`
	// Tick bounds one batch of arrivals (Engine): at most the shortest one-way network delay.
	Tick Duration `yaml:"tick"`

	// Policy is an embedded policy (a YAML block string or mapping); PolicyFile a path to one,
	// relative to the scenario file.
	Policy     yaml.Node `yaml:"policy"`
	PolicyFile string    `yaml:"policy_file"`

	// Regions, or Agents and Coordinators for a single region named "local".
	Regions      []Region `yaml:"regions"`
	Home         string   `yaml:"home"` // region of the global store; the first region if empty
	Agents       int      `yaml:"agents"`
	Coordinators int      `yaml:"coordinators"`

	Network    Network       `yaml:"network"`
	Agent      AgentParams   `yaml:"agent"`
	Identities []Identities  `yaml:"identities"`
	Traffic    []Traffic     `yaml:"traffic"`
	Crashes    Crashes       `yaml:"crashes"`
	Outages    []Outage      `yaml:"outages"`
	Partitions []Partition   `yaml:"partitions"`
	Faults     Faults        `yaml:"faults"`
	Sweep      *Sweep        `yaml:"sweep"`
	Capacity   *CapacitySpec `yaml:"capacity"`

	file   string      // the scenario file, for messages
	dir    string      // its directory, for relative paths
	policy *policy.Set // parsed once by Load
	text   []byte      // the policy source
}

// Region is one region: its agents and its coordinator replicas (stateless; the count sizes the
// per-replica load).
type Region struct {
	Name         string `yaml:"name"`
	Agents       int    `yaml:"agents"`
	Coordinators int    `yaml:"coordinators"`
}

// Network holds the one-way delays. An Acquire sent at t reaches the store at
// t + AgentCoordinator + CoordinatorStore (+ CrossRegion when the store is in another region),
// the store acts then, and the answer is applied after the same path back. Each one-way delay is
// the base delay times 1 + U(0, Jitter).
type Network struct {
	AgentCoordinator Duration `yaml:"agent_coordinator"`
	CoordinatorStore Duration `yaml:"coordinator_store"`
	CrossRegion      Duration `yaml:"cross_region"`
	Jitter           float64  `yaml:"jitter"`
}

// AgentParams are the agent shell's parameters: the same knobs and defaults as the production
// shells (agent.Server's MaxWait, agent.Refresher's call timeout, calls in flight and sweep).
// WantFactor scales what agents ask for (see docs/simulator.md: the lease core fixes it at 1).
type AgentParams struct {
	MaxWait     Duration `yaml:"max_wait"`
	CallTimeout Duration `yaml:"call_timeout"`
	MaxInFlight int      `yaml:"max_in_flight"`
	SweepEvery  Duration `yaml:"sweep_every"`
	WantFactor  float64  `yaml:"want_factor"`
}

// Identities is a group of identities: each tenant of the group sends requests on Path with
// Operation. Tenants is a count (tenants named Prefix + number) or a list of names.
type Identities struct {
	Name      string    `yaml:"name"`
	Tenants   yaml.Node `yaml:"tenants"`
	Prefix    string    `yaml:"prefix"`
	Path      string    `yaml:"path"`
	Operation string    `yaml:"operation"`
	Cost      int64     `yaml:"cost"` // tokens per request; 0: the rule's cost

	names []string
}

// Traffic is one arrival process: Rate requests per second in all (split evenly over the agents
// it runs on), picking identities of a group by Skew, shaped over time by Shape.
type Traffic struct {
	Identities string `yaml:"identities"`
	Rate       Rate   `yaml:"rate"`
	// Agents: "all" (default), a region name, or a list of agent numbers (0-based, across regions
	// in order).
	Agents   yaml.Node `yaml:"agents"`
	Arrivals string    `yaml:"arrivals"` // poisson (default) or constant
	Shape    Shape     `yaml:"shape"`
	Skew     Skew      `yaml:"skew"`
	// Cost, if set, makes every check an estimate settled after the response (settle.go).
	Cost *SettledCost `yaml:"cost"`

	nodes []int
}

// Shape modulates a rate over time: none, diurnal (a cosine of Period peaking at PeakAt, between
// 1−Amplitude and 1+Amplitude of the rate) or bursts (Factor times the rate for Length every
// Every).
type Shape struct {
	Kind      string   `yaml:"kind"`
	Period    Duration `yaml:"period"`
	PeakAt    Duration `yaml:"peak_at"`
	Amplitude float64  `yaml:"amplitude"`
	Every     Duration `yaml:"every"`
	Length    Duration `yaml:"length"`
	Factor    float64  `yaml:"factor"`
}

// Skew is how a request picks its identity in the group: uniform (default), Zipf with exponent
// Zipf (> 0; the first tenant is the most frequent), Hot: one hot key taking that share of the
// traffic and the rest uniform, or Cycle: every identity in turn, in a seeded random order, so
// each is picked exactly once every N requests of the traffic (as the stack benchmark walks its
// uniform keys).
type Skew struct {
	Zipf  float64 `yaml:"zipf"`
	Hot   float64 `yaml:"hot"`
	Cycle bool    `yaml:"cycle"`
}

// Crashes are agent deaths: at RatePerAgentHour (a Poisson process per live agent) and on a
// Schedule. A crashed agent's Limiter is dropped without Close; after RestartAfter a new Limiter
// with a new agent id takes over. Meanwhile its traffic goes to the next live agent ("redirect",
// as a load balancer does) or is lost ("drop": not sent to any agent nor to the oracle).
type Crashes struct {
	RatePerAgentHour float64   `yaml:"rate_per_agent_hour"`
	RestartAfter     Duration  `yaml:"restart_after"`
	Traffic          string    `yaml:"traffic"`
	Schedule         []CrashAt `yaml:"schedule"`
}

// CrashAt is one scheduled crash.
type CrashAt struct {
	Agent        int       `yaml:"agent"`
	At           Duration  `yaml:"at"`
	RestartAfter *Duration `yaml:"restart_after"`
}

// Outage makes the coordinators of a region ("coordinator") or a store ("redis": Store is
// "global" or a region's name for its regional store) unreachable in [From, To). Mode "refused"
// (default) fails calls after one round trip; "blackhole" lets them time out (call_timeout, and
// the shell's one retry).
type Outage struct {
	Kind   string   `yaml:"kind"`
	Region string   `yaml:"region"`
	Store  string   `yaml:"store"`
	From   Duration `yaml:"from"`
	To     Duration `yaml:"to"`
	Mode   string   `yaml:"mode"`
}

// Partition cuts Region off from the other regions in [From, To): its coordinators cannot reach
// stores elsewhere (the global store, unless it is the home region) and no other region's
// coordinators can reach its stores.
type Partition struct {
	Region string   `yaml:"region"`
	From   Duration `yaml:"from"`
	To     Duration `yaml:"to"`
}

// Faults break the system on purpose, to show the checks fire. OvergrantFactor > 1 wraps the
// store so that every grant is reported to the agent that many times larger than what the bucket
// was debited: a broken grant rule.
type Faults struct {
	OvergrantFactor float64 `yaml:"overgrant_factor"`
}

// Sweep runs the scenario once per value of one parameter (SweepParams lists them).
type Sweep struct {
	Parameter string    `yaml:"parameter"`
	Values    []float64 `yaml:"values"`
	// Duration of each point (the scenario's duration if zero).
	Duration Duration `yaml:"duration"`
}

// sweepParams are the parameters a sweep can vary.
var sweepParams = []string{"agents", "burst_factor", "crash_rate", "hot_share", "lease", "load", "want_factor", "zipf"}

// Load reads and validates a scenario file; the policy file it names is read relative to it.
func Load(path string) (*Scenario, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("sim: %w", err)
	}
	return parseScenario(path, data)
}

// parseScenario validates the scenario in data (filename is used for messages and relative paths).
func parseScenario(filename string, data []byte) (*Scenario, error) {
	sc := &Scenario{}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(sc); err != nil {
		return nil, fmt.Errorf("sim: %s: %w", filename, err)
	}
	sc.file, sc.dir = filename, filepath.Dir(filename)
	if err := sc.prepare(); err != nil {
		return nil, fmt.Errorf("sim: %s: %w", filename, err)
	}
	return sc, nil
}

// Defaults of the shell and the network (docs/simulator.md explains each).
const (
	defaultMaxWait     = agent.DefaultMaxWait
	defaultCallTimeout = agent.DefaultCallTimeout
	defaultInFlight    = agent.DefaultMaxInFlight
	// defaultSweepEvery: the Refresher sweeps 4 of 64 shards every 25 ms, the whole table every
	// 400 ms; the simulator sweeps the whole table every 400 ms (see node.sweep for why).
	defaultSweepEvery = 400 * time.Millisecond
	defaultTick       = time.Millisecond
	defaultRestart    = 10 * time.Second
)

func (sc *Scenario) prepare() error {
	if sc.Name == "" {
		sc.Name = strings.TrimSuffix(filepath.Base(sc.file), filepath.Ext(sc.file))
	}
	if sc.Duration <= 0 {
		return errors.New("duration: required and positive")
	}
	if sc.Warmup >= sc.Duration {
		return errors.New("warmup: shorter than the duration")
	}
	if err := sc.loadPolicy(); err != nil {
		return err
	}
	if len(sc.Regions) == 0 {
		sc.Regions = []Region{{Name: "local", Agents: sc.Agents, Coordinators: sc.Coordinators}}
	} else if sc.Agents != 0 || sc.Coordinators != 0 {
		return errors.New("agents/coordinators: give them per region when regions are listed")
	}
	seen := map[string]bool{}
	for i := range sc.Regions {
		r := &sc.Regions[i]
		switch {
		case r.Name == "" || seen[r.Name]:
			return fmt.Errorf("regions[%d]: a unique name is required", i)
		case r.Agents < 1:
			return fmt.Errorf("regions[%d] (%s): agents must be at least 1", i, r.Name)
		}
		seen[r.Name] = true
		if r.Coordinators == 0 {
			r.Coordinators = 1
		}
	}
	if sc.Home == "" {
		sc.Home = sc.Regions[0].Name
	} else if !seen[sc.Home] {
		return fmt.Errorf("home: no region %q", sc.Home)
	}
	n := &sc.Network
	if n.AgentCoordinator == 0 {
		n.AgentCoordinator = Duration(500 * time.Microsecond)
	}
	if n.CoordinatorStore == 0 {
		n.CoordinatorStore = Duration(250 * time.Microsecond)
	}
	if n.CrossRegion == 0 {
		n.CrossRegion = Duration(40 * time.Millisecond)
	}
	if n.Jitter < 0 || n.Jitter > 10 {
		return errors.New("network.jitter: a fraction in [0, 10]")
	}
	// The engine's lookahead: nothing one agent does reaches another before the shortest one-way
	// path agent → store (or store → agent).
	lookahead := n.AgentCoordinator + n.CoordinatorStore
	if sc.Tick == 0 {
		sc.Tick = Duration(min(defaultTick, lookahead.D()))
	}
	if sc.Tick > lookahead || sc.Tick <= 0 {
		return fmt.Errorf("tick %s: must be positive and at most the shortest one-way path agent → store (%s)", sc.Tick, lookahead)
	}
	a := &sc.Agent
	if a.MaxWait == 0 {
		a.MaxWait = Duration(defaultMaxWait)
	}
	if a.CallTimeout == 0 {
		a.CallTimeout = Duration(defaultCallTimeout)
	}
	if a.MaxInFlight == 0 {
		a.MaxInFlight = defaultInFlight
	}
	if a.SweepEvery == 0 {
		a.SweepEvery = Duration(defaultSweepEvery)
	}
	if a.WantFactor == 0 {
		a.WantFactor = 1
	}
	if a.MaxInFlight < 1 || a.WantFactor < 0 {
		return errors.New("agent: max_in_flight must be at least 1 and want_factor positive")
	}
	if err := sc.prepareIdentities(); err != nil {
		return err
	}
	if err := sc.prepareTraffic(); err != nil {
		return err
	}
	if err := sc.prepareFailures(); err != nil {
		return err
	}
	if sc.Faults.OvergrantFactor != 0 && sc.Faults.OvergrantFactor < 1 {
		return errors.New("faults.overgrant_factor: at least 1")
	}
	if s := sc.Sweep; s != nil {
		if !slices.Contains(sweepParams, s.Parameter) {
			return fmt.Errorf("sweep.parameter %q: one of %s", s.Parameter, strings.Join(sweepParams, ", "))
		}
		if len(s.Values) == 0 {
			return errors.New("sweep.values: at least one value")
		}
		for _, v := range s.Values {
			if v < 0 || math.IsNaN(v) || math.IsInf(v, 0) {
				return fmt.Errorf("sweep.values: %v is not a non-negative number", v)
			}
			if s.Parameter == "lease" && v != 0 && v != 1 {
				return fmt.Errorf("sweep.values: lease %v: 1 (every rule lease: on) or 0 (lease: off)", v)
			}
		}
	}
	if c := sc.Capacity; c != nil {
		if err := c.prepare(); err != nil {
			return fmt.Errorf("capacity: %w", err)
		}
	}
	return nil
}

func (sc *Scenario) loadPolicy() error {
	hasInline := sc.Policy.Kind != 0
	switch {
	case hasInline && sc.PolicyFile != "":
		return errors.New("policy and policy_file: give one")
	case sc.PolicyFile != "":
		p := sc.PolicyFile
		if !filepath.IsAbs(p) {
			p = filepath.Join(sc.dir, p)
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return fmt.Errorf("policy_file: %w", err)
		}
		sc.text = data
	case sc.Policy.Kind == yaml.ScalarNode:
		sc.text = []byte(sc.Policy.Value)
	case sc.Policy.Kind == yaml.MappingNode:
		data, err := yaml.Marshal(&sc.Policy)
		if err != nil {
			return fmt.Errorf("policy: %w", err)
		}
		sc.text = data
	default:
		return errors.New("policy or policy_file: required")
	}
	return sc.parsePolicy()
}

func (sc *Scenario) parsePolicy() error {
	set, err := policy.Parse(sc.Name+" policy", sc.text)
	if err != nil {
		return err
	}
	// The virtual clock starts at the epoch, and its oracle is one token bucket: a calendar
	// quota's periods and its exact counter are not simulated.
	for _, r := range append(set.Rules(), set.Default()) {
		switch {
		case r.Quota.Calendar != nil:
			return fmt.Errorf("policy: rule %s (line %d): calendar quotas (quota: %s) are not simulated; give the rule a limit", r.Name, r.Line, r.Quota)
		case len(r.Extra) > 0 || r.Scope == policy.Tenant:
			// Its oracle is one bucket per check.
			return fmt.Errorf("policy: rule %s (line %d): checks charging several buckets (limits, scope: tenant) are not simulated", r.Name, r.Line)
		}
	}
	sc.policy = set
	return nil
}

func (sc *Scenario) prepareIdentities() error {
	if len(sc.Identities) == 0 {
		return errors.New("identities: at least one group")
	}
	seen := map[string]bool{}
	for i := range sc.Identities {
		g := &sc.Identities[i]
		if g.Name == "" || seen[g.Name] {
			return fmt.Errorf("identities[%d]: a unique name is required", i)
		}
		seen[g.Name] = true
		if g.Path == "" || g.Operation == "" {
			return fmt.Errorf("identities %s: path and operation are required", g.Name)
		}
		if g.Cost < 0 {
			return fmt.Errorf("identities %s: cost must not be negative", g.Name)
		}
		switch g.Tenants.Kind {
		case yaml.ScalarNode:
			var count int
			if err := g.Tenants.Decode(&count); err != nil || count < 1 {
				return fmt.Errorf("identities %s: tenants is a positive count or a list of names", g.Name)
			}
			prefix := g.Prefix
			if prefix == "" {
				prefix = g.Name + "-"
			}
			width := len(fmt.Sprint(count - 1))
			g.names = make([]string, count)
			for j := range g.names {
				g.names[j] = fmt.Sprintf("%s%0*d", prefix, width, j)
			}
		case yaml.SequenceNode:
			if err := g.Tenants.Decode(&g.names); err != nil || len(g.names) == 0 {
				return fmt.Errorf("identities %s: tenants is a positive count or a list of names", g.Name)
			}
		default:
			return fmt.Errorf("identities %s: tenants is required", g.Name)
		}
		for _, t := range g.names {
			if err := policy.ValidTenant(t); err != nil {
				return fmt.Errorf("identities %s: %w", g.Name, err)
			}
		}
	}
	return nil
}

func (sc *Scenario) group(name string) *Identities {
	for i := range sc.Identities {
		if sc.Identities[i].Name == name {
			return &sc.Identities[i]
		}
	}
	return nil
}

// numAgents is the number of agents across regions.
func (sc *Scenario) numAgents() int {
	n := 0
	for _, r := range sc.Regions {
		n += r.Agents
	}
	return n
}

func (sc *Scenario) prepareTraffic() error {
	if len(sc.Traffic) == 0 {
		return errors.New("traffic: at least one entry")
	}
	total := sc.numAgents()
	for i := range sc.Traffic {
		t := &sc.Traffic[i]
		at := fmt.Sprintf("traffic[%d]", i)
		if sc.group(t.Identities) == nil {
			return fmt.Errorf("%s: no identities group %q", at, t.Identities)
		}
		if t.Rate < 0 {
			return fmt.Errorf("%s: rate must not be negative", at)
		}
		if !oneOf(&t.Arrivals, "poisson", "constant") {
			return fmt.Errorf("%s: arrivals is poisson or constant", at)
		}
		nodes, err := sc.selectAgents(t.Agents, total)
		if err != nil {
			return fmt.Errorf("%s: agents: %w", at, err)
		}
		t.nodes = nodes
		if t.Cost != nil {
			if err := t.Cost.prepare(); err != nil {
				return fmt.Errorf("%s: %w", at, err)
			}
		}
		s := &t.Shape
		switch s.Kind {
		case "", "none":
			s.Kind = "none"
		case "diurnal":
			if s.Period <= 0 || s.Amplitude < 0 || s.Amplitude > 1 {
				return fmt.Errorf("%s: a diurnal shape needs a period and an amplitude in [0, 1]", at)
			}
		case "bursts":
			if s.Every <= 0 || s.Length <= 0 || s.Length > s.Every || s.Factor < 1 {
				return fmt.Errorf("%s: a bursts shape needs every > 0, 0 < length <= every and factor >= 1", at)
			}
		default:
			return fmt.Errorf("%s: shape kind is none, diurnal or bursts", at)
		}
		switch k := t.Skew; {
		case k.Zipf < 0 || k.Hot < 0 || k.Hot > 1:
			return fmt.Errorf("%s: skew.zipf must be positive, skew.hot a share in [0, 1]", at)
		case k.Zipf > 0 && k.Hot > 0, k.Cycle && (k.Zipf > 0 || k.Hot > 0):
			return fmt.Errorf("%s: skew is one of zipf, hot or cycle", at)
		}
	}
	return nil
}

// oneOf sets an empty *v to the first of values, the default, and reports whether *v is one of
// values.
func oneOf(v *string, values ...string) bool {
	if *v == "" {
		*v = values[0]
	}
	return slices.Contains(values, *v)
}

// selectAgents resolves a traffic entry's agents: all, a region name or a list of numbers.
func (sc *Scenario) selectAgents(n yaml.Node, total int) ([]int, error) {
	var all []int
	for i := range total {
		all = append(all, i)
	}
	switch n.Kind {
	case 0:
		return all, nil
	case yaml.ScalarNode:
		if n.Value == "all" {
			return all, nil
		}
		first := 0
		for _, r := range sc.Regions {
			if r.Name == n.Value {
				return all[first : first+r.Agents], nil
			}
			first += r.Agents
		}
		return nil, fmt.Errorf("%q is neither all nor a region", n.Value)
	case yaml.SequenceNode:
		var list []int
		if err := n.Decode(&list); err != nil {
			return nil, err
		}
		for _, a := range list {
			if a < 0 || a >= total {
				return nil, fmt.Errorf("agent %d: there are agents 0..%d", a, total-1)
			}
		}
		slices.Sort(list)
		return slices.Compact(list), nil
	}
	return nil, errors.New("all, a region name or a list of agent numbers")
}

func (sc *Scenario) prepareFailures() error {
	c := &sc.Crashes
	if c.RatePerAgentHour < 0 {
		return errors.New("crashes.rate_per_agent_hour must not be negative")
	}
	if c.RestartAfter == 0 {
		c.RestartAfter = Duration(defaultRestart)
	}
	if !oneOf(&c.Traffic, "redirect", "drop") {
		return errors.New("crashes.traffic is redirect or drop")
	}
	total := sc.numAgents()
	for i, s := range c.Schedule {
		if s.Agent < 0 || s.Agent >= total {
			return fmt.Errorf("crashes.schedule[%d]: agent %d: there are agents 0..%d", i, s.Agent, total-1)
		}
	}
	region := func(name string) bool {
		return slices.ContainsFunc(sc.Regions, func(r Region) bool { return r.Name == name })
	}
	for i := range sc.Outages {
		o := &sc.Outages[i]
		at := fmt.Sprintf("outages[%d]", i)
		if o.To <= o.From {
			return fmt.Errorf("%s: to must be after from", at)
		}
		if !oneOf(&o.Mode, "refused", "blackhole") {
			return fmt.Errorf("%s: mode is refused or blackhole", at)
		}
		switch o.Kind {
		case "coordinator":
			if o.Region == "" {
				o.Region = sc.Home
			}
			if !region(o.Region) {
				return fmt.Errorf("%s: no region %q", at, o.Region)
			}
		case "redis":
			if o.Store == "" {
				o.Store = "global"
			}
			if o.Store != "global" && !region(o.Store) {
				return fmt.Errorf("%s: store is global or a region's name", at)
			}
		default:
			return fmt.Errorf("%s: kind is coordinator or redis", at)
		}
	}
	for i, p := range sc.Partitions {
		if !region(p.Region) || p.To <= p.From {
			return fmt.Errorf("partitions[%d]: a known region and from < to are required", i)
		}
	}
	return nil
}
