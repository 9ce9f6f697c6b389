package chaos

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
)

// Slack the checker allows for clocks, documented in docs/reliability.md. Clients time a check
// on the machine's monotonic clock; the bound holds on each key's Redis clock (wall time, whole
// milliseconds) and agents measure leases on their monotonic clocks:
//
//   - fixedSlack covers Redis' millisecond truncation and the agents' coarse clock tick;
//   - rateSlack covers a difference in rate between the wall clock and the monotonic clock
//     (NTP slews the wall clock by at most 500 ppm), applied to the window and the lease.
const (
	fixedSlack = 5 * time.Millisecond
	rateSlack  = 0.001
)

// Violation is a broken promise, found from the outside.
type Violation struct {
	Check  string // admission, emergency, failure-mode, ledger, idempotency, soak, lru, abuse, process
	Detail string
}

func (v Violation) String() string { return v.Check + ": " + v.Detail }

// Outage is a time during which the global state was unreachable for some keys: every process
// of the path was down, hung or cut off, from From (after the fault took effect) to To (before
// the harness began to restore it).
type Outage struct {
	Step     string
	From, To time.Duration
	// Nodes are the Redis nodes whose keys were cut off; nil means every key.
	Nodes []int
}

// Window is the fullest window the admission check found on a key, for the report.
type Window struct {
	Key     string
	Bucket  string        // the bucket's rule (multi, multi#2, a budget's name)
	From    time.Duration // since the run's zero
	Tokens  float64       // allowed in the window
	Span    time.Duration
	Bound   float64 // C + r·(w + τ) + slack
	Allowed int     // checks allowed on the key over the run
}

// CheckInput is what the checker works from: the clients' records, the keys, the outages, and
// the ledger's facts (Redis' level, the agents' gauges).
type CheckInput struct {
	Keys    *Keys
	Records []Record
	Outages []Outage
	// NodeOf places a key's bucket on a Redis node (for outages of one node).
	NodeOf func(key string) int
	// IdempotencyWindow is the agents' window (a repeat within it is replayed).
	IdempotencyWindow time.Duration
	Ledger            *LedgerFacts
}

// LedgerFacts are the state of the ledger keys (the ledger rule's, and the multi rule's first
// limit of each of its tenants) at the end of a run and what the agents said about their leases.
type LedgerFacts struct {
	Keys []LedgerLevel
	// Strandable is the outstanding-lease gauge of every agent killed with SIGKILL, read just
	// before the kill: what the dead processes may have taken with them (tokens).
	Strandable float64
	// Held is the ledger keys' own leases in those agents (debug endpoint), for the report.
	Held float64
	// Lost is what the agents said they could not return: tokens_lost_total of every process
	// before it stopped, and what each graceful shutdown logged (tokens).
	Lost float64
	// Refunds and RefundsLost are charge_refunds_total and charge_refunds_lost_total of every
	// process before it stopped: the costs checks of several buckets gave back when one bucket
	// refused, and of those the costs that stayed spent (their lease was retired in between).
	Refunds, RefundsLost float64
}

// LedgerLevel is one ledger key in Redis after every agent stopped.
type LedgerLevel struct {
	Key      int // index in Keys
	Capacity bucket.Micro
	Level    bucket.Micro // the key's tokens
	Refill   bucket.Micro // the most the bucket can have refilled during the run
}

// Result is what the checker found and measured.
type Result struct {
	Violations []Violation
	Windows    []Window // the fullest window of each key with allows, by kind
	Emergency  []Window // the fullest emergency-bucket window per agent process and key
	Ledger     LedgerResult
	Outages    []OutageResult
	Replays    int // idempotent repeats answered without a charge
}

// LedgerResult is the ledger's account over every ledger key: granted (net debits in Redis) =
// spent + stranded.
type LedgerResult struct {
	Debited, Spent, Stranded, Bound, Held float64
	Errors                                int // checks of a ledger key that failed (their cost counts as spent)
	Refunds, RefundsLost                  float64
	Parts                                 []LedgerPart // per key
}

// LedgerPart is one ledger key's share of the account.
type LedgerPart struct {
	Key             string
	Bucket          string
	Debited, Spent  float64
	Denied, Allowed int // checks of the key refused and allowed (for a key charged with others: what refunds come from)
}

