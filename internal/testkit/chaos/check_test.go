package chaos

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
)

// The checker on records built by hand: each check must catch the broken promise it exists for
// and pass the kept one, so that a clean run means something.

func testKeys(t *testing.T) (*Keys, map[Kind]*Key) {
	t.Helper()
	ks, err := NewKeys()
	if err != nil {
		t.Fatal(err)
	}
	byKind := map[Kind]*Key{}
	for _, k := range []struct {
		kind             Kind
		tenant, path, op string
	}{
		{KindHot, hotTenant(), hotPath(), "GET"},
		{KindClosed, closedTenant(0), closedPath(1), "POST"},
		{KindEmergency, emergencyTenant(0), emergencyPath(1), "GET"},
		{KindLedger, ledgerTenant(), ledgerPath(), "GET"},
		{KindCold, coldTenant(0), coldPath(1), "GET"},
		{KindTail, tailTenant(0), tailPath(1), "GET"},
		{KindDirect, directTenant(), directPath(1), "GET"},
		{KindMulti, multiTenant(0), multiPath(1), multiOp()},
		{KindDMulti, multiTenant(0), dmultiPath(1), multiOp()},
		{KindSettled, settledTenant(0), settledPath(1), "GET"},
	} {
		key, err := ks.Add(k.kind, k.tenant, k.path, k.op)
		if err != nil {
			t.Fatal(err)
		}
		byKind[k.kind] = key
	}
	return ks, byKind
}

func ms(n int) time.Duration { return time.Duration(n) * time.Millisecond }

// allows returns n allows of key k, one every gap from start, each answered 1 ms after it was sent.
func allows(k *Key, n int, start, gap time.Duration) []Record {
	rs := make([]Record, n)
	for i := range rs {
		sent := start + time.Duration(i)*gap
		rs[i] = Record{Sent: sent, Recv: sent + ms(1), Key: int32(k.ID), Kind: k.Kind, Cost: int32(k.Cost), Outcome: OutAllow}
	}
	return rs
}

func violations(res Result, check string) []Violation {
	var vs []Violation
	for _, v := range res.Violations {
		if v.Check == check {
			vs = append(vs, v)
		}
	}
	return vs
}

func TestAdmission(t *testing.T) {
	ks, k := testKeys(t)
	hot := k[KindHot] // C = 50, r = 100/s, τ = 200 ms: at most 70 in any instant, 170 in a second
	for _, tc := range []struct {
		name    string
		records []Record
		broken  bool
	}{
		{"the burst and the lease at once", allows(hot, 70, 0, 0), false},
		{"one more than C + r·τ at once", allows(hot, 71, 0, 0), true},
		{"at the rate for 10 s after a full burst", append(allows(hot, 70, 0, 0), allows(hot, 1000, ms(10), ms(10))...), false},
		{"10 % above the rate for 10 s", allows(hot, 1100, 0, ms(9)), true},
		{"twice the burst in a second", allows(hot, 340, 0, ms(3)), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := Check(CheckInput{Keys: ks, Records: tc.records})
			if got := len(violations(res, "admission")) > 0; got != tc.broken {
				t.Fatalf("admission violated = %v, want %v (%v; fullest window %+v)", got, tc.broken, res.Violations, res.Windows)
			}
		})
	}
}

