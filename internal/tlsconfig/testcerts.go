package tlsconfig

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"
)

// Files are the PEM files of a test PKI written by WriteTestPKI.
type Files struct {
	CA                    string // the CA certificate
	ServerCert, ServerKey string // for 127.0.0.1 and localhost
	ClientCert, ClientKey string // a client certificate signed by the CA (an agent's, CN "agent")
	AdminCert, AdminKey   string // an operator's client certificate signed by the CA (CN "admin", URI AdminURI)
	OtherCert, OtherKey   string // a client certificate signed by another CA (must be refused)
}

// AdminURI is the URI subject alternative name of the test PKI's admin certificate.
const AdminURI = "spiffe://leasebucket.test/admin"

// WriteTestPKI writes a throwaway CA, a server certificate, an agent's and an admin's client
// certificates and a client certificate of a foreign CA into dir, valid for a day. For tests and
// local demos only.
func WriteTestPKI(dir string) (Files, error) {
	ca, caKey, err := newCA("leasebucket test CA")
	if err != nil {
		return Files{}, err
	}
	other, otherKey, err := newCA("foreign CA")
	if err != nil {
		return Files{}, err
	}
	f := Files{
		CA:         filepath.Join(dir, "ca.pem"),
		ServerCert: filepath.Join(dir, "server.pem"), ServerKey: filepath.Join(dir, "server-key.pem"),
		ClientCert: filepath.Join(dir, "client.pem"), ClientKey: filepath.Join(dir, "client-key.pem"),
		AdminCert: filepath.Join(dir, "admin.pem"), AdminKey: filepath.Join(dir, "admin-key.pem"),
		OtherCert: filepath.Join(dir, "other.pem"), OtherKey: filepath.Join(dir, "other-key.pem"),
	}
	if err := writePEM(f.CA, "CERTIFICATE", ca.Raw); err != nil {
		return Files{}, err
	}
	server := &x509.Certificate{
		Subject:     pkix.Name{CommonName: "coordinator"},
		DNSNames:    []string{"localhost"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	client := &x509.Certificate{Subject: pkix.Name{CommonName: "agent"}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	adminURI, err := url.Parse(AdminURI)
	if err != nil {
		return Files{}, fmt.Errorf("tlsconfig: %w", err)
	}
	admin := &x509.Certificate{Subject: pkix.Name{CommonName: "admin"}, URIs: []*url.URL{adminURI},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	for _, c := range []struct {
		tmpl              *x509.Certificate
		parent            *x509.Certificate
		parentKey         *ecdsa.PrivateKey
		certFile, keyFile string
	}{
		{server, ca, caKey, f.ServerCert, f.ServerKey},
		{client, ca, caKey, f.ClientCert, f.ClientKey},
		{admin, ca, caKey, f.AdminCert, f.AdminKey},
		{&x509.Certificate{Subject: pkix.Name{CommonName: "intruder"}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}, other, otherKey, f.OtherCert, f.OtherKey},
	} {
		if err := issue(c.tmpl, c.parent, c.parentKey, c.certFile, c.keyFile); err != nil {
			return Files{}, err
		}
	}
	return f, nil
}

// serial numbers the certificates; WriteTestPKI may run in parallel tests.
var serial atomic.Int64

func template(cn string) *x509.Certificate {
	now := time.Now()
	return &x509.Certificate{
		SerialNumber: big.NewInt(serial.Add(1)), Subject: pkix.Name{CommonName: cn},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature,
	}
}

func newCA(cn string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("tlsconfig: %w", err)
	}
	t := template(cn)
	t.IsCA, t.BasicConstraintsValid = true, true
	t.KeyUsage |= x509.KeyUsageCertSign
	der, err := x509.CreateCertificate(rand.Reader, t, t, &key.PublicKey, key)
	if err != nil {
		return nil, nil, fmt.Errorf("tlsconfig: CA: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	return cert, key, err
}

func issue(tmpl, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, certFile, keyFile string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("tlsconfig: %w", err)
	}
	t := template(tmpl.Subject.CommonName)
	t.DNSNames, t.IPAddresses, t.URIs, t.ExtKeyUsage = tmpl.DNSNames, tmpl.IPAddresses, tmpl.URIs, tmpl.ExtKeyUsage
	der, err := x509.CreateCertificate(rand.Reader, t, parent, &key.PublicKey, parentKey)
	if err != nil {
		return fmt.Errorf("tlsconfig: certificate %s: %w", t.Subject.CommonName, err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return fmt.Errorf("tlsconfig: %w", err)
	}
	if err := writePEM(certFile, "CERTIFICATE", der); err != nil {
		return err
	}
	return writePEM(keyFile, "EC PRIVATE KEY", keyDER)
}

func writePEM(path, kind string, der []byte) error {
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
		return fmt.Errorf("tlsconfig: %w", err)
	}
	return nil
}
