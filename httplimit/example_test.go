package httplimit_test

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log"
	"net/http"
	"os"

	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/httplimit"
	"github.com/leasebucket/leasebucket/policy"
)

// A Go service limited per client: the identity is the verified client certificate's common
// name, the policy the file the node's agent reads. docs/gateway.md shows this code.
func Example() {
	// One client per process: one connection to the node's agent, shared by every request.
	agentClient, err := client.New(client.Options{Socket: client.DefaultSocket})
	if err != nil {
		log.Fatal(err)
	}
	defer agentClient.Close()

	// The same policy file as the agent's, reloaded when it changes.
	watcher, err := policy.NewWatcher("/etc/leasebucket/policy.yaml", policy.WatchOptions{})
	if err != nil {
		log.Fatal(err)
	}
	watcher.Start()
	defer watcher.Close()

	limiter, err := httplimit.New(httplimit.Config{
		Checker:  agentClient,
		Policy:   watcher,
		Identity: httplimit.ClientCertificate(nil), // the verified certificate's common name
		Region:   os.Getenv("LEASEBUCKET_REGION"),
	})
	if err != nil {
		log.Fatal(err)
	}

	api := http.NewServeMux()
	api.HandleFunc("GET /orders/{id}", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "order %s\n", r.PathValue("id"))
	})

	caPEM, err := os.ReadFile("/etc/api/clients-ca.pem")
	if err != nil {
		log.Fatal(err)
	}
	clientCAs := x509.NewCertPool()
	clientCAs.AppendCertsFromPEM(caPEM)
	srv := &http.Server{
		Addr:    ":8443",
		Handler: limiter.Handler(api), // api is called only after an allow
		TLSConfig: &tls.Config{
			ClientAuth: tls.RequireAndVerifyClientCert,
			ClientCAs:  clientCAs,
			MinVersion: tls.VersionTLS12,
		},
	}
	log.Fatal(srv.ListenAndServeTLS("/etc/api/server.pem", "/etc/api/server-key.pem"))
}
