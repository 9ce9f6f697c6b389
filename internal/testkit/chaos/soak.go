package chaos

import (
	"bufio"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Growth allowances of the soak check: the largest value of the last quarter of the steady
// phase may exceed the largest of its second quarter (the first one after a quarter of
// warm-up) by this fraction plus this amount. A Go process's heap, and so its RSS, breathes with
// the garbage collector and the load; a coordinator runs a goroutine per call in flight (up to
// 4 per agent) and opens Redis connections up to its pool size when Redis slows down, and keeps
// them. A leak grows without end, so over a long soak it passes any fixed allowance (a goroutine,
// a descriptor or a few kilobytes per second is thousands of goroutines and descriptors and
// megabytes in 30 minutes).
var growthAllowance = map[string]struct {
	rel, abs float64
}{
	"rss_kib":    {0.25, 16 << 10},
	"goroutines": {0.10, 25},
	"fds":        {0.10, 32},
}

// Sample is one reading of one process.
type Sample struct {
	At         time.Duration
	RSSKiB     int64
	FDs        int
	Goroutines int // -1: not a Go process (Redis) or /metrics did not answer
	Keys       int // agents' leasebucket_agent_keys; -1 for others
}

// Series is the samples of one process (a restarted process is a new series).
type Series struct {
	Name    string
	Pid     int
	Samples []Sample
}

// Sampler reads RSS and open file descriptors (/proc/<pid>/status, /proc/<pid>/fd) and
// goroutines (go_goroutines of /metrics) of every process of a stack, every interval.
type Sampler struct {
	s     *Stack
	every time.Duration

	mu     sync.Mutex
	series map[string]*Series
	order  []string

	stop chan struct{}
	wg   sync.WaitGroup
}

// NewSampler starts sampling.
func NewSampler(s *Stack, every time.Duration) *Sampler {
	sm := &Sampler{s: s, every: every, series: map[string]*Series{}, stop: make(chan struct{})}
	sm.wg.Go(sm.run)
	return sm
}

// Stop stops sampling.
func (sm *Sampler) Stop() {
	select {
	case <-sm.stop:
	default:
		close(sm.stop)
	}
	sm.wg.Wait()
}

func (sm *Sampler) run() {
	t := time.NewTicker(sm.every)
	defer t.Stop()
	for {
		sm.sample()
		select {
		case <-sm.stop:
			return
		case <-t.C:
		}
	}
}

func (sm *Sampler) sample() {
	at := sm.s.Since()
	for _, p := range sm.s.Processes() {
		rss, err := rssKiB(p.Pid)
		if err != nil {
			continue // exited meanwhile
		}
		smp := Sample{At: at, RSSKiB: rss, FDs: countFDs(p.Pid), Goroutines: -1, Keys: -1}
		if p.Metrics != "" {
			if m, err := Scrape(p.Metrics); err == nil {
				if g, ok := m["go_goroutines"]; ok {
					smp.Goroutines = int(g)
				}
				if k, ok := m["leasebucket_agent_keys"]; ok {
					smp.Keys = int(k)
				}
			}
		}
		id := fmt.Sprintf("%s/%d", p.Name, p.Pid)
		sm.mu.Lock()
		sr, ok := sm.series[id]
		if !ok {
			sr = &Series{Name: p.Name, Pid: p.Pid}
			sm.series[id] = sr
			sm.order = append(sm.order, id)
		}
		sr.Samples = append(sr.Samples, smp)
		sm.mu.Unlock()
	}
}

// Series returns every series, in the order they appeared.
func (sm *Sampler) Series() []*Series {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	out := make([]*Series, len(sm.order))
	for i, id := range sm.order {
		sr := *sm.series[id]
		sr.Samples = slices.Clone(sr.Samples)
		out[i] = &sr
	}
	return out
}

func rssKiB(pid int) (int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			return strconv.ParseInt(strings.Fields(v)[0], 10, 64)
		}
	}
	return 0, fmt.Errorf("chaos: no VmRSS for %d", pid)
}

func countFDs(pid int) int {
	es, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return -1
	}
	return len(es)
}

// Growth is one process's resources over the steady phase: the largest value of its second
// quarter and of its last.
type Growth struct {
	Name                    string
	Pid                     int
	RSSKiB, Goroutines, FDs [2]int64 // [second quarter max, last quarter max]; goroutines -1 for Redis
	MaxKeys                 int      // agents: the largest key count seen
}

// CheckGrowth checks every process that ran through the steady phase [from, to]: the last
// quarter's maximum of RSS, goroutines and open descriptors within the allowance of the second
// quarter's (the first quarter is warm-up); and no agent ever held more keys than maxKeys.
func CheckGrowth(series []*Series, from, to time.Duration, maxKeys int) ([]Growth, []Violation) {
	q := (to - from) / 4
	var gs []Growth
	var vs []Violation
	for _, sr := range series {
		for _, smp := range sr.Samples {
			if smp.Keys > maxKeys {
				vs = append(vs, Violation{Check: "lru", Detail: fmt.Sprintf(
					"%s held %d keys at %v, above --max-keys %d", sr.Name, smp.Keys, smp.At.Round(time.Second), maxKeys)})
				break
			}
		}
		if len(sr.Samples) == 0 || sr.Samples[0].At > from+q || sr.Samples[len(sr.Samples)-1].At < to-q/2 {
			continue // did not live through the phase
		}
		g := Growth{Name: sr.Name, Pid: sr.Pid, Goroutines: [2]int64{-1, -1}}
		for _, smp := range sr.Samples {
			var i int
			switch {
			case smp.At >= from+q && smp.At < from+2*q:
				i = 0
			case smp.At >= from+3*q && smp.At <= to:
				i = 1
			default:
				continue
			}
			g.RSSKiB[i] = max(g.RSSKiB[i], smp.RSSKiB)
			g.FDs[i] = max(g.FDs[i], int64(smp.FDs))
			if smp.Goroutines >= 0 {
				g.Goroutines[i] = max(g.Goroutines[i], int64(smp.Goroutines))
			}
			g.MaxKeys = max(g.MaxKeys, smp.Keys)
		}
		for name, v := range map[string][2]int64{"rss_kib": g.RSSKiB, "goroutines": g.Goroutines, "fds": g.FDs} {
			a := growthAllowance[name]
			if v[0] <= 0 || v[1] <= 0 {
				continue
			}
			if limit := float64(v[0])*(1+a.rel) + a.abs; float64(v[1]) > limit {
				vs = append(vs, Violation{Check: "soak", Detail: fmt.Sprintf(
					"%s (pid %d): %s grew from %d (second quarter's max) to %d (last quarter's), above the allowance %.0f",
					sr.Name, sr.Pid, name, v[0], v[1], limit)})
			}
		}
		gs = append(gs, g)
	}
	return gs, vs
}
