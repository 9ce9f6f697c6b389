package policy

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

// splitKey inverts the key format for tests: it returns the unescaped components after the prefix,
// or an error if the key is not well formed.
func splitKey(key string) ([]string, error) {
	rest, ok := strings.CutPrefix(key, KeyPrefix)
	if !ok {
		return nil, fmt.Errorf("no prefix %q", KeyPrefix)
	}
	if tenant, after, ok := strings.Cut(rest, string(keySep)); ok && strings.HasPrefix(tenant, "{") {
		inner, ok := strings.CutSuffix(tenant[1:], "}")
		if !ok {
			return nil, fmt.Errorf("unterminated hash tag in %q", key)
		}
		rest = inner + string(keySep) + after
	}
	var out []string
	for _, c := range strings.Split(rest, string(keySep)) {
		var b strings.Builder
		for i := 0; i < len(c); i++ {
			if c[i] != '%' {
				if mustEscape[c[i]] {
					return nil, fmt.Errorf("unescaped byte %q in component %q", c[i], c)
				}
				b.WriteByte(c[i])
				continue
			}
			if i+2 >= len(c) || !isUpperHex(c[i+1]) || !isUpperHex(c[i+2]) {
				return nil, fmt.Errorf("bad escape in %q", c)
			}
			v := unhex(c[i+1])<<4 | unhex(c[i+2])
			if !mustEscape[v] {
				return nil, fmt.Errorf("needless escape of %q in %q", v, c)
			}
			b.WriteByte(v)
			i += 2
		}
		out = append(out, b.String())
	}
	return out, nil
}

// checkTag checks a key of route r for tenant against the hash-tag rule: a route charged together
// with others has exactly one hash tag, the escaped tenant right after the prefix; any other
// route's key holds no brace.
func checkTag(key string, r Route, tenant string) error {
	if !r.r.tagged {
		if strings.ContainsAny(key, "{}") || hashSlotInput(key) != key {
			return fmt.Errorf("key %q of %v holds a hash tag", key, r)
		}
		return nil
	}
	var b strings.Builder
	keyEscape(&b, tenant)
	if !strings.HasPrefix(key, KeyPrefix+"{"+b.String()+"}"+string(keySep)) || strings.Count(key, "{") != 1 || strings.Count(key, "}") != 1 {
		return fmt.Errorf("key %q of %v: want the one hash tag {%s} after the prefix", key, r, b.String())
	}
	if hashSlotInput(key) != b.String() {
		return fmt.Errorf("key %q of %v hashes %q, want %q", key, r, hashSlotInput(key), b.String())
	}
	return nil
}

// hashSlotInput is the part of a key Redis Cluster hashes: the content of the first {...} if it is
// non-empty, else the whole key.
func hashSlotInput(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}

func TestKeyFormat(t *testing.T) {
	s := loadExample(t)
	for _, tc := range []struct {
		tenant, path, op, region string
		want                     string // key without the fingerprint, "#" in its place
	}{
		{"acme", "/orders/7", "GET", "", "lb1:acme|/orders/%7B%7D|read|#"},
		{"acme", "/users/1/orders/2/x", "HEAD", "", "lb1:acme|/users/%7B%7D/orders/*|read|#"},
		{"acme", "/orders", "export", "", "lb1:acme|/orders|export|#"},
		{"acme", "/search", "GET", "us-east", "lb1:acme|/search|read|#|us-east"},
		{"acme", "/unknown", "POST", "", "lb1:acme||write|#"},
		{"acme", "/unknown", "BREW", "", "lb1:acme||*|#"},
		{"ACME Corp", "/orders", "GET", "", "lb1:ACME%20Corp|/orders|read|#"},
		{"ä|{x}%", "/orders", "GET", "", "lb1:ä%7C%7Bx%7D%25|/orders|read|#"},
	} {
		r, err := s.Match(tc.path, tc.op)
		if err != nil {
			t.Fatal(err)
		}
		key, err := s.Key(r, tc.tenant, tc.region)
		if err != nil {
			t.Errorf("Key(%s, %q, %q): %v", r, tc.tenant, tc.region, err)
			continue
		}
		l, _ := s.Limits(r, tc.tenant, tc.region)
		if want := strings.Replace(tc.want, "#", l.Fingerprint, 1); key != want {
			t.Errorf("Key(%s, %q, %q) = %q, want %q", r, tc.tenant, tc.region, key, want)
		}
		if len(l.Fingerprint) != FingerprintLen || strings.Trim(l.Fingerprint, "0123456789abcdef") != "" {
			t.Errorf("fingerprint %q is not %d hex digits", l.Fingerprint, FingerprintLen)
		}
	}
}