// A direct key (lease: off) is checked against C + r·w: no lease term. Its records sit between
// the two bounds, so a checker that gave the key the lease lifetime of its limit would pass them.
func TestAdmissionDirect(t *testing.T) {
	ks, k := testKeys(t)
	direct := k[KindDirect] // C = 20, r = 50/s: at most 20 at once, 70 in a second
	if direct.Tau != 0 {
		t.Fatalf("the direct key's τ = %v, want 0 (lease: off keeps no lease)", direct.Tau)
	}
	leased := *direct
	leased.ID, leased.Tau = 0, lease.TTL(direct.Limit) // what a lease rule of the same limit would get: 200 ms
	withLease := &Keys{Set: ks.Set, List: []*Key{&leased}}
	for _, tc := range []struct {
		name    string
		records func(*Key) []Record
		broken  bool // beyond C + r·w; each is within C + r·(w + τ)
	}{
		{"the burst at once", func(k *Key) []Record { return allows(k, 20, 0, 0) }, false},
		{"the burst and three more at once", func(k *Key) []Record { return allows(k, 23, 0, 0) }, true},
		{"at the rate for 10 s after a full burst", func(k *Key) []Record {
			return append(allows(k, 20, 0, 0), allows(k, 500, ms(20), ms(20))...)
		}, false},
		{"the burst, then 5 % above the rate for 2 s", func(k *Key) []Record {
			return append(allows(k, 20, 0, 0), allows(k, 105, ms(19), ms(19))...)
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := Check(CheckInput{Keys: ks, Records: tc.records(direct)})
			if got := len(violations(res, "admission")) > 0; got != tc.broken {
				t.Fatalf("admission violated = %v, want %v (%v; fullest window %+v)", got, tc.broken, res.Violations, res.Windows)
			}
			// The same records on a key with a lease term pass: the case tests the missing τ.
			if res := Check(CheckInput{Keys: withLease, Records: tc.records(&leased)}); len(res.Violations) > 0 {
				t.Fatalf("within C + r·(w + τ), yet blamed: %v", res.Violations)
			}
		})
	}
}

// settles returns n allows of the settled key k on an estimate of 1, one every gap from start,
// each settled 10 ms later with actual tokens, of which forgiven were not debited.
func settles(k *Key, n int, start, gap time.Duration, actual, forgiven int32) []Record {
	rs := allows(k, n, start, gap)
	for i := range rs {
		rs[i].Cost, rs[i].Actual, rs[i].Forgiven, rs[i].Settled = 1, actual, forgiven, true
		rs[i].SettleSent, rs[i].SettleRecv = rs[i].Recv+ms(10), rs[i].Recv+ms(11)
	}
	return rs
}

// A settled key is checked against C + r·(w + τ) + max_debt, counting what each settle charged
// (the actual cost less what the bucket forgave) or gave back, and only estimates of settles that
// were not confirmed.
func TestAdmissionDebt(t *testing.T) {
	ks, k := testKeys(t)
	st := k[KindSettled] // C = 40, r = 20/s, τ = 500 ms, max_debt 40: at most 90 at once, 110 in a second
	if st.MaxDebt != 40 {
		t.Fatalf("the settled key's max_debt = %v, want 40", st.MaxDebt)
	}
	unconfirmed := settles(st, 30, 0, 0, 10, 0)
	for i := range unconfirmed {
		unconfirmed[i].Settled = false
	}
	for _, tc := range []struct {
		name    string
		records []Record
		broken  bool
	}{
		{"C + r·τ + max_debt at once", settles(st, 18, 0, 0, 5, 0), false},
		{"a settle beyond it", settles(st, 19, 0, 0, 5, 0), true},
		{"beyond it, the excess forgiven", settles(st, 19, 0, 0, 5, 1), false},
		{"unused estimates given back", append(settles(st, 80, 0, 0, 0, 0), settles(st, 80, ms(20), 0, 0, 0)...), false},
		{"the same estimates never given back", append(allows(st, 80, 0, 0), allows(st, 80, ms(20), 0)...), true},
		{"unconfirmed settles count their estimate", unconfirmed, false},
		{"at the rate in actual costs for 5 s", settles(st, 100, 0, ms(50), 1, 0), false},
		{"twice the rate in actual costs for 5 s", settles(st, 100, 0, ms(50), 2, 0), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := Check(CheckInput{Keys: ks, Records: tc.records})
			if got := len(violations(res, "admission")) > 0; got != tc.broken {
				t.Fatalf("admission violated = %v, want %v (%v; fullest window %+v)", got, tc.broken, res.Violations, res.Windows)
			}
		})
	}
	if vs := checkDebtLevel(DebtLevel{Key: st.Name, Lowest: -40, MaxDebt: 40}); len(vs) != 0 {
		t.Errorf("a level of −max_debt blamed: %v", vs)
	}
	if vs := checkDebtLevel(DebtLevel{Key: st.Name, Lowest: -40.000001, MaxDebt: 40}); len(vs) != 1 {
		t.Errorf("a level below −max_debt not blamed: %v", vs)
	}
}

