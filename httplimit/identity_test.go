package httplimit_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"testing"

	"github.com/leasebucket/leasebucket/httplimit"
	"github.com/leasebucket/leasebucket/internal/tlsconfig"
)

func TestFromContext(t *testing.T) {
	r := httptest.NewRequest("GET", "/", nil)
	if _, ok := httplimit.FromContext(r); ok {
		t.Error("identity without WithTenant")
	}
	if _, ok := httplimit.FromContext(r.WithContext(httplimit.WithTenant(r.Context(), ""))); ok {
		t.Error("an empty tenant is an identity")
	}
	if got, ok := httplimit.FromContext(r.WithContext(httplimit.WithTenant(r.Context(), "acme"))); !ok || got != "acme" {
		t.Errorf("FromContext = %q, %v; want acme", got, ok)
	}

	type authKey struct{}
	id := httplimit.ContextValue(authKey{})
	if got, ok := id(r.WithContext(context.WithValue(r.Context(), authKey{}, "globex"))); !ok || got != "globex" {
		t.Errorf("ContextValue = %q, %v; want globex", got, ok)
	}
	if _, ok := id(r.WithContext(context.WithValue(r.Context(), authKey{}, 42))); ok {
		t.Error("ContextValue took a value that is not a string")
	}
}

func TestTrustedHeader(t *testing.T) {
	id := httplimit.TrustedHeader("x-authenticated-user", netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("::1/128"))
	tests := []struct {
		name   string
		remote string
		values []string
		want   string
		ok     bool
	}{
		{"trusted proxy", "10.1.2.3:5555", []string{"acme"}, "acme", true},
		{"trusted IPv6 proxy", "[::1]:5555", []string{"acme"}, "acme", true},
		{"trusted proxy, IPv4 in IPv6", "[::ffff:10.1.2.3]:5555", []string{"acme"}, "acme", true},
		{"untrusted peer", "192.0.2.7:5555", []string{"acme"}, "", false},
		{"header twice", "10.1.2.3:5555", []string{"acme", "globex"}, "", false},
		{"empty header", "10.1.2.3:5555", []string{""}, "", false},
		{"no header", "10.1.2.3:5555", nil, "", false},
		{"no address", "", []string{"acme"}, "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", "/", nil)
			r.RemoteAddr = tt.remote
			for _, v := range tt.values {
				r.Header.Add("X-Authenticated-User", v)
			}
			// What a client writes about addresses never matters.
			r.Header.Set("X-Forwarded-For", "10.1.2.3")
			r.Header.Set("X-Real-IP", "10.1.2.3")
			r.Header.Set("Forwarded", "for=10.1.2.3")
			got, ok := id(r)
			if got != tt.want || ok != tt.ok {
				t.Errorf("TrustedHeader = %q, %v; want %q, %v", got, ok, tt.want, tt.ok)
			}
		})
	}
}

// TestClientCertificate: over real TLS, only a certificate the server verified is an identity.
func TestClientCertificate(t *testing.T) {
	pki, err := tlsconfig.WriteTestPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	caPEM, err := os.ReadFile(pki.CA)
	if err != nil {
		t.Fatal(err)
	}
	cas := x509.NewCertPool()
	cas.AppendCertsFromPEM(caPEM)
	serverCert, err := tls.LoadX509KeyPair(pki.ServerCert, pki.ServerKey)
	if err != nil {
		t.Fatal(err)
	}
	clientCert, err := tls.LoadX509KeyPair(pki.ClientCert, pki.ClientKey)
	if err != nil {
		t.Fatal(err)
	}
	otherCert, err := tls.LoadX509KeyPair(pki.OtherCert, pki.OtherKey)
	if err != nil {
		t.Fatal(err)
	}
	id := httplimit.ClientCertificate(nil)
	serve := func(auth tls.ClientAuthType) *httptest.Server {
		srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if tenant, ok := id(r); ok {
				_, _ = io.WriteString(w, tenant)
				return
			}
			w.WriteHeader(http.StatusForbidden)
		}))
		srv.Config.ErrorLog = log.New(io.Discard, "", 0) // refused handshakes are expected
		srv.TLS = &tls.Config{Certificates: []tls.Certificate{serverCert}, ClientAuth: auth, ClientCAs: cas, MinVersion: tls.VersionTLS12}
		srv.StartTLS()
		t.Cleanup(srv.Close)
		return srv
	}
	get := func(srv *httptest.Server, cert *tls.Certificate) (int, string, error) {
		cfg := &tls.Config{RootCAs: cas, MinVersion: tls.VersionTLS12}
		if cert != nil { // sent whatever CAs the server names, as a hostile client would
			cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert, nil }
		}
		c := &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}}
		defer c.CloseIdleConnections()
		resp, err := c.Get(srv.URL)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), nil
	}

	verifying := serve(tls.VerifyClientCertIfGiven)
	if code, body, err := get(verifying, &clientCert); err != nil || code != 200 || body != "agent" {
		t.Errorf("verified certificate: %d %q %v, want the common name agent", code, body, err)
	}
	if code, _, err := get(verifying, nil); err != nil || code != http.StatusForbidden {
		t.Errorf("no certificate: %d %v, want no identity", code, err)
	}
	if code, body, err := get(verifying, &otherCert); err == nil {
		t.Errorf("a certificate of a foreign CA was accepted by a verifying server: %d %q", code, body)
	}
	// Presented but not verified: not an identity, whoever signed it.
	unverified := serve(tls.RequireAnyClientCert)
	for _, cert := range []*tls.Certificate{&clientCert, &otherCert} {
		if code, _, err := get(unverified, cert); err != nil || code != http.StatusForbidden {
			t.Errorf("unverified certificate: %d %v, want no identity", code, err)
		}
	}
	// A plain HTTP request has no certificate.
	if _, ok := id(httptest.NewRequest("GET", "/", nil)); ok {
		t.Error("identity without TLS")
	}
}
