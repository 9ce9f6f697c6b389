package stackbench

import (
	"fmt"
	"strconv"
	"time"
)

// Mode is how the benchmarked rule spends its global bucket.
type Mode string

// Modes. Empty is not a rule: it names runs against the empty handler (cmd emptyagent).
const (
	Lease  Mode = "lease"  // lease: on, agents hold leases sized by demand
	Direct Mode = "direct" // lease: off, every check one atomic take in the global bucket
	Empty  Mode = "empty"  // no limiter: every check allowed by a handler that does nothing else
	// Control is a second direct rule beside direct and lease (-stackbench.aa): its ratios to
	// direct, which does the same work, are the comparison's own noise.
	Control Mode = "control"
	// EmptyControl is a second empty handler, a process of its own (-stackbench.aa, hot-key
	// case): its ratio to the empty handler is the noise of a comparison between two processes.
	EmptyControl Mode = "empty-control"
)

// Bare reports whether m's runs are against an empty handler (Empty or EmptyControl): no rule,
// no coordinator, no Redis.
func (m Mode) Bare() bool { return m == Empty || m == EmptyControl }

// Compared reports whether m's rows are compared with the direct row of their case and API.
func (m Mode) Compared() bool { return m == Lease || m == Control }

// Operation is what every check does: a read.
const Operation = "GET"

// Rule is the name of mode m's rule in a case's policy file: the mode's name. Empty has none.
func (m Mode) Rule() string {
	if m != Lease && m != Direct && m != Control {
		panic(fmt.Sprintf("stackbench: no rule for mode %q", m))
	}
	return string(m)
}

// prefix is what the routes of mode m's rule begin with.
func (m Mode) prefix() string { return "/v1/" + m.Rule() + "/" }

// Route is the route template of mode m's rule, and Path the route its checks ask for: each mode
// its own route and rule (and so its own buckets) in the one policy file of a case's stack.
func (m Mode) Route() string { return m.prefix() + "{id}" }

// Path is a route of m's rule (Route): what every check of a mode-m load asks for. An empty
// handler's load asks for Lease's.
func (m Mode) Path() string {
	if m.Bare() {
		m = Lease
	}
	return m.prefix() + "42"
}

// Limits of the benchmarked rule, and why.
const (
	// HotLimit and HotBurst never deny one key at any rate one agent serves (10 million checks a
	// second, two orders of magnitude above the stream ceiling measured in agent's
	// BenchmarkUnixCheckStream): the hot-key case measures what a check costs, never a denial.
	// τ = C/(4r) = 250 ms.
	HotLimit = "10000000/second"
	HotBurst = 10_000_000

	// TenantLimit and TenantBurst are a per-tenant limit of the order public APIs publish for
	// one account (tens to hundreds of requests a second): 100 a second with a burst of one
	// second's worth. τ = C/(4r) = 250 ms, the lease lifetime the long-tail targets were set at. The
	// uniform cases never deny with it (a key is checked far less than 4 times a second there);
	// under Zipf s=1.1 the head tenants go over it, as the heaviest tenants of a real API do, and
	// are denied.
	TenantLimit = "100/second"
	TenantBurst = 100
)

// TTL is the lease lifetime of every case's rules: τ = C/(4r) = 250 ms for both limits above
// (lease.TTL; TestPolicies checks it).
const TTL = 250 * time.Millisecond

// Case is one key distribution and the rule its tenants are limited by.
type Case struct {
	Name  string
	Keys  Dist
	Limit string // the rule's limit, as the policy file writes it
	Burst int64
}

// Cases are the benchmark's cases, in the order they run.
var Cases = []Case{
	{Name: "hot", Keys: Dist{Kind: Hot, N: 1}, Limit: HotLimit, Burst: HotBurst},
	{Name: "uniform-10k", Keys: Dist{Kind: Uniform, N: 10_000}, Limit: TenantLimit, Burst: TenantBurst},
	{Name: "uniform-100k", Keys: Dist{Kind: Uniform, N: 100_000}, Limit: TenantLimit, Burst: TenantBurst},
	{Name: "zipf-1.1-100k", Keys: Dist{Kind: Zipf, N: 100_000, S: 1.1}, Limit: TenantLimit, Burst: TenantBurst},
}

// PolicyYAML is the policy file of case c's stack: one rule per mode of modes (Lease, Direct or
// Control; each once), named for its mode, on the mode's route (Mode.Route) for reads, with the
// case's limit, and `lease: on` (Lease) or `lease: off`; and the Envoy descriptor mapping spelled
// out (tenant, path, method). The rest goes to a default rule no benchmark check reaches.
func PolicyYAML(c Case, modes ...Mode) []byte {
	b := fmt.Appendf(nil, `version: %q
envoy:
  domain: leasebucket
  tenant_key: tenant
  route_key: path
  operation_key: method
rules:
`, "stackbench-"+c.Name)
	for _, m := range modes {
		lease := "on"
		if m != Lease {
			lease = "off"
		}
		b = fmt.Appendf(b, `  - name: %s
    routes: [%q]
    operations: [read]
    limit: %s
    burst: %s
    lease: %s
`, m.Rule(), m.Route(), c.Limit, strconv.FormatInt(c.Burst, 10), lease)
	}
	return append(b, `default:
  limit: 60/minute
  burst: 10
`...)
}
