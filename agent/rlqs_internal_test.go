package agent

import (
	"maps"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	rlqsv3 "github.com/envoyproxy/go-control-plane/envoy/service/rate_limit_quota/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/lease"
)

// TestTokenBucketFor: every assignment's token bucket admits at most the k requests reserved for
// it over its life (ttl plus the margin), however its requests come (a continuously refilled
// bucket admits at most bMax + f·t by t), whatever the pace asked for; holds at least one token,
// refills at least one a second and no faster than asked, is paced as asked when k covers the pace
// over the life, and keeps a whole-second ttl whole.
func TestTokenBucketFor(t *testing.T) {
	ttls := []time.Duration{20 * time.Millisecond, 400 * time.Millisecond, 899 * time.Millisecond,
		time.Second, 2 * time.Second, 7 * time.Second, 15 * time.Second}
	for k := int64(1); k <= 3000; k += 1 + k/7 {
		for _, ttl := range ttls {
			for _, rate := range []float64{0, 0.5, 1, 7, 100, 2999, 1e9} {
				bMax, f, got := tokenBucketFor(k, ttl, rate)
				life := got + AssignmentMargin
				most := bMax + f*int64(life/time.Millisecond)/1000 // ⌊bMax + f·life⌋
				switch {
				case bMax < 1 || f < 1:
					t.Fatalf("tokenBucketFor(%d, %v) = %d, %d: want at least one token and one a second", k, ttl, bMax, f)
				case most > k:
					t.Fatalf("tokenBucketFor(%d, %v) = %d + %d/s for %v: admits %d over its life, more than %d", k, ttl, bMax, f, got, most, k)
				case got > ttl:
					t.Fatalf("tokenBucketFor(%d, %v): ttl grew to %v", k, ttl, got)
				case ttl >= time.Second && k >= 2 && got%time.Second != 0:
					t.Fatalf("tokenBucketFor(%d, %v): ttl %v is not whole seconds", k, ttl, got)
				case f > 1 && float64(f) > rate:
					t.Fatalf("tokenBucketFor(%d, %v, %v): %d a second, faster than asked", k, ttl, rate, f)
				}
			}
		}
	}
}

// TestPlanAssignments: a fresh lease of any lifetime backs an assignment: the life a reservation
// asks for fits in what a refill leaves of the lease, and the ttl planned from a reservation ends,
// with the margin, before the reservation does; leases of a second and a half or more give ttls of
// whole seconds.
func TestPlanAssignments(t *testing.T) {
	for tau := lease.MinTTL; tau <= lease.MaxTTL; tau += 37 * time.Millisecond {
		p := planAssignments(tau)
		fresh := tau - clock.Guard.Duration() - quotaRefillAllowance
		if p.life > fresh {
			t.Fatalf("τ = %v: a reservation asks for %v of life, a fresh lease has %v", tau, p.life, fresh)
		}
		if tau >= 1500*time.Millisecond && !p.whole {
			t.Fatalf("τ = %v: want whole-second ttls", tau)
		}
		for left := p.life; left <= fresh; left += 50 * time.Millisecond {
			exp := clock.Of(left)
			ttl := p.ttl(0, exp)
			switch {
			case ttl <= 0:
				t.Fatalf("τ = %v, %v left: no ttl", tau, left)
			case clock.Of(ttl+AssignmentMargin) > exp:
				t.Fatalf("τ = %v, %v left: ttl %v ends past the reservation", tau, left, ttl)
			case p.whole && (ttl < time.Second || ttl%time.Second != 0):
				t.Fatalf("τ = %v, %v left: ttl %v, want whole seconds", tau, left, ttl)
			}
		}
	}
}

// FuzzBucketSig: two bucket ids have the same signature exactly when they have the same entries,
// whatever their order. The fuzzer splits two strings into entries at NUL bytes and '=' signs.
func FuzzBucketSig(f *testing.F) {
	f.Add("tenant=acme\x00path=/a", "path=/a\x00tenant=acme")
	f.Add("a=b,c", "a=b\x00c=")
	f.Add("ab=c", "a=bc")
	f.Add("=", "")
	f.Fuzz(func(t *testing.T, a, b string) {
		parse := func(s string) map[string]string {
			m := map[string]string{}
			for e := range strings.SplitSeq(s, "\x00") {
				if len(m) == MaxEnvoyEntries {
					break
				}
				k, v, _ := strings.Cut(e, "=")
				m[k] = v
			}
			return m
		}
		ma, mb := parse(a), parse(b)
		if got, want := mapSig(ma) == mapSig(mb), maps.Equal(ma, mb); got != want {
			t.Fatalf("ids %q and %q: same signature %v, same entries %v", ma, mb, got, want)
		}
	})
}

