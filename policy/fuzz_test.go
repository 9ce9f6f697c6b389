package policy

import (
	"errors"
	"os"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzParse: the parser never panics, fails with located errors, and whatever it accepts keeps
// the Set's invariants (routes dense and resolvable, keys bounded and free of hash tags, digest
// deterministic).
func FuzzParse(f *testing.F) {
	example, err := os.ReadFile(examplePath)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(example)
	f.Add([]byte(precedencePolicy))
	f.Add([]byte(calendarPolicy))
	f.Add([]byte(chargesPolicy))
	f.Add([]byte(watchPolicy("v1", 100, 30)))
	f.Add([]byte(header + "  - {name: r, routes: [/a], operations: [read], limit: 1/s, cost: 2}\n"))
	f.Add([]byte("version: v1\ndefault: &d {limit: 10/minute}\nx: *d\n"))
	f.Add([]byte("version: v1\ndefault: {limit: 1/1ms, burst: 4503599627}\n"))
	f.Add([]byte("version: [\n"))
	f.Add([]byte(""))
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 1<<16 {
			return
		}
		s, err := Parse("fuzz.yaml", data)
		if err != nil {
			var pe *ParseError
			if !errors.As(err, &pe) || len(pe.Errors) == 0 {
				t.Fatalf("error %T %v is not a non-empty *ParseError", err, err)
			}
			for _, fe := range pe.Errors {
				if !strings.HasPrefix(fe.Error(), "fuzz.yaml") || fe.Msg == "" {
					t.Fatalf("error %q does not name the file or says nothing", fe.Error())
				}
			}
			return
		}
		checkSet(t, s)
		again, err := Parse("fuzz.yaml", data)
		if err != nil || again.Digest() != s.Digest() {
			t.Fatalf("parsing twice: digest %s vs %v, %v", s.Digest(), again, err)
		}
	})
}

// checkSet asserts what every valid Set guarantees.
func checkSet(t *testing.T, s *Set) {
	t.Helper()
	if s.Version() == "" || len(s.Digest()) != 64 || s.Default() == nil || s.Rule(DefaultRuleName) != s.Default() {
		t.Fatalf("set: version %q digest %q default %v", s.Version(), s.Digest(), s.Default())
	}
	worst := strings.Repeat("{", MaxTenantLen)
	for id := range s.NumRoutes() {
		r := s.RouteByID(uint32(id))
		if !r.Valid() || r.ID != uint32(id) {
			t.Fatalf("RouteByID(%d) = %v", id, r)
		}
		if got, ok := s.Lookup(r.Rule.Name, r.Template(), r.Operation()); !ok || got != r {
			t.Fatalf("Lookup(%v) = %v, %v", r, got, ok)
		}
		if c := s.Cost(r); c < 1 {
			t.Fatalf("Cost(%v) = %d", r, c)
		}
		regions := []string{""}
		for _, rq := range r.Rule.Regions {
			regions = append(regions, rq.Region)
		}
		if r.Rule.Scope == Regional {
			regions = regions[1:]
		}
		// The buckets a check charges besides its own: at most MaxCharges, each another bucket
		// whose burst takes the route's cost.
		if cs := r.Charges(); len(cs) > MaxCharges {
			t.Fatalf("%v charges %d buckets besides its own, more than %d", r, len(cs), MaxCharges)
		}
		own, _ := s.Key(r, "t", "")
		seen := map[string]bool{own: true}
		for _, id := range r.Charges() {
			c := s.RouteByID(id)
			l, err := s.Limits(c, "t", "")
			if !c.Valid() || err != nil || len(c.Charges()) != 0 || s.Cost(r) > l.Burst {
				t.Fatalf("charge %v of %v: limits %v, %v; charges %v; cost %d", c, r, l, err, c.Charges(), s.Cost(r))
			}
			if k, _ := s.Key(c, "t", ""); r.Rule.Scope != Regional && seen[k] {
				t.Fatalf("charge %v of %v: key %s twice", c, r, k)
			} else {
				seen[k] = true
			}
		}
		tenants := append([]string{worst, "t"}, r.Rule.OverrideTenants()...)
		for _, tenant := range tenants {
			for _, region := range regions {
				l, err := s.Limits(r, tenant, region)
				if err != nil {
					t.Fatalf("Limits(%v, %q, %q): %v", r, tenant, region, err)
				}
				if s.Cost(r) > l.Burst {
					t.Fatalf("cost %d above burst %d of %v", s.Cost(r), l.Burst, r)
				}
				if l.Emergency != nil && (l.Emergency.Burst >= l.Burst || rateCmp(*l.Emergency, l.Quota) >= 0) {
					t.Fatalf("emergency %v not below %v", *l.Emergency, l.Quota)
				}
				key, err := s.Key(r, tenant, region)
				if err != nil || len(key) > MaxKeyLen || checkTag(key, r, tenant) != nil {
					t.Fatalf("Key(%v, %.10q, %q) = %d bytes %q, %v, %v", r, tenant, region, len(key), key, err, checkTag(key, r, tenant))
				}
			}
		}
	}
}