// OutageResult measures one outage from the clients' side.
type OutageResult struct {
	Step                              string
	Duration                          time.Duration
	Unavailable, DegradedAllows, Deny int // answers after every lease expired
	Allowed                           int // allows without the emergency bucket then: violations
	// For an outage of some Redis nodes: checks of keys on the other nodes after τ, and how many
	// of them got a failure-mode answer (503, or degraded).
	Others, OthersFailed int
	Checked              int           // checks of affected keys after every lease expired
	Recovery             time.Duration // from To to the first fail-closed allow (max over agents)
}

// Check runs every check of the records.
func Check(in CheckInput) Result {
	var res Result
	// byKey: the records of every check that charges the key — its own, and those of the keys
	// whose checks charge it too (an allow spent from every bucket of its check; a refusal from
	// none).
	byKey := make([][]*Record, len(in.Keys.List))
	for i := range in.Records {
		r := &in.Records[i]
		if r.Key >= 0 {
			byKey[r.Key] = append(byKey[r.Key], r)
			for _, c := range in.Keys.List[r.Key].Charges {
				byKey[c] = append(byKey[c], r)
			}
		}
	}
	for _, k := range in.Keys.List {
		w, vs := checkAdmission(k, byKey[k.ID])
		res.Violations = append(res.Violations, vs...)
		if w.Allowed > 0 {
			res.Windows = append(res.Windows, w)
		}
		if k.Emergency != nil {
			ws, vs := checkEmergency(k, byKey[k.ID])
			res.Violations = append(res.Violations, vs...)
			res.Emergency = append(res.Emergency, ws...)
		}
	}
	for _, o := range in.Outages {
		or, vs := checkOutage(in, o)
		res.Violations = append(res.Violations, vs...)
		res.Outages = append(res.Outages, or)
	}
	var vs []Violation
	res.Replays, vs = checkIdempotency(in)
	res.Violations = append(res.Violations, vs...)
	if in.Ledger != nil {
		res.Ledger, vs = checkLedger(in, byKey)
		res.Violations = append(res.Violations, vs...)
	}
	return res
}

// spend is a span of time within which one allow spent tokens.
type spend struct {
	sent, recv time.Duration
	tokens     float64
}

// fullestWindow finds, over spends, the window that comes closest to (or furthest beyond) the
// bound capacity + rate·(w + extra + slack). A set of allows whose answers arrived within
// [a, b] spent within [m, b], m the earliest send among them; so for spends sorted by answer,
// the window of answers i..j is charged the span b − m, where m is the earliest send of every
// spend from i on (those answered later only make m earlier: the span, and so the bound, can
// only grow — the check never blames a window that held less than it says). O(n log n).
func fullestWindow(spends []spend, capacity, rate float64, extra time.Duration) (over float64, w Window) {
	if len(spends) == 0 {
		return math.Inf(-1), w
	}
	slices.SortFunc(spends, func(a, b spend) int { return int(a.recv - b.recv) })
	n := len(spends)
	minSent := make([]time.Duration, n)
	minSent[n-1] = spends[n-1].sent
	for i := n - 2; i >= 0; i-- {
		minSent[i] = min(minSent[i+1], spends[i].sent)
	}
	// allowed(i..j) ≤ C + r'(b_j − m_i + extra) + r·fixedSlack, r' = r(1 + rateSlack), i.e.
	// (S_j − r'·b_j) − (S_{i−1} − r'·m_i) ≤ C + r'·extra + r·fixedSlack.
	rp := rate * (1 + rateSlack)
	limit := capacity + rp*extra.Seconds() + rate*fixedSlack.Seconds()
	best := math.Inf(-1)
	var bestI, bestJ int
	var prefix float64 // S_{j−1}
	minB, minI := math.Inf(1), 0
	sums := make([]float64, n+1)
	for j := range n {
		if b := prefix - rp*minSent[j].Seconds(); b < minB {
			minB, minI = b, j
		}
		prefix += spends[j].tokens
		sums[j+1] = prefix
		if v := prefix - rp*spends[j].recv.Seconds() - minB - limit; v > best {
			best, bestI, bestJ = v, minI, j
		}
	}
	span := spends[bestJ].recv - minSent[bestI]
	w = Window{From: minSent[bestI], Tokens: sums[bestJ+1] - sums[bestI], Span: span,
		Bound: capacity + rp*(span+extra).Seconds() + rate*fixedSlack.Seconds()}
	return best, w
}

