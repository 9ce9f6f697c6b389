package cli

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// renamed defines --interval (T_INTERVAL), once called --poll (T_POLL), and --out.
func renamed(env map[string]string, stderr io.Writer) (*Flags, *time.Duration, *string) {
	f := NewFlags("test", "Usage: test [flags]\n\nFlags:\n", func(k string) string { return env[k] }, stderr)
	var d time.Duration
	var out string
	f.RenameEnv("T_POLL", "T_INTERVAL")
	f.EnvDuration(&d, "interval", "T_INTERVAL", 2*time.Second, "how often")
	f.Rename("poll", "interval")
	f.StringVar(&out, "out", "", "output `directory`")
	return f, &d, &out
}

// TestRename: the old name of a flag or variable sets the new one's value and is reported as
// deprecated; the new names report nothing; giving both names of one setting is an error.
func TestRename(t *testing.T) {
	for _, tc := range []struct {
		name       string
		env        map[string]string
		args       []string
		want       time.Duration
		deprecated []Deprecation
		err        string
	}{
		{name: "default", want: 2 * time.Second},
		{name: "new flag", args: []string{"--interval", "3s"}, want: 3 * time.Second},
		{name: "new variable", env: map[string]string{"T_INTERVAL": "4s"}, want: 4 * time.Second},
		{name: "old flag", args: []string{"-poll", "5s"}, want: 5 * time.Second,
			deprecated: []Deprecation{{"--poll", "--interval"}}},
		{name: "old variable", env: map[string]string{"T_POLL": "6s"}, want: 6 * time.Second,
			deprecated: []Deprecation{{"T_POLL", "T_INTERVAL"}}},
		{name: "old variable, new flag wins", env: map[string]string{"T_POLL": "6s"}, args: []string{"--interval", "7s"},
			want: 7 * time.Second, deprecated: []Deprecation{{"T_POLL", "T_INTERVAL"}}},
		{name: "both flags", args: []string{"--poll", "1s", "--interval", "2s"}, err: "--poll and --interval are one flag"},
		{name: "both variables", env: map[string]string{"T_POLL": "1s", "T_INTERVAL": "2s"}, err: "T_POLL and T_INTERVAL are both set"},
		{name: "bad old variable", env: map[string]string{"T_POLL": "soon"}, err: `T_POLL="soon"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, d, _ := renamed(tc.env, io.Discard)
			err := f.Parse(tc.args)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("Parse(%q) error = %v, want one containing %q", tc.args, err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Parse(%q): %v", tc.args, err)
			}
			if *d != tc.want {
				t.Errorf("interval = %v, want %v", *d, tc.want)
			}
			if got := f.Deprecated(); !slices.Equal(got, tc.deprecated) {
				t.Errorf("Deprecated() = %v, want %v", got, tc.deprecated)
			}
		})
	}
}

func TestDeprecationWarnings(t *testing.T) {
	f, _, _ := renamed(map[string]string{"T_POLL": "1s"}, io.Discard)
	if err := f.Parse([]string{"--poll", "3s"}); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.WarnLevel)
	WarnDeprecated(zap.New(core), f.Deprecated())
	var msgs []string
	for _, e := range logs.All() {
		msgs = append(msgs, e.Message+" "+e.ContextMap()["deprecated"].(string)+" "+e.ContextMap()["use"].(string))
	}
	want := []string{
		"T_POLL is deprecated and goes in the next release: use T_INTERVAL T_POLL T_INTERVAL",
		"--poll is deprecated and goes in the next release: use --interval --poll --interval",
	}
	if !slices.Equal(msgs, want) {
		t.Errorf("logged %q, want %q", msgs, want)
	}
	var out bytes.Buffer
	PrintDeprecated(&out, "test", f.Deprecated())
	if want := "test: warning: T_POLL is deprecated and goes in the next release: use T_INTERVAL\n" +
		"test: warning: --poll is deprecated and goes in the next release: use --interval\n"; out.String() != want {
		t.Errorf("printed %q, want %q", out.String(), want)
	}
}

func TestRenameMisuse(t *testing.T) {
	f := NewFlags("test", "", func(string) string { return "" }, io.Discard)
	var s string
	f.EnvString(&s, "new", "T_NEW", "", "")
	for name, call := range map[string]func(){
		"RenameEnv after the flag": func() { f.RenameEnv("T_OLD", "T_NEW") },
		"Rename of no flag":        func() { f.Rename("old", "missing") },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s did not panic", name)
				}
			}()
			call()
		}()
	}
}

// TestUsage: --help is the header, then every flag as "--name VALUE  (VARIABLE, default D)" and
// its help wrapped below, then the deprecated names.
func TestUsage(t *testing.T) {
	var out bytes.Buffer
	f, _ := define(map[string]string{"T_S": "env"}, &out)
	f.RenameEnv("T_OLD_X", "T_X")
	var x string
	f.EnvString(&x, "x", "T_X", "", "a long help text that goes on and on, "+strings.Repeat("and on ", 20)+"until it ends")
	f.Rename("ex", "x")
	if err := f.Parse([]string{"-h"}); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("-h: %v", err)
	}
	want := `Usage: test [flags]

Flags:
  --b  (T_B)
      a bool
  --d duration  (T_D, default 1s)
      a duration
  --f float  (T_F, default 0.5)
      a float
  --n int  (T_N, default 1)
      an int
  --s string  (T_S, default env)
      a string
  --x string  (T_X)
      a long help text that goes on and on, and on and on and on and on and on and on and on and on
      and on and on and on and on and on and on and on and on and on and on and on and on until it
      ends

Deprecated names, still accepted until the next release:
  --ex                             use --x
  T_OLD_X                          use T_X
`
	if out.String() != want {
		t.Errorf("usage:\n%s\nwant:\n%s", out.String(), want)
	}
	for _, line := range strings.Split(out.String(), "\n") {
		if len(line) > usageWidth {
			t.Errorf("line of %d columns: %q", len(line), line)
		}
	}
	if got, want := f.EnvVars(), []string{"T_B", "T_D", "T_F", "T_N", "T_OLD_X", "T_S", "T_X"}; !slices.Equal(got, want) {
		t.Errorf("EnvVars() = %q, want %q", got, want)
	}
	if f.Env("d") != "T_D" || f.Env("ex") != "" {
		t.Errorf("Env(d) = %q, Env(ex) = %q", f.Env("d"), f.Env("ex"))
	}
}
