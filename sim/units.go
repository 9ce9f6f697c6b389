package sim

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// Duration is a time.Duration written in YAML as Go writes durations: "1h30m", "250ms", "500us".
type Duration time.Duration

// D is the duration as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// UnmarshalYAML implements yaml.Unmarshaler.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	var s string
	if err := n.Decode(&s); err != nil {
		return err
	}
	v, err := time.ParseDuration(strings.TrimSpace(s))
	if err != nil {
		return fmt.Errorf("line %d: %q is not a duration (write e.g. 250ms, 10s, 1h)", n.Line, s)
	}
	if v < 0 {
		return fmt.Errorf("line %d: duration %s is negative", n.Line, v)
	}
	*d = Duration(v)
	return nil
}

// MarshalYAML implements yaml.Marshaler.
func (d Duration) MarshalYAML() (any, error) { return time.Duration(d).String(), nil }

func (d Duration) String() string { return time.Duration(d).String() }

// Rate is a number of events per second. YAML writes it as a number (per second) or with a unit
// and an SI suffix: 2000, "2k/s", "1.2M/s", "100/m", "3/h".
type Rate float64

// UnmarshalYAML implements yaml.Unmarshaler.
func (r *Rate) UnmarshalYAML(n *yaml.Node) error {
	var s string
	if err := n.Decode(&s); err != nil {
		return err
	}
	v, err := ParseRate(s)
	if err != nil {
		return fmt.Errorf("line %d: %w", n.Line, err)
	}
	*r = Rate(v)
	return nil
}

// ParseRate reads a rate: a number with an optional k, M or G suffix and an optional /s, /m or /h
// unit (per second if none).
func ParseRate(s string) (float64, error) {
	s = strings.TrimSpace(s)
	num, per := s, time.Second
	if i := strings.IndexByte(s, '/'); i >= 0 {
		num = strings.TrimSpace(s[:i])
		switch strings.TrimSpace(s[i+1:]) {
		case "s", "sec", "second":
			per = time.Second
		case "m", "min", "minute":
			per = time.Minute
		case "h", "hour":
			per = time.Hour
		default:
			return 0, fmt.Errorf("rate %q: the unit after / must be s, m or h", s)
		}
	}
	v, err := parseCount(num)
	if err != nil {
		return 0, fmt.Errorf("rate %q: %w", s, err)
	}
	return v / per.Seconds(), nil
}

// parseCount reads a non-negative number with an optional k, M or G suffix ("80K", "1.2M").
func parseCount(s string) (float64, error) {
	mult := 1.0
	if n := len(s); n > 0 {
		switch s[n-1] {
		case 'k', 'K':
			mult, s = 1e3, s[:n-1]
		case 'M':
			mult, s = 1e6, s[:n-1]
		case 'G':
			mult, s = 1e9, s[:n-1]
		}
	}
	v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || v < 0 || v != v {
		return 0, fmt.Errorf("%q is not a non-negative number", s)
	}
	return v * mult, nil
}
