package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

const sample = `goos: linux
goarch: amd64
pkg: github.com/leasebucket/leasebucket/coordinator
cpu: AMD EPYC
BenchmarkAcquireRedis/batch=100-2         	     642	   3303890 ns/op	    157495 grants/cpu-s	     30267 grants/s	         0.01047 round-trips/grant	  197940 B/op	    3198 allocs/op
BenchmarkAcquireMemory/batch=1-2          	 1000000	      1247 ns/op	    896816 grants/cpu-s	    392 B/op	       7 allocs/op
--- BENCH: BenchmarkAcquireMemory/batch=1-2
    bench_test.go:10: a log line
BenchmarkLogged
    bench_test.go:11: more log
BenchmarkLogged 	 5	 200.5 ns/op
PASS
ok  	github.com/leasebucket/leasebucket/coordinator	6.345s
pkg: github.com/leasebucket/leasebucket/internal/bucket
BenchmarkTake	  30000000	        39.1 ns/op
PASS
`

func f(v float64) *float64 { return &v }

func TestParse(t *testing.T) {
	rep, err := Parse(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	const coord, bkt = "github.com/leasebucket/leasebucket/coordinator", "github.com/leasebucket/leasebucket/internal/bucket"
	want := &Report{Schema: Schema, GOOS: "linux", GOARCH: "amd64", CPU: "AMD EPYC", Benchmarks: []Benchmark{
		{Name: "BenchmarkAcquireRedis/batch=100", Package: coord, Procs: 2, Iterations: 642, NsPerOp: 3303890,
			BytesPerOp: f(197940), AllocsPerOp: f(3198),
			Metrics: map[string]float64{"grants/cpu-s": 157495, "grants/s": 30267, "round-trips/grant": 0.01047}},
		{Name: "BenchmarkAcquireMemory/batch=1", Package: coord, Procs: 2, Iterations: 1000000, NsPerOp: 1247,
			BytesPerOp: f(392), AllocsPerOp: f(7), Metrics: map[string]float64{"grants/cpu-s": 896816}},
		{Name: "BenchmarkLogged", Package: coord, Procs: 1, Iterations: 5, NsPerOp: 200.5},
		{Name: "BenchmarkTake", Package: bkt, Procs: 1, Iterations: 30000000, NsPerOp: 39.1},
	}}
	if !reflect.DeepEqual(rep, want) {
		got, _ := json.MarshalIndent(rep, "", " ")
		exp, _ := json.MarshalIndent(want, "", " ")
		t.Fatalf("Parse =\n%s\nwant\n%s", got, exp)
	}
}

func TestParseRejects(t *testing.T) {
	for name, in := range map[string]string{
		"nothing":        "PASS\nok  \tx\t0.1s\n",
		"bad value":      "BenchmarkX-2 10 abc ns/op\n",
		"no ns/op":       "BenchmarkX-2 10 5 B/op\n",
		"odd fields":     "BenchmarkX-2 10 5 ns/op 7\n",
		"bad iterations": "BenchmarkX-2 ten 5 ns/op\n",
	} {
		if _, err := Parse(strings.NewReader(in)); err == nil {
			t.Errorf("%s: Parse(%q) succeeded", name, in)
		}
	}
}

func TestRunWritesFile(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "latest.txt")
	if err := os.WriteFile(in, []byte(sample), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "latest.json")
	if err := run([]string{"-o", out, in}, nil, nil); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var rep Report
	if err := json.Unmarshal(data, &rep); err != nil || rep.Schema != Schema || len(rep.Benchmarks) != 4 {
		t.Fatalf("%s = %+v, %v", out, rep, err)
	}
	var stdout bytes.Buffer
	if err := run(nil, strings.NewReader(sample), &stdout); err != nil || !bytes.Equal(stdout.Bytes(), data) {
		t.Fatalf("stdin to stdout: %v\n%s", err, stdout.String())
	}
}
