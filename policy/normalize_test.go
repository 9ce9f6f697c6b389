package policy

import (
	"errors"
	"strings"
	"testing"
)

func TestNormalize(t *testing.T) {
	for _, tc := range []struct {
		in, want string
	}{
		{"/", "/"},
		{"/orders/7", "/orders/7"},
		// Trailing slashes are dropped; the root stays.
		{"/orders/", "/orders"},
		{"/orders///", "/orders"},
		{"//", "/"},
		// Double slashes collapse.
		{"//orders//7", "/orders/7"},
		// Dot segments resolve and never climb above the root.
		{"/orders/./7", "/orders/7"},
		{"/orders/x/../7", "/orders/7"},
		{"/../../orders", "/orders"},
		{"/orders/7/..", "/orders"},
		{"/orders/7/../..", "/"},
		{"/.", "/"},
		{"/..", "/"},
		{"/a/.../b", "/a/.../b"}, // "..." is an ordinary segment
		{"/a/..b/c", "/a/..b/c"},
		// Encoded dots are dots: the upstream decodes them too.
		{"/orders/%2E%2E/admin", "/admin"},
		{"/orders/%2e/7", "/orders/7"},
		{"/orders/.%2E/admin", "/admin"},
		// Unreserved escapes are decoded, with any hex case.
		{"/%6Frders/%37", "/orders/7"},
		{"/a%2db%5Fc%7e", "/a-b_c~"},
		// Reserved escapes stay encoded, with upper-case hex: an encoded slash never splits.
		{"/files/a%2fb", "/files/a%2Fb"},
		{"/files/a%2Fb/c", "/files/a%2Fb/c"},
		{"/files/%2F..%2F", "/files/%2F..%2F"},
		{"/q%3Fx", "/q%3Fx"},
		// "%25" is decoded at most once.
		{"/a%252Fb", "/a%252Fb"},
		{"/a%25", "/a%25"},
		// The query is cut off.
		{"/orders/7?x=1&y=/../z", "/orders/7"},
		{"/orders/?", "/orders"},
		// Bytes outside pchar are encoded, so raw and encoded spellings agree.
		{"/a b", "/a%20b"},
		{"/a%20b", "/a%20b"},
		{`/a\b`, "/a%5Cb"},
		{"/a{b}|c", "/a%7Bb%7D%7Cc"},
		{"/a#b", "/a%23b"},
		{"/a\"<>^`", "/a%22%3C%3E%5E%60"},
		// Unicode: raw UTF-8 is percent-encoded; encoded UTF-8 stays encoded.
		{"/café", "/caf%C3%A9"},
		{"/caf%c3%a9", "/caf%C3%A9"},
		{"/日本", "/%E6%97%A5%E6%9C%AC"},
		{"/%FF", "/%FF"}, // encoded bytes are opaque, valid UTF-8 or not
		// Sub-delimiters, ':' and '@' stay.
		{"/a:b@c!$&'()*+,;=", "/a:b@c!$&'()*+,;="},
		// Case is kept: paths are case-sensitive.
		{"/Orders/ABC", "/Orders/ABC"},
	} {
		got, err := Normalize(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("Normalize(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
			continue
		}
		if again, err := Normalize(got); err != nil || again != got {
			t.Errorf("Normalize(Normalize(%q)) = %q, %v; want %q (idempotent)", tc.in, again, err, got)
		}
		if !isCanonical(got) {
			t.Errorf("Normalize(%q) = %q, which isCanonical rejects", tc.in, got)
		}
	}
}

func TestNormalizeErrors(t *testing.T) {
	long := "/" + strings.Repeat("a", MaxPathLen)
	for _, tc := range []struct {
		in, want string
	}{
		{"", "empty path"},
		{"orders/7", "path must start with '/'"},
		{"*", "path must start with '/'"},
		{"http://host/orders", "path must start with '/'"},
		{"?x=1", "empty path"},
		{"/a\x00b", "control character 0x00"},
		{"/a%00b", "encoded NUL"},
		{"/a\nb", "control character 0x0a"},
		{"/a\x7fb", "control character 0x7f"},
		{"/a%", "malformed percent-escape at byte 1"},
		{"/a%4", "malformed percent-escape at byte 1"},
		{"/a%zz", "malformed percent-escape at byte 1"},
		{"/a%%41", "malformed percent-escape at byte 1"},
		{"/\xff", "invalid UTF-8 at byte 0"},
		{"/caf\xc3", "invalid UTF-8 at byte 3"},
		{"/\xed\xa0\x80", "invalid UTF-8 at byte 0"}, // a UTF-16 surrogate
		{long, "path longer than 2048 bytes"},
		{"/" + strings.Repeat("é", 400), "normalized path longer than 2048 bytes"},
		{strings.Repeat("/a", MaxSegments+1), "more than 64 segments"},
	} {
		got, err := Normalize(tc.in)
		if !errors.Is(err, ErrInvalidPath) || !strings.HasSuffix(err.Error(), tc.want) {
			t.Errorf("Normalize(%.40q) = %q, %v; want ErrInvalidPath ending %q", tc.in, got, err, tc.want)
		}
	}
	// Bounds that are met exactly are fine; dot segments count after resolution.
	for _, in := range []string{
		"/" + strings.Repeat("a", MaxPathLen-1),
		strings.Repeat("/a", MaxSegments),
		strings.Repeat("/a", MaxSegments) + "/b/..",
		"/" + strings.Repeat("a", MaxPathLen-1) + "?" + strings.Repeat("q", 5000),
	} {
		if _, err := Normalize(in); err != nil {
			t.Errorf("Normalize(%.40q... %d bytes) = %v, want success", in, len(in), err)
		}
	}
}

func TestNormalizeCanonicalDoesNotAllocate(t *testing.T) {
	for _, p := range []string{"/", "/orders/7", "/users/1/orders/2/items", "/a:b@c"} {
		if n := testing.AllocsPerRun(100, func() { _, _ = Normalize(p) }); n != 0 {
			t.Errorf("Normalize(%q) allocates %v times, want 0", p, n)
		}
	}
}
