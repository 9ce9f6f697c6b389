package cli_test

import (
	"runtime"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasebucket/leasebucket/internal/cli"
)

// TestRuntimeCollectors: a server's /metrics has client_golang's runtime and process metrics and
// the runtime's CPU classes, the collector's CPU counted once it has run.
func TestRuntimeCollectors(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(cli.RuntimeCollectors()...)
	runtime.GC()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() { // a summary's or histogram's name counts as present, at 0
			got[mf.GetName()] += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	for _, name := range []string{
		"go_gc_duration_seconds", "go_goroutines", "go_memstats_heap_inuse_bytes",
		"process_cpu_seconds_total", "process_resident_memory_bytes",
		"go_cpu_classes_idle_cpu_seconds_total",
	} {
		if _, ok := got[name]; !ok {
			t.Errorf("no %s", name)
		}
	}
	// The three the garbage collector's share of the CPU is read from (RuntimeCollectors' doc):
	// after a collection, its CPU and the total are above zero.
	gc, total := got["go_cpu_classes_gc_total_cpu_seconds_total"], got["go_cpu_classes_total_cpu_seconds_total"]
	if gc <= 0 || total <= gc {
		t.Errorf("go_cpu_classes_gc_total_cpu_seconds_total %v, go_cpu_classes_total_cpu_seconds_total %v: want 0 < gc < total", gc, total)
	}
}
