package httplimit

import (
	"context"
	"crypto/x509"
	"net/http"
	"net/netip"
)

// Identity returns the authenticated principal of a request: the tenant the request is limited
// as. ok is false when the request carries no identity (the Filter then applies Config.Anonymous
// or fails closed). An Identity must read only what authentication established — a context value
// set by the authentication middleware, a verified client certificate — and never a header the
// client chose: X-Forwarded-For, X-Real-IP and their kind are the client's to write.
type Identity func(r *http.Request) (tenant string, ok bool)

type tenantKey struct{}

// WithTenant returns a copy of ctx carrying the authenticated tenant, for an authentication
// middleware to hand to FromContext:
//
//	r = r.WithContext(httplimit.WithTenant(r.Context(), claims.Subject))
func WithTenant(ctx context.Context, tenant string) context.Context {
	return context.WithValue(ctx, tenantKey{}, tenant)
}

// FromContext is the Identity set by WithTenant.
func FromContext(r *http.Request) (string, bool) {
	t, ok := r.Context().Value(tenantKey{}).(string)
	return t, ok && t != ""
}

// ContextValue is an Identity that reads a string stored under key in the request's context by
// an authentication middleware of your own (or a library's, if its key is exported).
func ContextValue(key any) Identity {
	return func(r *http.Request) (string, bool) {
		t, ok := r.Context().Value(key).(string)
		return t, ok && t != ""
	}
}

// ClientCertificate is an Identity from the client's TLS certificate, as name extracts it (the
// subject's common name if name is nil). Only a certificate the server verified counts: the leaf
// of the first verified chain, which exists when the server's tls.Config verifies client
// certificates (ClientAuth VerifyClientCertIfGiven or RequireAndVerifyClientCert). A certificate
// presented but not verified (RequestClientCert, RequireAnyClientCert) is no identity.
//
// For SPIFFE identities, for example:
//
//	httplimit.ClientCertificate(func(c *x509.Certificate) string {
//		for _, u := range c.URIs {
//			if u.Scheme == "spiffe" {
//				return u.String()
//			}
//		}
//		return ""
//	})
func ClientCertificate(name func(*x509.Certificate) string) Identity {
	if name == nil {
		name = func(c *x509.Certificate) string { return c.Subject.CommonName }
	}
	return func(r *http.Request) (string, bool) {
		if r.TLS == nil || len(r.TLS.VerifiedChains) == 0 || len(r.TLS.VerifiedChains[0]) == 0 {
			return "", false
		}
		t := name(r.TLS.VerifiedChains[0][0])
		return t, t != ""
	}
}

// TrustedHeader is an Identity for a service behind an authenticating proxy (an auth sidecar, an
// API gateway in front) that puts the principal it authenticated in a request header. The header
// is honoured only when the request's immediate peer (http.Request.RemoteAddr, the TCP
// connection, never a forwarded address) is in trusted, and only when it appears exactly once
// and is not empty; otherwise the request has no identity. The proxy must overwrite the header on
// every request, so a client cannot pass its own value through it.
//
// It does not read X-Forwarded-For or any address: an IP address is not an identity (many
// tenants share one behind NAT, one tenant has many), and a forwarded one is whatever the client
// wrote.
func TrustedHeader(header string, trusted ...netip.Prefix) Identity {
	header = http.CanonicalHeaderKey(header)
	return func(r *http.Request) (string, bool) {
		peer, err := netip.ParseAddrPort(r.RemoteAddr)
		if err != nil {
			return "", false
		}
		addr := peer.Addr().Unmap()
		ok := false
		for _, p := range trusted {
			if p.Contains(addr) {
				ok = true
				break
			}
		}
		if !ok {
			return "", false
		}
		v := r.Header[header]
		if len(v) != 1 || v[0] == "" {
			return "", false
		}
		return v[0], true
	}
}
