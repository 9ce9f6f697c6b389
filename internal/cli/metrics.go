package cli

import (
	"regexp"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// RuntimeCollectors are the Go runtime's and the process's metrics every server serves on its
// /metrics: client_golang's defaults (go_gc_duration_seconds, go_memstats_*, go_goroutines,
// process_*) and the runtime's CPU classes (go_cpu_classes_*_cpu_seconds_total), from which
// the share of a process's CPU its garbage collector takes is
//
//	rate(go_cpu_classes_gc_total_cpu_seconds_total)
//	  / (rate(go_cpu_classes_total_cpu_seconds_total) - rate(go_cpu_classes_idle_cpu_seconds_total))
//
// (the runtime's estimates, comparable with each other and not with process_cpu_seconds_total,
// brought up to date when a collection ends): what an operator reads before changing GOGC or
// GOMEMLIMIT (docs/operations.md).
func RuntimeCollectors() []prometheus.Collector {
	return []prometheus.Collector{
		collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(
			collectors.GoRuntimeMetricsRule{Matcher: regexp.MustCompile(`^/cpu/classes/`)})),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	}
}