// ratePerSecond is a limit's refill rate in tokens per second.
func ratePerSecond(l bucket.Limit) float64 {
	num, den := l.Rate()
	if den == 0 {
		return 0
	}
	return float64(num) / float64(den) * 1000 / float64(bucket.PerToken)
}

// checkAdmission: the tokens allowed by all agents on a key in any window of length w are at
// most C + r·(w + τ) (I6 of docs/design.md, proved in docs/leases.md), plus the clock slack. A
// direct key (lease: off) has τ = 0: C + r·w. recs are every check that charges the key: a
// bucket charged with others keeps its own bound, with its own C, r and τ.
func checkAdmission(k *Key, recs []*Record) (Window, []Violation) {
	var spends []spend
	for _, r := range recs {
		if r.Spends() {
			spends = append(spends, spend{r.Sent, r.Recv, float64(r.Cost)})
			if r.Settled {
				// The settle replaced the estimate: what was given back, or what was charged
				// beyond it less what the bucket forgave.
				spends = append(spends, spend{r.SettleSent, r.SettleRecv, float64(r.Actual - r.Cost - r.Forgiven)})
			}
		}
	}
	// Costs settled after the response may take the bucket down to max_debt below zero.
	capacity := tokensOf(k.Limit.Capacity()) + k.MaxDebt
	over, w := fullestWindow(spends, capacity, ratePerSecond(k.Limit), k.Tau)
	w.Key, w.Bucket, w.Allowed = k.Name, k.Rule.Name, len(spends)
	if over > 1e-9 {
		bound := "C + r·(w + τ)"
		if k.Rule.Direct {
			bound = "C + r·w (lease: off)"
		}
		if k.MaxDebt > 0 {
			bound += " + max_debt"
		}
		return w, []Violation{{Check: "admission", Detail: fmt.Sprintf(
			"key %s (bucket %s): %.0f tokens allowed within %v from %v, bound %s = %.2f (C = %.0f, r = %g/s, τ = %v, with slack)",
			k.Name, k.Rule.Name, w.Tokens, w.Span.Round(time.Millisecond), w.From.Round(time.Millisecond), bound, w.Bound, capacity, ratePerSecond(k.Limit), k.Tau)}}
	}
	return w, nil
}

// checkEmergency: each agent process's emergency bucket of a key allows at most C_e + r_e·w in
// any window of length w. Degraded answers whose process is uncertain (sent across a restart)
// are left out.
func checkEmergency(k *Key, recs []*Record) ([]Window, []Violation) {
	type proc struct {
		agent int8
		gen   int32
	}
	by := map[proc][]spend{}
	for _, r := range recs {
		if r.Outcome == OutAllow && r.Degraded && r.Gen >= 0 {
			p := proc{r.Agent, r.Gen}
			by[p] = append(by[p], spend{r.Sent, r.Recv, float64(r.Cost)})
		}
	}
	var ws []Window
	var vs []Violation
	capacity := tokensOf(k.Emergency.Capacity())
	for p, spends := range by {
		over, w := fullestWindow(spends, capacity, ratePerSecond(*k.Emergency), 0)
		w.Key, w.Allowed = fmt.Sprintf("%s agent %d/%d", k.Name, p.agent, p.gen/2), len(spends)
		ws = append(ws, w)
		if over > 1e-9 {
			vs = append(vs, Violation{Check: "emergency", Detail: fmt.Sprintf(
				"key %s, agent %d (start %d): %.0f degraded allows within %v from %v, bound C_e + r_e·w = %.2f",
				k.Name, p.agent, p.gen/2, w.Tokens, w.Span.Round(time.Millisecond), w.From.Round(time.Millisecond), w.Bound)})
		}
	}
	slices.SortFunc(ws, func(a, b Window) int { return int(b.Tokens - a.Tokens) })
	return ws, vs
}

