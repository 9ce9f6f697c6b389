package sim

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
)

// Costs known after the response (docs/agent.md): a traffic entry with a cost sends every check
// with Query.Settle and its estimate; After (drawn per check) after an allowed answer, its agent
// calls Limiter.Settle with the actual cost, drawn from Actual. What exceeds the estimate is spent
// from the key's lease as far as it holds and sent as debt with the key's next call; the store
// debits it even below zero, down to the rule's max_debt (the rest is forgiven).
//
// The ideal limiter and the decision counts see the estimate (what the checks asked for); the
// actual costs are measured apart (Result.Settled) and checked against the debt bound: on each
// key, what the agents spent from leases (estimates, plus extras, less the estimates given back)
// plus what the stores debited as debt, in any window of length w, is at most
// C + r·(w + τ + 1 ms) + max_debt (docs/leases.md, "Debt").

// SettledCost is a traffic entry's costs known after the response.
type SettledCost struct {
	Estimate int64 `yaml:"estimate"` // tokens each check is decided on
	Actual   Dist  `yaml:"actual"`   // tokens, rounded to whole tokens
	After    Delay `yaml:"after"`    // from the answer to the Settle
}

// Dist is a distribution of a non-negative quantity: fixed (value), uniform in [min, max],
// pareto (scale min, shape alpha) or lognormal (median, sigma). Heavy-tailed draws are capped at
// max (a point mass there), so every draw is at most max.
type Dist struct {
	Dist   string  `yaml:"dist"`
	Value  float64 `yaml:"value"`
	Min    float64 `yaml:"min"`
	Max    float64 `yaml:"max"`
	Alpha  float64 `yaml:"alpha"`
	Median float64 `yaml:"median"`
	Sigma  float64 `yaml:"sigma"`
}

// Delay is a distribution of durations: a duration (fixed) or a mapping as Dist's, with
// durations for value, min, max and median.
type Delay struct {
	d Dist // in ns
}

// UnmarshalYAML implements yaml.Unmarshaler.
func (d *Delay) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		var v Duration
		if err := n.Decode(&v); err != nil {
			return err
		}
		d.d = Dist{Dist: "fixed", Value: float64(v)}
		return nil
	}
	var m struct {
		Dist   string   `yaml:"dist"`
		Value  Duration `yaml:"value"`
		Min    Duration `yaml:"min"`
		Max    Duration `yaml:"max"`
		Alpha  float64  `yaml:"alpha"`
		Median Duration `yaml:"median"`
		Sigma  float64  `yaml:"sigma"`
	}
	if n.Kind != yaml.MappingNode {
		return fmt.Errorf("line %d: after is a duration or a mapping (dist, value, min, max, alpha, median, sigma)", n.Line)
	}
	for i := 0; i < len(n.Content); i += 2 {
		switch f := n.Content[i].Value; f {
		case "dist", "value", "min", "max", "alpha", "median", "sigma":
		default:
			return fmt.Errorf("line %d: field %s not found in after", n.Content[i].Line, f)
		}
	}
	if err := n.Decode(&m); err != nil {
		return err
	}
	d.d = Dist{Dist: m.Dist, Value: float64(m.Value), Min: float64(m.Min), Max: float64(m.Max),
		Alpha: m.Alpha, Median: float64(m.Median), Sigma: m.Sigma}
	return nil
}

// check validates d; needMax requires a cap for the heavy-tailed kinds.
func (d *Dist) check(needMax bool) error {
	bad := func(v float64) bool { return v < 0 || math.IsNaN(v) || math.IsInf(v, 0) }
	if bad(d.Value) || bad(d.Min) || bad(d.Max) || bad(d.Alpha) || bad(d.Median) || bad(d.Sigma) {
		return errors.New("values must be finite and not negative")
	}
	switch d.Dist {
	case "", "fixed":
		d.Dist = "fixed"
	case "uniform":
		if d.Max < d.Min {
			return errors.New("uniform needs min <= max")
		}
	case "pareto":
		if d.Alpha <= 0 || d.Min <= 0 {
			return errors.New("pareto needs alpha > 0 and min > 0")
		}
		if needMax && d.Max == 0 || d.Max > 0 && d.Max < d.Min {
			return errors.New("pareto needs max >= min (draws above it are capped)")
		}
	case "lognormal":
		if d.Median <= 0 {
			return errors.New("lognormal needs median > 0 and sigma >= 0")
		}
		if needMax && d.Max == 0 {
			return errors.New("lognormal needs max (draws above it are capped)")
		}
	default:
		return fmt.Errorf("dist %q: fixed, uniform, pareto or lognormal", d.Dist)
	}
	return nil
}

// most is the largest value d draws (+Inf if uncapped).
func (d *Dist) most() float64 {
	switch d.Dist {
	case "fixed":
		return d.Value
	case "uniform":
		return d.Max
	}
	if d.Max == 0 {
		return math.Inf(1)
	}
	return d.Max
}

