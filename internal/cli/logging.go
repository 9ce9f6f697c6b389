package cli

import (
	"fmt"
	"io"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Logging is what --log-level and --log-format say.
type Logging struct {
	Level  string // debug, info, warn or error
	Format string // json or console
}

// LogFlags defines --log-level (LEASEBUCKET_LOG_LEVEL) and --log-format (LEASEBUCKET_LOG_FORMAT);
// Parse rejects values NewLogger could not use.
func (f *Flags) LogFlags(l *Logging) {
	f.EnvString(&l.Level, "log-level", "LEASEBUCKET_LOG_LEVEL", "info", "log `level`: debug, info, warn or error")
	f.EnvString(&l.Format, "log-format", "LEASEBUCKET_LOG_FORMAT", "json",
		"log `format` on stderr: json (one object per line) or console (for people)")
	f.logging = l
}

func (l Logging) check() error {
	if _, err := zapcore.ParseLevel(l.Level); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	if l.Format != "json" && l.Format != "console" {
		return fmt.Errorf("--log-format %q: want json or console", l.Format)
	}
	return nil
}

// NewLogger returns a logger writing to w at l.Level or above, as JSON lines or, with the
// console format, as human-readable lines; opts are applied after (zap.AddCaller, zap.WrapCore
// for sampling).
func (l Logging) NewLogger(w io.Writer, opts ...zap.Option) (*zap.Logger, error) {
	if err := l.check(); err != nil {
		return nil, err
	}
	level, _ := zapcore.ParseLevel(l.Level)
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	var encoder zapcore.Encoder
	if l.Format == "console" {
		enc.EncodeLevel = zapcore.CapitalLevelEncoder
		encoder = zapcore.NewConsoleEncoder(enc)
	} else {
		encoder = zapcore.NewJSONEncoder(enc)
	}
	return zap.New(zapcore.NewCore(encoder, zapcore.Lock(zapcore.AddSync(w)), level), opts...), nil
}