func TestAdmissionSlowAnswers(t *testing.T) {
	// 71 allows answered within a millisecond of each other, sent over the 600 ms before: their
	// spends may lie anywhere in those 600 ms, so the window is 600 ms long (bound 50 + 100·0.8).
	ks, k := testKeys(t)
	rs := allows(k[KindHot], 71, 0, 0)
	for i := range rs {
		rs[i].Sent, rs[i].Recv = ms(i*600/71), ms(600)+time.Duration(i)*time.Microsecond
	}
	if res := Check(CheckInput{Keys: ks, Records: rs}); len(res.Violations) > 0 {
		t.Fatalf("slow answers blamed: %v", res.Violations)
	}
	// The same allows, each answered at once: within 600 ms the bound is 50 + 100·0.8 = 130; 140
	// (twice the 70) is beyond it.
	rs = append(allows(k[KindHot], 70, 0, ms(8)), allows(k[KindHot], 70, 0, ms(8))...)
	if res := Check(CheckInput{Keys: ks, Records: rs}); len(violations(res, "admission")) == 0 {
		t.Fatal("140 allows within 560 ms passed")
	}
}

func TestAdmissionIgnoresDegradedAndReplays(t *testing.T) {
	ks, k := testKeys(t)
	rs := allows(k[KindHot], 70, 0, 0)
	more := allows(k[KindHot], 20, 0, 0)
	for i := range more {
		more[i].Replayed = true
	}
	if res := Check(CheckInput{Keys: ks, Records: append(rs, more...)}); len(res.Violations) > 0 {
		t.Fatalf("replays counted as spends: %v", res.Violations)
	}
}

func TestEmergencyBucket(t *testing.T) {
	ks, k := testKeys(t)
	em := k[KindEmergency] // emergency bucket: C_e = 4, r_e = 2/s
	degraded := func(agent int8, gen int32, n int, gap time.Duration) []Record {
		rs := allows(em, n, ms(1000), gap)
		for i := range rs {
			rs[i].Degraded, rs[i].Agent, rs[i].Gen = true, agent, gen
		}
		return rs
	}
	// Two agents, four each at once: each agent's own bucket.
	if res := Check(CheckInput{Keys: ks, Records: append(degraded(0, 0, 4, 0), degraded(1, 0, 4, 0)...)}); len(res.Violations) > 0 {
		t.Fatalf("two agents' emergency buckets: %v", res.Violations)
	}
	// One agent, 4 at once then one every 500 ms: at the emergency rate.
	if res := Check(CheckInput{Keys: ks, Records: append(degraded(0, 0, 4, 0), degraded(0, 0, 10, ms(500))[1:]...)}); len(violations(res, "emergency")) > 0 {
		t.Fatalf("the emergency rate: %v", res.Violations)
	}
	if res := Check(CheckInput{Keys: ks, Records: degraded(0, 0, 5, 0)}); len(violations(res, "emergency")) == 0 {
		t.Fatal("five degraded allows at once from one agent's bucket of four passed")
	}
	// A restarted agent has a new bucket.
	if res := Check(CheckInput{Keys: ks, Records: append(degraded(0, 0, 4, 0), degraded(0, 2, 4, 0)...)}); len(res.Violations) > 0 {
		t.Fatalf("a restarted agent's new bucket: %v", res.Violations)
	}
}

