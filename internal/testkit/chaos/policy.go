package chaos

import (
	"fmt"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
)

// PolicyText is the policy every process of a run reads. Each rule serves one kind of identity
// of the load (Kind); docs/reliability.md explains the choice of numbers.
//
//   - hot: one key every agent shares, offered about twice its rate: the admission bound is
//     tested where it is tight. τ = 200 ms (C/4r is 125 ms, below lease.MinTTL).
//   - cold: many tenants at low, skewed rates with mixed costs (1..3); key churn uses it too.
//   - closed: fails closed (503, Retry-After 2 s) without its global state; τ = 200 ms, so a
//     lease granted before an outage is dead 200 ms into it.
//   - emergency: falls back to a per-agent emergency bucket of 2/s, burst 4.
//   - ledger: refills one token a day, so its level in Redis is a ledger of what was granted.
//     Its burst is far above what a run spends.
//   - quota: served to Envoy-faithful rate_limit_quota filters (internal/testkit/envoyquota), one
//     per agent, offered far more than its rate; fails closed (DENY_ALL fallbacks). τ = 2.5 s, so
//     a fresh lease backs one-second assignments.
//   - tail: the long tail, thousands of tenants each checked far less often than its lease lives
//     (τ = C/4r = 500 ms; a tenant comes back to an agent tens of seconds later), so every check
//     is cold: a lease of the check's cost, nothing to hand back.
//   - direct: lease: off, one key every agent shares, offered about twice its rate: each check is
//     one atomic take in the global bucket, so the admission bound is the plain bucket's
//     C + r·w (τ = 0), tested where it is tight. 50/s with a burst of 20: a burst well below a
//     second's refill, so a window of any length is close to its bound when the load saturates it.
//   - multi: two limits and a tenant budget, charged all or nothing by every check of the route
//     (operation transfer, class spend, which no other rule lists: the budget covers this rule
//     alone, and every other rule keeps its buckets and its keys). Its first limit is a ledger
//     (1/day, burst 200000, as the ledger rule): the agent spends a check's buckets in order — the
//     rule's first limit, its other limits, then the budgets — so a check that multi#2 or the
//     budget refuses has already spent from the ledger and must give it back; what Redis shows
//     debited from it, beyond what allowed checks spent, is a partial charge (or a stranded
//     lease). multi#2 (20/s, burst 10: τ = 200 ms) is the tight per-second limit; the budget
//     mbudget (600/minute, burst 100: 10/s, τ = 2.5 s) is slower with a larger burst. Tenants are
//     offered 0.5 to 3 times multi#2's rate (skewed 3:2:1): after every fault both buckets are
//     full, multi#2 binds first (its burst is gone at once) while the budget drains from its
//     burst at the difference of the rates; then the budget binds, until the next fault lets it
//     refill. Both fail closed with the same Retry-After, so a 503 says the same whichever of
//     the check's buckets could not be reached.
//   - dmulti: the multi rule in direct mode (lease: off) for the same tenants and operation, so
//     mbudget covers it too: each check is one atomic take from dmulti (a ledger, as multi's
//     first limit), dmulti#2 (20/s, burst 10), dmulti#3 (a second ledger, 1/day with a burst
//     of 300000, among the route's charges) and the tenant's mbudget, which the multi route keeps charging from leases.
//     dmulti and dmulti#2 keep the direct bound C + r·w, mbudget its lease bound; a refused
//     check must leave nothing on either ledger (the ledger check): a grant no check spent goes
//     back to every bucket it was taken from, the charges as well as the route's own.
//   - settled: costs known after the response. Each check is allowed on an estimate (1 or 2) and
//     settled, after a response time, with a heavy-tailed actual cost (Pareto, α 1.3, capped at
//     C + max_debt = 80); extra cost beyond the lease is debt, down to max_debt (40) below zero.
//     20/s with a burst of 40 (τ = 500 ms), offered about its rate in estimates and several times
//     it in actual costs: the bucket lives in debt, and the checker holds its charges to
//     C + r·(w + τ) + max_debt and Redis' level to −max_debt and above.
const PolicyText = `version: "chaos-4"

operations:
  transfer: spend

envoy:
  domain: leasebucket
  tenant_key: tenant
  route_key: path
  operation_key: method

rules:
  - name: hot
    description: One key every agent shares, saturated by the load.
    routes: ["/hot"]
    operations: [read]
    limit: 100/second
    burst: 50

  - name: cold
    description: Many tenants at low rates with mixed costs; key churn.
    routes: ["/cold/{id}"]
    operations: [read]
    limit: 20/second
    burst: 12

  - name: closed
    description: Fails closed without its global state.
    routes: ["/w/{id}"]
    operations: [write]
    limit: 50/second
    burst: 20
    on_failure: deny
    retry_after_on_failure: 2s

  - name: emergency
    description: Degrades to a local emergency bucket without its global state.
    routes: ["/r/{id}"]
    operations: [read]
    limit: 50/second
    burst: 20
    on_failure: emergency
    emergency: {limit: 2/second, burst: 4}

  - name: quota
    description: Served over the rate limit quota service; Envoys hold the assignments.
    routes: ["/quota/{id}"]
    operations: [read]
    limit: 40/second
    burst: 400
    on_failure: deny

  - name: tail
    description: The long tail; thousands of tenants, each colder than its lease.
    routes: ["/tail/{id}"]
    operations: [read]
    limit: 5/second
    burst: 10

  - name: direct
    description: No leases; every check is one atomic take in the global bucket.
    routes: ["/d/{id}"]
    operations: [read]
    limit: 50/second
    burst: 20
    lease: off

  - name: ledger
    description: Refills one token a day; Redis' level is a ledger of the grants.
    routes: ["/ledger"]
    operations: [read]
    limit: 1/day
    burst: 200000

  - name: multi
    description: Two limits and a tenant budget, charged all or nothing; the first limit is a ledger.
    routes: ["/m/{id}"]
    operations: [spend]
    limits:
      - {limit: 1/day, burst: 200000}
      - {limit: 20/second, burst: 10}
    retry_after_on_failure: 3s

  - name: dmulti
    description: The multi rule in direct mode; one atomic take of its limits and the tenant budget.
    routes: ["/dm/{id}"]
    operations: [spend]
    lease: off
    limits:
      - {limit: 1/day, burst: 200000}
      - {limit: 20/second, burst: 10}
      - {limit: 1/day, burst: 300000}
    retry_after_on_failure: 3s

  - name: settled
    description: Costs known after the response; debt down to max_debt below zero.
    routes: ["/s/{id}"]
    operations: [read]
    limit: 20/second
    burst: 40
    max_debt: 40

  - name: mbudget
    description: A tenant budget over every spend operation, charged with the route's limits.
    scope: tenant
    operations: [spend]
    limit: 600/minute
    burst: 100
    retry_after_on_failure: 3s

default:
  limit: 60/minute
  burst: 10
`

