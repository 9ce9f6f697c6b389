package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"time"

	"go.uber.org/zap"
)

// Flags is a command's flag set in which a flag may take its default from an environment
// variable; a flag on the command line wins over the variable. Renamed flags and variables keep
// working under their old names for one release: Deprecated lists the old names used, and the
// usage lists them apart.
type Flags struct {
	*flag.FlagSet
	header string
	getenv func(string) string
	envErr error

	env         map[string]string // flag name → its environment variable
	envRead     map[string]bool   // variables read so far
	renamedEnv  map[string]string // new variable → old variable
	renamedFlag map[string]string // old flag name → new flag name
	deprecated  []Deprecation
	logging     *Logging
}

// NewFlags returns the flags of the command name. Errors and the usage go to stderr: the usage
// is header, then the flags (see PrintUsage). By convention header is
//
//	Usage: NAME [flags] ARGS
//
//	What the command does, in a paragraph or two.
//
//	Flags:
//
// getenv reads the environment.
func NewFlags(name, header string, getenv func(string) string, stderr io.Writer) *Flags {
	f := &Flags{
		FlagSet: flag.NewFlagSet(name, flag.ContinueOnError), header: header, getenv: getenv,
		env: map[string]string{}, envRead: map[string]bool{}, renamedEnv: map[string]string{}, renamedFlag: map[string]string{},
	}
	f.SetOutput(stderr)
	f.Usage = f.PrintUsage
	return f
}

// Parse parses args. It returns the error of the command line (flag.ErrHelp when help was asked
// for and printed), else those of the environment variables that did not parse, of a flag given
// under both its names, and of the log flags.
func (f *Flags) Parse(args []string) error {
	if err := f.FlagSet.Parse(args); err != nil {
		return err
	}
	errs := []error{f.envErr}
	set := map[string]bool{}
	f.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	f.Visit(func(fl *flag.Flag) {
		nw, ok := f.renamedFlag[fl.Name]
		switch {
		case !ok:
		case set[nw]:
			errs = append(errs, fmt.Errorf("--%s and --%s are one flag (the first its old name): use --%s", fl.Name, nw, nw))
		default:
			f.deprecated = append(f.deprecated, Deprecation{Old: "--" + fl.Name, New: "--" + nw})
		}
	})
	if f.logging != nil {
		errs = append(errs, f.logging.check())
	}
	return errors.Join(errs...)
}

// Deprecation is an old name of a flag or environment variable that was used.
type Deprecation struct {
	Old, New string // "--policy-poll", "--policy-interval"
}

func (d Deprecation) String() string {
	return d.Old + " is deprecated and goes in the next release: use " + d.New
}

// Deprecated returns the old names the command line and the environment used, once Parse
// returned.
func (f *Flags) Deprecated() []Deprecation { return slices.Clone(f.deprecated) }

// WarnDeprecated logs each deprecation as a warning.
func WarnDeprecated(log *zap.Logger, ds []Deprecation) {
	for _, d := range ds {
		log.Warn(d.String(), zap.String("deprecated", d.Old), zap.String("use", d.New))
	}
}

// PrintDeprecated writes each deprecation as a line "name: warning: ..." to w, for commands
// without a logger.
func PrintDeprecated(w io.Writer, name string, ds []Deprecation) {
	for _, d := range ds {
		fmt.Fprintf(w, "%s: warning: %s\n", name, d)
	}
}

// Rename keeps old as a deprecated name of the flag nw, defined before: old sets the same value,
// is left out of the flag list and is reported by Deprecated when used. Giving both is an error.
func (f *Flags) Rename(old, nw string) {
	fl := f.Lookup(nw)
	if fl == nil {
		panic("cli: Rename(" + old + ", " + nw + "): no flag " + nw)
	}
	f.Var(fl.Value, old, "deprecated: use --"+nw)
	f.renamedFlag[old] = nw
}

// RenameEnv keeps the variable old as a deprecated name of nw: where nw is unset, old's value is
// the default and the use is reported by Deprecated; setting both is an error. Call it before
// defining the flag that reads nw.
func (f *Flags) RenameEnv(old, nw string) {
	if f.envRead[nw] {
		panic("cli: RenameEnv(" + old + ", " + nw + ") after the flag that reads " + nw)
	}
	f.renamedEnv[nw] = old
}

// Env returns the environment variable of the flag name, "" if it has none.
func (f *Flags) Env(name string) string { return f.env[name] }

// EnvVars returns every environment variable the flags read, old names included, sorted.
func (f *Flags) EnvVars() []string {
	var vs []string
	for _, v := range f.env {
		vs = append(vs, v)
		if old := f.renamedEnv[v]; old != "" {
			vs = append(vs, old)
		}
	}
	slices.Sort(vs)
	return vs
}

// EnvString defines a string flag whose default is the variable env when that is set.
func (f *Flags) EnvString(p *string, name, env, def, usage string) {
	f.StringVar(p, name, envDefault(f, name, env, def, func(v string) (string, error) { return v, nil }), usage)
}

// EnvDuration defines a duration flag whose default is the variable env when that is set.
func (f *Flags) EnvDuration(p *time.Duration, name, env string, def time.Duration, usage string) {
	f.DurationVar(p, name, envDefault(f, name, env, def, time.ParseDuration), usage)
}

// EnvInt defines an int flag whose default is the variable env when that is set.
func (f *Flags) EnvInt(p *int, name, env string, def int, usage string) {
	f.IntVar(p, name, envDefault(f, name, env, def, strconv.Atoi), usage)
}

// EnvFloat64 defines a float64 flag whose default is the variable env when that is set.
func (f *Flags) EnvFloat64(p *float64, name, env string, def float64, usage string) {
	f.Float64Var(p, name, envDefault(f, name, env, def, func(v string) (float64, error) { return strconv.ParseFloat(v, 64) }), usage)
}

// EnvBool defines a bool flag whose default is the variable env when that is set.
func (f *Flags) EnvBool(p *bool, name, env string, def bool, usage string) {
	f.BoolVar(p, name, envDefault(f, name, env, def, strconv.ParseBool), usage)
}

// envDefault is the value of the variable env (or of its old name), or def when neither is set
// or the value does not parse; an error of the latter kind is kept for Parse.
func envDefault[T any](f *Flags, name, env string, def T, parse func(string) (T, error)) T {
	f.env[name] = env
	f.envRead[env] = true
	v, from := f.getenv(env), env
	if old := f.renamedEnv[env]; old != "" {
		switch ov := f.getenv(old); {
		case ov == "":
		case v != "":
			f.envErr = errors.Join(f.envErr, fmt.Errorf("%s and %s are both set (the first is the old name of the second): set %s only", old, env, env))
			return def
		default:
			v, from = ov, old
			f.deprecated = append(f.deprecated, Deprecation{Old: old, New: env})
		}
	}
	if v == "" {
		return def
	}
	x, err := parse(v)
	if err != nil {
		f.envErr = errors.Join(f.envErr, fmt.Errorf("%s=%q: %w", from, v, err))
		return def
	}
	return x
}