func TestOutage(t *testing.T) {
	ks, k := testKeys(t)
	closed, em := k[KindClosed], k[KindEmergency] // τ = 200 ms, Retry-After 2 s
	outage := Outage{Step: "test", From: ms(1000), To: ms(3000)}
	answer := func(key *Key, sent time.Duration, o Outcome, degraded bool, retry time.Duration) Record {
		return Record{Sent: sent, Recv: sent + ms(1), Key: int32(key.ID), Kind: key.Kind, Cost: 1, Outcome: o,
			Degraded: degraded, RetryAfter: retry}
	}
	good := []Record{
		answer(closed, ms(1100), OutAllow, false, 0), // within τ: a lease may still serve it
		answer(closed, ms(1500), OutUnavailable, false, 2*time.Second),
		answer(closed, ms(2500), OutDeny, false, time.Second), // a cached deny
		answer(em, ms(1500), OutAllow, true, 0),
		answer(em, ms(1600), OutDeny, true, 500*time.Millisecond),
		answer(closed, ms(3100), OutAllow, false, 0), // after the outage
	}
	for _, tc := range []struct {
		name string
		bad  Record
	}{
		{"a fail-closed allow after τ", answer(closed, ms(1300), OutAllow, false, 0)},
		{"an emergency allow that is not degraded", answer(em, ms(2000), OutAllow, false, 0)},
		{"503 with another Retry-After", answer(closed, ms(2000), OutUnavailable, false, time.Second)},
		{"503 on an emergency route", answer(em, ms(2000), OutUnavailable, false, time.Second)},
		{"a degraded allow on a fail-closed route", answer(closed, ms(2000), OutAllow, true, 0)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := Check(CheckInput{Keys: ks, Records: good, Outages: []Outage{outage}})
			if len(res.Violations) > 0 {
				t.Fatalf("kept promises blamed: %v", res.Violations)
			}
			res = Check(CheckInput{Keys: ks, Records: append(append([]Record(nil), good...), tc.bad), Outages: []Outage{outage}})
			if len(violations(res, "failure-mode")) == 0 {
				t.Fatal("not caught")
			}
		})
	}
	// Only 429s on a fail-closed route through a whole outage: its failure mode never showed.
	res := Check(CheckInput{Keys: ks, Outages: []Outage{outage}, Records: []Record{answer(closed, ms(2000), OutDeny, false, time.Second)}})
	if len(violations(res, "failure-mode")) == 0 {
		t.Fatal("an outage without a single 503 passed")
	}
	// An outage of another Redis node does not concern the key.
	res = Check(CheckInput{Keys: ks, Outages: []Outage{{Step: "node 1", From: ms(1000), To: ms(3000), Nodes: []int{1}}},
		NodeOf: func(string) int { return 0 }, Records: []Record{answer(closed, ms(2000), OutAllow, false, 0)}})
	if len(res.Violations) > 0 {
		t.Fatalf("an outage of another node blamed: %v", res.Violations)
	}
}

func TestIdempotency(t *testing.T) {
	ks, k := testKeys(t)
	first := Record{Sent: ms(0), Recv: ms(1), Key: int32(k[KindCold].ID), Outcome: OutAllow, Gen: 2}
	replay := first
	replay.Sent, replay.Recv, replay.Retry, replay.Replayed = ms(2), ms(3), true, true
	charged := replay
	charged.Replayed = false
	restarted := charged
	restarted.Gen = 4
	in := func(rs ...Record) CheckInput {
		return CheckInput{Keys: ks, Records: rs, IdempotencyWindow: 2 * time.Minute}
	}
	if res := Check(in(first, replay)); len(res.Violations) > 0 || res.Replays != 1 {
		t.Fatalf("a replay: %v, %d replays", res.Violations, res.Replays)
	}
	if res := Check(in(first, charged)); len(violations(res, "idempotency")) == 0 {
		t.Fatal("a repeat of an allow decided again passed")
	}
	if res := Check(in(first, restarted)); len(res.Violations) > 0 {
		t.Fatalf("a repeat to a restarted agent (which cannot remember) blamed: %v", res.Violations)
	}
	denied := first
	denied.Outcome = OutDeny
	if res := Check(in(denied, replay)); len(violations(res, "idempotency")) == 0 {
		t.Fatal("a deny replayed passed")
	}
}

