package sim

import (
	"fmt"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
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
