package testcluster

import (
	"os"
	"path/filepath"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/syscode-labs/imp/internal/pki"
)

// The API server's audit log, at Metadata level: it names the user, verb, resource and
// subresource of every request, whoever makes it.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
- level: Metadata
`

// WithAudit makes the API server write its audit log, JSON lines, to the returned path in dir.
func WithAudit(dir string) (Option, string, error) {
	policy := filepath.Join(dir, "audit-policy.yaml")
	if err := os.WriteFile(policy, []byte(auditPolicy), 0o600); err != nil {
		return nil, "", err
	}
	log := filepath.Join(dir, "audit.log")
	return func(e *envtest.Environment) {
		e.ControlPlane.GetAPIServer().Configure().
			Set("audit-policy-file", policy).
			Set("audit-log-path", log).
			Set("audit-log-format", "json").
			Set("audit-log-mode", "blocking").
			Set("audit-log-maxsize", "1000000") // MB: never rotated under a run, whose offsets it counts by
	}, log, nil
}

// FrontProxyName is the front-proxy client certificate's name under WithFrontProxy.
const FrontProxyName = "front-proxy-client"

// WithFrontProxy gives the API server a front proxy, as kubeadm configures one, so that it
// proxies aggregated APIs to their servers with a client certificate and the user in
// X-Remote-User. Its CA and client certificate are written to dir.
func WithFrontProxy(dir string) (Option, error) {
	now := time.Now()
	ca, err := pki.NewCA("front-proxy-ca", now, 24*time.Hour)
	if err != nil {
		return nil, err
	}
	client, err := pki.Issue(ca, pki.Request{CommonName: FrontProxyName, Client: true, Lifetime: 24 * time.Hour}, now)
	if err != nil {
		return nil, err
	}
	files := map[string][]byte{"front-proxy-ca.crt": ca.Cert, "front-proxy-client.crt": client.Cert, "front-proxy-client.key": client.Key}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			return nil, err
		}
	}
	return func(e *envtest.Environment) {
		e.ControlPlane.GetAPIServer().Configure().
			Set("requestheader-client-ca-file", filepath.Join(dir, "front-proxy-ca.crt")).
			Set("requestheader-allowed-names", FrontProxyName).
			Set("requestheader-username-headers", "X-Remote-User").
			Set("requestheader-group-headers", "X-Remote-Group").
			Set("requestheader-extra-headers-prefix", "X-Remote-Extra-").
			Set("proxy-client-cert-file", filepath.Join(dir, "front-proxy-client.crt")).
			Set("proxy-client-key-file", filepath.Join(dir, "front-proxy-client.key"))
	}, nil
}