func TestLedger(t *testing.T) {
	ks, k := testKeys(t)
	l := k[KindLedger]
	spent := allows(l, 100, 0, ms(10)) // 100 tokens
	facts := func(debited, strandable, lost float64) *LedgerFacts {
		return &LedgerFacts{Keys: []LedgerLevel{ledgerLevel(l, debited)}, Strandable: strandable, Lost: lost}
	}
	for _, tc := range []struct {
		name      string
		facts     *LedgerFacts
		violation string
	}{
		{"exact", facts(100, 0, 0), ""},
		{"a killed agent held 30", facts(130, 40, 0), ""},
		{"a return of 30 failed", facts(130, 0, 30), ""},
		{"one token more allowed than debited", facts(99, 0, 0), "created"},
		{"30 stranded, nothing killed", facts(130, 0, 0), "neither spent nor returned"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := Check(CheckInput{Keys: ks, Records: spent, Ledger: tc.facts})
			vs := violations(res, "ledger")
			switch {
			case tc.violation == "" && len(vs) > 0:
				t.Fatalf("blamed: %v", vs)
			case tc.violation != "" && (len(vs) == 0 || !strings.Contains(vs[0].Detail, tc.violation)):
				t.Fatalf("got %v, want a violation saying %q", vs, tc.violation)
			}
		})
	}
}

// ledgerLevel is key k's level in Redis after debited tokens were taken from it.
func ledgerLevel(k *Key, debited float64) LedgerLevel {
	c := k.Limit.Capacity()
	return LedgerLevel{Key: k.ID, Capacity: c, Level: c - bucket.Micro(debited*float64(bucket.PerToken)), Refill: 1}
}

// multiBuckets returns the multi route's key and the other buckets its checks charge, by rule.
func multiBuckets(t *testing.T, ks *Keys, m *Key) map[string]*Key {
	t.Helper()
	bs := map[string]*Key{}
	for _, b := range m.Buckets(ks) {
		bs[b.Rule.Name] = b
	}
	if len(bs) != 3 || bs["multi"] != m || bs["multi#2"] == nil || bs["mbudget"] == nil {
		t.Fatalf("the multi route charges %v, want multi, multi#2 and mbudget", bs)
	}
	return bs
}

func withOutcome(rs []Record, o Outcome) []Record {
	for i := range rs {
		rs[i].Outcome = o
	}
	return rs
}

// A check of several buckets counts against each of them when allowed, and against none when
// refused: each bucket is held to its own bound with its own C, r and τ.
func TestMultiAdmission(t *testing.T) {
	ks, k := testKeys(t)
	m := k[KindMulti]
	bs := multiBuckets(t, ks, m)
	// multi: the ledger (C = 200000); multi#2: C = 10, r = 20/s, τ = 200 ms (14 at once, 14 + 20·w);
	// mbudget: C = 100, r = 10/s, τ = 2.5 s (125 at once, 125 + 10·w).
	if bs["multi#2"].Tau != 200*time.Millisecond || bs["mbudget"].Tau != 2500*time.Millisecond {
		t.Fatalf("τ of multi#2 %v, of mbudget %v; the cases below assume 200 ms and 2.5 s", bs["multi#2"].Tau, bs["mbudget"].Tau)
	}
	for _, tc := range []struct {
		name    string
		records []Record
		broken  []string // the buckets whose bound is broken
	}{
		{"within every bound: 14 at once, then 10/s for 10 s", append(allows(m, 14, 0, 0), allows(m, 100, ms(100), ms(100))...), nil},
		{"one more than multi#2's C + r·τ at once", allows(m, 15, 0, 0), []string{"multi#2"}},
		{"19/s for 20 s: within multi#2, beyond the budget", allows(m, 380, 0, ms(1000/19)), []string{"mbudget"}},
		{"refusals charge nothing", append(allows(m, 14, 0, 0), withOutcome(allows(m, 1000, 0, 0), OutDeny)...), nil},
		{"failure-mode answers charge nothing", append(allows(m, 14, 0, 0), withOutcome(allows(m, 1000, 0, 0), OutUnavailable)...), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := Check(CheckInput{Keys: ks, Records: tc.records})
			got := brokenBuckets(res, bs)
			if !slices.Equal(got, tc.broken) {
				t.Fatalf("bounds broken on %v, want %v (%v)", got, tc.broken, res.Violations)
			}
			if len(res.Violations) != len(tc.broken) {
				t.Fatalf("violations %v, want one on each of %v", res.Violations, tc.broken)
			}
		})
	}
}

