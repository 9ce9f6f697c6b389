// Package checkwire is the wire format of the agent's CheckStream, written and read by hand
// rather than by the generated code, on both ends: the agent decodes requests and encodes answers
// (agent/stream_codec.go), a caller encodes requests and decodes answers (here: the client
// package and the stack benchmark's load generator use it).
//
// Why by hand: a streamed check's share of gRPC is small, and the generated code's per-check
// work (a message per check, a string per field, through reflection) is then a large part of
// what a check costs either end. A caller that decodes an answer here gets each result as a
// value, its rule name shared between answers, and one allocation per message at most.
//
// Every function here reads and writes exactly what proto.Marshal and proto.Unmarshal do for
// leasebucket.agent.v1's messages (FuzzDecodeAnswer, TestAppendRequestBytes), so either end can
// talk to a peer that uses the generated code.
package checkwire

import (
	"errors"
	"fmt"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
)

// Field numbers of leasebucket.agent.v1 (checked against the generated descriptors by
// TestFieldNumbers).
const (
	StreamIDField      = 1 // CheckStreamRequest.id, CheckStreamResponse.id
	StreamChecksField  = 2 // CheckStreamRequest.checks
	StreamPartialField = 3 // CheckStreamRequest.partial
	StreamResultsField = 2 // CheckStreamResponse.results
	StreamErrorsField  = 3 // CheckStreamResponse.errors
	StreamIndexesField = 4 // CheckStreamResponse.indexes

	CheckTenantField    = 1 // CheckRequest.tenant
	CheckRouteField     = 2 // CheckRequest.route
	CheckOperationField = 3 // CheckRequest.operation
	CheckCostField      = 4 // CheckRequest.cost
	CheckIdemKeyField   = 5 // CheckRequest.idempotency_key
	CheckSettleField    = 6 // CheckRequest.settle
	CheckBriefField     = 7 // CheckRequest.brief

	RespDecisionField   = 1  // CheckResponse.decision
	RespDegradedField   = 2  // CheckResponse.degraded
	RespRetryAfterField = 3  // CheckResponse.retry_after_ms
	RespRemainingField  = 4  // CheckResponse.remaining
	RespLimitField      = 5  // CheckResponse.limit
	RespWindowField     = 6  // CheckResponse.window_ms
	RespResetField      = 7  // CheckResponse.reset_ms
	RespRuleField       = 8  // CheckResponse.rule
	RespShadowDenyField = 9  // CheckResponse.shadow_deny
	RespReplayedField   = 10 // CheckResponse.replayed
	RespSettleIDField   = 11 // CheckResponse.settle_id
)

