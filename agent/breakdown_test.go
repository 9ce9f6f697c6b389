package agent

import "testing"

// BenchmarkCheckMatch is the route resolution inside BenchmarkCheck's query (policy.Set.Match:
// normalize the path, walk the templates). BenchmarkSpend is the lease half (hash the key, find
// the entry, spend); Check is about their sum plus building the verdict.
func BenchmarkCheckMatch(b *testing.B) {
	set := testSet(b)
	q := Query{Tenant: "acme", Path: "/api/orders", Operation: "GET"}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := set.Match(q.Path, q.Operation); err != nil {
			b.Fatal(err)
		}
	}
}