// checkOutage: while the global state of a key is unreachable, no lease can be granted, and
// every lease granted before has expired τ after the outage began (a lease is measured from
// the moment its Acquire was sent, which was before). So a check sent τ (plus slack) or more
// into the outage and answered before it ended is answered by the route's failure mode: a
// fail-closed route never allows (503 with its Retry-After, or a cached deny), an emergency
// route allows only degraded. A check of several buckets is allowed only by a live lease of
// each: its τ is the shortest of the buckets the outage cuts off (an allow after it charged
// every bucket but that one).
func checkOutage(in CheckInput, o Outage) (OutageResult, []Violation) {
	res := OutageResult{Step: o.Step, Duration: o.To - o.From}
	nodes := map[int]int{} // key ID → node
	affected := func(k *Key) bool {
		if o.Nodes == nil {
			return true
		}
		n, ok := nodes[k.ID]
		if !ok {
			n = in.NodeOf(k.Name)
			nodes[k.ID] = n
		}
		return slices.Contains(o.Nodes, n)
	}
	// cutTau is the shortest τ of the buckets of k's checks that the outage cuts off; cut is
	// false when it cuts none of them.
	cutTau := func(k *Key) (tau time.Duration, cut bool) {
		if affected(k) {
			tau, cut = k.Tau, true
		}
		for _, c := range k.Charges {
			if b := in.Keys.List[c]; affected(b) && (!cut || b.Tau < tau) {
				tau, cut = b.Tau, true
			}
		}
		return tau, cut
	}
	cold := in.Keys.Set.Rule("cold")
	var vs []Violation
	firstAllow := map[int8]time.Duration{}
	for i := range in.Records {
		r := &in.Records[i]
		var rule *policy.Rule
		var tau time.Duration
		if r.Key >= 0 {
			k := in.Keys.List[r.Key]
			t, cut := cutTau(k)
			if !cut {
				if r.Sent >= o.From+shortestTau(in.Keys, k)+fixedSlack && r.Recv <= o.To && r.Outcome != OutError {
					res.Others++
					if r.Outcome == OutUnavailable || r.Degraded {
						res.OthersFailed++
					}
				}
				continue
			}
			rule, tau = k.Rule, t
		} else {
			if o.Nodes != nil {
				continue // churn keys are spread over every node
			}
			rule, tau = cold, churnTau(in.Keys)
		}
		if r.Kind == KindClosed && r.Outcome == OutAllow && r.Sent >= o.To {
			if t, ok := firstAllow[r.Agent]; !ok || r.Recv < t {
				firstAllow[r.Agent] = r.Recv
			}
		}
		if r.Sent < o.From+tau+fixedSlack || r.Recv > o.To || r.Outcome == OutError {
			continue
		}
		res.Checked++
		switch {
		case r.Outcome == OutAllow && r.Degraded:
			res.DegradedAllows++
			if rule.OnFailure != policy.Emergency {
				vs = append(vs, Violation{Check: "failure-mode", Detail: fmt.Sprintf(
					"%s: degraded allow on fail-closed rule %s (agent %d at %v)", o.Step, rule.Name, r.Agent, r.Sent)})
			}
		case r.Outcome == OutAllow:
			res.Allowed++
			vs = append(vs, Violation{Check: "failure-mode", Detail: fmt.Sprintf(
				"%s: %s check allowed %v into the outage, after every lease had expired (τ = %v; agent %d, sent at %v)",
				o.Step, rule.Name, (r.Sent - o.From).Round(time.Millisecond), tau, r.Agent, r.Sent.Round(time.Millisecond))})
		case r.Outcome == OutUnavailable:
			res.Unavailable++
			if rule.OnFailure == policy.Emergency {
				vs = append(vs, Violation{Check: "failure-mode", Detail: fmt.Sprintf(
					"%s: emergency rule %s answered unavailable (agent %d at %v)", o.Step, rule.Name, r.Agent, r.Sent)})
			} else if want := ceilSeconds(rule.FailureRetryAfter, r.Envoy); r.RetryAfter != want {
				vs = append(vs, Violation{Check: "failure-mode", Detail: fmt.Sprintf(
					"%s: rule %s answered unavailable with Retry-After %v, want the rule's %v", o.Step, rule.Name, r.RetryAfter, want)})
			}
		case r.Outcome == OutDeny:
			res.Deny++
		}
	}
	res.Recovery = -1 // no fail-closed key was cut off
	for _, t := range firstAllow {
		res.Recovery = max(res.Recovery, t-o.To)
	}
	// The failure mode must show: a fail-closed key answered unavailable and an emergency key
	// allowed degraded, whenever their checks fell in the outage.
	var closedChecks, emergencyChecks, emergencyDegraded, multiChecks, multiUnavailable int
	for i := range in.Records {
		r := &in.Records[i]
		if r.Key < 0 || r.Outcome == OutError || r.Recv > o.To {
			continue
		}
		if tau, cut := cutTau(in.Keys.List[r.Key]); !cut || r.Sent < o.From+tau+fixedSlack {
			continue
		}
		switch r.Kind {
		case KindMulti, KindDMulti:
			multiChecks++
			if r.Outcome == OutUnavailable {
				multiUnavailable++
			}
		case KindClosed:
			closedChecks++
		case KindEmergency:
			emergencyChecks++
			if r.Degraded {
				emergencyDegraded++
			}
		}
	}
	if closedChecks > 0 && res.Unavailable == 0 {
		vs = append(vs, Violation{Check: "failure-mode", Detail: fmt.Sprintf(
			"%s: %d fail-closed checks in the outage, none answered unavailable", o.Step, closedChecks)})
	}
	if multiChecks > 0 && multiUnavailable == 0 {
		vs = append(vs, Violation{Check: "failure-mode", Detail: fmt.Sprintf(
			"%s: %d checks of several buckets in the outage, none answered unavailable", o.Step, multiChecks)})
	}
	if emergencyChecks > 0 && emergencyDegraded == 0 {
		vs = append(vs, Violation{Check: "failure-mode", Detail: fmt.Sprintf(
			"%s: %d emergency checks in the outage, none answered from the emergency bucket", o.Step, emergencyChecks)})
	}
	return res, vs
}

