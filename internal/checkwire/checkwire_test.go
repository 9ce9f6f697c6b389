package checkwire

import (
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
	"unsafe"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// TestFieldNumbers: the package's field numbers are the generated descriptors', and it knows
// every field of the messages it writes and reads.
func TestFieldNumbers(t *testing.T) {
	req := (&agentv1.CheckStreamRequest{}).ProtoReflect().Descriptor()
	resp := (&agentv1.CheckStreamResponse{}).ProtoReflect().Descriptor()
	check := (&agentv1.CheckRequest{}).ProtoReflect().Descriptor()
	answer := (&agentv1.CheckResponse{}).ProtoReflect().Descriptor()
	for _, f := range []struct {
		msg  protoreflect.MessageDescriptor
		name protoreflect.Name
		num  protowire.Number
	}{
		{req, "id", StreamIDField}, {req, "checks", StreamChecksField}, {req, "partial", StreamPartialField},
		{resp, "id", StreamIDField}, {resp, "results", StreamResultsField}, {resp, "errors", StreamErrorsField},
		{resp, "indexes", StreamIndexesField},
		{check, "tenant", CheckTenantField}, {check, "route", CheckRouteField}, {check, "operation", CheckOperationField},
		{check, "cost", CheckCostField}, {check, "idempotency_key", CheckIdemKeyField}, {check, "settle", CheckSettleField},
		{check, "brief", CheckBriefField},
		{answer, "decision", RespDecisionField}, {answer, "degraded", RespDegradedField},
		{answer, "retry_after_ms", RespRetryAfterField}, {answer, "remaining", RespRemainingField},
		{answer, "limit", RespLimitField}, {answer, "window_ms", RespWindowField}, {answer, "reset_ms", RespResetField},
		{answer, "rule", RespRuleField}, {answer, "shadow_deny", RespShadowDenyField},
		{answer, "replayed", RespReplayedField}, {answer, "settle_id", RespSettleIDField},
	} {
		fd := f.msg.Fields().ByName(f.name)
		if fd == nil || fd.Number() != f.num {
			t.Errorf("%s.%s: the package uses field %d, the descriptor says %v", f.msg.Name(), f.name, f.num, fd)
		}
	}
	for _, m := range []struct {
		msg  protoreflect.MessageDescriptor
		last protowire.Number
	}{{req, StreamPartialField}, {resp, StreamIndexesField}, {check, CheckBriefField}, {answer, RespSettleIDField}} {
		if n := m.msg.Fields().Len(); n != int(m.last) {
			t.Errorf("%s has %d fields; the package knows %d", m.msg.Name(), n, m.last)
		}
	}
}

// randomChecks is n checks with random fields, each left at its zero value one time in four.
func randomChecks(r *rand.Rand, n int) []Check {
	str := func() string {
		if r.IntN(4) == 0 {
			return ""
		}
		return strings.Repeat("é/x", r.IntN(60))
	}
	num := func() int64 {
		switch r.IntN(4) {
		case 0:
			return 0
		case 1:
			return -r.Int64()
		}
		return r.Int64N(1<<uint(r.IntN(62)) + 1)
	}
	checks := make([]Check, n)
	for i := range checks {
		checks[i] = Check{Tenant: str(), Route: str(), Operation: str(), Cost: num(), IdempotencyKey: str(), Settle: r.IntN(2) == 0, Brief: r.IntN(2) == 0}
	}
	return checks
}

// TestAppendRequestBytes: AppendRequest writes the bytes proto.Marshal writes for the same
// CheckStreamRequest, after whatever b held.
func TestAppendRequestBytes(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 500 {
		checks := randomChecks(r, r.IntN(20))
		id := uint64(r.IntN(3)) * r.Uint64()
		partial := r.IntN(2) == 0
		m := &agentv1.CheckStreamRequest{Id: id, Partial: partial}
		for _, c := range checks {
			m.Checks = append(m.Checks, &agentv1.CheckRequest{Tenant: c.Tenant, Route: c.Route, Operation: c.Operation,
				Cost: c.Cost, IdempotencyKey: c.IdempotencyKey, Settle: c.Settle, Brief: c.Brief})
		}
		want, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		got := AppendRequest([]byte("prefix"), id, checks, partial)
		if string(got) != "prefix"+string(want) {
			t.Fatalf("case %d: AppendRequest wrote\n%x\nproto.Marshal\n%x", i, got[len("prefix"):], want)
		}
	}
}

// TestDecodeAnswer: an answer written by proto.Marshal decodes to the same values, into an Answer
// that held another answer before (nothing of it is left), and a rule name is shared between
// answers.
func TestDecodeAnswer(t *testing.T) {
	var d Decoder
	a := Answer{ID: 9, Results: make([]Result, 5), Errors: []string{"old"}, Indexes: []uint32{1, 2}}
	a.Results[0].Rule = "old"
	msgs := []*agentv1.CheckStreamResponse{
		{Id: 3, Results: []*agentv1.CheckResponse{
			{Decision: agentv1.Decision_DECISION_ALLOW, Remaining: 41, Limit: 100, WindowMs: 60_000, ResetMs: 590, Rule: "api", SettleId: 7},
			{Decision: agentv1.Decision_DECISION_DENY, RetryAfterMs: 250, Limit: 100, WindowMs: 60_000, Rule: "api", ShadowDeny: true},
			{},
		}, Errors: []string{"", "", "check 2: bad route"}, Indexes: []uint32{0, 4, 70000}},
		{Results: []*agentv1.CheckResponse{{Decision: agentv1.Decision_DECISION_UNAVAILABLE, Degraded: true, Replayed: true, RetryAfterMs: math.MaxInt64, Remaining: -5, Rule: "api"}}},
	}
	var rules []string
	for _, m := range msgs {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Decode(b, &a); err != nil {
			t.Fatal(err)
		}
		checkAnswer(t, &a, m)
		for _, r := range a.Results {
			if r.Rule != "" {
				rules = append(rules, r.Rule)
			}
		}
	}
	if len(rules) != 3 || !sameString(rules[0], rules[2]) {
		t.Errorf("rule names %q: want three, sharing their bytes", rules)
	}
	if n := testing.AllocsPerRun(100, func() {
		b, _ := proto.Marshal(msgs[0])
		_ = b
	}); n == 0 {
		t.Fatal("proto.Marshal allocated nothing: the measure below means nothing")
	}
	b, _ := proto.Marshal(msgs[1])
	if n := testing.AllocsPerRun(100, func() {
		if err := d.Decode(b, &a); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Errorf("decoding an answer without errors into a reused Answer allocated %v times, want 0", n)
	}
}

// sameString reports whether a and b are one string: the same bytes in the same memory.
func sameString(a, b string) bool { return a == b && unsafe.StringData(a) == unsafe.StringData(b) }

// checkAnswer fails unless a holds m's values.
func checkAnswer(t *testing.T, a *Answer, m *agentv1.CheckStreamResponse) {
	t.Helper()
	if a.ID != m.Id || len(a.Results) != len(m.Results) || len(a.Errors) != len(m.Errors) || len(a.Indexes) != len(m.Indexes) {
		t.Fatalf("decoded id %d, %d results, %d errors, %d indexes; want %d, %d, %d, %d",
			a.ID, len(a.Results), len(a.Errors), len(a.Indexes), m.Id, len(m.Results), len(m.Errors), len(m.Indexes))
	}
	for i, w := range m.Results {
		want := Result{Decision: int32(w.Decision), Degraded: w.Degraded, RetryAfterMs: w.RetryAfterMs, Remaining: w.Remaining,
			Limit: w.Limit, WindowMs: w.WindowMs, ResetMs: w.ResetMs, Rule: w.Rule, ShadowDeny: w.ShadowDeny,
			Replayed: w.Replayed, SettleID: w.SettleId}
		if a.Results[i] != want {
			t.Fatalf("result %d: decoded %+v, want %+v", i, a.Results[i], want)
		}
	}
	for i := range m.Errors {
		if a.Errors[i] != m.Errors[i] {
			t.Fatalf("error %d: decoded %q, want %q", i, a.Errors[i], m.Errors[i])
		}
	}
	for i := range m.Indexes {
		if a.Indexes[i] != m.Indexes[i] {
			t.Fatalf("index %d: decoded %d, want %d", i, a.Indexes[i], m.Indexes[i])
		}
	}
}

// FuzzDecodeAnswer: Decode accepts exactly the messages proto.Unmarshal accepts as a
// CheckStreamResponse, and reads the same values.
func FuzzDecodeAnswer(f *testing.F) {
	seed := func(m *agentv1.CheckStreamResponse) {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	seed(&agentv1.CheckStreamResponse{Id: 7, Results: []*agentv1.CheckResponse{
		{Decision: agentv1.Decision_DECISION_ALLOW, Remaining: 3, Limit: 10, WindowMs: 1000, ResetMs: 700, Rule: "r", SettleId: 1},
		{Decision: agentv1.Decision_DECISION_DENY, RetryAfterMs: 5, ShadowDeny: true, Replayed: true, Degraded: true},
		{},
	}, Errors: []string{"", "x", ""}, Indexes: []uint32{2, 0, 1}})
	// A rule given twice (the last), a decision of the wrong wire type (unknown), a group, an
	// unknown field; the id twice; indexes unpacked, then packed; an error of the wrong wire type.
	res := protowire.AppendTag(nil, RespRuleField, protowire.BytesType)
	res = protowire.AppendString(res, "a")
	res = protowire.AppendTag(res, RespRuleField, protowire.BytesType)
	res = protowire.AppendString(res, "b")
	res = protowire.AppendTag(res, RespDecisionField, protowire.BytesType)
	res = protowire.AppendString(res, "x")
	res = protowire.AppendTag(res, 12, protowire.StartGroupType)
	res = protowire.AppendTag(res, 12, protowire.EndGroupType)
	res = protowire.AppendTag(res, 13, protowire.Fixed32Type)
	res = protowire.AppendFixed32(res, 1)
	msg := protowire.AppendTag(nil, StreamResultsField, protowire.BytesType)
	msg = protowire.AppendBytes(msg, res)
	msg = protowire.AppendTag(msg, StreamIDField, protowire.VarintType)
	msg = protowire.AppendVarint(msg, 1)
	msg = protowire.AppendTag(msg, StreamIDField, protowire.VarintType)
	msg = protowire.AppendVarint(msg, 2)
	msg = protowire.AppendTag(msg, StreamIndexesField, protowire.VarintType)
	msg = protowire.AppendVarint(msg, 1<<33+5)
	msg = protowire.AppendTag(msg, StreamIndexesField, protowire.BytesType)
	msg = protowire.AppendBytes(msg, protowire.AppendVarint(protowire.AppendVarint(nil, 3), 300))
	msg = protowire.AppendTag(msg, StreamErrorsField, protowire.VarintType)
	msg = protowire.AppendVarint(msg, 1)
	f.Add(msg)
	bad := protowire.AppendTag(nil, RespRuleField, protowire.BytesType)
	bad = protowire.AppendString(bad, "r\xff")
	f.Add(protowire.AppendBytes(protowire.AppendTag(nil, StreamResultsField, protowire.BytesType), bad))
	f.Add(protowire.AppendString(protowire.AppendTag(nil, StreamErrorsField, protowire.BytesType), "\xc0"))
	f.Add(protowire.AppendBytes(protowire.AppendTag(nil, StreamIndexesField, protowire.BytesType), []byte{0x80}))
	var d Decoder
	var a Answer
	f.Fuzz(func(t *testing.T, b []byte) {
		var want agentv1.CheckStreamResponse
		werr := proto.Unmarshal(b, &want)
		gerr := d.Decode(b, &a)
		if (werr == nil) != (gerr == nil) {
			t.Fatalf("proto.Unmarshal: %v; Decode: %v", werr, gerr)
		}
		if werr == nil {
			checkAnswer(t, &a, &want)
		}
	})
}

// FuzzAppendRequest: what AppendRequest writes, proto.Unmarshal reads back as the same message.
func FuzzAppendRequest(f *testing.F) {
	f.Add(uint64(7), "acme", "/api/x", "GET", int64(2), "k", true, true, true, 3)
	f.Add(uint64(0), "", "", "", int64(-1), "", false, false, false, 0)
	f.Fuzz(func(t *testing.T, id uint64, tenant, route, op string, cost int64, key string, settle, brief, partial bool, n int) {
		for _, s := range []string{tenant, route, op, key} {
			if !utf8.ValidString(s) {
				return // a caller checks its strings first (proto3 strings are UTF-8)
			}
		}
		checks := make([]Check, n&7)
		for i := range checks {
			checks[i] = Check{Tenant: tenant, Route: route, Operation: op, Cost: cost + int64(i), IdempotencyKey: key, Settle: settle, Brief: brief}
		}
		var got agentv1.CheckStreamRequest
		if err := proto.Unmarshal(AppendRequest(nil, id, checks, partial), &got); err != nil {
			t.Fatal(err)
		}
		if got.Id != id || got.Partial != partial || len(got.Checks) != len(checks) {
			t.Fatalf("read id %d, partial %v, %d checks; want %d, %v, %d", got.Id, got.Partial, len(got.Checks), id, partial, len(checks))
		}
		for i, c := range got.Checks {
			w := checks[i]
			if c.Tenant != w.Tenant || c.Route != w.Route || c.Operation != w.Operation || c.Cost != w.Cost ||
				c.IdempotencyKey != w.IdempotencyKey || c.Settle != w.Settle || c.Brief != w.Brief {
				t.Fatalf("check %d read as %v, want %+v", i, c, w)
			}
		}
	})
}

// BenchmarkDecode: an answer of 17 allowed checks as a lease answers them (the hot-key stack
// benchmark's average message), per check.
func BenchmarkDecode(b *testing.B) {
	m := &agentv1.CheckStreamResponse{Id: 12345}
	for i := range 17 {
		m.Results = append(m.Results, &agentv1.CheckResponse{Decision: agentv1.Decision_DECISION_ALLOW, Remaining: 99_000 + int64(i),
			Limit: 100_000, WindowMs: 1000, ResetMs: 12, Rule: "bench"})
	}
	buf, err := proto.Marshal(m)
	if err != nil {
		b.Fatal(err)
	}
	var d Decoder
	var a Answer
	b.ReportAllocs()
	for b.Loop() {
		if err := d.Decode(buf, &a); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(m.Results)), "ns/check")
}

// TestStrings: a table returns each string as given, shares the ones it keeps (at most
// MaxShared), and refuses one that is not UTF-8 whether or not a similar one is kept.
func TestStrings(t *testing.T) {
	var tab Strings
	get := func(s string) string {
		t.Helper()
		got, ok := tab.Get([]byte(s))
		if !ok || got != s {
			t.Fatalf("Get(%q) = %q, %v", s, got, ok)
		}
		return got
	}
	if get("") != "" || tab.Len() != 0 {
		t.Fatal("the empty string is kept")
	}
	a, _ := get("alpha"), get("beta")
	fromMap := get("alpha")  // "beta" was the last string: found in the map
	fromLast := get("alpha") // the last string now: found without the map
	if !sameString(fromMap, a) || !sameString(fromLast, a) {
		t.Error("a string kept is not shared")
	}
	for i := range 2 * MaxShared {
		get(strconv.Itoa(i))
	}
	if tab.Len() != MaxShared {
		t.Errorf("the table keeps %d strings, want %d", tab.Len(), MaxShared)
	}
	x := get("not kept")
	if y := get("not kept"); sameString(x, y) {
		t.Error("a string past the bound is shared: the table grew")
	}
	for _, bad := range []string{"a\xff", "\xc0", "b\x80"} {
		if s, ok := tab.Get([]byte(bad)); ok || s != "" {
			t.Errorf("Get(%q) = %q, %v; want a refusal", bad, s, ok)
		}
	}
}
