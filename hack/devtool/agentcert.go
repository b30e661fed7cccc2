package main

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/syscode-labs/imp/internal/pki"
)

// agentCert writes, into dir, what an agent's access endpoint serves with when it is given
// files instead of asking the certificates API (--access-cert-dir): a serving certificate for
// node signed by the access CA (caCert, caKey: the operator's Secret imp-access-ca), as the
// operator's signer issues them, and that CA as the client CA (the operator's client
// certificate is signed by it). make dev's agent runs with the admin's kubeconfig, which has no
// pod-bound token for the signer to trust.
func agentCert(caCert, caKey, node, dir string) error {
	var ca pki.Pair
	var err error
	if ca.Cert, err = os.ReadFile(caCert); err != nil {
		return err
	}
	if ca.Key, err = os.ReadFile(caKey); err != nil {
		return err
	}
	leaf, err := pki.Issue(ca, pki.Request{CommonName: pki.AgentName, DNSNames: []string{pki.AgentDNSName(node)}, Server: true, Client: true, Lifetime: pki.LeafLifetime}, time.Now())
	if err != nil {
		return fmt.Errorf("issuing the agent's certificate: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	for name, data := range map[string][]byte{"tls.crt": leaf.Cert, "tls.key": leaf.Key, "ca.crt": ca.Cert} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			return err
		}
	}
	return nil
}