// ceilSeconds is the Retry-After a client sees: milliseconds on the native API, whole seconds
// (rounded up) through Envoy's.
func ceilSeconds(d time.Duration, envoy bool) time.Duration {
	if !envoy {
		return d
	}
	return (d + time.Second - 1) / time.Second * time.Second
}

func churnTau(ks *Keys) time.Duration {
	for _, k := range ks.List {
		if k.Kind == KindCold {
			return k.Tau
		}
	}
	return 0
}

// checkIdempotency: a repeat of an allowed check's idempotency key, sent to the same agent
// process within its window, is answered with the first decision and not charged; a repeat of
// anything else is decided afresh. Records of one generator are in order, a repeat right after
// its original.
func checkIdempotency(in CheckInput) (replays int, vs []Violation) {
	for i := 1; i < len(in.Records); i++ {
		r, first := &in.Records[i], &in.Records[i-1]
		if !r.Retry {
			continue
		}
		if r.Replayed {
			replays++
		}
		switch {
		case first.Replayed:
			vs = append(vs, Violation{Check: "idempotency", Detail: fmt.Sprintf(
				"agent %d: the first check of a fresh idempotency key was answered as a replay", first.Agent)})
		case first.Outcome == OutAllow && first.Gen >= 0 && r.Gen == first.Gen && r.Sent-first.Sent < in.IdempotencyWindow &&
			r.Outcome != OutError && !(r.Outcome == OutAllow && r.Replayed):
			vs = append(vs, Violation{Check: "idempotency", Detail: fmt.Sprintf(
				"agent %d: a repeat of an allowed check's idempotency key got %v (replayed %v), want the first allow without a charge",
				r.Agent, r.Outcome, r.Replayed)})
		case first.Outcome != OutAllow && r.Replayed:
			vs = append(vs, Violation{Check: "idempotency", Detail: fmt.Sprintf(
				"agent %d: a repeat of a check that got %v was answered as a replay", r.Agent, first.Outcome)})
		}
	}
	return replays, vs
}

