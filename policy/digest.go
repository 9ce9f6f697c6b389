package policy

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"sort"
	"strings"
)

// digest hashes a canonical rendering of everything the Set means: sorted, independent of
// formatting, comments and the order of rules, templates or map entries.
func digest(s *Set) string {
	var b strings.Builder
	fmt.Fprintf(&b, "leasebucket-policy-v1\nversion %q\n", s.version)
	for _, m := range sortedKeys(s.methods) {
		fmt.Fprintf(&b, "method %q %q\n", m, s.methods[m])
	}
	for _, o := range sortedKeys(s.named) {
		fmt.Fprintf(&b, "operation %q %q\n", o, s.named[o])
	}
	fmt.Fprintf(&b, "envoy %q %q %q %q\n", s.envoy.Domain, s.envoy.TenantKey, s.envoy.RouteKey, s.envoy.OperationKey)
	if s.envoy.SettleKey != "settle" {
		fmt.Fprintf(&b, "envoy settle_key %q\n", s.envoy.SettleKey) // only when set: digests of earlier policies stay
	}
	if s.envoy.PerDescriptor {
		b.WriteString("envoy charge per_descriptor\n")
	}
	rules := append(s.Rules(), s.def)
	sort.Slice(rules, func(i, j int) bool { return rules[i].Name < rules[j].Name })
	q := func(q Quota) string {
		if q.Calendar != nil {
			return fmt.Sprintf("%d/calendar %s %q", q.Requests, q.Calendar.Unit, q.Calendar.Loc)
		}
		return fmt.Sprintf("%d/%d/%d", q.Requests, q.Period.Milliseconds(), q.Burst)
	}
	for _, r := range rules {
		fmt.Fprintf(&b, "rule %q default=%t\n description %q\n", r.Name, r.Default, r.Description)
		fmt.Fprintf(&b, " templates %q\n", sorted(r.Templates))
		fmt.Fprintf(&b, " operations %q\n", sorted(r.Operations))
		fmt.Fprintf(&b, " quota %s scope %s\n", q(r.Quota), r.Scope)
		for _, x := range r.Extra {
			fmt.Fprintf(&b, " limit %d %s\n", x.Nth, q(x.Quota))
		}
		for _, rq := range r.Regions {
			fmt.Fprintf(&b, " region %q %s\n", rq.Region, q(rq.Quota))
		}
		fmt.Fprintf(&b, " on_failure %s retry %d", r.OnFailure, r.FailureRetryAfter.Milliseconds())
		if r.Emergency != nil {
			fmt.Fprintf(&b, " emergency %s", q(*r.Emergency))
		}
		fmt.Fprintf(&b, "\n shadow %t headers %t direct %t\n", r.Shadow, r.Headers, r.Direct)
		if r.MaxDebt > 0 {
			// Only when set: a policy without max_debt keeps the digest it had before the field.
			fmt.Fprintf(&b, " max_debt %d\n", r.MaxDebt)
		}
		fmt.Fprintf(&b, " cost %d\n", r.cost)
		for _, op := range sortedKeys(r.costs) {
			fmt.Fprintf(&b, " cost %q %d\n", op, r.costs[op])
		}
		for _, t := range sortedKeys(r.overrides) {
			o := r.overrides[t]
			fmt.Fprintf(&b, " override %q %s", t, q(o.quota))
			for _, rq := range o.regions {
				fmt.Fprintf(&b, " region %q %s", rq.Region, q(rq.Quota))
			}
			if o.emergency != nil {
				fmt.Fprintf(&b, " emergency %s", q(*o.emergency))
			}
			b.WriteByte('\n')
		}
	}
	sum := sha256.Sum256([]byte(b.String()))
	return hex.EncodeToString(sum[:])
}

func sorted(s []string) []string {
	out := append([]string(nil), s...)
	slices.Sort(out)
	return out
}
