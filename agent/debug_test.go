package agent_test

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/leasebucket/leasebucket/agent"
)

// TestListenDebug: the debug endpoint listens on loopback addresses only.
func TestListenDebug(t *testing.T) {
	for _, addr := range []string{":0", "0.0.0.0:0", "[::]:0", "10.1.2.3:0", "192.168.0.1:7073", "example.com:0", "nonsense"} {
		if ln, err := agent.ListenDebug(addr); err == nil {
			ln.Close()
			t.Errorf("ListenDebug(%q) listened on %v", addr, ln.Addr())
		} else if addr != "nonsense" && !errors.Is(err, agent.ErrDebugNotLoopback) {
			t.Errorf("ListenDebug(%q) = %v, want ErrDebugNotLoopback", addr, err)
		}
	}
	for _, addr := range []string{"127.0.0.1:0", "localhost:0", "127.0.0.2:0"} {
		ln, err := agent.ListenDebug(addr)
		if err != nil {
			t.Fatalf("ListenDebug(%q) = %v", addr, err)
		}
		ln.Close()
	}
}

func getJSON(t testing.TB, h http.Handler, url string, into any) int {
	t.Helper()
	rr := httptest.NewRecorder()
	h.ServeHTTP(rr, httptest.NewRequest(http.MethodGet, url, nil))
	body, _ := io.ReadAll(rr.Body)
	if rr.Code == http.StatusOK {
		if err := json.Unmarshal(body, into); err != nil {
			t.Fatalf("%s: %v\n%s", url, err, body)
		}
	}
	return rr.Code
}

// TestDebugEndpoint: the live leases are listed with their rule, template, operation, tenant,
// tokens and expiry; explain resolves a request and shows its key's lease; neither changes the
// lease table (a tenant explained is not added, a listing leaves the keys as they were).
func TestDebugEndpoint(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	for _, q := range []agent.Query{
		{Tenant: "acme", Path: "/orders/7", Operation: "GET"},
		{Tenant: "acme", Path: "/products/3", Operation: "GET"},
		{Tenant: "bigcorp", Path: "/orders/7", Operation: "GET"},
	} {
		s.warm(t, q)
	}
	h := agent.DebugHandler(s.lim, s.clk)
	var list struct {
		PolicyVersion string             `json:"policy_version"`
		Keys          int                `json:"keys"`
		Leases        []agent.DebugLease `json:"leases"`
		Truncated     bool               `json:"truncated"`
	}
	if code := getJSON(t, h, "/debug/leases", &list); code != http.StatusOK {
		t.Fatalf("leases: %d", code)
	}
	if list.PolicyVersion != "2026-12-01.1" || list.Keys != 3 || len(list.Leases) != 3 || list.Truncated {
		t.Fatalf("leases = %+v", list)
	}
	l := list.Leases[0] // sorted: acme catalog-read, acme orders-read, bigcorp orders-read
	if l.Tenant != "acme" || l.Rule != "catalog-read" || l.Route != "/products/{sku}" || l.Operation != "read" ||
		l.Tokens <= 0 || l.ExpiresInMs <= 0 || l.Burst != 60 || l.Limit != "600/1m burst 60" {
		t.Fatalf("first lease = %+v", l)
	}
	if b := list.Leases[2]; b.Tenant != "bigcorp" || b.Burst != 100 {
		t.Fatalf("bigcorp's lease = %+v, want its override's burst of 100", b)
	}
	if code := getJSON(t, h, "/debug/leases?tenant=acme&rule=orders-read&limit=5", &list); code != http.StatusOK || len(list.Leases) != 1 || list.Leases[0].Rule != "orders-read" {
		t.Fatalf("filtered leases = %d %+v", code, list)
	}
	if code := getJSON(t, h, "/debug/leases?limit=1", &list); code != http.StatusOK || len(list.Leases) != 1 || !list.Truncated {
		t.Fatalf("limit=1 = %d %+v", code, list)
	}

	var ex struct {
		Explanation string            `json:"explanation"`
		Rule        string            `json:"rule"`
		Route       string            `json:"route"`
		Key         string            `json:"key"`
		Lease       *agent.DebugLease `json:"lease"`
	}
	if code := getJSON(t, h, "/debug/explain?tenant=acme&route=/orders/7&op=GET", &ex); code != http.StatusOK {
		t.Fatalf("explain: %d", code)
	}
	if ex.Rule != "orders-read" || ex.Route != "/orders/{id}" || !strings.HasPrefix(ex.Key, "lb1:acme|/orders/%7B%7D|read|") ||
		!strings.Contains(ex.Explanation, "100 per 1m, burst 20") || ex.Lease == nil || ex.Lease.Tokens <= 0 {
		t.Fatalf("explain = %+v", ex)
	}
	if code := getJSON(t, h, "/debug/explain?tenant=newcomer&route=/orders/7&op=GET", &ex); code != http.StatusOK || ex.Lease != nil {
		t.Fatalf("explain of a tenant without a key = %d %+v, want no lease", code, ex)
	}
	if n := s.lim.Keys(); n != 3 {
		t.Fatalf("%d keys after the debug calls, want the 3 checked (nothing added)", n)
	}
	for _, bad := range []string{"/debug/explain?route=/x", "/debug/explain?tenant=a&route=%2500", "/debug/leases?limit=0"} {
		if code := getJSON(t, h, bad, &ex); code != http.StatusBadRequest {
			t.Errorf("%s: %d, want 400", bad, code)
		}
	}
	rr := httptest.NewRecorder()
	h.ServeHTTP(rr, httptest.NewRequest(http.MethodPost, "/debug/leases", nil))
	if rr.Code != http.StatusMethodNotAllowed {
		t.Errorf("POST: %d, want 405", rr.Code)
	}
}