// The ledger account over the ledger rule's key and the multi rule's first limit: a refused
// check that left its cost spent in the first limit (a partial charge) is debited in Redis and
// accounted for by nothing the agents said.
func TestMultiLedger(t *testing.T) {
	ks, k := testKeys(t)
	l, m := k[KindLedger], k[KindMulti]
	// 50 ledger allows; 100 multi allows and 300 refusals of the multi route (multi#2 or the
	// budget refused: the first limit, spent first, had to be given back).
	records := append(allows(l, 50, 0, ms(10)), allows(m, 100, 0, ms(10))...)
	records = append(records, withOutcome(allows(m, 200, ms(5), ms(10)), OutDeny)...)
	records = append(records, withOutcome(allows(m, 100, ms(7), ms(10)), OutUnavailable)...)
	type facts struct{ ledger, multi, strandable, refundsLost float64 }
	for _, tc := range []struct {
		name      string
		f         facts
		violation string
	}{
		{"exact: only the allows are debited", facts{50, 100, 0, 0}, ""},
		{"30 refusals left their cost in the first limit", facts{50, 130, 0, 0}, "neither spent nor returned"},
		{"30 refunds the agents counted as lost", facts{50, 130, 0, 30}, ""},
		{"a killed agent held 30 of the first limit", facts{50, 130, 30, 0}, ""},
		// The agents' counters span every key: the bound is over the ledger keys together, so 30
		// held of the ledger rule's key leave no room for 30 partial charges of the multi rule.
		{"30 held of the ledger key, 30 partial charges", facts{80, 130, 30, 0}, "neither spent nor returned"},
		{"10 allows of the multi rule with nothing debited", facts{50, 90, 0, 0}, "created"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := Check(CheckInput{Keys: ks, Records: records, Ledger: &LedgerFacts{
				Keys:       []LedgerLevel{ledgerLevel(l, tc.f.ledger), ledgerLevel(m, tc.f.multi)},
				Strandable: tc.f.strandable, RefundsLost: tc.f.refundsLost}})
			vs := violations(res, "ledger")
			switch {
			case tc.violation == "" && len(vs) > 0:
				t.Fatalf("blamed: %v", vs)
			case tc.violation != "" && (len(vs) != 1 || !strings.Contains(vs[0].Detail, tc.violation)):
				t.Fatalf("got %v, want one violation saying %q", vs, tc.violation)
			}
			if len(res.Ledger.Parts) != 2 || res.Ledger.Parts[1].Spent != 100 || res.Ledger.Parts[1].Denied != 300 {
				t.Fatalf("parts %+v, want the multi rule's first limit with 100 spent and 300 refused", res.Ledger.Parts)
			}
		})
	}
}

// The dmulti rule's ledgers: its first limit (the check's own key) and its third (one of the
// check's charges). A direct check takes from both in one operation, so what the ledger among the
// charges shows debited is spent by the allows of the dmulti key; a grant no check spent that went
// back to the own key only is a debit there that nothing accounts for, and leaves the two ledgers
// apart even when the agents' losses would cover it.
func TestDMultiLedger(t *testing.T) {
	ks, k := testKeys(t)
	d := k[KindDMulti]
	var third *Key
	for _, b := range d.Buckets(ks) {
		if b.Rule.Name == dmultiLedger {
			third = b
		}
	}
	if third == nil || third.Limit.Refills() && third.Limit.FillTime() < d.Limit.FillTime() {
		t.Fatalf("the dmulti route charges %v, want a second ledger %s", d.Buckets(ks), dmultiLedger)
	}
	records := append(allows(d, 100, 0, ms(10)), withOutcome(allows(d, 200, ms(5), ms(10)), OutUnavailable)...)
	type facts struct{ own, third, lost float64 }
	const apart = "a cost stayed in one of them"
	for _, tc := range []struct {
		name       string
		f          facts
		violations []string
	}{
		{"exact: only the allows are debited", facts{100, 100, 0}, nil},
		{"30 unspent grants went back to the own key only", facts{100, 130, 0}, []string{apart, "neither spent nor returned"}},
		// Fewer than the agents' lost returns and killed leases allow, but still apart.
		{"3 unspent grants went back to the own key only", facts{110, 113, 30}, []string{apart}},
		{"0.6 tokens apart: the refill cannot explain it", facts{100, 100.6, 30}, []string{apart}},
		{"0.4 tokens apart: less than any cost", facts{100, 100.4, 30}, nil},
		{"30 tokens of returns the agents counted as lost", facts{130, 130, 60}, nil},
		{"10 allows with nothing debited among the charges", facts{100, 90, 0}, []string{"created", apart}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := Check(CheckInput{Keys: ks, Records: records, Ledger: &LedgerFacts{
				Keys: []LedgerLevel{ledgerLevel(d, tc.f.own), ledgerLevel(third, tc.f.third)}, Lost: tc.f.lost}})
			vs := violations(res, "ledger")
			if len(vs) != len(tc.violations) {
				t.Fatalf("got %v, want violations saying %q", vs, tc.violations)
			}
			for i, v := range vs {
				if !strings.Contains(v.Detail, tc.violations[i]) {
					t.Fatalf("got %v, want violations saying %q", vs, tc.violations)
				}
			}
			if p := res.Ledger.Parts; len(p) != 2 || p[1].Spent != 100 || p[1].Denied != 200 {
				t.Fatalf("parts %+v, want the third limit with the route's 100 allows spent and 200 refused", p)
			}
		})
	}
}