// TestTokenBucketAction: the token bucket assignment encoded by hand reads as the message built
// the plain way, field for field, and appends without allocating; the field numbers it writes are
// the descriptors'.
func TestTokenBucketAction(t *testing.T) {
	id := &rlqsv3.BucketId{Bucket: map[string]string{"tenant": "acme", "path": "/q/{id}"}}
	echo := echoField(id)
	for _, tc := range []struct {
		ttl     time.Duration
		bMax, f int64
	}{{time.Second, 3, 9}, {2 * time.Second, 1, 1}, {899 * time.Millisecond, 1<<31 - 1, 1}, {20 * time.Millisecond, 7, 0}, {0, 0, 1}} {
		want := assignment(tc.ttl, &typev3.RateLimitStrategy{Strategy: &typev3.RateLimitStrategy_TokenBucket{TokenBucket: &typev3.TokenBucket{
			MaxTokens:     uint32(tc.bMax),
			TokensPerFill: wrapperspb.UInt32(uint32(tc.f)),
			FillInterval:  durationpb.New(time.Second),
		}}})
		want.BucketId = id
		var got rlqsv3.RateLimitQuotaResponse
		if err := proto.Unmarshal(appendTokenBucketAction(nil, echo, tc.ttl, tc.bMax, tc.f), &got); err != nil ||
			len(got.BucketAction) != 1 || !proto.Equal(got.BucketAction[0], want) {
			t.Errorf("appendTokenBucketAction(%v, %d, %d) reads as %v (%v), want %v", tc.ttl, tc.bMax, tc.f, &got, err, want)
		}
	}
	buf := make([]byte, 0, 4096)
	if n := testing.AllocsPerRun(100, func() { buf = appendTokenBucketAction(buf[:0], echo, time.Second, 3, 9) }); n != 0 {
		t.Errorf("appendTokenBucketAction: %v allocations, want none", n)
	}
	fields := func(m proto.Message) protoreflect.FieldDescriptors { return m.ProtoReflect().Descriptor().Fields() }
	for _, tc := range []struct {
		f   protoreflect.FieldDescriptor
		num protowire.Number
	}{
		{fields(&rlqsv3.RateLimitQuotaResponse{}).ByName("bucket_action"), responseActionField},
		{fields(want0()).ByName("bucket_id"), actionBucketIDField},
		{fields(want0()).ByName("quota_assignment_action"), actionAssignmentField},
		{fields(&rlqsv3.RateLimitQuotaResponse_BucketAction_QuotaAssignmentAction{}).ByName("assignment_time_to_live"), assignmentTTLField},
		{fields(&rlqsv3.RateLimitQuotaResponse_BucketAction_QuotaAssignmentAction{}).ByName("rate_limit_strategy"), assignmentStrategyField},
		{fields(&typev3.RateLimitStrategy{}).ByName("token_bucket"), strategyTokenBucket},
		{fields(&typev3.TokenBucket{}).ByName("max_tokens"), tokenBucketMaxField},
		{fields(&typev3.TokenBucket{}).ByName("tokens_per_fill"), tokenBucketPerFillField},
		{fields(&typev3.TokenBucket{}).ByName("fill_interval"), tokenBucketFillField},
	} {
		if tc.f == nil || tc.f.Number() != tc.num {
			t.Errorf("hand-encoded field %d: the descriptor says %v", tc.num, tc.f)
		}
	}
}

func want0() *rlqsv3.RateLimitQuotaResponse_BucketAction {
	return &rlqsv3.RateLimitQuotaResponse_BucketAction{}
}

// TestBucketSigLookup: a known bucket's signature is built in the stream's buffer and looked up
// without an allocation.
func TestBucketSigLookup(t *testing.T) {
	id := map[string]string{"tenant": "acme", "path": "/q/{id}", "method": "GET"}
	m := map[string]int{mapSig(id): 1}
	es := entriesOf(id)
	var buf []byte
	if n := testing.AllocsPerRun(100, func() {
		buf = appendEntriesSig(buf[:0], es)
		if m[string(buf)] != 1 {
			t.Fatal("the bucket is not found by its signature")
		}
	}); n != 0 {
		t.Errorf("a known bucket's lookup: %v allocations, want none", n)
	}
}

// mapSig is the signature of the bucket id m.
func mapSig(m map[string]string) string { return string(appendEntriesSig(nil, entriesOf(m))) }

// entriesOf is the bucket id m as decoded entries, in the map's order.
func entriesOf(m map[string]string) []idEntry {
	var es []idEntry
	for k, v := range m {
		es = append(es, idEntry{[]byte(k), []byte(v)})
	}
	return es
}

