package bucket

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/cockroachdb/datadriven"
)

// TestDataDriven runs the specification files in testdata/spec: each command acts on one bucket.
//
//	limit capacity=C amount=A period=P   shape the bucket (amounts in µ, or in tokens with a t suffix)
//	full now=T                            a fresh (or expired) bucket
//	take now=T want=W min=M [share=S]     State.TakeShare
//	return now=T amount=A granted_at=G    State.Return
//	charge now=T amount=A max_debt=D      State.Charge (a cost settled after the fact)
//	refill now=T                          State.Refill
//	state                                 tokens, last refill and time to full
func TestDataDriven(t *testing.T) {
	datadriven.Walk(t, "testdata/spec", func(t *testing.T, path string) {
		var (
			l Limit
			s State
		)
		datadriven.RunTest(t, path, func(t *testing.T, d *datadriven.TestData) string {
			switch d.Cmd {
			case "limit":
				var err error
				l, err = NewLimit(Micro(micros(t, d, "capacity")), Micro(micros(t, d, "amount")), Millis(micros(t, d, "period")))
				if err != nil {
					return "error: " + err.Error()
				}
				return fmt.Sprintf("%s fill=%dms", l, l.FillTime())
			case "full":
				s = Full(l, Millis(micros(t, d, "now")))
				return show(l, s)
			case "take":
				share := int64(WholeShare)
				if d.HasArg("share") {
					share = micros(t, d, "share")
				}
				unit := int64(1)
				if d.HasArg("unit") {
					unit = micros(t, d, "unit")
				}
				r := s.TakeShare(l, Millis(micros(t, d, "now")), Micro(micros(t, d, "want")), Micro(micros(t, d, "min")), share, Micro(unit))
				return fmt.Sprintf("granted=%s remaining=%s retry=%s", tok(r.Granted), tok(r.Remaining), ms(r.RetryAfter))
			case "return":
				r := s.Return(l, Millis(micros(t, d, "now")), Micro(micros(t, d, "amount")), Millis(micros(t, d, "granted_at")))
				return fmt.Sprintf("credited=%s remaining=%s", tok(r.Granted), tok(r.Remaining))
			case "charge":
				r := s.Charge(l, Millis(micros(t, d, "now")), Micro(micros(t, d, "amount")), Micro(micros(t, d, "max_debt")))
				return fmt.Sprintf("charged=%s remaining=%s", tok(r.Granted), tok(r.Remaining))
			case "refill":
				s.Refill(l, Millis(micros(t, d, "now")))
				return show(l, s)
			case "state":
				return show(l, s)
			default:
				d.Fatalf(t, "unknown command %q", d.Cmd)
				return ""
			}
		})
	})
}

// micros reads an integer argument; a "t" suffix means whole tokens.
func micros(t *testing.T, d *datadriven.TestData, key string) int64 {
	t.Helper()
	var v string
	d.ScanArgs(t, key, &v)
	mult := int64(1)
	if s, ok := strings.CutSuffix(v, "t"); ok {
		v, mult = s, int64(PerToken)
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		d.Fatalf(t, "%s=%q: %v", key, v, err)
	}
	return n * mult
}

// tok prints microtokens, as tokens when whole.
func tok(m Micro) string {
	if m%PerToken == 0 {
		return fmt.Sprintf("%dt", m/PerToken)
	}
	return fmt.Sprintf("%dµ", m)
}

func ms(m Millis) string {
	if m == Never {
		return "never"
	}
	return fmt.Sprintf("%dms", m)
}

func show(l Limit, s State) string {
	ttf, ok := s.TimeToFull(l)
	full := "never"
	if ok {
		full = ms(ttf)
	}
	frac := ""
	if s.Frac != 0 {
		_, den := l.Rate()
		frac = fmt.Sprintf(" frac=%d/%dµ", s.Frac, den)
	}
	return fmt.Sprintf("tokens=%s%s last=%dms full-in=%s", tok(s.Tokens), frac, s.Last, full)
}
