package agent

import (
	"errors"
	"fmt"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/leasebucket/leasebucket/internal/checkwire"
)

// A CheckStream message is decoded and its answer encoded here rather than by the generated code:
// with gRPC's cost spread over a message of many checks, the generated decoder (a message and
// three strings per check, through reflection) and the answer's message per check were a fifth of
// the agent's CPU per streamed check. The stream receives a message as an empty message (all of
// it kept as unknown fields, one copy), decodeCheckStream reads it straight into the checks'
// slots, and appendStreamAnswer writes the answer's bytes, sent as the unknown fields of an empty
// CheckStreamResponse.
//
// decodeCheckStream accepts and refuses exactly what proto.Unmarshal of a CheckStreamRequest does
// and reads the same values (FuzzDecodeCheckStream): strings must be valid UTF-8, a field of a
// known number with another wire type is an unknown field, a scalar given twice keeps the last,
// each checks field is one more check. appendStreamAnswer writes the bytes proto.Marshal writes
// for the message answers builds (TestStreamAnswerBytes).

// Field numbers of leasebucket.agent.v1, the names this file reads best with (checkwire checks
// them against the generated descriptors).
const (
	streamIDField      = checkwire.StreamIDField
	streamChecksField  = checkwire.StreamChecksField
	streamPartialField = checkwire.StreamPartialField
	streamResultsField = checkwire.StreamResultsField
	streamErrorsField  = checkwire.StreamErrorsField
	streamIndexesField = checkwire.StreamIndexesField

	checkTenantField    = checkwire.CheckTenantField
	checkRouteField     = checkwire.CheckRouteField
	checkOperationField = checkwire.CheckOperationField
	checkCostField      = checkwire.CheckCostField
	checkIdemKeyField   = checkwire.CheckIdemKeyField
	checkSettleField    = checkwire.CheckSettleField
	checkBriefField     = checkwire.CheckBriefField

	respDecisionField   = checkwire.RespDecisionField
	respDegradedField   = checkwire.RespDegradedField
	respRetryAfterField = checkwire.RespRetryAfterField
	respRemainingField  = checkwire.RespRemainingField
	respLimitField      = checkwire.RespLimitField
	respWindowField     = checkwire.RespWindowField
	respResetField      = checkwire.RespResetField
	respRuleField       = checkwire.RespRuleField
	respShadowDenyField = checkwire.RespShadowDenyField
	respReplayedField   = checkwire.RespReplayedField
	respSettleIDField   = checkwire.RespSettleIDField
)

// streamDecoder decodes one stream's messages. Routes, operations and the busiest tenants repeat
// from check to check: each has a table of the first checkwire.MaxShared distinct ones to share
// (a string found there is valid UTF-8 already); the others, and idempotency keys, are allocated
// per check. The slots of a message answered at once are handed back (release) and decode the
// next message: a message whose checks all find a lease allocates no slots.
type streamDecoder struct {
	routes, operations, tenants checkwire.Strings
	spare                       []slot // zeroed slots released by the last message answered at once
}

// release hands back the slots of a message nothing refers to any more (answered, its answer
// encoded, no check waiting), zeroed so that they keep nothing alive.
func (d *streamDecoder) release(slots []slot) {
	clear(slots)
	d.spare = slots[:0]
}

// slots returns n zeroed slots: the spare ones if they are enough.
func (d *streamDecoder) slots(n int) []slot {
	if cap(d.spare) < n {
		return make([]slot, n)
	}
	s := d.spare[:n]
	d.spare = nil
	return s
}

// streamMessage is a decoded CheckStreamRequest.
type streamMessage struct {
	id      uint64
	n       int    // its checks
	partial bool   // the caller reads partial answers
	slots   []slot // one per check; nil when n is more than MaxBatchChecks
}

// decodeCheckStream decodes the CheckStreamRequest b: its id, partial flag, number of checks and,
// unless there are more than MaxBatchChecks, one slot per check.
func (d *streamDecoder) decodeCheckStream(b []byte) (m streamMessage, err error) {
	err = checkwire.ForFields(b, func(num protowire.Number, typ protowire.Type, _ []byte, x uint64) error {
		switch {
		case num == streamIDField && typ == protowire.VarintType:
			m.id = x
		case num == streamPartialField && typ == protowire.VarintType:
			m.partial = x != 0
		case num == streamChecksField && typ == protowire.BytesType:
			m.n++
		}
		return nil
	})
	if err != nil || m.n > MaxBatchChecks {
		return m, err
	}
	m.slots = d.slots(m.n)
	i := 0
	err = checkwire.ForFields(b, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		if num != streamChecksField || typ != protowire.BytesType {
			return nil
		}
		if err := d.decodeCheck(v, &m.slots[i]); err != nil {
			return fmt.Errorf("check %d: %w", i, err)
		}
		i++
		return nil
	})
	return m, err
}

