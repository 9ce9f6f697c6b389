package audit

import (
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// JSONSink writes one JSON object per record with zap (docs/audit.md lists the fields):
//
//	{"ts":"2026-12-02T13:55:01.123456789Z","agent_id":"node-7-4121-9f3c","api":"check",
//	 "decision":"deny","rule":"orders-read","route":"/orders/{id}","operation":"read",
//	 "tenant":"acme","cost":1,"retry_after_ms":600,"remaining":0,"degraded":false,
//	 "shadow":false,"replayed":false,"priority":"high"}
//
// Nothing written names a store, a shard or a coordinator address, and the raw request path is
// never written (only its template).
type JSONSink struct {
	core   zapcore.Core
	ws     zapcore.WriteSyncer
	fields []zap.Field // reused: Write is called from one goroutine at a time, and zap's JSON core encodes the fields before Write returns
}

// NewJSONSink writes to ws, every record carrying agentID.
func NewJSONSink(ws zapcore.WriteSyncer, agentID string) *JSONSink {
	enc := zapcore.NewJSONEncoder(zapcore.EncoderConfig{
		TimeKey:        "ts",
		EncodeTime:     func(t time.Time, e zapcore.PrimitiveArrayEncoder) { e.AppendString(t.UTC().Format(time.RFC3339Nano)) },
		EncodeDuration: zapcore.MillisDurationEncoder,
		LineEnding:     zapcore.DefaultLineEnding,
	})
	core := zapcore.NewCore(enc, ws, zapcore.InfoLevel).With([]zap.Field{zap.String("agent_id", agentID)})
	return &JSONSink{core: core, ws: ws, fields: make([]zap.Field, 0, 16)}
}

// Write implements Sink.
func (s *JSONSink) Write(r *Record) error {
	// The core directly rather than a Logger: the record's own time, and the write's error.
	s.fields = append(s.fields[:0],
		zap.String("api", r.API),
		zap.String("decision", r.Decision),
		zap.String("rule", r.Rule),
		zap.String("route", r.Route),
		zap.String("operation", r.Operation),
		zap.String("tenant", r.Tenant),
		zap.Int64("cost", r.Cost),
		zap.Int64("retry_after_ms", retryMs(r)),
		zap.Int64("remaining", r.Remaining),
		zap.Bool("degraded", r.Degraded),
		zap.Bool("shadow", r.Shadow),
		zap.Bool("replayed", r.Replayed),
		zap.String("priority", r.Priority.String()),
	)
	return s.core.Write(zapcore.Entry{Level: zapcore.InfoLevel, Time: r.Time}, s.fields)
}

// retryMs is the Retry-After in milliseconds, rounded up as the check's response says it.
func retryMs(r *Record) int64 {
	if r.RetryAfter <= 0 {
		return 0
	}
	return int64((r.RetryAfter + time.Millisecond - 1) / time.Millisecond)
}

// Sync implements Sink.
func (s *JSONSink) Sync() error { return s.ws.Sync() }
