// Command sim runs leasebucket simulation scenarios and writes a report with plots.
//
//	sim [--out DIR] [--seed N] [--duration D] [--no-sweep] [--progress] [--bench FILE] SCENARIO.yaml...
//
// See docs/simulator.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/schollz/progressbar/v3"

	"github.com/leasebucket/leasebucket/internal/cli"
	"github.com/leasebucket/leasebucket/sim"
)

const usage = `Usage: sim [flags] SCENARIO.yaml...

Runs leasebucket simulation scenarios (docs/simulator.md) and writes a report. Each scenario runs
once as written, then once per value of its sweep, and, if it has a capacity section, yields a
capacity plan. The report (report.md with plots, CSV per scenario) goes to --out. Exit status: 0
every bound held, 1 a bound broke in some run (the report says where) or an error, 2 usage error.

Flags:
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		var u usageError
		if errors.As(err, &u) {
			os.Exit(2)
		}
		fmt.Fprintln(os.Stderr, "sim:", err)
		os.Exit(1)
	}
}

type usageError struct{ error }

// config is the command line.
type config struct {
	out      string
	seed     uint64
	seedSet  bool
	duration time.Duration
	noSweep  bool
	progress bool
	bench    string
	figures  sim.Figures
	files    []string
}

func parse(args []string, stderr io.Writer) (*config, error) {
	c := &config{}
	fs := cli.NewFlags("sim", usage, func(string) string { return "" }, stderr)
	fs.StringVar(&c.out, "out", "out/sim", "`directory` of the report")
	seed := fs.Uint64("seed", 0, "run every scenario with this `seed` instead of its own")
	fs.DurationVar(&c.duration, "duration", 0, "run every scenario (and sweep point) this long instead (a quick look)")
	fs.BoolVar(&c.noSweep, "no-sweep", false, "skip the sweeps")
	fs.BoolVar(&c.progress, "progress", false, "draw a progress bar even when stderr is not a terminal")
	fs.StringVar(&c.bench, "bench", "", "benchmark results `file` for capacity plans (default: the scenario's, bench/latest.json)")
	fs.Float64Var(&c.figures.AgentCheckNs, "agent-check-ns", 0, "capacity: CPU `ns` per check on an agent")
	rate := func(name, help string, v *sim.Rate) {
		fs.Func(name, help, func(s string) error {
			f, err := sim.ParseRate(s)
			*v = sim.Rate(f)
			return err
		})
	}
	rate("coordinator-items", "capacity: Acquire/Return items per second (`rate`) one coordinator replica serves", &c.figures.CoordinatorItemsPerSecond)
	rate("redis-ops", "capacity: operations per second (`rate`) one Redis shard serves", &c.figures.RedisOpsPerSecond)
	rate("redis-key-ops", "capacity: operations per second (`rate`) one Redis key serves", &c.figures.RedisKeyOpsPerSecond)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		return nil, usageError{err}
	}
	fs.Visit(func(f *flag.Flag) {
		if f.Name == "seed" {
			c.seed, c.seedSet = *seed, true
		}
	})
	c.files = fs.Args()
	if len(c.files) == 0 {
		fs.Usage()
		return nil, usageError{errors.New("no scenario")}
	}
	return c, nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c, err := parse(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	var outs []*sim.Outcome
	failed := 0
	for _, file := range c.files {
		sc, err := sim.Load(file)
		if err != nil {
			return err
		}
		if c.seedSet {
			sc.Seed = c.seed
		}
		if c.duration > 0 {
			sc.Duration = sim.Duration(c.duration)
			if sc.Sweep != nil {
				sc.Sweep.Duration = sim.Duration(c.duration)
			}
			sc.Warmup = min(sc.Warmup, sc.Duration/2)
		}
		if c.noSweep {
			sc.Sweep = nil
		}
		bench := sim.Measured{}
		if sc.Capacity != nil {
			bench = readBench(cmpOr(c.bench, sc.Capacity.Bench))
		}
		bar := newProgress(stderr, sc.Name, c.progress)
		start := time.Now()
		var checks int64
		out, err := sim.Simulate(sc, sim.Options{Context: ctx, Progress: bar.update}, bench, c.figures)
		bar.finish()
		if err != nil {
			return err
		}
		elapsed := time.Since(start)
		checks = out.Result.Checks
		if out.Sweep != nil {
			for _, p := range out.Sweep.Points {
				checks += p.Checks
			}
		}
		r := out.Result
		fmt.Fprintf(stdout, "%-16s utilisation %s  under-use %s  false denies %s  crashes %d  stranded/crash %s  bounds %s\n",
			sc.Name, pct(r.Utilisation()), pct(r.Underuse()), pct(r.FalseDenyShare()), len(r.Crashes),
			perCrash(r), bounds(out))
		if p := out.Plan; p != nil {
			fmt.Fprintf(stdout, "%-16s capacity at %.0f checks/s: card %d replicas; ours %d coordinators, %d Redis shards, %.2f agent cores\n",
				"", p.Peak, p.CardReplicas, p.Coordinators, p.RedisShards, p.AgentCores)
		}
		fmt.Fprintf(stderr, "%s: %d simulated checks in %s (%.2fM checks per wall second)\n",
			sc.Name, checks, elapsed.Round(time.Millisecond), float64(checks)/elapsed.Seconds()/1e6)
		if out.Failed() {
			failed++
		}
		outs = append(outs, out)
	}
	if err := sim.WriteReport(c.out, outs); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "report: %s\n", filepath.Join(c.out, "report.md"))
	if failed > 0 {
		return fmt.Errorf("a bound broke in %d of %d scenarios (see the report)", failed, len(outs))
	}
	return nil
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

func readBench(path string) sim.Measured {
	list, file, err := sim.ReadBench(path)
	if err != nil {
		return sim.Measured{File: fmt.Sprintf("none (%s not found: run `make bench`)", path)}
	}
	return sim.MeasuredFrom(list, file)
}

func pct(x float64) string { return fmt.Sprintf("%6.2f%%", 100*x) }

func perCrash(r *sim.Result) string {
	if len(r.Crashes) == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2f tokens", r.StrandedPerCrash()/1e6)
}

func bounds(o *sim.Outcome) string {
	if o.Failed() {
		return "FAILED"
	}
	return "held"
}

// progress draws a bar on stderr for a run that takes longer than a couple of seconds, when
// stderr is a terminal or when asked to.
type progress struct {
	w     io.Writer
	name  string
	show  bool
	start time.Time
	bar   *progressbar.ProgressBar
}

// barAfter is how long a run goes before it gets a bar: short runs print nothing.
const barAfter = 2 * time.Second

func newProgress(w io.Writer, name string, force bool) *progress {
	show := force
	if f, ok := w.(*os.File); ok && !force {
		if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
			show = true
		}
	}
	return &progress{w: w, name: name, show: show, start: time.Now()}
}

func (p *progress) update(done, total time.Duration) {
	if !p.show {
		return
	}
	if p.bar == nil {
		if time.Since(p.start) < barAfter {
			return
		}
		p.bar = progressbar.NewOptions64(int64(total/time.Second),
			progressbar.OptionSetWriter(p.w),
			progressbar.OptionSetDescription(p.name+" (simulated s)"),
			progressbar.OptionShowCount(),
			progressbar.OptionSetPredictTime(true),
			progressbar.OptionThrottle(200*time.Millisecond),
		)
	}
	p.bar.ChangeMax64(int64(total / time.Second))
	_ = p.bar.Set64(int64(done / time.Second))
}

func (p *progress) finish() {
	if p.bar != nil {
		_ = p.bar.Finish()
		fmt.Fprintln(p.w)
	}
}
