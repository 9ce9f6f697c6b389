package policy

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Bucket keys have the form
//
//	lb1:<tenant>|<route>|<operation>|<fingerprint>[|<region>]
//	lb1:{<tenant>}|<route>|<operation>|<fingerprint>[|<region>]   (buckets charged together)
//
// <route> is the template's shape (parameter names erased: "/orders/{}"), or empty for the
// default rule; <fingerprint> is the key version (Limits.Fingerprint); <region> is present only for
// rules with regional scope. Every component is escaped with keyEscape, which removes '|', '{' and
// '}' (and '%', space and control bytes) from it, so the components of a key are recovered by
// splitting at '|' and no input can forge another key.
//
// A bucket that a check can charge together with others (a route with charges, and each route it
// charges: a rule's further limits, a tenant budget) wraps its escaped tenant in braces: a Redis
// Cluster hash tag, so that every such bucket of one tenant is in one slot and a direct check takes
// them in one atomic script. The tag is exactly the escaped tenant (which holds no brace), so no
// tenant can forge another's tag, and a tagged key (its tenant component starts with '{') never
// equals an untagged one. Other keys hold no brace: the cluster hashes the whole key.
const (
	// KeyPrefix starts every bucket key; the digit is the key format's version.
	KeyPrefix = "lb1:"

	// MaxTenantLen bounds a tenant identifier (UTF-8 bytes). Longer tenants are rejected, never
	// truncated or hashed: two tenants must never share a bucket.
	MaxTenantLen = 128

	// MaxKeyLen bounds every bucket key the package builds, for every valid tenant and region.
	// Validation rejects a policy any of whose routes could exceed it with a MaxTenantLen tenant
	// whose every byte needs escaping (3 bytes each). It is well below coordinator.MaxKey.
	MaxKeyLen = 512

	// FingerprintLen is the number of hex digits of a limit's fingerprint in a key: 40 bits, so
	// that two different limits of one (tenant, route, operation) practically never share a key.
	FingerprintLen = 10

	keySep = '|'

	// tagLen is what a hash tag adds to a key: the braces around the tenant.
	tagLen = 2
)

// ErrInvalidTenant is wrapped when a tenant cannot be part of a key.
var ErrInvalidTenant = errors.New("policy: invalid tenant")

// ValidTenant checks a tenant identifier: 1..MaxTenantLen bytes of valid UTF-8 without control
// characters. It does not allocate.
func ValidTenant(tenant string) error {
	switch {
	case tenant == "":
		return fmt.Errorf("%w: empty", ErrInvalidTenant)
	case len(tenant) > MaxTenantLen:
		return fmt.Errorf("%w: longer than %d bytes", ErrInvalidTenant, MaxTenantLen)
	}
	for i := 0; i < len(tenant); {
		c := tenant[i]
		if c < utf8.RuneSelf {
			if c < 0x20 || c == 0x7f {
				return fmt.Errorf("%w: control character at byte %d", ErrInvalidTenant, i)
			}
			i++
			continue
		}
		r, n := utf8.DecodeRuneInString(tenant[i:])
		if r == utf8.RuneError && n <= 1 {
			return fmt.Errorf("%w: invalid UTF-8 at byte %d", ErrInvalidTenant, i)
		}
		if unicode.IsControl(r) {
			return fmt.Errorf("%w: control character at byte %d", ErrInvalidTenant, i)
		}
		i += n
	}
	return nil
}

// mustEscape marks the bytes keyEscape encodes: the separator, the hash-tag braces, the escape
// byte itself, space and control bytes. Other bytes (including UTF-8) stay as they are.
var mustEscape = func() (t [256]bool) {
	for c := 0; c <= 0x20; c++ {
		t[c] = true
	}
	for _, c := range []byte{0x7f, '%', '{', '}', keySep} {
		t[c] = true
	}
	return t
}()

// escapedLen is the length of s after keyEscape.
func escapedLen(s string) int {
	n := len(s)
	for i := 0; i < len(s); i++ {
		if mustEscape[s[i]] {
			n += 2
		}
	}
	return n
}

// keyEscape appends s to b with every mustEscape byte written as %XX. The mapping is injective
// ('%' is itself escaped) and its output holds none of '|', '{', '}'.
func keyEscape(b *strings.Builder, s string) {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if mustEscape[c] {
			b.WriteByte('%')
			b.WriteByte(upperHex[c>>4])
			b.WriteByte(upperHex[c&15])
		} else {
			b.WriteByte(c)
		}
	}
}

// hashTag is the hash tag of a key built by buildKey, or "" when it has none.
func hashTag(key string) string {
	rest, ok := strings.CutPrefix(key, KeyPrefix+"{")
	if !ok {
		return ""
	}
	tag, _, _ := strings.Cut(rest, "}")
	return tag
}

// maxKeyLen is the longest key of a route: a tenant of MaxTenantLen bytes all escaped, plus the
// escaped route, operation and longest region.
func maxKeyLen(shape, op string, maxRegion int) int {
	n := len(KeyPrefix) + 3*MaxTenantLen + 1 + escapedLen(shape) + 1 + escapedLen(op) + 1 + FingerprintLen
	if maxRegion > 0 {
		n += 1 + maxRegion
	}
	return n
}

// buildKey builds a key; tagged wraps the escaped tenant in a hash tag (see KeyPrefix).
func buildKey(tenant, shape, op, fingerprint, region string, tagged bool) string {
	var b strings.Builder
	b.Grow(len(KeyPrefix) + escapedLen(tenant) + escapedLen(shape) + escapedLen(op) + len(fingerprint) + len(region) + 8 + tagLen)
	b.WriteString(KeyPrefix)
	if tagged {
		b.WriteByte('{')
		keyEscape(&b, tenant)
		b.WriteByte('}')
	} else {
		keyEscape(&b, tenant)
	}
	b.WriteByte(keySep)
	keyEscape(&b, shape)
	b.WriteByte(keySep)
	keyEscape(&b, op)
	b.WriteByte(keySep)
	b.WriteString(fingerprint)
	if region != "" {
		b.WriteByte(keySep)
		keyEscape(&b, region)
	}
	return b.String()
}

// fingerprint is the key version of an effective limit: the first FingerprintLen hex digits of
// SHA-256 over a canonical encoding of what the global bucket's state depends on (capacity, the
// reduced refill rate, the scope and the region slice). Limits that are equal in that sense (such
// as 100/minute and 200/2m with one burst) share it; anything else a rule says (costs, failure
// mode, shadow, headers, templates) does not enter it, so changing those keeps the bucket state.
//
// A calendar quota's fingerprint is over its own encoding (the quota, the period and the time
// zone): a counter and a bucket never share a key, and token-bucket fingerprints are unchanged.
func fingerprint(q Quota, scope Scope, region string) string {
	if q.Calendar != nil {
		sum := sha256.Sum256(fmt.Appendf(nil, "lb-calendar-v1\nquota=%d\nperiod=%s\nzone=%s\nscope=%s\nregion=%s\n",
			q.Bucket.Capacity(), q.Calendar.Unit, q.Calendar.Loc, scope, region))
		return hex.EncodeToString(sum[:])[:FingerprintLen]
	}
	num, den := q.Bucket.Rate()
	sum := sha256.Sum256(fmt.Appendf(nil, "lb-limit-v1\ncapacity=%d\nrate=%d/%d\nscope=%s\nregion=%s\n",
		q.Bucket.Capacity(), num, den, scope, region))
	return hex.EncodeToString(sum[:])[:FingerprintLen]
}
