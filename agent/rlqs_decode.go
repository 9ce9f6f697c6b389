package agent

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/leasebucket/leasebucket/internal/checkwire"
)

// A usage report is decoded here rather than by the generated code: the generated decoder builds a
// map (and its strings) for every usage's bucket id, every reporting interval, for buckets the
// stream already knows by their signature: three quarters of the allocations of a stream of a
// thousand buckets. The stream receives a report as an empty message (all of it kept as unknown
// fields, one copy), and decodeQuotaReports reads what the agent uses of it in place: the domain,
// and for each usage its bucket id's entries and its counts. It accepts and refuses exactly what
// proto.Unmarshal of a RateLimitQuotaUsageReports does (FuzzDecodeQuotaReports): strings must be
// valid UTF-8, a field of a known number with another wire type is an unknown field, a message
// field given twice is merged, a scalar given twice keeps the last.

// Field numbers of envoy.service.rate_limit_quota.v3 (checked against the generated descriptors by
// TestQuotaReportFields).
const (
	reportsDomainField  = 1 // RateLimitQuotaUsageReports.domain
	reportsUsagesField  = 2 // RateLimitQuotaUsageReports.bucket_quota_usages
	usageBucketIDField  = 1 // BucketQuotaUsage.bucket_id
	usageElapsedField   = 2 // BucketQuotaUsage.time_elapsed (google.protobuf.Duration)
	usageAllowedField   = 3 // BucketQuotaUsage.num_requests_allowed
	usageDeniedField    = 4 // BucketQuotaUsage.num_requests_denied
	bucketIDBucketField = 1 // BucketId.bucket, map<string, string>
	mapKeyField         = 1
	mapValueField       = 2
)

// quotaReports is a decoded usage report message. Its byte slices point into the message.
type quotaReports struct {
	domain  []byte
	usages  []quotaUsage
	entries []idEntry // every usage's bucket id entries, each usage's in a range of its own
}

// quotaUsage is one usage: its bucket id is entries[from:to] of its message (keys distinct, the
// last value given for a key).
type quotaUsage struct {
	from, to        int
	allowed, denied uint64
}

type idEntry struct{ k, v []byte }

// errTooManyEntries is a usage whose bucket id has more than MaxEnvoyEntries entries: the decoder
// stops there (validate says which usage).
var errTooManyEntries = errors.New("too many bucket_id entries")

// decodeQuotaReports decodes b into r, reusing r's slices.
func decodeQuotaReports(b []byte, r *quotaReports) error {
	r.domain, r.usages, r.entries = nil, r.usages[:0], r.entries[:0]
	return checkwire.ForFields(b, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		switch {
		case num == reportsDomainField && typ == protowire.BytesType:
			if !utf8.Valid(v) {
				return errors.New("domain is not valid UTF-8")
			}
			r.domain = v
		case num == reportsUsagesField && typ == protowire.BytesType:
			u := quotaUsage{from: len(r.entries), to: len(r.entries)}
			if err := r.decodeUsage(v, &u); err != nil {
				return fmt.Errorf("usage %d: %w", len(r.usages), err)
			}
			r.usages = append(r.usages, u)
		}
		return nil
	})
}

func (r *quotaReports) decodeUsage(b []byte, u *quotaUsage) error {
	return checkwire.ForFields(b, func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error {
		switch {
		case num == usageBucketIDField && typ == protowire.BytesType:
			return checkwire.ForFields(v, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
				if num == bucketIDBucketField && typ == protowire.BytesType {
					return r.decodeEntry(v, u)
				}
				return nil
			})
		case num == usageElapsedField && typ == protowire.BytesType:
			return checkwire.ForFields(v, func(protowire.Number, protowire.Type, []byte, uint64) error { return nil })
		case num == usageAllowedField && typ == protowire.VarintType:
			u.allowed = x
		case num == usageDeniedField && typ == protowire.VarintType:
			u.denied = x
		}
		return nil
	})
}

// decodeEntry adds one map entry of a bucket id to u: a key given before takes the new value.
func (r *quotaReports) decodeEntry(b []byte, u *quotaUsage) error {
	var e idEntry
	err := checkwire.ForFields(b, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		if typ != protowire.BytesType || num != mapKeyField && num != mapValueField {
			return nil
		}
		if !utf8.Valid(v) {
			return errors.New("bucket_id entry is not valid UTF-8")
		}
		if num == mapKeyField {
			e.k = v
		} else {
			e.v = v
		}
		return nil
	})
	if err != nil {
		return err
	}
	for i := u.from; i < u.to; i++ {
		if bytes.Equal(r.entries[i].k, e.k) {
			r.entries[i].v = e.v
			return nil
		}
	}
	if u.to-u.from == MaxEnvoyEntries {
		return errTooManyEntries
	}
	r.entries = append(r.entries, e)
	u.to++
	return nil
}

// appendEntriesSig appends the signature of the bucket id entries es (keys distinct) to b: a
// bucket id's identity, its entries sorted by key (the order of a bucket id's entries does not
// matter), each key and value preceded by its length, so no two ids share one. Every usage of
// every report computes it, into a buffer the stream reuses: it allocates nothing.
func appendEntriesSig(b []byte, es []idEntry) []byte {
	var small [MaxEnvoyEntries]idEntry
	sorted := append(small[:0], es...)
	slices.SortFunc(sorted, func(x, y idEntry) int { return bytes.Compare(x.k, y.k) })
	for _, e := range sorted {
		b = protowire.AppendVarint(b, uint64(len(e.k)))
		b = append(b, e.k...)
		b = protowire.AppendVarint(b, uint64(len(e.v)))
		b = append(b, e.v...)
	}
	return b
}

// idMap is the bucket id of the entries es, as the generated code would have decoded it.
func idMap(es []idEntry) map[string]string {
	m := make(map[string]string, len(es))
	for _, e := range es {
		m[string(e.k)] = string(e.v)
	}
	return m
}
