package stackbench

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
)

// clockTick is a clock tick of /proc/<pid>/stat's utime and stime: USER_HZ, 100 on Linux.
const clockTick = 10 * time.Millisecond

// ProcCPU is the user+system CPU time that process pid has used so far, every thread included
// (live and exited): utime + stime of /proc/<pid>/stat, in clock ticks of 10 ms. Over a measured
// phase of a few seconds the tick is well under 1 % of what a busy process uses.
func ProcCPU(pid int) (time.Duration, error) {
	path := "/proc/self/stat"
	if pid > 0 {
		path = fmt.Sprintf("/proc/%d/stat", pid)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("stackbench: %w", err)
	}
	// The command name (field 2) is in parentheses and may hold spaces; after it, field 3 is the
	// state, 14 utime and 15 stime.
	i := strings.LastIndexByte(string(data), ')')
	if i < 0 {
		return 0, fmt.Errorf("stackbench: %s: no command name", path)
	}
	f := strings.Fields(string(data[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("stackbench: %s: %d fields", path, len(f))
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("stackbench: %s: utime %q stime %q", path, f[11], f[12])
	}
	return time.Duration(utime+stime) * clockTick, nil
}

// HostCPU is what the machine's CPUs did so far, in clock ticks of all of them: the first line
// of /proc/stat.
type HostCPU struct {
	// Total is user, nice, system, idle, iowait, irq, softirq and steal (guest time is already in
	// user and nice).
	Total int64
	// Steal is the time a virtual CPU had work and the hypervisor ran something else: the other
	// tenants of a shared machine, which slows every process here without showing in their CPU.
	Steal int64
}

// Sub is h − o.
func (h HostCPU) Sub(o HostCPU) HostCPU {
	return HostCPU{Total: h.Total - o.Total, Steal: h.Steal - o.Steal}
}

// StealPercent is the share of the CPUs' time the hypervisor took, in %; 0 over no time.
func (h HostCPU) StealPercent() float64 {
	if h.Total <= 0 {
		return 0
	}
	return 100 * float64(h.Steal) / float64(h.Total)
}

// ReadHostCPU reads /proc/stat.
func ReadHostCPU() (HostCPU, error) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return HostCPU{}, fmt.Errorf("stackbench: %w", err)
	}
	return parseHostCPU(string(data))
}

// parseHostCPU reads the "cpu" line of a /proc/stat. Kernels before 2.6.11 had no steal field;
// those fields that are missing count as 0.
func parseHostCPU(stat string) (HostCPU, error) {
	line, _, _ := strings.Cut(stat, "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return HostCPU{}, fmt.Errorf("stackbench: /proc/stat: first line %q", line)
	}
	var h HostCPU
	for i, v := range f[1:min(len(f), 9)] { // user … steal
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return HostCPU{}, fmt.Errorf("stackbench: /proc/stat: field %d %q", i+1, v)
		}
		h.Total += n
		if i == 7 {
			h.Steal = n
		}
	}
	return h, nil
}

// RedisStats is what INFO commandstats says of a redis-server so far, without the probe's own
// commands (see RedisProbe).
type RedisStats struct {
	Commands float64 // every command, those run by scripts included
	Scripts  float64 // EVAL, EVALSHA, FCALL and their read-only forms: one per script run
	// HSET calls: bucket.lua runs one for each operation it applies, wherever a batch of them
	// runs in one script (redisstore's batch.lua)
	HSets float64
	// ScriptMicros is the time Redis spent running scripts (the usec of the script commands):
	// wall time, so on a busy machine it also counts moments the server was not on a core.
	ScriptMicros float64
}

// RedisProbe reads a redis-server's command statistics over one connection of its own, and
// takes its own commands out of them: Redis counts a command after running it, so each INFO
// shows every probe command before it, itself excluded.
type RedisProbe struct {
	c   *redis.Client
	own atomic.Int64 // probe commands sent so far
}

// NewRedisProbe connects to the Redis at opts (one connection, opened now: its handshake is not
// counted against any phase) and returns the probe and the server's process id.
func NewRedisProbe(ctx context.Context, opts *redis.Options) (*RedisProbe, int, error) {
	o := *opts
	o.PoolSize, o.MinIdleConns, o.MaxIdleConns = 1, 1, 1
	o.ConnMaxIdleTime, o.ConnMaxLifetime = -1, -1 // keep the one connection for good
	p := &RedisProbe{c: redis.NewClient(&o)}
	info, err := p.c.Info(ctx, "server").Result()
	if err != nil {
		_ = p.c.Close()
		return nil, 0, fmt.Errorf("stackbench: redis INFO server: %w", err)
	}
	p.own.Add(1)
	pid, err := strconv.Atoi(infoField(info, "process_id"))
	if err != nil {
		_ = p.c.Close()
		return nil, 0, fmt.Errorf("stackbench: redis process_id: %w", err)
	}
	return p, pid, nil
}