// Kind is the kind of identity a check is for (one per rule of PolicyText, plus churn).
type Kind uint8

// Kinds of identities.
const (
	KindHot Kind = iota
	KindCold
	KindChurn
	KindClosed
	KindEmergency
	KindLedger
	KindQuota   // requests decided by an Envoy-faithful rate_limit_quota filter on the agent
	KindTail    // the long tail: a key of thousands, each checked less often than its lease lives
	KindDirect  // the direct-mode rule (lease: off)
	KindMulti   // the multi rule: three buckets (two limits and a tenant budget) all or nothing
	KindDMulti  // the dmulti rule: the multi rule's buckets in direct mode, one atomic take
	KindSettled // the settled rule: estimates settled with heavy-tailed costs after the response
	numKinds
)

var kindNames = [numKinds]string{"hot", "cold", "churn", "closed", "emergency", "ledger", "quota", "tail", "direct", "multi", "dmulti", "settled"}

func (k Kind) String() string {
	if k < numKinds {
		return kindNames[k]
	}
	return fmt.Sprintf("kind(%d)", k)
}

// Key is one global bucket the load uses, with what the checker needs of its limit.
type Key struct {
	ID     int
	Kind   Kind
	Tenant string
	Path   string // a path that maps to the key (the load varies {id} segments)
	Op     string
	Name   string // the bucket key in Redis
	Rule   *policy.Rule
	Limit  bucket.Limit
	// Tau is the lease lifetime, lease.TTL(Limit); 0 for a direct rule (lease: off): its checks
	// keep no lease, each is taken from the bucket between its send and its answer, and the
	// admission bound is C + r·w.
	Tau  time.Duration
	Cost int64 // the rule's cost
	// MaxDebt is how far below zero costs settled after the response may take the bucket, tokens.
	MaxDebt float64
	// Emergency is the local emergency bucket of an emergency rule, nil otherwise.
	Emergency *bucket.Limit
	// Charges are the other buckets (indexes in Keys) a check of this key charges with it, all
	// or nothing: its rule's further limits and the tenant budgets covering it (policy's
	// Route.Charges). Records name the check's own key; an allow spent from each of these too.
	Charges []int
}

// Buckets are every bucket a check of k charges: k, then its Charges.
func (k *Key) Buckets(ks *Keys) []*Key {
	bs := []*Key{k}
	for _, c := range k.Charges {
		bs = append(bs, ks.List[c])
	}
	return bs
}

