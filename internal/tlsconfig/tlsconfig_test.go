package tlsconfig

import (
	"crypto/tls"
	"errors"
	"io"
	"testing"
)

// TestMutualTLS: a client with the CA's certificate gets through; one without a certificate and
// one with a foreign CA's certificate are refused by the server.
func TestMutualTLS(t *testing.T) {
	f, err := WriteTestPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	srvCfg, err := Server(f.ServerCert, f.ServerKey, f.CA)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", srvCfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				if err := c.(*tls.Conn).Handshake(); err == nil {
					_, _ = c.Write([]byte("ok"))
				}
			}()
		}
	}()
	dial := func(cert, key string) error {
		cfg, err := Client(f.CA, cert, key, "")
		if err != nil {
			return err
		}
		c, err := tls.Dial("tcp", ln.Addr().String(), cfg)
		if err != nil {
			return err
		}
		defer c.Close()
		buf := make([]byte, 2)
		if _, err := io.ReadFull(c, buf); err != nil {
			return err
		}
		if string(buf) != "ok" {
			return errors.New("unexpected answer")
		}
		return nil
	}
	if err := dial(f.ClientCert, f.ClientKey); err != nil {
		t.Fatalf("client with the CA's certificate: %v", err)
	}
	if err := dial("", ""); err == nil {
		t.Fatal("client without a certificate got through")
	}
	if err := dial(f.OtherCert, f.OtherKey); err == nil {
		t.Fatal("client with a foreign CA's certificate got through")
	}
}

func TestErrors(t *testing.T) {
	if _, err := Server("", "", ""); err == nil {
		t.Error("Server without certificate: want an error")
	}
	if _, err := Client("", "x.pem", "", ""); err == nil {
		t.Error("Client with a certificate but no key: want an error")
	}
	if _, err := Client("/nonexistent/ca.pem", "", "", ""); err == nil {
		t.Error("Client with a missing CA file: want an error")
	}
}
