package agent_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

// TestRefillBatching: a thousand keys wanting a refill at once, with a slow coordinator, travel in
// a few batched calls: no call carries more than agent.MaxBatch keys, no more than
// agent.DefaultMaxInFlight calls are in flight, and every check is answered from a lease.
func TestRefillBatching(t *testing.T) {
	s := newStack(t, parsePolicy(t, benchPolicy), stackOptions{maxWait: 5 * time.Second})
	s.coord.setFault(slow)
	const keys = 1000
	var wg sync.WaitGroup
	errs := make(chan error, keys)
	for i := range keys {
		wg.Go(func() {
			q := agent.Query{Tenant: fmt.Sprintf("tenant-%d", i), Path: "/api/x", Operation: "GET"}
			v, err := s.srv.Decide(ctxTimeout(t, 10*time.Second), q)
			if err == nil && (v.Outcome != agent.Allow || v.Degraded) {
				err = fmt.Errorf("tenant-%d: %s", i, show(v))
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	s.coord.mu.Lock()
	defer s.coord.mu.Unlock()
	total := 0
	for _, n := range s.coord.batches {
		if n > agent.MaxBatch {
			t.Fatalf("an Acquire carried %d keys, more than MaxBatch %d", n, agent.MaxBatch)
		}
		total += n
	}
	if total != keys {
		t.Fatalf("Acquires carried %d keys in all, want %d (one refill per key)", total, keys)
	}
	if s.coord.maxInflight > agent.DefaultMaxInFlight {
		t.Fatalf("%d Acquires in flight at once, more than %d", s.coord.maxInflight, agent.DefaultMaxInFlight)
	}
	if len(s.coord.batches) >= keys/10 {
		t.Fatalf("%d Acquire calls for %d keys: refills were not batched", len(s.coord.batches), keys)
	}
}

// TestTimedOutAcquireRetriedWithSameSeq: an Acquire that times out is sent again with the same
// seq (the coordinator answers a repeat without charging twice), and its lease serves the check.
func TestTimedOutAcquireRetriedWithSameSeq(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{callTimeout: 50 * time.Millisecond, maxWait: 2 * time.Second})
	s.coord.setFault(hangOnce)
	q := agent.Query{Tenant: "acme", Path: "/orders/7", Operation: "GET"}
	v, err := s.srv.Decide(ctxTimeout(t, 5*time.Second), q)
	if err != nil || v.Outcome != agent.Allow || v.Degraded {
		t.Fatalf("Decide = %s, %v; want allow from the retried Acquire", show(v), err)
	}
	seqs := s.coord.acquireSeqs()
	if len(seqs) < 2 || seqs[0] != seqs[1] {
		t.Fatalf("Acquire seqs %v: want the timed-out call retried with its seq", seqs)
	}
}

// TestExpirySweep: an idle key's lease expires and the sweep retires it without any further
// check. Its unspent tokens are not sent back: a return is credited its unspent tokens less the
// refill since the grant, and a lease that expired unspent has seen the bucket refill a quarter
// of its burst (lease.TTL), more than this lease sized to the key's demand over half a lifetime —
// the Return would cost a store operation and credit nothing.
func TestExpirySweep(t *testing.T) {
	// 100 per second with a burst of 80: leases live 200 ms.
	set := parsePolicy(t, `
version: "v1"
rules:
  - name: fast
    routes: ["/fast"]
    operations: [read]
    limit: 6000/minute
    burst: 80
default:
  limit: 60/minute
  burst: 10
`)
	s := newStack(t, set, stackOptions{})
	q := agent.Query{Tenant: "acme", Path: "/fast", Operation: "GET"}
	s.warm(t, q)
	held := s.lim.Outstanding()
	skipped, skippedMicro := s.lim.Stats().ReturnsSkipped.Load(), s.lim.Stats().SkippedMicro.Load()
	eventually(t, 5*time.Second, "the expired lease retired", func() bool {
		return s.lim.Stats().ReturnsSkipped.Load() == skipped+1
	})
	s.coord.mu.Lock()
	returned := s.coord.returned
	s.coord.mu.Unlock()
	if returned != 0 {
		t.Fatalf("a Return carried %d µ of a lease the refill since its grant covers", returned)
	}
	if s.lim.Stats().Expired.Load() != 1 || s.lim.Outstanding() != 0 || s.lim.Stats().SkippedMicro.Load()-skippedMicro != uint64(held) {
		t.Fatalf("expired %d, outstanding %d µ, given up %d µ; want 1, 0 and the %d µ of the lease",
			s.lim.Stats().Expired.Load(), s.lim.Outstanding(), s.lim.Stats().SkippedMicro.Load()-skippedMicro, held)
	}
	// An outside ledger of the key needs to see it: the lease given up, its tokens counted.
	values := metricValues(t, s.reg)
	if n, tok := values["leasebucket_agent_lease_skipped_returns_total"], values["leasebucket_agent_lease_skipped_tokens_total"]; n != float64(skipped+1) || tok != float64(s.lim.Stats().SkippedMicro.Load())/float64(bucket.PerToken) {
		t.Fatalf("exported %v skipped returns of %v tokens, want %d of %v", n, tok, skipped+1, float64(s.lim.Stats().SkippedMicro.Load())/float64(bucket.PerToken))
	}
}

// TestLostAnswerIsResent: Acquires the store applied but whose answers never came (every retry
// too) strand nothing: the key's next refill sends the same seq again, the coordinator answers
// it from its record, and every token debited in the global bucket is spent or returned.
func TestLostAnswerIsResent(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{callTimeout: 50 * time.Millisecond, maxWait: 200 * time.Millisecond})
	q := agent.Query{Tenant: "acme", Path: "/orders/7", Operation: "GET"} // orders-read: 100/minute, burst 20
	s.coord.setFault(lostAnswers)
	if v, err := s.srv.Decide(ctxTimeout(t, 5*time.Second), q); err != nil || v.Outcome == agent.Allow {
		t.Fatalf("Decide while answers are lost = %s, %v; want the failure mode", show(v), err)
	}
	full := bucket.Micro(20) * bucket.PerToken
	debited := full - s.level(t, q.Path, q.Operation, q.Tenant)
	if debited <= 0 {
		t.Fatal("the lost Acquire debited nothing: the test shows nothing")
	}
	first := s.coord.acquireSeqs()[0]
	s.coord.setFault(healthy)
	s.awaitAllow(t, q)
	const allowed = 1
	seqs := s.coord.acquireSeqs()
	if last := seqs[len(seqs)-1]; last != first || s.lim.Stats().Resends.Load() == 0 {
		t.Fatalf("Acquire seqs %v: want the lost seq %d sent again", seqs, first)
	}
	// The replayed grant is the agent's lease: nothing more was debited for the allow.
	if now := full - s.level(t, q.Path, q.Operation, q.Tenant); now != debited {
		t.Fatalf("debited %d µ after the resend, %d before: the resend was charged again", now, debited)
	}
	s.stop(t)
	// Shut down, the agent returned its lease: the bucket lacks exactly what was allowed.
	if left := s.level(t, q.Path, q.Operation, q.Tenant); left != full-bucket.Micro(allowed)*bucket.PerToken {
		t.Fatalf("bucket at %d µ after shutdown, want %d: %d µ stranded", left, full-bucket.Micro(allowed)*bucket.PerToken,
			full-bucket.Micro(allowed)*bucket.PerToken-left)
	}
}
