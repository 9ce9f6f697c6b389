package agent

import (
	"bytes"
	"errors"
	"maps"
	"testing"

	rlqsv3 "github.com/envoyproxy/go-control-plane/envoy/service/rate_limit_quota/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/durationpb"
)

// TestQuotaReportFields: the decoder's field numbers are the generated descriptors'.
func TestQuotaReportFields(t *testing.T) {
	reports := (&rlqsv3.RateLimitQuotaUsageReports{}).ProtoReflect().Descriptor()
	usage := (&rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{}).ProtoReflect().Descriptor()
	id := (&rlqsv3.BucketId{}).ProtoReflect().Descriptor()
	checkFieldNumbers(t, "the decoder reads", []fieldNumber{
		{reports, "domain", reportsDomainField}, {reports, "bucket_quota_usages", reportsUsagesField},
		{usage, "bucket_id", usageBucketIDField}, {usage, "time_elapsed", usageElapsedField},
		{usage, "num_requests_allowed", usageAllowedField}, {usage, "num_requests_denied", usageDeniedField},
		{id, "bucket", bucketIDBucketField},
		{id.Fields().ByName("bucket").MapKey().ContainingMessage(), "key", mapKeyField},
		{id.Fields().ByName("bucket").MapKey().ContainingMessage(), "value", mapValueField},
	})
}

// fieldNumber is a field a hand-written codec reads or writes, by the number it uses.
type fieldNumber struct {
	d    protoreflect.MessageDescriptor
	name protoreflect.Name
	num  protowire.Number
}

// checkFieldNumbers: each field's number is the generated descriptor's.
func checkFieldNumbers(t *testing.T, uses string, fields []fieldNumber) {
	t.Helper()
	for _, tc := range fields {
		if f := tc.d.Fields().ByName(tc.name); f == nil || f.Number() != tc.num {
			t.Errorf("%s.%s: %s field %d, the descriptor says %v", tc.d.FullName(), tc.name, uses, tc.num, f)
		}
	}
}