// Close closes the probe's connection.
func (p *RedisProbe) Close() error { return p.c.Close() }

// Stats reads INFO commandstats: the server's counts so far, less every command this probe sent
// before this one.
func (p *RedisProbe) Stats(ctx context.Context) (RedisStats, error) {
	before := p.own.Add(1) - 1
	info, err := p.c.Info(ctx, "commandstats").Result()
	if err != nil {
		return RedisStats{}, fmt.Errorf("stackbench: redis INFO commandstats: %w", err)
	}
	s, err := parseCommandStats(info)
	if err != nil {
		return RedisStats{}, err
	}
	s.Commands -= float64(before)
	return s, nil
}

// parseCommandStats sums the calls of INFO commandstats lines
// ("cmdstat_evalsha:calls=12,usec=…,…"), and the usec of the script commands.
func parseCommandStats(info string) (RedisStats, error) {
	cmds, err := redistest.ParseCommandStats(info)
	if err != nil {
		return RedisStats{}, fmt.Errorf("stackbench: %w", err)
	}
	var s RedisStats
	for cmd, c := range cmds {
		s.Commands += c.Calls
		if cmd == "hset" {
			s.HSets += c.Calls
		}
		if redistest.ScriptCommands[cmd] {
			s.Scripts += c.Calls
			s.ScriptMicros += c.Usec
		}
	}
	return s, nil
}

// infoField is the value of field in an INFO reply, "" if absent.
func infoField(info, field string) string {
	for line := range strings.SplitSeq(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v
		}
	}
	return ""
}

// metricsClient scrapes the processes' /metrics; it never keeps a scrape waiting long.
var metricsClient = &http.Client{Timeout: 5 * time.Second}

// ScrapeSum is the sum of every sample of the metric family name (any labels) on the Prometheus
// endpoint at addr (host:port) whose labels include every name="value" pair of match. A family
// with no sample is an error: a renamed metric must not read as zero.
func ScrapeSum(ctx context.Context, addr, name string, match ...string) (float64, error) {
	sums, err := scrape(ctx, addr, []string{name}, match)
	if err != nil {
		return 0, err
	}
	return sums[0], nil
}

// ScrapeSums is ScrapeSum of each of names, whatever their labels, from one scrape: counters read
// together, as of one moment.
func ScrapeSums(ctx context.Context, addr string, names ...string) ([]float64, error) {
	return scrape(ctx, addr, names, nil)
}

func scrape(ctx context.Context, addr string, names, match []string) ([]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := metricsClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("stackbench: scrape %s: %w", addr, err)
	}
	defer func() { _ = resp.Body.Close() }()
	sums, found := make([]float64, len(names)), make([]bool, len(names))
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		for i, name := range names {
			rest, ok := strings.CutPrefix(line, name)
			if !ok || rest == "" || (rest[0] != ' ' && rest[0] != '{') {
				continue
			}
			labels, value := "", strings.TrimSpace(rest)
			if rest[0] == '{' {
				end := strings.LastIndexByte(rest, '}')
				if end < 0 {
					continue
				}
				labels, value = rest[1:end], strings.TrimSpace(rest[end+1:])
			}
			if !hasLabels(labels, match) {
				continue
			}
			found[i] = true
			v, err := strconv.ParseFloat(strings.Fields(value)[0], 64)
			if err != nil {
				return nil, fmt.Errorf("stackbench: %s: %q: %w", addr, line, err)
			}
			sums[i] += v
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("stackbench: scrape %s: %w", addr, err)
	}
	for i, ok := range found {
		if !ok {
			return nil, fmt.Errorf("stackbench: %s serves no %s%v", addr, names[i], match)
		}
	}
	return sums, nil
}

// hasLabels reports whether labels (`a="x",b="y"`) hold every `name="value"` of match.
func hasLabels(labels string, match []string) bool {
	for _, m := range match {
		if !strings.Contains(","+labels+",", ","+m+",") {
			return false
		}
	}
	return true
}