// TestKeyInjection: tenants and regions built to collide with, or break out of, other keys.
func TestKeyInjection(t *testing.T) {
	s := mustParse(t, `
version: k1
default: {limit: 10/minute}
rules:
  - name: g
    routes: [/a, "/a/{x}"]
    operations: [read, write]
    limit: 10/s
  - name: r
    routes: [/reg]
    operations: [read]
    limit: 10/s
    scope: regional
    regions:
      eu: {limit: 5/s, burst: 5}
      eu.x: {limit: 5/s, burst: 5}
  - name: b
    scope: tenant
    operations: [write]
    limit: 100/s
`)
	tenants := []string{
		"acme", "acme|/a|read", "acme|", "|acme", "acme%7C", "acme%", "%25", "%", "{acme}", "{", "}", "}{",
		"a{b}c", "acme}|{x", "lb1:acme", "acme ", " acme", "ac me", "acme\u00a0", "ACME", "acmé", "acme\u200b",
		"日本", "a|b|c|d|e", "acme|/a|read|0123456789", strings.Repeat("{", MaxTenantLen),
		strings.Repeat("%", MaxTenantLen), strings.Repeat("é", MaxTenantLen/2),
	}
	var routes []Route
	for id := range s.NumRoutes() {
		routes = append(routes, s.RouteByID(uint32(id)))
	}
	type input struct{ route, tenant, region string }
	seen := map[string]input{}
	for _, r := range routes {
		regions := []string{""}
		if r.Rule.Scope == Regional {
			regions = []string{"eu", "eu.x"}
		}
		for _, tenant := range tenants {
			for _, region := range regions {
				in := input{r.String(), tenant, region}
				key, err := s.Key(r, tenant, region)
				if err != nil {
					t.Fatalf("Key(%v): %v", in, err)
				}
				if prev, dup := seen[key]; dup {
					t.Errorf("Key(%v) = Key(%v) = %q", in, prev, key)
				}
				seen[key] = in
				if len(key) > MaxKeyLen {
					t.Errorf("Key(%v) is %d bytes, more than MaxKeyLen %d", in, len(key), MaxKeyLen)
				}
				if err := checkTag(key, r, tenant); err != nil {
					t.Errorf("Key(%v): %v", in, err)
				}
				parts, err := splitKey(key)
				if err != nil {
					t.Errorf("Key(%v) = %q: %v", in, key, err)
					continue
				}
				l, _ := s.Limits(r, tenant, region)
				want := []string{tenant, r.r.tmpl.shape, r.Operation(), l.Fingerprint}
				if region != "" {
					want = append(want, region)
				}
				if fmt.Sprint(parts) != fmt.Sprint(want) {
					t.Errorf("Key(%v) = %q splits into %q, want %q", in, key, parts, want)
				}
			}
		}
	}
}

func TestInvalidTenants(t *testing.T) {
	s := loadExample(t)
	r, _ := s.Match("/orders/7", "GET")
	for _, tenant := range []string{
		"", strings.Repeat("a", MaxTenantLen+1), strings.Repeat("é", MaxTenantLen/2) + "a",
		"a\x00b", "a\nb", "a\tb", "a\x7fb", "a\u0085b", "a\u009fb", "\xff", "a\xc3", "\xed\xa0\x80",
	} {
		if _, err := s.Key(r, tenant, ""); !errors.Is(err, ErrInvalidTenant) {
			t.Errorf("Key(%.20q) = %v, want ErrInvalidTenant", tenant, err)
		}
		if err := ValidTenant(tenant); !errors.Is(err, ErrInvalidTenant) {
			t.Errorf("ValidTenant(%.20q) = %v, want ErrInvalidTenant", tenant, err)
		}
	}
	if err := ValidTenant(strings.Repeat("a", MaxTenantLen)); err != nil {
		t.Errorf("ValidTenant(%d bytes) = %v", MaxTenantLen, err)
	}
}

// TestKeyLengthBound: validation guarantees MaxKeyLen for the longest template it accepts.
func TestKeyLengthBound(t *testing.T) {
	// The longest key of this template with "read" is exactly MaxKeyLen.
	tmpl := "/" + strings.Repeat("a", 52) + "/{b}/" + strings.Repeat("c", 32) + "/{d}/eeeeee"
	s := mustParse(t, header+`  - name: r
    routes: ["`+tmpl+`"]
    operations: [read]
    limit: 1/s
`)
	r, _ := s.Match("/"+strings.Repeat("a", 52)+"/1/"+strings.Repeat("c", 32)+"/2/eeeeee", "read")
	if r.Template() != tmpl {
		t.Fatalf("matched %v", r)
	}
	key, err := s.Key(r, strings.Repeat("|", MaxTenantLen), "")
	if err != nil || len(key) != MaxKeyLen {
		t.Errorf("worst-case key is %d bytes (%v), want exactly %d", len(key), err, MaxKeyLen)
	}
}
