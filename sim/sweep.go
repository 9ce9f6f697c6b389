package sim

import (
	"fmt"
	"math"
	"time"

	"go.yaml.in/yaml/v3"
)

// SweepResult is one run per value of the swept parameter.
type SweepResult struct {
	Parameter string
	Points    []*Result
}

// runSweep runs sc once per value of its sweep. Progress (if set) covers all the points.
func runSweep(sc *Scenario, opts Options) (*SweepResult, error) {
	s := sc.Sweep
	out := &SweepResult{Parameter: s.Parameter}
	for i, v := range s.Values {
		point, err := sc.With(s.Parameter, v)
		if err != nil {
			return nil, err
		}
		if s.Duration > 0 {
			point.Duration = s.Duration
		}
		o := opts
		if opts.Progress != nil {
			base := time.Duration(i) * point.Duration.D()
			total := time.Duration(len(s.Values)) * point.Duration.D()
			o.Progress = func(done, _ time.Duration) { opts.Progress(base+done, total) }
		}
		res, err := runScenario(point, o)
		if err != nil {
			return nil, err
		}
		res.Param, res.Value = s.Parameter, v
		out.Points = append(out.Points, res)
	}
	return out, nil
}

// With is a copy of sc with one parameter changed (the parameters of SweepParams):
//
//	agents        the number of agents (spread over the regions in proportion)
//	burst_factor  every burst of the policy multiplied (so the lease TTL, C/(4r), too)
//	crash_rate    crashes per agent and hour
//	hot_share     the hot key's share of every traffic entry with a hot key
//	lease         1: every rule keeps leases (lease: on), 0: every rule is in direct mode (lease: off)
//	load          every traffic rate multiplied
//	want_factor   what agents ask for multiplied (the grant rule caps it at 2× their demand)
//	zipf          the Zipf exponent of every Zipf-skewed traffic entry
func (sc *Scenario) With(param string, v float64) (*Scenario, error) {
	c := *sc
	c.Sweep = nil
	c.Regions = append([]Region(nil), sc.Regions...)
	c.Traffic = append([]Traffic(nil), sc.Traffic...)
	switch param {
	case "agents":
		n := int(math.Round(v))
		if n < len(c.Regions) {
			return nil, fmt.Errorf("sim: %s: agents = %v: at least one per region", sc.Name, v)
		}
		total, left := sc.numAgents(), n
		for i := range c.Regions {
			share := n * sc.Regions[i].Agents / total
			if i == len(c.Regions)-1 {
				share = left
			}
			c.Regions[i].Agents = max(1, share)
			left -= c.Regions[i].Agents
		}
		if len(sc.Crashes.Schedule) > 0 {
			return nil, fmt.Errorf("sim: %s: a crash schedule names agents: sweep crash_rate instead of agents", sc.Name)
		}
		for i := range c.Traffic {
			t := &c.Traffic[i]
			if t.Agents.Kind == yaml.SequenceNode {
				return nil, fmt.Errorf("sim: %s: traffic[%d] lists agents by number: it cannot follow an agents sweep", sc.Name, i)
			}
			nodes, err := c.selectAgents(t.Agents, c.numAgents())
			if err != nil {
				return nil, err
			}
			t.nodes = nodes
		}
	case "burst_factor":
		text, err := scaleBursts(sc.text, v)
		if err != nil {
			return nil, fmt.Errorf("sim: %s: burst_factor %v: %w", sc.Name, v, err)
		}
		c.text = text
		if err := c.parsePolicy(); err != nil {
			return nil, fmt.Errorf("sim: %s: burst_factor %v: %w", sc.Name, v, err)
		}
	case "crash_rate":
		c.Crashes.RatePerAgentHour = v
	case "hot_share":
		if v > 1 {
			return nil, fmt.Errorf("sim: %s: hot_share %v: a share in [0, 1]", sc.Name, v)
		}
		for i := range c.Traffic {
			if c.Traffic[i].Skew.Hot > 0 {
				c.Traffic[i].Skew.Hot = v
			}
		}
	case "lease":
		if v != 0 && v != 1 {
			return nil, fmt.Errorf("sim: %s: lease %v: 1 (on) or 0 (off)", sc.Name, v)
		}
		text, err := setLease(sc.text, v == 1)
		if err != nil {
			return nil, fmt.Errorf("sim: %s: lease %v: %w", sc.Name, v, err)
		}
		c.text = text
		if err := c.parsePolicy(); err != nil {
			return nil, fmt.Errorf("sim: %s: lease %v: %w", sc.Name, v, err)
		}
	case "load":
		for i := range c.Traffic {
			c.Traffic[i].Rate = Rate(float64(c.Traffic[i].Rate) * v)
		}
	case "want_factor":
		if v <= 0 {
			return nil, fmt.Errorf("sim: %s: want_factor %v: positive", sc.Name, v)
		}
		c.Agent.WantFactor = v
	case "zipf":
		for i := range c.Traffic {
			if c.Traffic[i].Skew.Zipf > 0 {
				c.Traffic[i].Skew.Zipf = v
			}
		}
	default:
		return nil, fmt.Errorf("sim: unknown sweep parameter %q", param)
	}
	return &c, nil
}