// draw takes one value of d; it uses one or two numbers of r (the same for every kind of a run).
func (d *Dist) draw(r *rand.Rand) float64 {
	var v float64
	switch d.Dist {
	case "fixed":
		return d.Value
	case "uniform":
		return d.Min + (d.Max-d.Min)*r.Float64()
	case "pareto":
		v = d.Min * math.Pow(1-r.Float64(), -1/d.Alpha) // inverse CDF; 1 − U is in (0, 1]
	case "lognormal":
		v = d.Median * math.Exp(d.Sigma*r.NormFloat64())
	}
	if d.Max > 0 {
		v = min(v, d.Max)
	}
	return v
}

// prepare validates a traffic entry's cost (what needs the policy is checked by newWorld).
func (c *SettledCost) prepare() error {
	if c.Estimate < 1 {
		return errors.New("cost.estimate: at least 1 token")
	}
	if err := c.Actual.check(true); err != nil {
		return fmt.Errorf("cost.actual: %w", err)
	}
	if err := c.After.d.check(false); err != nil {
		return fmt.Errorf("cost.after: %w", err)
	}
	if c.After.d.Dist == "fixed" && c.After.d.Value <= 0 || c.After.d.most() <= 0 {
		return errors.New("cost.after: the response must take some time (e.g. after: 2s)")
	}
	return nil
}

// Settled is what the settled costs of a run did, summed over agents (their Stats) and stores.
// Amounts are µ.
type Settled struct {
	Checks        int64 // allowed checks with a settle id
	Unheld        int64 // allowed without a settle id (an emergency bucket's answer): the estimate stands
	Settles       int64 // Settle calls applied
	LostInCrash   int64 // checks whose agent died before their Settle
	Pending       int64 // checks not settled when the run ended
	Estimates     int64 // µ of the estimates of the checks settled
	Actual        int64 // µ of the actual costs of the checks settled
	Credited      int64 // µ of estimates given back (agents' SettleCredited)
	Uncredited    int64 // µ of estimates that stayed spent (no lease held them)
	SpentExtra    int64 // µ beyond estimates spent from leases
	Debt          int64 // µ beyond estimates sent as debt
	DebtCharged   int64 // µ of debt debited by stores (agents' DebtCharged)
	DebtForgiven  int64 // µ of debt forgiven: the bucket was at -max_debt
	DebtLost      int64 // µ of debt never sent
	StoreDebited  int64 // µ debited by stores, as the stores answered
	StoreForgiven int64 // µ of debt the stores did not debit
	// Budget is what the keys' buckets could admit over the run, Σ C + r·T, µ; Charged what their
	// admitted requests were charged: spent from leases, net, plus debited as debt.
	Budget  int64
	Charged int64
	// Worst is the key closest to the debt bound: its worst window's charge less r·w, against
	// C + r·(τ + 1 ms) + max_debt.
	WorstKey    string
	WorstExcess float64
	WorstBound  float64
	// Deepest is the lowest level a store answered for a key, µ (≤ 0), and DeepestMax that key's
	// max_debt: the bound is Deepest ≥ -DeepestMax.
	DeepestKey string
	Deepest    int64
	DeepestMax int64
}

// WorstRatio is the worst window's charge against the debt bound (≤ 1 when it holds).
func (s *Settled) WorstRatio() float64 {
	if s.WorstBound == 0 {
		return 0
	}
	return s.WorstExcess / s.WorstBound
}

// Utilisation is the charge of the admitted requests over the buckets' budget for the run.
func (s *Settled) Utilisation() float64 { return ratio(s.Charged, s.Budget) }

// settleJob is an allowed check whose response ends at its event: its agent settles its cost.
type settleJob struct {
	inc    *incarnation
	id     uint64
	k      *key
	actual int64 // tokens
	est    int64 // µ
}

// settleLater schedules the Settle of an allowed check of rq (answered at t by inc).
func (w *world) settleLater(inc *incarnation, rq *request, k *key, v agent.Verdict, t int64) {
	s := &w.res.Settled
	if v.SettleID == 0 {
		s.Unheld++
		return
	}
	s.Checks++
	n := inc.node
	actual := int64(math.Round(rq.settle.Actual.draw(n.settles)))
	at := t + max(1, int64(rq.settle.After.d.draw(n.settles)))
	if at >= w.end {
		s.Pending++
		return
	}
	w.schedule(event{at: at, kind: evSettle, own: true, node: n, inc: inc,
		job: &settleJob{inc: inc, id: v.SettleID, k: k, actual: actual, est: rq.micro}})
}

