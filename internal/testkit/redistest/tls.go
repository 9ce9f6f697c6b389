package redistest

import (
	"crypto/tls"
	"fmt"

	"github.com/leasebucket/leasebucket/internal/tlsconfig"
)

// tlsMaterial is a throwaway PKI (internal/tlsconfig's test PKI) shared by every server of one
// Start call: servers present its certificate for 127.0.0.1 and, when they connect to each other
// (replication, the cluster bus), its client certificate; clients trust its CA.
type tlsMaterial struct {
	tlsconfig.Files
	client *tls.Config
}

func newTLSMaterial(dir string) (*tlsMaterial, error) {
	f, err := tlsconfig.WriteTestPKI(dir)
	if err != nil {
		return nil, fmt.Errorf("tls: %w", err)
	}
	client, err := tlsconfig.Client(f.CA, "", "", "")
	if err != nil {
		return nil, fmt.Errorf("tls: %w", err)
	}
	return &tlsMaterial{Files: f, client: client}, nil
}

// clientConfig trusts the throwaway CA only; each call returns a fresh copy.
func (m *tlsMaterial) clientConfig() *tls.Config {
	return m.client.Clone()
}
