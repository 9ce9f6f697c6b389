package agent

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
)

// ErrDebugNotLoopback is returned for a debug address that is not a loopback one: the debug
// endpoint lists tenants and their leases, so it listens on a loopback address only.
var ErrDebugNotLoopback = errors.New("agent: the debug endpoint listens on a loopback address only")

// ListenDebug listens on addr for DebugHandler. addr must be a loopback address (127.0.0.1:7073,
// [::1]:7073, localhost:7073 which means 127.0.0.1); an empty host, a wildcard or any other
// address is refused.
func ListenDebug(addr string) (net.Listener, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("agent: debug address %q: %w", addr, err)
	}
	if host == "localhost" {
		// Not resolved: a hosts file could map it anywhere.
		host = "127.0.0.1"
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return nil, fmt.Errorf("%w: %q", ErrDebugNotLoopback, addr)
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(host, port))
	if err != nil {
		return nil, fmt.Errorf("agent: debug listen: %w", err)
	}
	if a, ok := ln.Addr().(*net.TCPAddr); !ok || !a.IP.IsLoopback() {
		_ = ln.Close()
		return nil, fmt.Errorf("%w: bound to %v", ErrDebugNotLoopback, ln.Addr())
	}
	return ln, nil
}

// DebugLease is one key of the lease table as the debug endpoint shows it. Durations are
// milliseconds from now (0: none, or over); tokens are whole and fractional tokens.
type DebugLease struct {
	Rule      string `json:"rule"`
	Route     string `json:"route"`     // the template ("" for the default rule)
	Operation string `json:"operation"` // the route's operation entry
	Tenant    string `json:"tenant"`
	Region    string `json:"region,omitempty"`
	// The current lease: what is left of it and until when it may be spent.
	Tokens      float64 `json:"tokens"`
	ExpiresInMs int64   `json:"expires_in_ms"`
	// A prefetched lease waiting for the current one to run out.
	NextTokens      float64 `json:"next_tokens,omitempty"`
	NextExpiresInMs int64   `json:"next_expires_in_ms,omitempty"`
	// Remaining is this agent's view of the key: its leases plus the global level at its last
	// refill (what a check's remaining says).
	Remaining float64 `json:"remaining"`
	Burst     int64   `json:"burst"`
	Limit     string  `json:"limit"`
	// DeniedForMs: the coordinator denied a refill; checks answer deny locally for this long.
	DeniedForMs int64 `json:"denied_for_ms,omitempty"`
	// FailureModeForMs: a refill failed; checks answer with the rule's failure mode this long.
	FailureModeForMs int64 `json:"failure_mode_for_ms,omitempty"`
	// EmergencyTokens is what the local emergency bucket held at its last use (emergency rules
	// that used it only).
	EmergencyTokens *float64 `json:"emergency_tokens,omitempty"`
	Refilling       bool     `json:"refilling"`
}

// DebugHandler serves the agent's read-only debug endpoints (docs/agent.md, "Debug endpoint"):
//
//	GET /debug/leases[?tenant=T][&rule=R][&all=1][&limit=N]  keys with a live lease (all=1: every key)
//	GET /debug/explain?tenant=T&route=PATH&op=OP              how a check resolves, and its key's lease
//
// Neither changes any state: a lookup never inserts a key, never marks one used (the eviction
// order is untouched), never spends or queues a refill.
func DebugHandler(lim *Limiter, clk clock.Clock) http.Handler {
	d := &debug{lim: lim, clk: clk}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/leases", d.leases)
	mux.HandleFunc("GET /debug/explain", d.explain)
	return mux
}

type debug struct {
	lim *Limiter
	clk clock.Clock
}

// debugMaxLeases bounds one listing: the table may hold a million keys.
const (
	debugDefaultLeases = 100
	debugMaxLeases     = 10000
)