// FuzzDecodeQuotaReports: decodeQuotaReports accepts exactly the messages proto.Unmarshal accepts
// as a RateLimitQuotaUsageReports (but for bucket ids beyond MaxEnvoyEntries, which it stops at),
// and reads the same domain, usages, bucket ids and counts.
func FuzzDecodeQuotaReports(f *testing.F) {
	seed := func(m *rlqsv3.RateLimitQuotaUsageReports) {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	seed(&rlqsv3.RateLimitQuotaUsageReports{Domain: "leasebucket", BucketQuotaUsages: []*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{
		{BucketId: &rlqsv3.BucketId{Bucket: map[string]string{"tenant": "acme", "path": "/q/{id}", "method": "GET"}},
			TimeElapsed: durationpb.New(1e9), NumRequestsAllowed: 7, NumRequestsDenied: 2},
		{BucketId: &rlqsv3.BucketId{Bucket: map[string]string{"tenant": "b", "": ""}}},
		{},
	}})
	// A bucket id given twice (merged), a count given twice (the last), invalid UTF-8, a field of
	// the wrong wire type, a group.
	usage := protowire.AppendTag(nil, usageBucketIDField, protowire.BytesType)
	usage = protowire.AppendBytes(usage, entryMsg("a", "1"))
	usage = protowire.AppendTag(usage, usageBucketIDField, protowire.BytesType)
	usage = protowire.AppendBytes(usage, entryMsg("a", "2"))
	usage = protowire.AppendTag(usage, usageAllowedField, protowire.VarintType)
	usage = protowire.AppendVarint(usage, 5)
	usage = protowire.AppendTag(usage, usageAllowedField, protowire.VarintType)
	usage = protowire.AppendVarint(usage, 6)
	usage = protowire.AppendTag(usage, usageDeniedField, protowire.BytesType)
	usage = protowire.AppendBytes(usage, []byte("x"))
	usage = protowire.AppendTag(usage, 9, protowire.StartGroupType)
	usage = protowire.AppendTag(usage, 9, protowire.EndGroupType)
	msg := protowire.AppendTag(nil, reportsUsagesField, protowire.BytesType)
	msg = protowire.AppendBytes(msg, usage)
	f.Add(msg)
	bad := protowire.AppendTag(nil, reportsUsagesField, protowire.BytesType)
	bad = protowire.AppendBytes(bad, protowire.AppendBytes(protowire.AppendTag(nil, usageBucketIDField, protowire.BytesType), entryMsg("a", "\xff")))
	f.Add(bad)
	f.Fuzz(func(t *testing.T, b []byte) {
		var want rlqsv3.RateLimitQuotaUsageReports
		werr := proto.Unmarshal(b, &want)
		var got quotaReports
		gerr := decodeQuotaReports(b, &got)
		if errors.Is(gerr, errTooManyEntries) || werr == nil && tooManyEntries(&want) {
			return // the decoder stops at the bound; proto.Unmarshal reads on
		}
		if (werr == nil) != (gerr == nil) {
			t.Fatalf("proto.Unmarshal: %v; decodeQuotaReports: %v", werr, gerr)
		}
		if werr != nil {
			return
		}
		if string(got.domain) != want.Domain || len(got.usages) != len(want.BucketQuotaUsages) {
			t.Fatalf("decoded domain %q and %d usages, want %q and %d", got.domain, len(got.usages), want.Domain, len(want.BucketQuotaUsages))
		}
		for i, u := range got.usages {
			w := want.BucketQuotaUsages[i]
			if id := idMap(got.entries[u.from:u.to]); !maps.Equal(id, w.GetBucketId().GetBucket()) || len(id) != u.to-u.from {
				t.Fatalf("usage %d: bucket id %q (%d entries), want %q", i, id, u.to-u.from, w.GetBucketId().GetBucket())
			}
			if u.allowed != w.NumRequestsAllowed || u.denied != w.NumRequestsDenied {
				t.Fatalf("usage %d: %d allowed, %d denied; want %d, %d", i, u.allowed, u.denied, w.NumRequestsAllowed, w.NumRequestsDenied)
			}
		}
	})
}

func tooManyEntries(m *rlqsv3.RateLimitQuotaUsageReports) bool {
	for _, u := range m.BucketQuotaUsages {
		if len(u.GetBucketId().GetBucket()) > MaxEnvoyEntries {
			return true
		}
	}
	return false
}

// entryMsg is a BucketId of the one entry k: v.
func entryMsg(k, v string) []byte {
	e := protowire.AppendTag(nil, mapKeyField, protowire.BytesType)
	e = protowire.AppendString(e, k)
	e = protowire.AppendTag(e, mapValueField, protowire.BytesType)
	e = protowire.AppendString(e, v)
	id := protowire.AppendTag(nil, bucketIDBucketField, protowire.BytesType)
	return protowire.AppendBytes(id, e)
}

// TestDecodeQuotaReportsReuse: decoding into the stream's reports again allocates nothing once its
// slices have grown, and a report whose bucket ids repeat a key keeps the last value.
func TestDecodeQuotaReportsReuse(t *testing.T) {
	m := &rlqsv3.RateLimitQuotaUsageReports{Domain: "d"}
	for i := range 100 {
		m.BucketQuotaUsages = append(m.BucketQuotaUsages, &rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{
			BucketId: &rlqsv3.BucketId{Bucket: map[string]string{"tenant": string(rune('a' + i%26)), "path": "/q/{id}"}}, NumRequestsAllowed: uint64(i)})
	}
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	var r quotaReports
	if n := testing.AllocsPerRun(50, func() {
		if err := decodeQuotaReports(b, &r); err != nil || len(r.usages) != 100 {
			t.Fatalf("decoded %d usages: %v", len(r.usages), err)
		}
	}); n != 0 {
		t.Errorf("decoding a report again: %v allocations, want none", n)
	}
	twice := protowire.AppendTag(nil, reportsUsagesField, protowire.BytesType)
	twice = protowire.AppendBytes(twice, append(protowire.AppendBytes(protowire.AppendTag(nil, usageBucketIDField, protowire.BytesType), entryMsg("k", "1")),
		protowire.AppendBytes(protowire.AppendTag(nil, usageBucketIDField, protowire.BytesType), entryMsg("k", "2"))...))
	if err := decodeQuotaReports(twice, &r); err != nil || len(r.usages) != 1 {
		t.Fatalf("decoded %d usages: %v", len(r.usages), err)
	}
	if es := r.entries[r.usages[0].from:r.usages[0].to]; len(es) != 1 || !bytes.Equal(es[0].v, []byte("2")) {
		t.Fatalf("entries %q, want k: 2", es)
	}
}
