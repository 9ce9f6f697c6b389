package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"strings"
	"testing"
	"time"
)

type values struct {
	s string
	d time.Duration
	n int
	f float64
	b bool
}

func define(env map[string]string, stderr io.Writer) (*Flags, *values) {
	v := &values{}
	f := NewFlags("test", "Usage: test [flags]\n\nFlags:\n", func(k string) string { return env[k] }, stderr)
	f.EnvString(&v.s, "s", "T_S", "def", "a string")
	f.EnvDuration(&v.d, "d", "T_D", time.Second, "a duration")
	f.EnvInt(&v.n, "n", "T_N", 1, "an int")
	f.EnvFloat64(&v.f, "f", "T_F", 0.5, "a float")
	f.EnvBool(&v.b, "b", "T_B", false, "a bool")
	return f, v
}

// TestPrecedence: a flag on the command line beats its environment variable, which beats the
// default.
func TestPrecedence(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  map[string]string
		args []string
		want values
	}{
		{"defaults", nil, nil, values{"def", time.Second, 1, 0.5, false}},
		{"environment", map[string]string{"T_S": "env", "T_D": "2s", "T_N": "2", "T_F": "0.25", "T_B": "true"}, nil,
			values{"env", 2 * time.Second, 2, 0.25, true}},
		{"empty variables are unset", map[string]string{"T_S": "", "T_D": "", "T_N": "", "T_F": "", "T_B": ""}, nil,
			values{"def", time.Second, 1, 0.5, false}},
		{"flags", map[string]string{"T_S": "env", "T_D": "2s", "T_N": "2", "T_F": "0.25", "T_B": "true"},
			[]string{"-s", "flag", "-d", "3s", "-n", "3", "-f", "0.75", "-b=false"},
			values{"flag", 3 * time.Second, 3, 0.75, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, v := define(tc.env, io.Discard)
			if err := f.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			if *v != tc.want {
				t.Errorf("got %+v, want %+v", *v, tc.want)
			}
		})
	}
}

// TestEnvErrors: every variable that does not parse is reported, named, once the command line
// parsed; its flag keeps the default.
func TestEnvErrors(t *testing.T) {
	env := map[string]string{"T_D": "soon", "T_N": "many", "T_F": "half", "T_B": "maybe", "T_S": "fine"}
	f, v := define(env, io.Discard)
	err := f.Parse(nil)
	if err == nil {
		t.Fatal("bad variables were accepted")
	}
	for _, want := range []string{`T_D="soon"`, `T_N="many"`, `T_F="half"`, `T_B="maybe"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %s", err, want)
		}
	}
	if want := (values{"fine", time.Second, 1, 0.5, false}); *v != want {
		t.Errorf("got %+v, want %+v", *v, want)
	}

	// A command line error comes first, and so does a request for help.
	f, _ = define(env, io.Discard)
	if err := f.Parse([]string{"-n", "x"}); err == nil || strings.Contains(err.Error(), "T_D") {
		t.Errorf("bad flag: error %v, want the flag's", err)
	}
	f, _ = define(env, io.Discard)
	if err := f.Parse([]string{"--help"}); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("--help: error %v, want flag.ErrHelp", err)
	}
}

func TestLogger(t *testing.T) {
	for _, tc := range []struct {
		env     map[string]string
		args    []string
		err     string
		console bool
	}{
		{args: nil},
		{env: map[string]string{"LEASEBUCKET_LOG_FORMAT": "console"}, console: true},
		{args: []string{"-log-level", "loud"}, err: "--log-level"},
		{env: map[string]string{"LEASEBUCKET_LOG_FORMAT": "xml"}, err: `--log-format "xml": want json or console`},
	} {
		f := NewFlags("test", "", func(k string) string { return tc.env[k] }, io.Discard)
		var l Logging
		f.LogFlags(&l)
		err := f.Parse(tc.args)
		if tc.err != "" {
			// Parse rejects what NewLogger could not use, and so does NewLogger.
			_, lerr := l.NewLogger(io.Discard)
			for _, err := range []error{err, lerr} {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Errorf("%+v: error %v, want one containing %q", l, err, tc.err)
				}
			}
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		log, err := l.NewLogger(&out)
		if err != nil {
			t.Fatalf("%+v: %v", l, err)
		}
		log.Debug("hidden")
		log.Info("shown")
		line := strings.TrimSpace(out.String())
		var m map[string]any
		isJSON := json.Unmarshal([]byte(line), &m) == nil
		if strings.Contains(line, "hidden") || !strings.Contains(line, "shown") || isJSON == tc.console {
			t.Errorf("%+v: logged %q", l, line)
		}
		if tc.console && !strings.Contains(line, "\tINFO\t") {
			t.Errorf("%+v: logged %q, want a capital level", l, line)
		}
	}
}