// settle runs a Settle: it books what the core spent beyond the estimate from the lease and what
// it gave back (the leases' ledgers and the bound checks follow the tokens), and sends the calls
// the debt made due.
func (w *world) settle(j *settleJob) {
	s := &w.res.Settled
	inc := j.inc
	if inc.dead {
		s.LostInCrash++
		return
	}
	st := inc.lim.Stats()
	credited0, spent0 := st.SettleCredited.Load(), st.SettleSpent.Load()
	if _, err := inc.lim.Settle(clock.Nanos(w.now), j.id, j.actual); err != nil {
		w.fatal = fmt.Errorf("sim: %s: settle %d tokens on %s: %w", w.sc.Name, j.actual, j.k.name, err)
		return
	}
	s.Settles++
	s.Estimates += j.est
	s.Actual += j.actual * int64(bucket.PerToken)
	w.second(w.now).SettledActual += j.actual * int64(bucket.PerToken)
	// The estimate's unused part went back into the lease, or to be handed back (then booked as
	// returned, or expired, when it leaves); the extra came out of the lease.
	net := int64(st.SettleSpent.Load()-spent0) - int64(st.SettleCredited.Load()-credited0)
	inc.spent += net
	j.k.spent += net
	j.k.leased -= net
	w.spend(j.k, w.now, float64(net))
	w.forfeits(inc)
	w.pumpIfDue(inc)
}

// spend books x µ spent from leases of k at t (negative: given back into them) and checks the
// admission bound and the debt bound.
func (w *world) spend(k *key, t int64, x float64) {
	if e := k.admitted.add(t, x, k.rate); e > k.admitBound+tolerance {
		w.violate("admission", k.name, t,
			"agents spent %s tokens in [%s, %s]: more than C + r·(w + τ) allows by %s tokens (C = %s, %s)",
			tokens(int64(e+k.rate*float64(t-k.admitted.start))), time.Duration(k.admitted.start), time.Duration(t),
			tokens(int64(e-k.admitBound)), tokens(int64(k.limit.Capacity())), k.lagText())
	}
	w.charge(k, t, x)
}

// charge books x µ charged to k at t (spent from a lease, or debited as debt) and checks the debt
// bound: in any window of length w, at most C + r·(w + τ + 1 ms) + max_debt.
func (w *world) charge(k *key, t int64, x float64) {
	k.chargedTotal += int64(x)
	if e := k.charged.add(t, x, k.rate); e > k.debtBound+tolerance {
		w.violate("debt", k.name, t,
			"leases spent and stores debited %s tokens in [%s, %s]: more than C + r·(w + τ) + max_debt allows by %s tokens (C = %s, max_debt = %s)",
			tokens(int64(e+k.rate*float64(t-k.charged.start))), time.Duration(k.charged.start), time.Duration(t),
			tokens(int64(e-k.debtBound)), tokens(int64(k.limit.Capacity())), tokens(k.maxDebt))
	}
}

// debtLevel checks a level a store answered for k (µ, after the operation) against -max_debt.
func (w *world) debtLevel(k *key, level int64) {
	if level >= 0 {
		return
	}
	if k.maxDebt > 0 {
		sec := w.second(w.now)
		sec.DebtDepth = max(sec.DebtDepth, float64(-level)/float64(k.maxDebt))
	}
	if level >= k.lowest {
		return
	}
	k.lowest = level
	if level < -k.maxDebt {
		w.violate("debt", k.name, w.now, "the store's level went to %s tokens, below -max_debt = -%s",
			tokens(level), tokens(k.maxDebt))
	}
}

// finishSettled sums the agents' settle and debt counters and the keys' debt figures.
func (w *world) finishSettled() {
	s := &w.res.Settled
	for _, inc := range w.incs {
		st := inc.lim.Stats()
		s.Credited += int64(st.SettleCredited.Load())
		s.Uncredited += int64(st.SettleUncredited.Load())
		s.SpentExtra += int64(st.SettleSpent.Load())
		s.Debt += int64(st.DebtMicro.Load())
		s.DebtCharged += int64(st.DebtCharged.Load())
		s.DebtForgiven += int64(st.DebtForgiven.Load())
		s.DebtLost += int64(st.DebtLost.Load())
	}
	if s.Checks == 0 {
		return
	}
	for _, k := range w.keys {
		if !k.settled {
			continue
		}
		num, den := k.limit.Rate()
		s.Budget += int64(k.limit.Capacity()) + int64(float64(num)/float64(den)*float64(w.end)/1e6)
		s.Charged += k.chargedTotal
		if s.WorstBound == 0 || k.charged.max/k.debtBound > s.WorstRatio() {
			s.WorstKey, s.WorstExcess, s.WorstBound = k.name, k.charged.max, k.debtBound
		}
		if s.DeepestKey == "" || k.lowest < s.Deepest {
			s.DeepestKey, s.Deepest, s.DeepestMax = k.name, min(k.lowest, 0), k.maxDebt
		}
	}
}
