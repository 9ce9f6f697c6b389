package main

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"

	"github.com/leasebucket/leasebucket/httplimit"
	"github.com/leasebucket/leasebucket/policy"
)

// tokens maps bearer tokens to tenants. It keeps the SHA-256 of each token, not the token: the
// map lookup then reveals nothing about a token's bytes through its timing, and the process
// holds no usable secret.
type tokens struct {
	tenants map[[sha256.Size]byte]string
}

// loadTokens reads a tokens file: one "TOKEN TENANT" pair per line, separated by blanks; blank
// lines and lines starting with # are ignored. Tenants follow the policy's rules for tenants.
func loadTokens(file string) (*tokens, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("tokens: %w", err)
	}
	t := &tokens{tenants: make(map[[sha256.Size]byte]string)}
	var errs []error
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) != 2 {
			errs = append(errs, fmt.Errorf("%s:%d: want TOKEN TENANT", file, n))
			continue
		}
		if err := policy.ValidTenant(f[1]); err != nil {
			errs = append(errs, fmt.Errorf("%s:%d: %w", file, n, err))
			continue
		}
		sum := sha256.Sum256([]byte(f[0]))
		if _, dup := t.tenants[sum]; dup {
			errs = append(errs, fmt.Errorf("%s:%d: token listed twice", file, n))
			continue
		}
		t.tenants[sum] = f[1]
	}
	if err := sc.Err(); err != nil {
		errs = append(errs, fmt.Errorf("%s: %w", file, err))
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return t, nil
}

// authenticate is the gateway's authentication: a valid bearer token puts its tenant in the
// request's context (httplimit.WithTenant) and is removed from the request, so it never reaches
// upstream. A wrong or malformed token is 401. A request without an Authorization header is 401
// too, unless anonymous is set: then it goes on without an identity, and the rate-limit filter
// limits it as the anonymous tenant.
func (t *tokens) authenticate(next http.Handler, anonymous bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		vals := r.Header.Values("Authorization")
		if len(vals) == 0 && anonymous {
			next.ServeHTTP(w, r)
			return
		}
		if len(vals) != 1 {
			unauthorized(w)
			return
		}
		scheme, token, ok := strings.Cut(vals[0], " ")
		token = strings.TrimSpace(token)
		if !ok || !strings.EqualFold(scheme, "Bearer") || token == "" {
			unauthorized(w)
			return
		}
		tenant, ok := t.tenants[sha256.Sum256([]byte(token))]
		if !ok {
			unauthorized(w)
			return
		}
		r = r.WithContext(httplimit.WithTenant(r.Context(), tenant))
		r.Header.Del("Authorization")
		next.ServeHTTP(w, r)
	})
}

func unauthorized(w http.ResponseWriter) {
	h := w.Header()
	h.Set("WWW-Authenticate", "Bearer")
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(http.StatusUnauthorized)
	_, _ = w.Write([]byte(http.StatusText(http.StatusUnauthorized) + "\n"))
}
