package coordinator

import (
	"context"
	"crypto/x509"
	"fmt"
	"slices"
	"strings"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// Identity is one name a client certificate carries: its subject's common name or one of its
// subject alternative names. It is written kind:value, kind one of cn, dns, uri and email:
// "cn:ops-admin", "uri:spiffe://example.org/ops/lbctl".
type Identity struct {
	Kind, Value string
}

func (i Identity) String() string { return i.Kind + ":" + i.Value }

// identityKinds are the kinds of names Identity reads from a certificate.
var identityKinds = []string{"cn", "dns", "uri", "email"}

// ParseIdentity reads "kind:value". The kind is required, so that an agent's DNS name can never
// be mistaken for an admin's common name.
func ParseIdentity(s string) (Identity, error) {
	kind, value, ok := strings.Cut(strings.TrimSpace(s), ":")
	kind = strings.ToLower(kind)
	switch {
	case !ok || value == "":
		return Identity{}, fmt.Errorf("identity %q: want kind:value, kind one of %s (cn:ops-admin)", s, strings.Join(identityKinds, ", "))
	case !slices.Contains(identityKinds, kind):
		return Identity{}, fmt.Errorf("identity %q: kind %q is not one of %s", s, kind, strings.Join(identityKinds, ", "))
	}
	return Identity{Kind: kind, Value: value}, nil
}

// ParseIdentities reads a comma-separated list of identities; empty entries are skipped.
func ParseIdentities(list string) ([]Identity, error) {
	var out []Identity
	for s := range strings.SplitSeq(list, ",") {
		if strings.TrimSpace(s) == "" {
			continue
		}
		id, err := ParseIdentity(s)
		if err != nil {
			return nil, err
		}
		out = append(out, id)
	}
	return out, nil
}

// CertIdentities lists the names of a certificate: its common name, then its DNS, URI and email
// subject alternative names.
func CertIdentities(c *x509.Certificate) []Identity {
	var out []Identity
	if c.Subject.CommonName != "" {
		out = append(out, Identity{"cn", c.Subject.CommonName})
	}
	for _, n := range c.DNSNames {
		out = append(out, Identity{"dns", n})
	}
	for _, u := range c.URIs {
		out = append(out, Identity{"uri", u.String()})
	}
	for _, e := range c.EmailAddresses {
		out = append(out, Identity{"email", e})
	}
	return out
}

// PeerCertificate is the client certificate of the call in ctx, if the server verified it
// against its client CA (mutual TLS); nil otherwise.
func PeerCertificate(ctx context.Context) *x509.Certificate {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(info.State.VerifiedChains) == 0 || len(info.State.VerifiedChains[0]) == 0 {
		return nil
	}
	return info.State.VerifiedChains[0][0]
}

// peerAddr is the address of the call's client, for the audit log.
func peerAddr(ctx context.Context) string {
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		return p.Addr.String()
	}
	return ""
}
