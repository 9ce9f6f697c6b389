package chaos

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// httpClient reads the processes' /metrics and debug endpoints. No connection is kept: the
// processes come and go, and nothing of the harness outlives a run.
var httpClient = &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}

// Scrape reads a Prometheus text page: each sample by its name with its labels as written
// ("leasebucket_agent_keys", `x_total{code="OK"}`).
func Scrape(addr string) (map[string]float64, error) {
	resp, err := httpClient.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, err
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("chaos: %s/metrics: %s", addr, resp.Status)
	}
	m := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		m[line[:i]] = v
	}
	return m, sc.Err()
}

// sum adds the samples of a metric over all its label values.
func sum(m map[string]float64, name string) float64 {
	var s float64
	for k, v := range m {
		if k == name || strings.HasPrefix(k, name+"{") {
			s += v
		}
	}
	return s
}

// debugLease is what the harness reads of the agent's debug endpoint (agent.DebugLease).
type debugLease struct {
	Tenant     string  `json:"tenant"`
	Rule       string  `json:"rule"`
	Tokens     float64 `json:"tokens"`
	NextTokens float64 `json:"next_tokens"`
	Refilling  bool    `json:"refilling"`
}

// debugLeases lists an agent's keys of a tenant, with or without a live lease.
func debugLeases(addr, tenant string) ([]debugLease, error) {
	resp, err := httpClient.Get("http://" + addr + "/debug/leases?all=1&tenant=" + url.QueryEscape(tenant))
	if err != nil {
		return nil, err
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("chaos: %s/debug/leases: %s", addr, resp.Status)
	}
	var out struct {
		Leases []debugLease `json:"leases"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return nil, err
	}
	return out.Leases, nil
}