// decodeCheck decodes one CheckRequest into sl.
func (d *streamDecoder) decodeCheck(b []byte, sl *slot) error {
	return checkwire.ForFields(b, func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error {
		if typ == protowire.VarintType {
			switch num {
			case checkCostField:
				sl.q.Cost = int64(x)
			case checkSettleField:
				sl.q.Settle = x != 0
			case checkBriefField:
				sl.brief = x != 0
			}
			return nil
		}
		ok := true
		switch num {
		case checkTenantField:
			sl.q.Tenant, ok = d.tenants.Get(v)
		case checkRouteField:
			sl.q.Path, ok = d.routes.Get(v)
		case checkOperationField:
			sl.q.Operation, ok = d.operations.Get(v)
		case checkIdemKeyField:
			if ok = utf8.Valid(v); ok {
				sl.key = string(v)
			}
		}
		if !ok {
			return errors.New("a string field is not valid UTF-8")
		}
		return nil
	})
}

// appendStreamAnswer appends the CheckStreamResponse of message id to b. With idx nil it answers
// every slot; else the slots idx names (ascending), and lists idx as the response's indexes.
// Each answered slot has a result and, if any of them has an error, an error string ("" for
// none), as answers builds them. A slot whose error is not one check's (a shutdown, a caller
// gone away) fails the whole message.
func (s *Server) appendStreamAnswer(b []byte, id uint64, slots []slot, idx []uint32) ([]byte, error) {
	if id != 0 {
		b = checkwire.AppendTag(b, streamIDField, protowire.VarintType)
		b = checkwire.AppendVarint(b, id)
	}
	n := len(slots)
	if idx != nil {
		n = len(idx)
	}
	at := func(k int) *slot {
		if idx == nil {
			return &slots[k]
		}
		return &slots[idx[k]]
	}
	someError := false
	for k := range n {
		sl := at(k)
		b = checkwire.AppendTag(b, streamResultsField, protowire.BytesType)
		if sl.err != nil {
			if !invalidCheck(sl.err) && !errors.Is(sl.err, ErrIdempotencyPending) {
				return nil, s.statusError(sl.err)
			}
			someError = true
			b = append(b, 0) // an empty result
			continue
		}
		b = appendAnswer(b, answerOf(sl.v, sl.brief), sl.replayed)
	}
	if someError { // else no errors list: no check answered has an error
		for k := range n {
			var msg string
			if err := at(k).err; err != nil {
				msg = err.Error()
			}
			b = checkwire.AppendTag(b, streamErrorsField, protowire.BytesType)
			b = protowire.AppendString(b, msg)
		}
	}
	if len(idx) > 0 { // packed, as proto.Marshal writes a repeated scalar of proto3
		size := 0
		for _, i := range idx {
			size += protowire.SizeVarint(uint64(i))
		}
		b = checkwire.AppendTag(b, streamIndexesField, protowire.BytesType)
		b = checkwire.AppendVarint(b, uint64(size))
		for _, i := range idx {
			b = checkwire.AppendVarint(b, uint64(i))
		}
	}
	return b, nil
}

// appendAnswer appends a as a length-delimited CheckResponse: its fields in number order, those
// at their zero value left out (proto3), as proto.Marshal writes them.
func appendAnswer(b []byte, a answer, replayed bool) []byte {
	b = append(b, 0) // the length, one byte unless the answer is 128 bytes or more
	start := len(b)
	varint := func(num protowire.Number, x uint64) {
		if x != 0 {
			b = checkwire.AppendTag(b, num, protowire.VarintType)
			b = checkwire.AppendVarint(b, x)
		}
	}
	flag := func(num protowire.Number, set bool) {
		if set {
			varint(num, 1)
		}
	}
	varint(respDecisionField, uint64(a.decision))
	flag(respDegradedField, a.degraded)
	varint(respRetryAfterField, uint64(a.retryAfterMs))
	varint(respRemainingField, uint64(a.remaining))
	varint(respLimitField, uint64(a.limit))
	varint(respWindowField, uint64(a.windowMs))
	varint(respResetField, uint64(a.resetMs))
	if a.rule != "" {
		b = checkwire.AppendTag(b, respRuleField, protowire.BytesType)
		b = append(checkwire.AppendVarint(b, uint64(len(a.rule))), a.rule...)
	}
	flag(respShadowDenyField, a.shadowDeny)
	flag(respReplayedField, replayed)
	varint(respSettleIDField, a.settleID)
	n := len(b) - start
	if n < 0x80 {
		b[start-1] = byte(n)
		return b
	}
	// A longer answer (a long rule name): its length takes more bytes; move the answer up.
	k := protowire.SizeVarint(uint64(n))
	b = append(b, make([]byte, k-1)...)
	copy(b[start+k-1:], b[start:start+n])
	checkwire.AppendVarint(b[start-1:start-1], uint64(n))
	return b
}
