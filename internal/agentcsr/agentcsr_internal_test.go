package agentcsr

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"net"
	"strings"
	"testing"

	certv1 "k8s.io/api/certificates/v1"

	"github.com/syscode-labs/imp/internal/pki"
)

const agent = "system:serviceaccount:imp-system:imp-agent"

// What an agent may ask for: its node's name, to serve, from its node-bound token.
func TestVerify(t *testing.T) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	req := func(tmpl x509.CertificateRequest) []byte {
		der, err := x509.CreateCertificateRequest(rand.Reader, &tmpl, key)
		if err != nil {
			t.Fatal(err)
		}
		return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})
	}
	own := req(x509.CertificateRequest{Subject: pkix.Name{CommonName: pki.AgentName}, DNSNames: []string{"imp-agent.node-a"}})
	serve := []certv1.KeyUsage{certv1.UsageDigitalSignature, certv1.UsageServerAuth}
	onNode := map[string]certv1.ExtraValue{NodeNameClaim: {"node-a"}}
	for _, tc := range []struct {
		name    string
		user    string
		extra   map[string]certv1.ExtraValue
		request []byte
		usages  []certv1.KeyUsage
		deny    string // empty: allowed
	}{
		{"its own node", agent, onNode, own, serve, ""},
		{"another user", "system:serviceaccount:imp-system:imp-operator", onNode, own, serve, "not the agents' identity"},
		{"no node claim", agent, nil, own, serve, "names no node"},
		{"two node claims", agent, map[string]certv1.ExtraValue{NodeNameClaim: {"node-a", "node-b"}}, own, serve, "names no node"},
		{"another node's name", agent, onNode, req(x509.CertificateRequest{DNSNames: []string{"imp-agent.node-b"}}), serve, `may ask for "imp-agent.node-a" only`},
		{"a second name", agent, onNode, req(x509.CertificateRequest{DNSNames: []string{"imp-agent.node-a", "imp-subresources"}}), serve, "may ask for"},
		{"an address", agent, onNode, req(x509.CertificateRequest{DNSNames: []string{"imp-agent.node-a"}, IPAddresses: []net.IP{net.ParseIP("10.0.0.1")}}), serve, "may ask for"},
		// An agent is its migrations' client of another node's agent (docs/migration.md).
		{"serving and client use", agent, onNode, own, []certv1.KeyUsage{certv1.UsageDigitalSignature, certv1.UsageServerAuth, certv1.UsageClientAuth}, ""},
		{"code signing", agent, onNode, own, []certv1.KeyUsage{certv1.UsageCodeSigning}, "serves and connects to agents, nothing else"},
		{"any use", agent, onNode, own, []certv1.KeyUsage{certv1.UsageAny}, "serves and connects to agents, nothing else"},
		{"not PEM", agent, onNode, []byte("garbage"), serve, "not a PEM certificate request"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			csr := &certv1.CertificateSigningRequest{Spec: certv1.CertificateSigningRequestSpec{Username: tc.user, Extra: tc.extra,
				Request: tc.request, Usages: tc.usages, SignerName: pki.SignerName}}
			_, node, err := (&Reconciler{AgentUser: agent}).verify(csr)
			switch {
			case tc.deny == "" && (err != nil || node != "node-a"):
				t.Fatalf("refused: %v (node %q)", err, node)
			case tc.deny != "" && (err == nil || !strings.Contains(err.Error(), tc.deny)):
				t.Fatalf("want refused with %q, got %v", tc.deny, err)
			}
		})
	}
}