// checkLedger: a ledger key barely refills, so Redis' level says what was granted (net of
// returns): debited = C − level, up to the refill. The ledger keys are the ledger rule's and the
// multi rule's first limit of each tenant, a bucket every check of the rule spends from before
// its other buckets can refuse (it comes first), so a refused check gives its cost back there;
// and the dmulti rule's first and third limits, which a direct check takes with its others in one
// operation, so a grant no check spent goes back to both. byKey holds the records of every check
// that charges a key, so the allows of the dmulti route count as spent from both.
// Every token debited was spent by an allow a client saw, or is stranded: held by an agent
// killed with SIGKILL, in a return that failed, or in a refund that could not be made (the
// lease was retired in between; the agents count those). So, per key, spent ≤ debited
// (+ refill) — an agent never admits more than it was granted — and over the ledger keys
// together, stranded = debited − spent ≤ the killed agents' outstanding leases + the returns
// the agents said they lost + the refunds they said they lost (+ the cost of checks whose
// answer the client never saw, and one token for the decay of returned leases and the
// refill). A refused check that left its cost spent in the ledger bucket (a partial charge)
// is a token debited that no allow spent and nothing accounts for: with thousands of refunds a
// run, a partial charge of even a small share of them passes the bound. (The agents' counters
// span every key, so the bound is taken over every ledger key at once.)
func checkLedger(in CheckInput, byKey [][]*Record) (LedgerResult, []Violation) {
	f := in.Ledger
	res := LedgerResult{Held: f.Held, Refunds: f.Refunds, RefundsLost: f.RefundsLost}
	var unknown, maxCost float64
	var vs []Violation
	for _, lv := range f.Keys {
		k := in.Keys.List[lv.Key]
		p := LedgerPart{Key: k.Name, Bucket: k.Rule.Name, Debited: tokensOf(lv.Capacity - lv.Level)}
		for _, r := range byKey[k.ID] {
			switch {
			case r.Spends():
				p.Spent += float64(r.Cost)
				p.Allowed++
			case r.Outcome == OutError:
				res.Errors++
				unknown += float64(r.Cost)
			case r.Outcome == OutDeny || r.Outcome == OutUnavailable:
				p.Denied++
			}
		}
		if len(k.Charges) > 0 {
			maxCost = max(maxCost, float64(k.Cost))
		}
		if p.Spent > p.Debited+tokensOf(lv.Refill) {
			vs = append(vs, Violation{Check: "ledger", Detail: fmt.Sprintf(
				"agents allowed %.0f tokens of the ledger key %s (bucket %s), but only %.6f were debited in Redis (refill at most %.6f): tokens were created",
				p.Spent, k.Name, k.Rule.Name, p.Debited, tokensOf(lv.Refill))})
		}
		res.Debited += p.Debited
		res.Spent += p.Spent
		res.Parts = append(res.Parts, p)
	}
	vs = append(vs, checkDirectLedgers(in)...)
	res.Stranded = res.Debited - res.Spent
	res.Bound = f.Strandable + f.Lost + f.RefundsLost*maxCost + unknown + 1
	if res.Stranded > res.Bound {
		vs = append(vs, Violation{Check: "ledger", Detail: fmt.Sprintf(
			"%.6f tokens of %d ledger keys debited but neither spent nor returned, more than the killed agents held (%.0f) plus the returns they lost (%.6f), the refunds they lost (%.0f) and %d unanswered checks: a check refused spent tokens, or tokens were lost",
			res.Stranded, len(f.Keys), f.Strandable, f.Lost, f.RefundsLost, res.Errors)})
	}
	return res, vs
}

// checkDirectLedgers: a direct check of several buckets is one take from all of them, and what
// no check spent of its grant goes back to all of them in one operation, so two ledger keys of
// the same rate that only such checks charge (the dmulti rule's first and third limits) are
// debited the same, whatever was killed, lost or refused, up to what they refilled; a difference
// of half a token or more is a cost left in some of the buckets only.
func checkDirectLedgers(in CheckInput) []Violation {
	levels := map[int]LedgerLevel{}
	for _, lv := range in.Ledger.Keys {
		levels[lv.Key] = lv
	}
	var vs []Violation
	for _, own := range in.Ledger.Keys {
		k := in.Keys.List[own.Key]
		if k.Tau != 0 {
			continue // leases: each bucket is refilled and handed back on its own
		}
		for _, c := range k.Charges {
			other, ok := levels[c]
			n1, d1 := in.Keys.List[c].Limit.Rate()
			n2, d2 := k.Limit.Rate()
			if !ok || n1 != n2 || d1 != d2 {
				continue
			}
			a, b := tokensOf(own.Capacity-own.Level), tokensOf(other.Capacity-other.Level)
			if math.Abs(a-b) >= 0.5+tokensOf(own.Refill+other.Refill) {
				vs = append(vs, Violation{Check: "ledger", Detail: fmt.Sprintf(
					"direct checks debited %.6f tokens of %s (bucket %s) and %.6f of %s (bucket %s), both taken and handed back together: a cost stayed in one of them",
					a, k.Name, k.Rule.Name, b, in.Keys.List[c].Name, in.Keys.List[c].Rule.Name)})
			}
		}
	}
	return vs
}

// shortestTau is the shortest τ of the buckets a check of k charges.
func shortestTau(ks *Keys, k *Key) time.Duration {
	tau := k.Tau
	for _, c := range k.Charges {
		tau = min(tau, ks.List[c].Tau)
	}
	return tau
}