// FuzzMatch: matching never panics, errors only for paths that cannot be normalized, agrees
// with matching the normalized path, and yields only the Set's routes and bounded keys.
func FuzzMatch(f *testing.F) {
	for _, seed := range []struct{ path, op string }{
		{"/orders/7", "GET"}, {"/orders/7/", "read"}, {"//orders/./7/../8", "POST"}, {"/orders/%2E%2E/x", "DELETE"},
		{"/orders/a%2Fb", "GET"}, {"/users/1/orders/2/3", "HEAD"}, {"/café", "GET"}, {"/a%00", "GET"},
		{"/a%zz", "GET"}, {"/\xff", "GET"}, {"/search?q=1", "export"}, {"", ""}, {"/products/1", "BREW"},
		{"/" + strings.Repeat("a/", 70), "GET"}, {"/%41%42", "PURGE"},
	} {
		f.Add(seed.path, seed.op, "tenant", "eu-west")
	}
	s, err := Load(examplePath)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, path, op, tenant, region string) {
		r, err := s.Match(path, op)
		norm, nerr := Normalize(path)
		if (err == nil) != (nerr == nil) {
			t.Fatalf("Match(%q) error %v, Normalize error %v", path, err, nerr)
		}
		if err != nil {
			if !errors.Is(err, ErrInvalidPath) || r.Valid() {
				t.Fatalf("Match(%q) = %v, %v; want only ErrInvalidPath", path, r, err)
			}
			return
		}
		checkNormalized(t, path, norm)
		if int(r.ID) >= s.NumRoutes() || s.RouteByID(r.ID) != r {
			t.Fatalf("Match(%q, %q) = %v, not a route of the Set", path, op, r)
		}
		if r2, err := s.Match(norm, op); err != nil || r2 != r {
			t.Fatalf("Match(%q) = %v but Match(normalized %q) = %v, %v", path, r, norm, r2, err)
		}
		if ValidTenant(tenant) != nil {
			if _, err := s.Key(r, tenant, region); !errors.Is(err, ErrInvalidTenant) {
				t.Fatalf("Key with invalid tenant %q: %v", tenant, err)
			}
			return
		}
		key, err := s.Key(r, tenant, region)
		if err != nil {
			if r.Rule.Scope == Regional && errors.Is(err, ErrUnknownRegion) {
				return
			}
			t.Fatalf("Key(%v, %q, %q): %v", r, tenant, region, err)
		}
		if len(key) > MaxKeyLen || strings.ContainsAny(key, "{}") {
			t.Fatalf("Key(%v, %q, %q) = %q", r, tenant, region, key)
		}
		// The route component is the template's shape (empty for the default rule), never the path.
		parts, err := splitKey(key)
		if err != nil || len(parts) < 4 || parts[0] != tenant || parts[1] != r.r.tmpl.shape || parts[2] != r.Operation() {
			t.Fatalf("Key(%v, %q) = %q splits into %q, %v", r, tenant, key, parts, err)
		}
	})
}

// FuzzNormalize: the canonical form is idempotent, bounded, canonical and free of dot segments,
// empty segments, NUL and raw bytes outside pchar.
func FuzzNormalize(f *testing.F) {
	for _, p := range []string{"/", "/a/b", "//a/./b/../c/", "/%2e%2E/%2F", "/caf\xc3\xa9", "/a?b", "/%", "/a%2", "/\x00"} {
		f.Add(p)
	}
	f.Fuzz(func(t *testing.T, path string) {
		norm, err := Normalize(path)
		if err != nil {
			if !errors.Is(err, ErrInvalidPath) {
				t.Fatalf("Normalize(%q) error %v is not ErrInvalidPath", path, err)
			}
			return
		}
		checkNormalized(t, path, norm)
	})
}