// Keys is the table of tracked keys; a Record names its key by index.
type Keys struct {
	Set  *policy.Set
	List []*Key
	byID map[string]int // bucket key → index
}

// NewKeys parses PolicyText.
func NewKeys() (*Keys, error) {
	set, err := policy.Parse("chaos.yaml", []byte(PolicyText))
	if err != nil {
		return nil, err
	}
	return &Keys{Set: set, byID: map[string]int{}}, nil
}

// Add registers the bucket of (tenant, path, op) and returns it (the same Key for a second
// path of the same bucket), with the other buckets its checks charge (Charges), registered too.
func (ks *Keys) Add(kind Kind, tenant, path, op string) (*Key, error) {
	r, err := ks.Set.Match(path, op)
	if err != nil {
		return nil, err
	}
	k, fresh, err := ks.add(kind, tenant, path, op, r, ks.Set.Cost(r))
	if err != nil || !fresh {
		return k, err
	}
	for _, id := range r.Charges() {
		c, _, err := ks.add(kind, tenant, path, op, ks.Set.RouteByID(id), k.Cost)
		if err != nil {
			return nil, err
		}
		k.Charges = append(k.Charges, c.ID)
	}
	return k, nil
}

// add registers the bucket of route r for tenant; fresh reports whether it was new. cost is
// what a check charges it (a bucket charged with others takes the cost of the check's route).
func (ks *Keys) add(kind Kind, tenant, path, op string, r policy.Route, cost int64) (k *Key, fresh bool, err error) {
	name, err := ks.Set.Key(r, tenant, "")
	if err != nil {
		return nil, false, err
	}
	if i, ok := ks.byID[name]; ok {
		return ks.List[i], false, nil
	}
	lim, err := ks.Set.Limits(r, tenant, "")
	if err != nil {
		return nil, false, err
	}
	k = &Key{ID: len(ks.List), Kind: kind, Tenant: tenant, Path: path, Op: op, Name: name, Rule: r.Rule,
		Limit: lim.Bucket, Tau: lease.TTL(lim.Bucket), Cost: cost, MaxDebt: tokensOf(lim.MaxDebt)}
	if r.Rule.Direct {
		k.Tau = 0
	}
	if lim.Emergency != nil {
		e := lim.Emergency.Bucket
		k.Emergency = &e
	}
	ks.byID[name] = k.ID
	ks.List = append(ks.List, k)
	return k, true, nil
}

// Name of the tenants of each kind.
func hotTenant() string               { return "hot" }
func coldTenant(i int) string         { return fmt.Sprintf("cold-%03d", i) }
func closedTenant(i int) string       { return fmt.Sprintf("fc-%d", i) }
func emergencyTenant(i int) string    { return fmt.Sprintf("em-%d", i) }
func churnTenant(a, n int) string     { return fmt.Sprintf("churn-%d-%d", a, n) }
func ledgerTenant() string            { return "ledger" }
func quotaTenant(i int) string        { return fmt.Sprintf("qt-%d", i) }
func quotaPath(id int) string         { return fmt.Sprintf("/quota/%d", id) }
func tailTenant(i int) string         { return fmt.Sprintf("tl-%05d", i) }
func tailPath(id int) string          { return fmt.Sprintf("/tail/%d", id) }
func directTenant() string            { return "direct" }
func directPath(id int) string        { return fmt.Sprintf("/d/%d", id) }
func multiTenant(i int) string        { return fmt.Sprintf("mt-%d", i) }
func multiPath(id int) string         { return fmt.Sprintf("/m/%d", id) }
func multiOp() string                 { return "transfer" }
func settledTenant(i int) string      { return fmt.Sprintf("st-%d", i) }
func settledPath(id int) string       { return fmt.Sprintf("/s/%d", id) }
func dmultiPath(id int) string        { return fmt.Sprintf("/dm/%d", id) }
func bystanderTenant() string         { return "bystander" }
func abuseTenant(i int) string        { return fmt.Sprintf("abuse-%d", i) }
func coldPath(id int) string          { return fmt.Sprintf("/cold/%d", id) }
func closedPath(id int) string        { return fmt.Sprintf("/w/%d", id) }
func emergencyPath(id int) string     { return fmt.Sprintf("/r/%d", id) }
func ledgerPath() string              { return "/ledger" }
func hotPath() string                 { return "/hot" }
func churnPath(n int) string          { return fmt.Sprintf("/cold/c%d", n) }
func unknownPath(n int) string        { return fmt.Sprintf("/no/such/route/%d", n) }
func tokensOf(m bucket.Micro) float64 { return float64(m) / float64(bucket.PerToken) }