// In an outage a check of several buckets can be allowed only while every bucket the outage
// cuts off still has a live lease: until the shortest τ among them.
func TestMultiOutage(t *testing.T) {
	ks, k := testKeys(t)
	m := k[KindMulti]
	bs := multiBuckets(t, ks, m)
	outage := Outage{Step: "test", From: ms(1000), To: ms(3000)}
	answer := func(sent time.Duration, o Outcome, retry time.Duration) Record {
		return Record{Sent: sent, Recv: sent + ms(1), Key: int32(m.ID), Kind: KindMulti, Cost: 1, Outcome: o, RetryAfter: retry}
	}
	good := []Record{
		answer(ms(1100), OutAllow, 0), // within multi#2's τ of 200 ms
		answer(ms(1500), OutUnavailable, 3*time.Second),
		answer(ms(1600), OutDeny, 100*time.Millisecond),
	}
	late := answer(ms(1300), OutAllow, 0) // after multi#2's τ, within the budget's and the ledger's
	for _, tc := range []struct {
		name   string
		cut    []string // the buckets on the node the outage cuts off (nil: an outage of every key)
		rs     []Record
		broken bool
	}{
		{"kept", nil, good, false},
		{"an allow after multi#2's τ", nil, append(good, late), true},
		{"an allow after multi#2's τ, its node up", []string{"multi", "mbudget"}, append(good, late), false},
		{"an allow after multi#2's τ, its node cut", []string{"multi#2"}, append(good, late), true},
		{"the wrong Retry-After", nil, append(good, answer(ms(2000), OutUnavailable, time.Second)), true},
		{"only denials through the outage", nil, []Record{answer(ms(1500), OutDeny, time.Second), answer(ms(2500), OutDeny, time.Second)}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := outage
			nodeOf := func(string) int { return 0 }
			if tc.cut != nil {
				o.Nodes = []int{1}
				nodeOf = func(key string) int {
					for _, name := range tc.cut {
						if bs[name].Name == key {
							return 1
						}
					}
					return 0
				}
			}
			res := Check(CheckInput{Keys: ks, Records: tc.rs, Outages: []Outage{o}, NodeOf: nodeOf})
			if got := len(violations(res, "failure-mode")) > 0; got != tc.broken {
				t.Fatalf("failure mode violated = %v, want %v (%v)", got, tc.broken, res.Violations)
			}
		})
	}
}

