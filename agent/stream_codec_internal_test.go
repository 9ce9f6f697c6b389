package agent

import (
	"bytes"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/checkwire"
	"github.com/leasebucket/leasebucket/policy"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// FuzzDecodeCheckStream: decodeCheckStream accepts exactly the messages proto.Unmarshal accepts
// as a CheckStreamRequest, and reads the same id, checks and fields.
func FuzzDecodeCheckStream(f *testing.F) {
	seed := func(m *agentv1.CheckStreamRequest) {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	seed(&agentv1.CheckStreamRequest{Id: 7, Partial: true, Checks: []*agentv1.CheckRequest{
		{Tenant: "acme", Route: "/api/orders/1", Operation: "GET", Cost: 3, IdempotencyKey: "k-1", Settle: true, Brief: true},
		{Tenant: "b", Route: "/api/orders/1", Operation: "GET", Cost: -1},
		{},
	}})
	// A tenant given twice (the last), a cost of the wrong wire type (unknown), invalid UTF-8, a
	// group, an unknown field.
	check := protowire.AppendTag(nil, checkTenantField, protowire.BytesType)
	check = protowire.AppendString(check, "a")
	check = protowire.AppendTag(check, checkTenantField, protowire.BytesType)
	check = protowire.AppendString(check, "b")
	check = protowire.AppendTag(check, checkCostField, protowire.BytesType)
	check = protowire.AppendString(check, "x")
	check = protowire.AppendTag(check, 9, protowire.StartGroupType)
	check = protowire.AppendTag(check, 9, protowire.EndGroupType)
	check = protowire.AppendTag(check, 12, protowire.Fixed64Type)
	check = protowire.AppendFixed64(check, 1)
	msg := protowire.AppendTag(nil, streamChecksField, protowire.BytesType)
	msg = protowire.AppendBytes(msg, check)
	msg = protowire.AppendTag(msg, streamIDField, protowire.VarintType)
	msg = protowire.AppendVarint(msg, 1)
	msg = protowire.AppendTag(msg, streamIDField, protowire.VarintType)
	msg = protowire.AppendVarint(msg, 2)
	// partial given twice (the last), then as bytes (unknown).
	msg = protowire.AppendTag(msg, streamPartialField, protowire.VarintType)
	msg = protowire.AppendVarint(msg, 1)
	msg = protowire.AppendTag(msg, streamPartialField, protowire.VarintType)
	msg = protowire.AppendVarint(msg, 0)
	msg = protowire.AppendTag(msg, streamPartialField, protowire.BytesType)
	msg = protowire.AppendString(msg, "x")
	f.Add(msg)
	bad := protowire.AppendTag(nil, checkRouteField, protowire.BytesType)
	bad = protowire.AppendString(bad, "/\xff")
	f.Add(protowire.AppendBytes(protowire.AppendTag(nil, streamChecksField, protowire.BytesType), bad))
	var d streamDecoder // one stream's: what an input interned, a later one finds
	f.Fuzz(func(t *testing.T, b []byte) {
		var want agentv1.CheckStreamRequest
		werr := proto.Unmarshal(b, &want)
		m, gerr := d.decodeCheckStream(b)
		id, n, slots := m.id, m.n, m.slots
		if (werr == nil) != (gerr == nil) {
			t.Fatalf("proto.Unmarshal: %v; decodeCheckStream: %v", werr, gerr)
		}
		if werr != nil {
			return
		}
		if id != want.Id || n != len(want.Checks) || m.partial != want.Partial {
			t.Fatalf("decoded id %d, %d checks, partial %v; want %d, %d, %v", id, n, m.partial, want.Id, len(want.Checks), want.Partial)
		}
		if n > MaxBatchChecks {
			if slots != nil {
				t.Fatalf("%d checks decoded, over the bound", n)
			}
			return
		}
		for i, c := range want.Checks {
			q := Query{Tenant: c.Tenant, Path: c.Route, Operation: c.Operation, Cost: c.Cost, Settle: c.Settle}
			if slots[i] != (slot{q: q, key: c.IdempotencyKey, brief: c.Brief}) {
				t.Fatalf("check %d: %+v key %q, want %+v key %q and nothing else", i, slots[i].q, slots[i].key, q, c.IdempotencyKey)
			}
		}
		// Decided and answered at once: the next input decodes into these slots, which must
		// not carry anything of this one's.
		for i := range slots {
			slots[i].v, slots[i].err, slots[i].state, slots[i].replayed = Verdict{Outcome: Deny, Remaining: 9}, ErrClosed, slotLease, true
		}
		d.release(slots)
	})
}

// TestDecodeCheckStreamInterns: a stream's tenants, routes and operations are allocated once,
// up to checkwire.MaxShared of each, and a string not valid UTF-8 is refused, never interned.
func TestDecodeCheckStreamInterns(t *testing.T) {
	m := &agentv1.CheckStreamRequest{Id: 1}
	for range 64 {
		m.Checks = append(m.Checks, &agentv1.CheckRequest{Tenant: "acme", Route: "/api/orders/1", Operation: "GET"})
	}
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	var d streamDecoder
	if _, err := d.decodeCheckStream(b); err != nil {
		t.Fatal(err)
	}
	// The slots and nothing else: no tenant, route or operation string per check.
	if n := testing.AllocsPerRun(20, func() { _, _ = d.decodeCheckStream(b) }); n != 1 {
		t.Errorf("decoding a message of 64 checks of a known tenant and route: %v allocations, want 1 (the slots)", n)
	}
	// A message answered at once hands its slots back: the next one of as many checks or fewer
	// decodes into them, one of more into new ones.
	if n := testing.AllocsPerRun(20, func() {
		m, _ := d.decodeCheckStream(b)
		d.release(m.slots)
	}); n != 0 {
		t.Errorf("decoding messages of 64 checks, each message's slots released: %v allocations, want 0", n)
	}
	m.Checks = append(m.Checks, m.Checks[0])
	if b, err = proto.Marshal(m); err != nil {
		t.Fatal(err)
	}
	if n := testing.AllocsPerRun(20, func() { _, _ = d.decodeCheckStream(b) }); n != 1 {
		t.Errorf("decoding a message of 65 checks after one of 64: %v allocations, want 1 (the slots)", n)
	}
	for i := range 2 * checkwire.MaxShared {
		if _, ok := d.tenants.Get([]byte(strings.Repeat("t", i+1))); !ok {
			t.Fatal("a valid tenant refused")
		}
	}
	if n := d.tenants.Len(); n != checkwire.MaxShared {
		t.Errorf("%d tenants kept, want at most %d", n, checkwire.MaxShared)
	}
	if s, ok := d.tenants.Get([]byte("t\xff")); ok || s != "" {
		t.Errorf("a tenant not UTF-8 = %q, %v; want a refusal", s, ok)
	}
}

// FuzzStreamAnswer: appendStreamAnswer writes the bytes proto.Marshal writes for the message
// answers builds, for any verdicts, replays and errors, answering every check or (errKind/3%8 a
// nonzero mask of the three) some of them with their indexes, the checks errKind/24 names sent
// brief.
func FuzzStreamAnswer(f *testing.F) {
	f.Add(uint64(7), uint8(1), false, uint64(0), false, int64(0), uint8(3), int64(50), false, uint8(0))
	f.Add(uint64(0), uint8(2), true, uint64(9), true, int64(1500), uint8(200), int64(-5), true, uint8(1))
	f.Add(uint64(1<<63), uint8(3), false, uint64(1), false, int64(time.Hour), uint8(0), int64(1<<40), false, uint8(2))
	f.Add(uint64(5), uint8(1), false, uint64(0), false, int64(0), uint8(3), int64(50), false, uint8(3*5+1))
	f.Add(uint64(5), uint8(2), false, uint64(0), false, int64(0), uint8(3), int64(50), false, uint8(3*4+2))
	f.Add(uint64(5), uint8(1), false, uint64(0), false, int64(0), uint8(3), int64(50), false, uint8(24*5))
	lim, err := bucket.NewLimit(100*bucket.PerToken, 10*bucket.PerToken, 1000)
	if err != nil {
		f.Fatal(err)
	}
	limits := &policy.Limits{Quota: policy.Quota{Requests: 10, Period: time.Second, Burst: 100, Bucket: lim}}
	s := &Server{}
	f.Fuzz(func(t *testing.T, id uint64, outcome uint8, degraded bool, settleID uint64, shadow bool,
		retry int64, ruleLen uint8, remaining int64, replayed bool, errKind uint8) {
		slots := make([]slot, 3)
		for i := range slots {
			v := Verdict{Outcome: Outcome(int(outcome)+i) % 4, Degraded: degraded, SettleID: settleID, ShadowDeny: shadow,
				RetryAfter: time.Duration(retry), Remaining: bucket.Micro(remaining) * bucket.PerToken}
			if ruleLen > 0 {
				v.Rule = &policy.Rule{Name: strings.Repeat("r", int(ruleLen))}
			}
			if i != 1 {
				v.Limits = limits
			}
			// errKind/24, a mask of the three: the checks sent brief
			slots[i] = slot{v: v, replayed: replayed && i == 0, brief: (errKind/24)&(1<<i) != 0}
		}
		switch errKind % 3 {
		case 1:
			slots[2].err = ErrInvalidTenant
		case 2:
			slots[1].err = ErrClosed // the whole message fails
		}
		var idx []uint32
		answered := slots
		if mask := errKind / 3 % 8; mask != 0 {
			answered = nil
			for i := range slots {
				if mask&(1<<i) != 0 {
					idx = append(idx, uint32(i))
					answered = append(answered, slots[i])
				}
			}
		}
		got, gerr := s.appendStreamAnswer(nil, id, slots, idx)
		results, errs, werr := s.answers(answered)
		if (gerr == nil) != (werr == nil) {
			t.Fatalf("appendStreamAnswer: %v; answers: %v", gerr, werr)
		}
		if werr != nil {
			return
		}
		want, err := proto.MarshalOptions{Deterministic: true}.Marshal(&agentv1.CheckStreamResponse{Id: id, Results: results, Errors: errs, Indexes: idx})
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("appendStreamAnswer wrote\n%x\nproto.Marshal writes\n%x", got, want)
		}
	})
}

// BenchmarkDecodeCheckStream: decoding a message of 17 checks (the hot-key stack benchmark's
// average) of three tenants on one route, by hand and by the generated code, per check.
func BenchmarkDecodeCheckStream(b *testing.B) {
	m := &agentv1.CheckStreamRequest{Id: 5, Partial: true}
	for i := range 17 {
		m.Checks = append(m.Checks, &agentv1.CheckRequest{Tenant: "tenant-" + strconv.Itoa(i%3), Route: "/api/items", Operation: "GET"})
	}
	buf, err := proto.Marshal(m)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("hand", func(b *testing.B) {
		var d streamDecoder
		b.ReportAllocs()
		for b.Loop() {
			if _, err := d.decodeCheckStream(buf); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(m.Checks)), "ns/check")
	})
	b.Run("generated", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var got agentv1.CheckStreamRequest
			if err := proto.Unmarshal(buf, &got); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(m.Checks)), "ns/check")
	})
}

// BenchmarkStreamAnswer: writing the answer of a message of 17 allowed checks (the hot-key stack
// benchmark's average), per check.
func BenchmarkStreamAnswer(b *testing.B) {
	lim, err := bucket.NewLimit(100_000*bucket.PerToken, 100_000*bucket.PerToken, 1000)
	if err != nil {
		b.Fatal(err)
	}
	limits := &policy.Limits{Quota: policy.Quota{Requests: 100_000, Period: time.Second, Burst: 100_000, Bucket: lim}}
	rule := &policy.Rule{Name: "bench"}
	slots := make([]slot, 17)
	for i := range slots {
		slots[i].v = Verdict{Outcome: Allow, Remaining: bucket.Micro(99_000+i) * bucket.PerToken, Rule: rule, Limits: limits}
	}
	s := &Server{}
	var buf []byte
	b.ReportAllocs()
	for b.Loop() {
		if buf, err = s.appendStreamAnswer(buf[:0], 12345, slots, nil); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(slots)), "ns/check")
}
