package sim

import (
	"fmt"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

// series is one line of a plot.
type series struct {
	name string
	pts  plotter.XYs
}

// savePlot draws lines into an SVG file, with a glyph at each point if marks.
func savePlot(path, title, xLabel, yLabel string, lines []series, marks bool) error {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = xLabel
	p.Y.Label.Text = yLabel
	p.Legend.Top = true
	p.Add(plotter.NewGrid())
	var args []any
	for _, l := range lines {
		if len(l.pts) == 0 {
			continue
		}
		args = append(args, l.name, l.pts)
	}
	if len(args) == 0 {
		return nil
	}
	add := plotutil.AddLines
	if marks {
		add = plotutil.AddLinePoints
	}
	if err := add(p, args...); err != nil {
		return fmt.Errorf("sim: plot %s: %w", path, err)
	}
	// Room above the data for the legend.
	p.Y.Min = min(p.Y.Min, 0)
	p.Y.Max += 0.3 * (p.Y.Max - p.Y.Min)
	if err := p.Save(9*vg.Inch, 4*vg.Inch, path); err != nil {
		return fmt.Errorf("sim: plot %s: %w", path, err)
	}
	return nil
}

// maxPoints bounds a timeline plot: longer runs are averaged over wider steps.
const maxPoints = 600

// plotTimeline draws a run's decisions per second: tokens the ideal limiter admitted, tokens the
// agents admitted, and the requests answered 429, 503 and degraded.
func plotTimeline(path string, r *Result) error {
	step := max(1, (len(r.Timeline)+maxPoints-1)/maxPoints)
	lines := []series{{name: "ideal admitted"}, {name: "admitted"}, {name: "429"}, {name: "503"}, {name: "degraded"}}
	for i := 0; i < len(r.Timeline); i += step {
		var c Counts
		n := 0
		for _, s := range r.Timeline[i:min(i+step, len(r.Timeline))] {
			c.add(&s.Counts)
			n++
		}
		x := float64(i) + float64(n)/2
		per := float64(n)
		for j, v := range []int64{c.IdealTokens, c.AllowedTokens, c.Denied + c.DegradedDenied, c.Unavailable, c.Degraded} {
			lines[j].pts = append(lines[j].pts, plotter.XY{X: x, Y: float64(v) / per})
		}
	}
	return savePlot(path, r.Scenario+": decisions per second", "time (s)", "per second", lines, false)
}

// sweepMetric is one quantity a sweep plot shows against the parameter.
type sweepMetric struct {
	name string
	get  func(*Result) float64
}

func plotSweep(path, title, yLabel string, s *SweepResult, metrics []sweepMetric) error {
	var lines []series
	for _, m := range metrics {
		l := series{name: m.name}
		for _, p := range s.Points {
			l.pts = append(l.pts, plotter.XY{X: p.Value, Y: m.get(p)})
		}
		lines = append(lines, l)
	}
	return savePlot(path, title, s.Parameter, yLabel, lines, true)
}

// plotSettled draws a run's costs settled after the response per second: the estimates admitted,
// the actual costs settled, the debt the stores debited and forgave, and the refill of the keys
// settled traffic uses (what they may admit in steady state).
func plotSettled(path string, r *Result) error {
	var refill float64
	for _, k := range r.Keys {
		if k.Settled {
			refill += k.RatePerSecond
		}
	}
	step := max(1, (len(r.Timeline)+maxPoints-1)/maxPoints)
	lines := []series{{name: "estimates admitted"}, {name: "actual costs settled"}, {name: "debt debited"},
		{name: "debt forgiven"}, {name: "refill of their keys"}}
	per := float64(bucket.PerToken)
	for i := 0; i < len(r.Timeline); i += step {
		var admitted, actual, debited, forgiven float64
		n := 0
		for _, s := range r.Timeline[i:min(i+step, len(r.Timeline))] {
			admitted += float64(s.AllowedTokens)
			actual += float64(s.SettledActual) / per
			debited += float64(s.DebtCharged) / per
			forgiven += float64(s.DebtForgiven) / per
			n++
		}
		x, f := float64(i)+float64(n)/2, float64(n)
		for j, v := range []float64{admitted / f, actual / f, debited / f, forgiven / f, refill / per} {
			if j == 4 && v == 0 {
				continue
			}
			lines[j].pts = append(lines[j].pts, plotter.XY{X: x, Y: v})
		}
	}
	return savePlot(path, r.Scenario+": costs settled after the response", "time (s)", "tokens per second", lines, false)
}

// plotDebtDepth draws the deepest level the stores answered each second as a share of the key's
// max_debt: the bound is 1.
func plotDebtDepth(path string, r *Result) error {
	lines := []series{{name: "deepest debt (share of max_debt)"}, {name: "bound"}}
	for i, s := range r.Timeline {
		lines[0].pts = append(lines[0].pts, plotter.XY{X: float64(i) + 0.5, Y: s.DebtDepth})
		lines[1].pts = append(lines[1].pts, plotter.XY{X: float64(i) + 0.5, Y: 1})
	}
	return savePlot(path, r.Scenario+": how deep the buckets went into debt", "time (s)", "level below zero / max_debt", lines, false)
}