func TestGrowth(t *testing.T) {
	series := func(name string, f func(i int) Sample) *Series {
		s := &Series{Name: name, Pid: 1}
		for i := range 40 {
			smp := f(i)
			smp.At = time.Duration(i) * time.Second
			s.Samples = append(s.Samples, smp)
		}
		return s
	}
	flat := series("flat", func(i int) Sample {
		return Sample{RSSKiB: 30000 + int64(i%3)*1000, FDs: 20, Goroutines: 40 + i%2, Keys: 256}
	})
	leak := series("leak", func(i int) Sample {
		return Sample{RSSKiB: 30000, FDs: 20, Goroutines: 40 + 2*i, Keys: 10}
	})
	fds := series("fds", func(i int) Sample { return Sample{RSSKiB: 30000, FDs: 20 + 3*i, Goroutines: -1, Keys: -1} })
	rss := series("rss", func(i int) Sample {
		return Sample{RSSKiB: 30000 + int64(i)*2000, FDs: 20, Goroutines: 40, Keys: -1}
	})
	over := series("over", func(int) Sample { return Sample{RSSKiB: 30000, FDs: 20, Goroutines: 40, Keys: 257} })
	gs, vs := CheckGrowth([]*Series{flat, leak, fds, rss, over}, 0, 40*time.Second, 256)
	if len(gs) != 5 {
		t.Fatalf("%d processes checked, want 5", len(gs))
	}
	got := map[string]bool{}
	for _, v := range vs {
		got[v.Check+" "+strings.Fields(v.Detail)[0]] = true
	}
	want := map[string]bool{"soak leak": true, "soak fds": true, "soak rss": true, "lru over": true}
	if len(got) != len(want) {
		t.Fatalf("violations %v, want %v", vs, want)
	}
	for w := range want {
		if !got[w] {
			t.Fatalf("violations %v, want %v", vs, want)
		}
	}
}

// A direct check of several buckets (the dmulti rule) holds dmulti and dmulti#2 to the direct
// bound C + r·w, and the tenant budget it shares with the multi route to its lease bound.
func TestDMultiAdmission(t *testing.T) {
	ks, k := testKeys(t)
	m := k[KindDMulti]
	bs := map[string]*Key{}
	for _, b := range m.Buckets(ks) {
		bs[b.Rule.Name] = b
	}
	if len(bs) != 4 || bs["dmulti#2"] == nil || bs[dmultiLedger] == nil || bs["mbudget"] == nil || bs["mbudget"] != multiBuckets(t, ks, k[KindMulti])["mbudget"] {
		t.Fatalf("the dmulti route charges %v, want dmulti, dmulti#2, dmulti#3 and the multi route's mbudget", bs)
	}
	if bs["dmulti"].Tau != 0 || bs["dmulti#2"].Tau != 0 || bs["mbudget"].Tau != 2500*time.Millisecond {
		t.Fatalf("τ of dmulti %v, dmulti#2 %v, mbudget %v: want 0, 0 and 2.5 s", bs["dmulti"].Tau, bs["dmulti#2"].Tau, bs["mbudget"].Tau)
	}
	for _, tc := range []struct {
		name    string
		records []Record
		broken  []string
	}{
		// dmulti#2: C = 10, r = 20/s, τ = 0: 10 at once (the leased multi#2 may admit 14).
		{"10 at once, then 20/s", append(allows(m, 10, 0, 0), allows(m, 40, ms(50), ms(50))...), nil},
		{"one more than dmulti#2's C at once", allows(m, 11, 0, 0), []string{"dmulti#2"}},
		{"refusals charge nothing", append(allows(m, 10, 0, 0), withOutcome(allows(m, 1000, 0, 0), OutDeny)...), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := Check(CheckInput{Keys: ks, Records: tc.records})
			got := brokenBuckets(res, bs)
			if !slices.Equal(got, tc.broken) || len(res.Violations) != len(tc.broken) {
				t.Fatalf("bounds broken on %v, want %v (%v)", got, tc.broken, res.Violations)
			}
		})
	}
}

// brokenBuckets names, sorted, the buckets of bs whose admission bound res says was broken.
func brokenBuckets(res Result, bs map[string]*Key) []string {
	var got []string
	for _, v := range violations(res, "admission") {
		for name, b := range bs {
			if strings.Contains(v.Detail, b.Name+" (bucket "+name+")") {
				got = append(got, name)
			}
		}
	}
	slices.Sort(got)
	return got
}
