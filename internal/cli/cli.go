// Package cli holds what leasebucket's commands share: the signal handling and exit status of
// main, flags whose defaults come from environment variables, and the logger that --log-level
// and --log-format configure.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Main calls run with a context that SIGINT or SIGTERM cancels. If run fails, Main prints
// "name: error" on stderr and exits with status 1.
func Main(name string, run func(ctx context.Context) error) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, name+":", err)
		os.Exit(1)
	}
}

// Flags is a command's flag set in which a flag may take its default from an environment
// variable; a flag on the command line wins over the variable. The usage names each variable in
// brackets after the flag's help.
type Flags struct {
	*flag.FlagSet
	getenv func(string) string
	envErr error
}

// NewFlags returns the flags of the command name. Errors and the usage, header followed by the
// flags and their defaults, go to stderr; getenv reads the environment.
func NewFlags(name, header string, getenv func(string) string, stderr io.Writer) *Flags {
	f := &Flags{FlagSet: flag.NewFlagSet(name, flag.ContinueOnError), getenv: getenv}
	f.SetOutput(stderr)
	f.Usage = func() {
		fmt.Fprint(f.Output(), header)
		f.PrintDefaults()
	}
	return f
}

// Parse parses args. It returns the error of the command line (flag.ErrHelp when help was asked
// for and printed) or else those of the environment variables that did not parse.
func (f *Flags) Parse(args []string) error {
	if err := f.FlagSet.Parse(args); err != nil {
		return err
	}
	return f.envErr
}

// EnvString defines a string flag whose default is the variable env when that is set.
func (f *Flags) EnvString(p *string, name, env, def, usage string) {
	f.StringVar(p, name, envDefault(f, env, def, func(v string) (string, error) { return v, nil }), withEnv(usage, env))
}

// EnvDuration defines a duration flag whose default is the variable env when that is set.
func (f *Flags) EnvDuration(p *time.Duration, name, env string, def time.Duration, usage string) {
	f.DurationVar(p, name, envDefault(f, env, def, time.ParseDuration), withEnv(usage, env))
}

// EnvInt defines an int flag whose default is the variable env when that is set.
func (f *Flags) EnvInt(p *int, name, env string, def int, usage string) {
	f.IntVar(p, name, envDefault(f, env, def, strconv.Atoi), withEnv(usage, env))
}

// EnvFloat64 defines a float64 flag whose default is the variable env when that is set.
func (f *Flags) EnvFloat64(p *float64, name, env string, def float64, usage string) {
	f.Float64Var(p, name, envDefault(f, env, def, func(v string) (float64, error) { return strconv.ParseFloat(v, 64) }),
		withEnv(usage, env))
}

// EnvBool defines a bool flag whose default is the variable env when that is set.
func (f *Flags) EnvBool(p *bool, name, env string, def bool, usage string) {
	f.BoolVar(p, name, envDefault(f, env, def, strconv.ParseBool), withEnv(usage, env))
}

// envDefault is the value of the variable env, or def when env is empty or does not parse; an
// error of the latter kind is kept for Parse.
func envDefault[T any](f *Flags, env string, def T, parse func(string) (T, error)) T {
	v := f.getenv(env)
	if v == "" {
		return def
	}
	x, err := parse(v)
	if err != nil {
		f.envErr = errors.Join(f.envErr, fmt.Errorf("%s=%q: %w", env, v, err))
		return def
	}
	return x
}

func withEnv(usage, env string) string { return usage + " [" + env + "]" }

// Logging is what --log-level and --log-format say.
type Logging struct {
	Level  string // debug, info, warn or error
	Format string // json or console
}

// LogFlags defines --log-level (LEASEBUCKET_LOG_LEVEL) and --log-format (LEASEBUCKET_LOG_FORMAT).
func (f *Flags) LogFlags(l *Logging) {
	f.EnvString(&l.Level, "log-level", "LEASEBUCKET_LOG_LEVEL", "info", "debug, info, warn or error")
	f.EnvString(&l.Format, "log-format", "LEASEBUCKET_LOG_FORMAT", "json", "json or console")
}

// NewLogger returns a logger writing to w at l.Level or above, as JSON lines or, with the
// console format, as human-readable lines.
func (l Logging) NewLogger(w io.Writer) (*zap.Logger, error) {
	level, err := zapcore.ParseLevel(l.Level)
	if err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	var encoder zapcore.Encoder
	switch l.Format {
	case "json":
		encoder = zapcore.NewJSONEncoder(enc)
	case "console":
		enc.EncodeLevel = zapcore.CapitalLevelEncoder
		encoder = zapcore.NewConsoleEncoder(enc)
	default:
		return nil, fmt.Errorf("--log-format %q: want json or console", l.Format)
	}
	return zap.New(zapcore.NewCore(encoder, zapcore.AddSync(w), level)), nil
}
