// Command benchjson turns the text output of `go test -bench` into JSON, for tools that read
// benchmark figures (the simulator's capacity mode). The format is described in
// docs/coordinator.md ("Benchmark figures").
//
//	go test -run '^$' -bench . -benchmem ./... | tee bench/latest.txt
//	go run ./internal/tools/benchjson -o bench/latest.json bench/latest.txt
//
// With no file arguments it reads standard input; without -o it writes standard output.
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// Schema names the JSON format; a reader checks it before trusting the fields.
const Schema = "leasebucket-bench/1"

// Report is the JSON document.
type Report struct {
	Schema     string      `json:"schema"`
	GOOS       string      `json:"goos,omitempty"`
	GOARCH     string      `json:"goarch,omitempty"`
	CPU        string      `json:"cpu,omitempty"`
	Benchmarks []Benchmark `json:"benchmarks"`
}

// Benchmark is one result line.
type Benchmark struct {
	Name        string             `json:"name"`    // without the -GOMAXPROCS suffix
	Package     string             `json:"package"` // import path
	Procs       int                `json:"procs"`   // GOMAXPROCS (1 when the name has no suffix)
	Iterations  int64              `json:"iterations"`
	NsPerOp     float64            `json:"ns_per_op"`
	BytesPerOp  *float64           `json:"bytes_per_op,omitempty"`  // with -benchmem or b.ReportAllocs
	AllocsPerOp *float64           `json:"allocs_per_op,omitempty"` // likewise
	Metrics     map[string]float64 `json:"metrics,omitempty"`       // b.ReportMetric's, by unit
}

func main() {
	if err := run(os.Args[1:], os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "benchjson:", err)
		os.Exit(1)
	}
}

func run(args []string, stdin io.Reader, stdout io.Writer) error {
	fs := flag.NewFlagSet("benchjson", flag.ContinueOnError)
	out := fs.String("o", "", "write the JSON to `file` instead of standard output")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var in []io.Reader
	for _, name := range fs.Args() {
		f, err := os.Open(name)
		if err != nil {
			return err
		}
		defer func() { _ = f.Close() }()
		in = append(in, f)
	}
	if len(in) == 0 {
		in = append(in, stdin)
	}
	rep, err := Parse(io.MultiReader(in...))
	if err != nil {
		return err
	}
	data, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	data = append(data, '\n')
	if *out == "" {
		_, err = stdout.Write(data)
		return err
	}
	return os.WriteFile(*out, data, 0o644)
}

// Parse reads `go test -bench` output: the goos/goarch/cpu/pkg header lines and one line per
// benchmark result; everything else (PASS, ok, logs) is skipped. It fails if no result is found
// or a result line is malformed.
func Parse(r io.Reader) (*Report, error) {
	rep := &Report{Schema: Schema, Benchmarks: []Benchmark{}}
	var pkg string
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for line := 1; sc.Scan(); line++ {
		text := sc.Text()
		if k, v, ok := strings.Cut(text, ": "); ok {
			switch k {
			case "goos":
				rep.GOOS = v
				continue
			case "goarch":
				rep.GOARCH = v
				continue
			case "cpu":
				rep.CPU = v
				continue
			case "pkg":
				pkg = v
				continue
			}
		}
		if !strings.HasPrefix(text, "Benchmark") {
			continue
		}
		fields := strings.Fields(text)
		if len(fields) < 2 {
			continue // a name alone: its result follows after the benchmark's log lines
		}
		if _, err := strconv.ParseInt(fields[1], 10, 64); err != nil {
			continue // not a result line
		}
		if len(fields) < 4 || len(fields)%2 != 0 {
			return nil, fmt.Errorf("line %d: malformed result %q", line, text)
		}
		b, err := parseResult(fields, pkg)
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", line, err)
		}
		rep.Benchmarks = append(rep.Benchmarks, b)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(rep.Benchmarks) == 0 {
		return nil, errors.New("no benchmark results in the input")
	}
	return rep, nil
}

// parseResult reads "BenchmarkName-P  N  v1 unit1  v2 unit2 ...".
func parseResult(fields []string, pkg string) (Benchmark, error) {
	b := Benchmark{Name: fields[0], Package: pkg, Procs: 1}
	if i := strings.LastIndexByte(b.Name, '-'); i > 0 {
		if p, err := strconv.Atoi(b.Name[i+1:]); err == nil && p > 0 {
			b.Name, b.Procs = b.Name[:i], p
		}
	}
	n, err := strconv.ParseInt(fields[1], 10, 64)
	if err != nil {
		return b, fmt.Errorf("iterations %q: %w", fields[1], err)
	}
	b.Iterations = n
	seenNs := false
	for i := 2; i < len(fields); i += 2 {
		v, err := strconv.ParseFloat(fields[i], 64)
		if err != nil {
			return b, fmt.Errorf("value %q of %s: %w", fields[i], fields[i+1], err)
		}
		switch unit := fields[i+1]; unit {
		case "ns/op":
			b.NsPerOp, seenNs = v, true
		case "B/op":
			b.BytesPerOp = &v
		case "allocs/op":
			b.AllocsPerOp = &v
		default:
			if b.Metrics == nil {
				b.Metrics = map[string]float64{}
			}
			b.Metrics[unit] = v
		}
	}
	if !seenNs {
		return b, fmt.Errorf("%s has no ns/op", b.Name)
	}
	return b, nil
}
