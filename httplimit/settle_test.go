package httplimit_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/httplimit"
)

// settlingChecker is a fakeChecker that can Settle: it records each settle on a channel.
type settlingChecker struct {
	fakeChecker
	settled chan [2]int64
}

func (s *settlingChecker) Settle(_ context.Context, id uint64, cost int64) (client.Settled, error) {
	s.settled <- [2]int64{int64(id), cost}
	return client.Settled{Charged: cost}, nil
}

// TestSettleCosts: with SettleCosts, checks go out as estimates to settle; the cost the handler
// reports with ReportCost settles the check after the handler; a handler that reports nothing
// leaves the estimate; a Checker that cannot settle is refused at New.
func TestSettleCosts(t *testing.T) {
	chk := &settlingChecker{settled: make(chan [2]int64, 4)}
	chk.set(client.Result{Decision: client.Allow, Rule: "api", SettleID: 77}, nil)
	f, err := httplimit.New(httplimit.Config{
		Checker: chk, Policy: httplimit.Static(loadExample(t)), SettleCosts: true,
		Identity: func(*http.Request) (string, bool) { return "acme", true },
		Cost:     func(*http.Request) int64 { return 5 },
	})
	if err != nil {
		t.Fatal(err)
	}
	report := true
	h := f.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if report {
			httplimit.ReportCost(r.Context(), 42)
		}
		_, _ = w.Write([]byte("answer"))
	}))
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("GET", "/orders/1", nil))
	if w.Code != http.StatusOK || w.Body.String() != "answer" {
		t.Fatalf("response %d %q, want the handler's", w.Code, w.Body.String())
	}
	if reqs := chk.requests(); len(reqs) != 1 || !reqs[0].Settle || reqs[0].Cost != 5 {
		t.Fatalf("checks %+v, want one estimate of 5 to settle", reqs)
	}
	select {
	case got := <-chk.settled:
		if got != [2]int64{77, 42} {
			t.Errorf("settled %v, want check 77 at 42", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the reported cost was not settled")
	}
	report = false
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/orders/1", nil))
	select {
	case got := <-chk.settled:
		t.Errorf("settled %v without a reported cost, want the estimate to stand", got)
	case <-time.After(100 * time.Millisecond):
	}
	// ReportCost outside such a request does nothing.
	httplimit.ReportCost(context.Background(), 3)

	_, err = httplimit.New(httplimit.Config{Checker: &fakeChecker{}, Policy: httplimit.Static(loadExample(t)), SettleCosts: true,
		Identity: func(*http.Request) (string, bool) { return "acme", true }})
	if err == nil || !strings.Contains(err.Error(), "Settle") {
		t.Errorf("New with a Checker that cannot settle = %v, want an error", err)
	}
}