func checkNormalized(t *testing.T, path, norm string) {
	t.Helper()
	if !isCanonical(norm) || len(norm) > MaxPathLen || !utf8.ValidString(norm) {
		t.Fatalf("Normalize(%q) = %q is not canonical", path, norm)
	}
	if again, err := Normalize(norm); err != nil || again != norm {
		t.Fatalf("Normalize(Normalize(%q)) = %q, %v; want %q", path, again, err, norm)
	}
	if norm != "/" {
		segs := strings.Split(norm[1:], "/")
		if len(segs) > MaxSegments {
			t.Fatalf("Normalize(%q) has %d segments", path, len(segs))
		}
		for _, seg := range segs {
			if seg == "" || seg == "." || seg == ".." {
				t.Fatalf("Normalize(%q) = %q keeps segment %q", path, norm, seg)
			}
		}
	}
	// The path part's '/' count bounds the segments: an encoded slash never adds one.
	raw, _, _ := strings.Cut(path, "?")
	if strings.Count(norm, "/") > max(1, strings.Count(raw, "/")) {
		t.Fatalf("Normalize(%q) = %q has more segments than the input", path, norm)
	}
}

// FuzzKey: no tenant or region can forge another key or a hash tag.
func FuzzKey(f *testing.F) {
	f.Add("acme", "eu-west", "acme|", "eu-west")
	f.Add("a|b", "", "a", "b")
	f.Add("{x}", "us-east", "%7Bx%7D", "us-east")
	s, err := Load(examplePath)
	if err != nil {
		f.Fatal(err)
	}
	search, _ := s.Match("/search", "GET")
	orders, _ := s.Match("/orders/1", "GET")
	cs, err := Parse("charges.yaml", []byte(chargesPolicy))
	if err != nil {
		f.Fatal(err)
	}
	chat, _ := cs.Match("/v1/chat", "POST") // charged with other buckets: its keys hold a hash tag
	if !chat.r.tagged || len(chat.Charges()) < 2 {
		f.Fatalf("%v has no hash tag or too few charges", chat)
	}
	f.Fuzz(func(t *testing.T, t1, r1, t2, r2 string) {
		for _, r := range []Route{search, orders, chat, cs.RouteByID(chat.Charges()[1])} {
			set := s
			if r.r.set == cs {
				set = cs
			}
			k1, err1 := set.Key(r, t1, r1)
			k2, err2 := set.Key(r, t2, r2)
			if err1 != nil || err2 != nil {
				continue // a region this route's scope refuses; the next route may take it
			}
			same := t1 == t2 && (r1 == r2 || r.Rule.Scope != Regional) // only a regional key holds its region
			if (k1 == k2) != same {
				t.Fatalf("Key(%q, %q) = %q, Key(%q, %q) = %q", t1, r1, k1, t2, r2, k2)
			}
			if len(k1) > MaxKeyLen || checkTag(k1, r, t1) != nil {
				t.Fatalf("Key(%q, %q) = %q: %v", t1, r1, k1, checkTag(k1, r, t1))
			}
			// Tagged keys share a slot exactly when they share the tenant.
			if r.r.tagged && (hashSlotInput(k1) == hashSlotInput(k2)) != (t1 == t2) {
				t.Fatalf("Key(%q) = %q and Key(%q) = %q: tags %q, %q", t1, k1, t2, k2, hashSlotInput(k1), hashSlotInput(k2))
			}
		}
	})
}

// isCanonicalRef is isCanonical as first written, one byte a step: the reference FuzzIsCanonical
// holds the fast loop to.
func isCanonicalRef(p string) bool {
	if len(p) == 0 || p[0] != '/' || len(p) > MaxPathLen {
		return false
	}
	if len(p) == 1 {
		return true
	}
	segs, start := 0, 1
	for i := 1; i <= len(p); i++ {
		if i < len(p) && p[i] != '/' {
			if pchar[p[i]] {
				continue
			}
			if p[i] != '%' || i+2 >= len(p) || !isUpperHex(p[i+1]) || !isUpperHex(p[i+2]) {
				return false
			}
			if b := unhex(p[i+1])<<4 | unhex(p[i+2]); b == 0 || isUnreserved(b) {
				return false
			}
			i += 2
			continue
		}
		seg := p[start:i]
		if seg == "" || seg == "." || seg == ".." {
			return false
		}
		if segs++; segs > MaxSegments {
			return false
		}
		start = i + 1
	}
	return true
}

// FuzzIsCanonical: the fast canonical-form check agrees with the reference on every input.
func FuzzIsCanonical(f *testing.F) {
	for _, p := range []string{"/", "/a/b", "/a/", "//", "/a//b", "/./a", "/a/..", "/%41", "/%2F", "/%2f", "/%00",
		"/a%2", "/a%", "/%C3%A9/x", "/a b", "/" + strings.Repeat("a/", 40) + "a"} {
		f.Add(p)
	}
	f.Fuzz(func(t *testing.T, p string) {
		if got, want := isCanonical(p), isCanonicalRef(p); got != want {
			t.Fatalf("isCanonical(%q) = %v, the reference says %v", p, got, want)
		}
	})
}
