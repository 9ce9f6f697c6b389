package policy

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"
)

const (
	// MaxPathLen bounds a request path, before and after normalization. Longer paths are rejected
	// rather than truncated: a truncated path could match a template the full path does not. 2048
	// bytes is above what browsers and common proxies accept in a whole URL.
	MaxPathLen = 2048

	// MaxSegments bounds the segments of a normalized path, so matching work is bounded whatever
	// the input.
	MaxSegments = 64
)

// ErrInvalidPath is wrapped by the errors of Normalize and Match: the path cannot be normalized
// safely. The gateway should answer 400; nothing is charged.
var ErrInvalidPath = errors.New("policy: invalid request path")

// pchar marks the bytes a canonical path segment holds unencoded: RFC 3986 unreserved
// characters, sub-delimiters, ':' and '@'. Every other byte is percent-encoded in canonical form.
var pchar = func() (t [256]bool) {
	for _, c := range []byte("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+,;=:@") {
		t[c] = true
	}
	return t
}()

func isUnreserved(c byte) bool {
	return 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || '0' <= c && c <= '9' ||
		c == '-' || c == '.' || c == '_' || c == '~'
}

// Normalize returns the canonical form of a request path, the only form that is ever matched
// against templates. The rules (docs/policy.md, "Route normalization"):
//
//   - a query ("?...") is cut off; the path must then start with '/';
//   - percent-escapes of unreserved characters (A-Z a-z 0-9 - . _ ~) are decoded, all other
//     escapes are kept with upper-case hex: "%2F" stays inside its segment and never splits it,
//     "%25" is never decoded twice;
//   - bytes outside RFC 3986 pchar (space, '"', '<', '>', '\\', '{', '|', '}', non-ASCII UTF-8, ...)
//     are percent-encoded, so a raw and an encoded spelling of the same bytes are one path;
//   - NUL (raw or "%00"), other raw control characters, malformed escapes and invalid UTF-8 are
//     errors;
//   - empty segments ("//") are removed, "." and ".." are resolved and never climb above "/";
//   - a trailing slash is dropped ("/orders/" is "/orders"); the root stays "/";
//   - case is preserved: paths are case-sensitive;
//   - at most MaxPathLen bytes in and out, at most MaxSegments segments.
//
// Normalize is idempotent. An already canonical path is returned without allocating.
func Normalize(path string) (string, error) {
	if q := strings.IndexByte(path, '?'); q >= 0 {
		path = path[:q]
	}
	if isCanonical(path) {
		return path, nil
	}
	return normalizeSlow(path)
}

// isCanonical reports whether p is already in canonical form: it starts with '/', holds only
// pchar bytes, '/' and canonical escapes (upper-case hex of a byte that is neither NUL nor
// unreserved), has no empty, "." or ".." segment and no trailing slash, and is within the length
// and segment bounds. It does not allocate.
func isCanonical(p string) bool {
	if len(p) == 0 || p[0] != '/' || len(p) > MaxPathLen {
		return false
	}
	if len(p) == 1 {
		return true
	}
	segs, start := 0, 1
	for i := 1; ; {
		// A segment's plain bytes in a tight loop: every check's path passes here.
		for i < len(p) && pchar[p[i]] {
			i++
		}
		if i < len(p) && p[i] != '/' {
			if p[i] != '%' || i+2 >= len(p) || !isUpperHex(p[i+1]) || !isUpperHex(p[i+2]) {
				return false
			}
			if b := unhex(p[i+1])<<4 | unhex(p[i+2]); b == 0 || isUnreserved(b) {
				return false
			}
			i += 3
			continue
		}
		// The end of a segment: '/' or the end of the path.
		seg := p[start:i]
		if seg == "" || seg == "." || seg == ".." {
			return false
		}
		if segs++; segs > MaxSegments {
			return false
		}
		if i == len(p) {
			return true
		}
		i++
		start = i
	}
}

func normalizeSlow(path string) (string, error) {
	switch {
	case path == "":
		return "", fmt.Errorf("%w: empty path", ErrInvalidPath)
	case path[0] != '/':
		return "", fmt.Errorf("%w: path must start with '/'", ErrInvalidPath)
	case len(path) > MaxPathLen:
		return "", fmt.Errorf("%w: path longer than %d bytes", ErrInvalidPath, MaxPathLen)
	}
	var (
		out    = make([]byte, 0, len(path)+16)
		starts = make([]int, 0, 8) // start in out of each kept segment's '/'
		seg    = make([]byte, 0, 32)
	)
	for i := 1; i <= len(path); {
		j := i
		for j < len(path) && path[j] != '/' {
			j++
		}
		var err error
		if seg, err = canonicalSegment(seg[:0], path[i:j]); err != nil {
			return "", err
		}
		switch string(seg) {
		case "":
		case ".":
		case "..":
			if n := len(starts); n > 0 {
				out = out[:starts[n-1]]
				starts = starts[:n-1]
			}
		default:
			// Bounds are checked on the result: ".." may still shorten it. The input bound keeps
			// out below 3*MaxPathLen meanwhile.
			starts = append(starts, len(out))
			out = append(out, '/')
			out = append(out, seg...)
		}
		i = j + 1
	}
	switch {
	case len(out) == 0:
		return "/", nil
	case len(starts) > MaxSegments:
		return "", fmt.Errorf("%w: more than %d segments", ErrInvalidPath, MaxSegments)
	case len(out) > MaxPathLen:
		return "", fmt.Errorf("%w: normalized path longer than %d bytes", ErrInvalidPath, MaxPathLen)
	}
	return string(out), nil
}

const upperHex = "0123456789ABCDEF"

// canonicalSegment appends the canonical form of one raw segment (no '/') to dst.
func canonicalSegment(dst []byte, s string) ([]byte, error) {
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == '%':
			if i+2 >= len(s) || !isHex(s[i+1]) || !isHex(s[i+2]) {
				return nil, fmt.Errorf("%w: malformed percent-escape at byte %d", ErrInvalidPath, i)
			}
			b := unhex(s[i+1])<<4 | unhex(s[i+2])
			switch {
			case b == 0:
				return nil, fmt.Errorf("%w: encoded NUL", ErrInvalidPath)
			case isUnreserved(b):
				dst = append(dst, b)
			default:
				dst = append(dst, '%', upperHex[b>>4], upperHex[b&15])
			}
			i += 3
		case c < 0x20 || c == 0x7f:
			return nil, fmt.Errorf("%w: control character 0x%02x", ErrInvalidPath, c)
		case c < utf8.RuneSelf:
			if pchar[c] {
				dst = append(dst, c)
			} else {
				dst = append(dst, '%', upperHex[c>>4], upperHex[c&15])
			}
			i++
		default:
			r, n := utf8.DecodeRuneInString(s[i:])
			if r == utf8.RuneError && n <= 1 {
				return nil, fmt.Errorf("%w: invalid UTF-8 at byte %d", ErrInvalidPath, i)
			}
			for k := i; k < i+n; k++ {
				dst = append(dst, '%', upperHex[s[k]>>4], upperHex[s[k]&15])
			}
			i += n
		}
	}
	return dst, nil
}

func isUpperHex(c byte) bool {
	return '0' <= c && c <= '9' || 'A' <= c && c <= 'F'
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func unhex(c byte) byte {
	switch {
	case c <= '9':
		return c - '0'
	case c <= 'F':
		return c - 'A' + 10
	default:
		return c - 'a' + 10
	}
}