// TestEchoBucketID: the bucket id an action echoes reads on the wire as the id Envoy sent, in
// every kind of action.
func TestEchoBucketID(t *testing.T) {
	for _, m := range []map[string]string{
		{"tenant": "acme", "path": "/q/{id}", "method": "GET"},
		{"": ""},
		{"k": strings.Repeat("v", 300), "é": "\x00"},
	} {
		echo := echoField(&rlqsv3.BucketId{Bucket: m})
		abandon := &rlqsv3.RateLimitQuotaResponse_BucketAction{BucketAction: &rlqsv3.RateLimitQuotaResponse_BucketAction_AbandonAction_{
			AbandonAction: &rlqsv3.RateLimitQuotaResponse_BucketAction_AbandonAction{}}}
		body, err := proto.Marshal(abandon)
		if err != nil {
			t.Fatal(err)
		}
		raw := appendAction(appendTokenBucketAction(nil, echo, time.Second, 3, 9), echo, body)
		var resp rlqsv3.RateLimitQuotaResponse
		if err := proto.Unmarshal(raw, &resp); err != nil || len(resp.BucketAction) != 2 {
			t.Fatalf("two actions echoing %v read as %v (%v)", m, &resp, err)
		}
		for _, a := range resp.BucketAction {
			if !maps.Equal(a.GetBucketId().GetBucket(), m) {
				t.Fatalf("an action echoing %v reads as %v", m, a)
			}
		}
		if resp.BucketAction[1].GetAbandonAction() == nil {
			t.Fatalf("the abandon action reads as %v", resp.BucketAction[1])
		}
	}
}

// TestDueHeap: random schedules, reschedules and removals keep every bucket's index true and pop
// buckets in the order of their times.
func TestDueHeap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var h dueHeap
	bs := make([]*quotaBucket, 64)
	for i := range bs {
		bs[i] = &quotaBucket{index: -1}
	}
	for op := range 20000 {
		b := bs[rng.IntN(len(bs))]
		at := clock.Nanos(rng.IntN(1000))
		switch {
		case rng.IntN(4) == 0 && b.index >= 0:
			if got := h.remove(b.index); got != b || b.index != -1 {
				t.Fatalf("op %d: remove returned another bucket or left an index", op)
			}
		case b.index >= 0:
			h[b.index].at = at
			h.fix(b.index)
		default:
			h.push(dueEntry{at: at, b: b})
		}
		for i, e := range h {
			if e.b.index != i {
				t.Fatalf("op %d: entry %d holds index %d", op, i, e.b.index)
			}
			if i > 0 && h[(i-1)/2].at > e.at {
				t.Fatalf("op %d: entry %d (at %d) under a later parent (%d)", op, i, e.at, h[(i-1)/2].at)
			}
		}
	}
	last := clock.Nanos(-1)
	for len(h) > 0 {
		at := h[0].at
		if h.remove(0).index != -1 || at < last {
			t.Fatalf("popped at %d after %d", at, last)
		}
		last = at
	}
}

// TestAssignmentSpread: requests arriving at random (a Poisson stream at the reported rate) into
// the token bucket of an assignment sized by assignmentWant are denied less than 1 % of the time
// at rates from 3 to 2,000 a second; without the spread's headroom, more than 2 % are up to 40 a
// second (9–25 %: the test sees the difference it is about; above, the tenth of a second of burst
// covers the spread).
func TestAssignmentSpread(t *testing.T) {
	plan := planAssignments(2500 * time.Millisecond)
	rng := rand.New(rand.NewPCG(3, 4))
	denied := func(rate, spread float64) float64 {
		var n, no int
		for range 2000 {
			k := assignmentWant(rate, plan, 1<<40, spread)
			bMax, f, ttl := tokenBucketFor(k, plan.target, rate)
			tokens, last := float64(bMax), 0.0
			for at := rng.ExpFloat64() / rate; at < ttl.Seconds(); at += rng.ExpFloat64() / rate {
				tokens, last = min(float64(bMax), tokens+float64(f)*(at-last)), at
				n++
				if tokens < 1 {
					no++
					continue
				}
				tokens--
			}
		}
		return float64(no) / float64(n)
	}
	for _, rate := range []float64{3, 10, 40, 200, 2000} {
		if d := denied(rate, quotaSpread); d >= 0.01 {
			t.Errorf("%v requests a second: %.2f %% denied, want below 1 %%", rate, 100*d)
		}
		if d := denied(rate, 0); rate <= 40 && d <= 0.02 {
			t.Errorf("%v requests a second without the spread: %.2f %% denied; the test cannot tell", rate, 100*d)
		}
	}
}