func (d *debug) leases(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	limit := debugDefaultLeases
	if s := q.Get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > debugMaxLeases {
			http.Error(w, fmt.Sprintf("limit must be 1..%d", debugMaxLeases), http.StatusBadRequest)
			return
		}
		limit = n
	}
	tenant, rule, all := q.Get("tenant"), q.Get("rule"), q.Get("all") == "1"
	v := d.lim.view.Load()
	now := d.clk.Now()
	out := struct {
		PolicyVersion string       `json:"policy_version"`
		Keys          int          `json:"keys"`
		Leases        []DebugLease `json:"leases"`
		Truncated     bool         `json:"truncated"`
	}{PolicyVersion: v.set.Version(), Keys: v.table.len(), Leases: []DebugLease{}}
	v.table.each(func(e *entry) {
		if (tenant != "" && e.tenant != tenant) || (rule != "" && e.rule.Name != rule) {
			return
		}
		l := d.lease(now, e)
		if !all && l.ExpiresInMs == 0 && l.NextTokens == 0 {
			return
		}
		if len(out.Leases) == limit {
			out.Truncated = true
			return
		}
		out.Leases = append(out.Leases, l)
	})
	slices.SortFunc(out.Leases, func(a, b DebugLease) int {
		return cmp.Or(cmp.Compare(a.Tenant, b.Tenant), cmp.Compare(a.Rule, b.Rule),
			cmp.Compare(a.Route, b.Route), cmp.Compare(a.Operation, b.Operation))
	})
	writeJSON(w, out)
}

// lease reads an entry without changing it (e.mu only to read what it guards).
func (d *debug) lease(now clock.Nanos, e *entry) DebugLease {
	route := e.view.set.RouteByID(e.route)
	l := DebugLease{
		Rule: e.rule.Name, Route: route.Template(), Operation: route.Operation(), Tenant: e.tenant,
		Region: e.lim.Region, Burst: int64(e.lim.Bucket.Capacity() / bucket.PerToken), Limit: e.lim.Quota.String(),
		Refilling: e.refilling.Load(),
	}
	msUntil := func(t clock.Nanos) int64 {
		if t <= now {
			return 0
		}
		return max(1, int64((t - now).Duration().Milliseconds()))
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	tokens := e.tokens.Load()
	if exp := clock.Nanos(e.expires.Load()); tokens > 0 && exp > now {
		l.Tokens, l.ExpiresInMs = tokensOf(tokens), msUntil(exp)
	}
	if n := e.s().next; n.tokens > 0 && n.expires > now {
		l.NextTokens, l.NextExpiresInMs = tokensOf(int64(n.tokens)), msUntil(n.expires)
	}
	l.Remaining = tokensOf(tokens + e.remaining.Load())
	l.DeniedForMs = msUntil(clock.Nanos(e.deniedUntil.Load()))
	if f := e.fail; f != nil {
		l.FailureModeForMs = msUntil(f.until)
		if f.emergencyOn {
			t := tokensOf(int64(f.emergency.Tokens))
			l.EmergencyTokens = &t
		}
	}
	return l
}

func tokensOf(micro int64) float64 { return float64(micro) / float64(bucket.PerToken) }

func (d *debug) explain(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	tenant, path, op := q.Get("tenant"), cmp.Or(q.Get("route"), q.Get("path")), cmp.Or(q.Get("op"), q.Get("method"))
	if tenant == "" || path == "" {
		http.Error(w, "tenant and route are required (and op: a method, class or named operation)", http.StatusBadRequest)
		return
	}
	v := d.lim.view.Load()
	ex, err := v.set.Explain(tenant, path, op, d.lim.cfg.Region)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	out := struct {
		Explanation string      `json:"explanation"`
		Rule        string      `json:"rule"`
		Route       string      `json:"route"`
		Operation   string      `json:"operation"`
		Key         string      `json:"key"`
		Cost        int64       `json:"cost"`
		Lease       *DebugLease `json:"lease"` // null: not in the lease table (the next check acquires one)
	}{Explanation: ex.String(), Rule: ex.Route.Rule.Name, Route: ex.Route.Template(), Operation: ex.Route.Operation(),
		Key: ex.Key, Cost: ex.Cost}
	if e := v.table.get(v.table.hash(ex.Route.ID, tenant), ex.Route.ID, tenant); e != nil && !e.dead.Load() {
		l := d.lease(d.clk.Now(), e)
		out.Lease = &l
	}
	writeJSON(w, out)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
