// Package tlsconfig builds the TLS configurations of leasebucket's gRPC servers and clients from
// PEM files: a server with an optional client CA (mTLS), a client with an optional certificate.
package tlsconfig

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
)

// Server returns the TLS configuration of a server presenting certFile/keyFile. With clientCAFile
// set, clients must present a certificate signed by that CA (mutual TLS); without it, any client
// may connect over TLS.
func Server(certFile, keyFile, clientCAFile string) (*tls.Config, error) {
	if certFile == "" || keyFile == "" {
		return nil, errors.New("tlsconfig: server needs both a certificate and a key")
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("tlsconfig: server certificate: %w", err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if clientCAFile != "" {
		pool, err := pool(clientCAFile)
		if err != nil {
			return nil, err
		}
		cfg.ClientCAs = pool
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

// Client returns the TLS configuration of a client that verifies servers against caFile (the
// system roots if empty) and, with certFile/keyFile set, presents that certificate (mutual TLS).
// serverName overrides the name checked in the server's certificate.
func Client(caFile, certFile, keyFile, serverName string) (*tls.Config, error) {
	cfg := &tls.Config{ServerName: serverName, MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pool, err := pool(caFile)
		if err != nil {
			return nil, err
		}
		cfg.RootCAs = pool
	}
	switch {
	case certFile != "" && keyFile != "":
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("tlsconfig: client certificate: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	case certFile != "" || keyFile != "":
		return nil, errors.New("tlsconfig: client needs both a certificate and a key, or neither")
	}
	return cfg, nil
}

func pool(caFile string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("tlsconfig: CA: %w", err)
	}
	p := x509.NewCertPool()
	if !p.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("tlsconfig: CA %s: no PEM certificate", caFile)
	}
	return p, nil
}