// scaleBursts multiplies every burst in a policy document (rules, overrides, regions, emergency
// buckets), rounding to at least 1.
func scaleBursts(text []byte, f float64) ([]byte, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(text, &doc); err != nil {
		return nil, err
	}
	var walk func(n *yaml.Node) error
	walk = func(n *yaml.Node) error {
		if n.Kind == yaml.MappingNode {
			for i := 0; i+1 < len(n.Content); i += 2 {
				k, v := n.Content[i], n.Content[i+1]
				if k.Value == "burst" && v.Kind == yaml.ScalarNode {
					var b float64
					if err := v.Decode(&b); err != nil {
						return fmt.Errorf("line %d: burst %q", v.Line, v.Value)
					}
					v.SetString(fmt.Sprint(max(1, int64(math.Round(b*f)))))
					v.Tag = "!!int"
					continue
				}
				if err := walk(v); err != nil {
					return err
				}
			}
			return nil
		}
		for _, c := range n.Content {
			if err := walk(c); err != nil {
				return err
			}
		}
		return nil
	}
	if err := walk(&doc); err != nil {
		return nil, err
	}
	return yaml.Marshal(&doc)
}

// setLease sets lease: on or off on every rule of a policy document (its rules list), replacing
// what a rule says.
func setLease(text []byte, on bool) ([]byte, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(text, &doc); err != nil {
		return nil, err
	}
	if len(doc.Content) == 0 || doc.Content[0].Kind != yaml.MappingNode {
		return nil, fmt.Errorf("the policy is not a mapping")
	}
	value := "off"
	if on {
		value = "on"
	}
	top := doc.Content[0]
	for i := 0; i+1 < len(top.Content); i += 2 {
		if top.Content[i].Value != "rules" || top.Content[i+1].Kind != yaml.SequenceNode {
			continue
		}
		for _, rule := range top.Content[i+1].Content {
			if rule.Kind != yaml.MappingNode {
				continue // policy.Parse says what is wrong with it
			}
			set := false
			for j := 0; j+1 < len(rule.Content); j += 2 {
				if rule.Content[j].Value == "lease" {
					rule.Content[j+1].SetString(value)
					set = true
				}
			}
			if !set {
				rule.Content = append(rule.Content,
					&yaml.Node{Kind: yaml.ScalarNode, Value: "lease"}, &yaml.Node{Kind: yaml.ScalarNode, Value: value})
			}
		}
	}
	return yaml.Marshal(&doc)
}

// Simulate runs everything a scenario asks for: the scenario as written, its sweep if it has one,
// and its capacity plan if it has a capacity section (figures from bench, overridden by
// override).
func Simulate(sc *Scenario, opts Options, bench Measured, override Figures) (*Outcome, error) {
	out := &Outcome{Scenario: sc}
	res, err := runScenario(sc, opts)
	if err != nil {
		return nil, err
	}
	out.Result = res
	if sc.Sweep != nil {
		if out.Sweep, err = runSweep(sc, opts); err != nil {
			return nil, err
		}
	}
	if sc.Capacity != nil {
		out.Plan = planCapacity(res, sc.Capacity, bench, override)
	}
	return out, nil
}