// ForFields calls f with each varint and length-delimited field of the message b in order (the
// other wire types are skipped, as a reader of these messages ignores them); v is a
// length-delimited field's bytes, x a varint's value. It fails as proto.Unmarshal fails on b's
// framing: a malformed tag or value, a field number out of range, an unmatched group.
func ForFields(b []byte, f func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error) error {
	for len(b) > 0 {
		num, typ, n := consumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		if num > protowire.MaxValidNumber {
			return fmt.Errorf("field number %d", num)
		}
		b = b[n:]
		var v []byte
		var x uint64
		switch typ {
		case protowire.BytesType:
			if len(b) > 0 && b[0] < 0x80 && int(b[0]) < len(b) { // a length of one byte, all there
				v, n = b[1:1+b[0]], 1+int(b[0])
			} else {
				v, n = protowire.ConsumeBytes(b)
			}
		case protowire.VarintType:
			x, n = consumeVarint(b)
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if typ == protowire.BytesType || typ == protowire.VarintType {
			if err := f(num, typ, v, x); err != nil {
				return err
			}
		}
	}
	return nil
}

// consumeVarint is protowire.ConsumeVarint with a one-byte varint (most tags, lengths and small
// values here) read inline.
func consumeVarint(b []byte) (uint64, int) {
	if len(b) > 0 && b[0] < 0x80 {
		return uint64(b[0]), 1
	}
	return protowire.ConsumeVarint(b)
}

// AppendVarint is protowire.AppendVarint with a one-byte varint appended inline.
func AppendVarint(b []byte, x uint64) []byte {
	if x < 0x80 {
		return append(b, byte(x))
	}
	return protowire.AppendVarint(b, x)
}

// AppendTag is protowire.AppendTag with a one-byte tag appended inline.
func AppendTag(b []byte, num protowire.Number, typ protowire.Type) []byte {
	return AppendVarint(b, protowire.EncodeTag(num, typ))
}

// consumeTag is protowire.ConsumeTag with a one-byte tag read inline.
func consumeTag(b []byte) (protowire.Number, protowire.Type, int) {
	if len(b) > 0 && b[0] < 0x80 && b[0]>>3 != 0 {
		return protowire.Number(b[0] >> 3), protowire.Type(b[0] & 7), 1
	}
	return protowire.ConsumeTag(b)
}

// Check is one check of a CheckStreamRequest (a CheckRequest).
type Check struct {
	Tenant         string
	Route          string
	Operation      string
	Cost           int64
	IdempotencyKey string
	Settle         bool
	Brief          bool // an allow is answered without its RateLimit fields
}

// AppendRequest appends the CheckStreamRequest of message id with checks to b, the bytes
// proto.Marshal writes for it.
func AppendRequest(b []byte, id uint64, checks []Check, partial bool) []byte {
	b = appendVarintField(b, StreamIDField, id)
	for i := range checks {
		b = appendCheck(b, &checks[i])
	}
	if partial {
		b = appendVarintField(b, StreamPartialField, 1)
	}
	return b
}

// appendCheck appends c as a length-delimited CheckRequest: its fields in number order, those at
// their zero value left out (proto3).
func appendCheck(b []byte, c *Check) []byte {
	size := stringSize(CheckTenantField, c.Tenant) + stringSize(CheckRouteField, c.Route) +
		stringSize(CheckOperationField, c.Operation) + varintSize(CheckCostField, uint64(c.Cost)) +
		stringSize(CheckIdemKeyField, c.IdempotencyKey)
	if c.Settle {
		size += varintSize(CheckSettleField, 1)
	}
	if c.Brief {
		size += varintSize(CheckBriefField, 1)
	}
	b = AppendTag(b, StreamChecksField, protowire.BytesType)
	b = AppendVarint(b, uint64(size))
	b = appendStringField(b, CheckTenantField, c.Tenant)
	b = appendStringField(b, CheckRouteField, c.Route)
	b = appendStringField(b, CheckOperationField, c.Operation)
	b = appendVarintField(b, CheckCostField, uint64(c.Cost))
	b = appendStringField(b, CheckIdemKeyField, c.IdempotencyKey)
	if c.Settle {
		b = appendVarintField(b, CheckSettleField, 1)
	}
	if c.Brief {
		b = appendVarintField(b, CheckBriefField, 1)
	}
	return b
}

func appendVarintField(b []byte, num protowire.Number, x uint64) []byte {
	if x == 0 {
		return b
	}
	b = AppendTag(b, num, protowire.VarintType)
	return AppendVarint(b, x)
}

func appendStringField(b []byte, num protowire.Number, s string) []byte {
	if s == "" {
		return b
	}
	b = AppendTag(b, num, protowire.BytesType)
	return append(AppendVarint(b, uint64(len(s))), s...)
}

func varintSize(num protowire.Number, x uint64) int {
	if x == 0 {
		return 0
	}
	return protowire.SizeTag(num) + protowire.SizeVarint(x)
}

func stringSize(num protowire.Number, s string) int {
	if s == "" {
		return 0
	}
	return protowire.SizeTag(num) + protowire.SizeBytes(len(s))
}

// Result is one CheckResponse of an answer. Decision is the leasebucket.agent.v1.Decision
// number, as received (an unknown one included).
type Result struct {
	Decision     int32
	Degraded     bool
	RetryAfterMs int64
	Remaining    int64
	Limit        int64
	WindowMs     int64
	ResetMs      int64
	Rule         string
	ShadowDeny   bool
	Replayed     bool
	SettleID     uint64
}

// Answer is a decoded CheckStreamResponse. Decode reuses its slices: what a caller keeps of one
// answer it copies before decoding the next.
type Answer struct {
	ID      uint64
	Results []Result
	Errors  []string
	Indexes []uint32
}

// MaxShared bounds the strings a Strings table keeps.
const MaxShared = 256

// Strings is a table of the strings a stream's messages repeat (routes, operations, tenants, rule
// names), so that each is allocated once: the first MaxShared distinct ones are kept and shared,
// the others allocated each time, and the last one found is looked at first. A string kept is
// valid UTF-8, so one found is not checked again. Not safe for concurrent use (one per stream
// and field).
type Strings struct {
	m    map[string]string
	last string
}

// Get returns b as a string, shared if the table keeps it, adding it while the table has room;
// ok is false when b is not valid UTF-8.
func (t *Strings) Get(b []byte) (s string, ok bool) {
	if string(b) == t.last { // no allocation for the comparisons and the lookup
		return t.last, true
	}
	if s, ok := t.m[string(b)]; ok {
		t.last = s
		return s, true
	}
	if !utf8.Valid(b) {
		return "", false
	}
	s = string(b)
	if t.m == nil {
		t.m = make(map[string]string)
	}
	if len(t.m) < MaxShared {
		t.m[s] = s
		t.last = s
	}
	return s, true
}

// Len is the number of strings the table keeps.
func (t *Strings) Len() int { return len(t.m) }

// Decoder decodes one stream's answers, their rule names shared. Not safe for concurrent use (a
// stream has one receiver).
type Decoder struct {
	rules Strings
}

var errUTF8 = errors.New("a string field is not valid UTF-8")

// Decode decodes the CheckStreamResponse b into a, replacing what a held. It accepts and refuses
// exactly what proto.Unmarshal does, and reads the same values: strings must be valid UTF-8, a
// field of a known number with another wire type is an unknown field (skipped), a scalar given
// twice keeps the last, each results or errors field is one more element, indexes are read
// packed or not.
func (d *Decoder) Decode(b []byte, a *Answer) error {
	a.ID, a.Results, a.Errors, a.Indexes = 0, a.Results[:0], a.Errors[:0], a.Indexes[:0]
	return ForFields(b, func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error {
		switch {
		case num == StreamIDField && typ == protowire.VarintType:
			a.ID = x
		case num == StreamResultsField && typ == protowire.BytesType:
			a.Results = append(a.Results, Result{})
			if err := d.decodeResult(v, &a.Results[len(a.Results)-1]); err != nil {
				return fmt.Errorf("result %d: %w", len(a.Results)-1, err)
			}
		case num == StreamErrorsField && typ == protowire.BytesType:
			if !utf8.Valid(v) {
				return errUTF8
			}
			a.Errors = append(a.Errors, string(v))
		case num == StreamIndexesField && typ == protowire.VarintType:
			a.Indexes = append(a.Indexes, uint32(x))
		case num == StreamIndexesField && typ == protowire.BytesType:
			for len(v) > 0 {
				i, n := protowire.ConsumeVarint(v)
				if n < 0 {
					return protowire.ParseError(n)
				}
				a.Indexes, v = append(a.Indexes, uint32(i)), v[n:]
			}
		}
		return nil
	})
}

// decodeResult decodes one CheckResponse into r (zero).
func (d *Decoder) decodeResult(b []byte, r *Result) error {
	return ForFields(b, func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error {
		if typ == protowire.BytesType {
			if num != RespRuleField {
				return nil
			}
			var ok bool
			if r.Rule, ok = d.rules.Get(v); !ok {
				return errUTF8
			}
			return nil
		}
		switch num {
		case RespDecisionField:
			r.Decision = int32(x)
		case RespDegradedField:
			r.Degraded = x != 0
		case RespRetryAfterField:
			r.RetryAfterMs = int64(x)
		case RespRemainingField:
			r.Remaining = int64(x)
		case RespLimitField:
			r.Limit = int64(x)
		case RespWindowField:
			r.WindowMs = int64(x)
		case RespResetField:
			r.ResetMs = int64(x)
		case RespShadowDenyField:
			r.ShadowDeny = x != 0
		case RespReplayedField:
			r.Replayed = x != 0
		case RespSettleIDField:
			r.SettleID = x
		}
		return nil
	})
}
