package pki

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// Secrets the Rotator keeps, in a namespace of their own (CANamespace), which no agent may read:
// a node's agent, or root on a node, must not be able to sign itself the client certificate
// that reaches every other node's agent, or another node's serving certificate. Each agent's
// certificate is its own, for its node only, through the certificates API (SignerName).
const (
	// CASecret holds the CA (tls.crt, tls.key) that signs the rest.
	CASecret = "imp-access-ca"
	// ServingSecret is the subresource server's serving certificate for the API server.
	ServingSecret = "imp-subresources-serving"
)

// Names in the certificates.
const (
	AgentName  = "imp-agent"
	ClientName = "imp-subresources"
)

// SignerName is the signer of the agents' certificates: the operator (internal/agentcsr).
const SignerName = "imp.dev/agent-access"

// AgentDNSName is the name in the access endpoint certificate of node's agent, which the
// subresource server expects of the agent it reaches on that node.
func AgentDNSName(node string) string { return AgentName + "." + node }

// Lifetimes: the CA's, and the leaves', which are issued again past two thirds of theirs.
const (
	CALifetime   = 10 * 365 * 24 * time.Hour
	LeafLifetime = 90 * 24 * time.Hour
)

// The secrets are the release namespace's, which the chart's Role imp-operator-run-secrets
// grants; the APIService is cluster-scoped.
// +kubebuilder:rbac:groups=apiregistration.k8s.io,resources=apiservices,verbs=get;patch

// Rotator issues and renews the certificates of the subresource server and the agents: the
// CA once, the leaves when a third of their lifetime is left or the CA changed. It keeps the
// subresource server's client certificate in memory only, and puts the CA in the APIService's
// caBundle.
type Rotator struct {
	// Client writes; Reader reads uncached (the operator caches no Secrets).
	Client client.Client
	Reader client.Reader
	// Namespace is the release namespace, of the Service; CANamespace (default Namespace) gets
	// CASecret and ServingSecret.
	Namespace   string
	CANamespace string
	// Service is the subresource server's Service, named in its serving certificate.
	Service string
	// APIService, when set, gets the CA as its caBundle.
	APIService string
	Clock      clock.PassiveClock
	Log        logr.Logger

	mu      sync.RWMutex
	ca      Pair
	pool    *x509.CertPool
	serving *tls.Certificate
	client  *tls.Certificate
	clientR time.Time // when the client certificate is due for renewal
}

// Start renews every 10 minutes (every 10 s after a failure) until ctx ends.
func (r *Rotator) Start(ctx context.Context) error {
	for {
		wait := 10 * time.Minute
		if err := r.Reconcile(ctx); err != nil {
			r.Log.Error(err, "issuing the access certificates")
			wait = 10 * time.Second
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}

// NeedLeaderElection: every replica serves, with the certificates every replica reads.
func (r *Rotator) NeedLeaderElection() bool { return false }

// Reconcile makes the certificates current.
func (r *Rotator) Reconcile(ctx context.Context) error {
	now := r.Clock.Now()
	ca, err := r.secret(ctx, r.caNamespace(), CASecret, func(s *corev1.Secret) (bool, error) {
		if len(s.Data["tls.crt"]) > 0 {
			return false, nil // never replaced here: the agents trust it
		}
		p, err := NewCA("imp-access-ca", now, CALifetime)
		s.Data = map[string][]byte{"tls.crt": p.Cert, "tls.key": p.Key}
		return true, err
	})
	if err != nil {
		return err
	}
	caPair := Pair{Cert: ca.Data["tls.crt"], Key: ca.Data["tls.key"]}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPair.Cert) {
		return fmt.Errorf("secret %s holds no CA certificate", CASecret)
	}
	if exp, err := Expiry(caPair.Cert); err == nil && exp.Sub(now) < 365*24*time.Hour {
		r.Log.Info("the access CA expires within a year and is not rotated automatically: delete the secret and restart the agents", "secret", CASecret, "expires", exp)
	}
	leaf := func(ns, name string, req Request) (*corev1.Secret, error) {
		return r.secret(ctx, ns, name, func(s *corev1.Secret) (bool, error) {
			if !due(s.Data["tls.crt"], pool, now) && bytes.Equal(s.Data["ca.crt"], caPair.Cert) {
				return false, nil
			}
			p, err := Issue(caPair, req, now)
			s.Data = map[string][]byte{"tls.crt": p.Cert, "tls.key": p.Key, "ca.crt": caPair.Cert}
			return true, err
		})
	}
	svc := r.Service + "." + r.Namespace + ".svc"
	serving, err := leaf(r.caNamespace(), ServingSecret, Request{CommonName: svc, DNSNames: []string{r.Service, r.Service + "." + r.Namespace, svc}, Server: true, Lifetime: LeafLifetime})
	if err != nil {
		return err
	}
	servingCert, err := tls.X509KeyPair(serving.Data["tls.crt"], serving.Data["tls.key"])
	if err != nil {
		return fmt.Errorf("secret %s: %w", ServingSecret, err)
	}

	// Only Reconcile writes these fields, one call at a time (Start); handshakes read them.
	r.mu.RLock()
	renew := r.client == nil || now.After(r.clientR) || !bytes.Equal(r.ca.Cert, caPair.Cert)
	r.mu.RUnlock()
	var client *tls.Certificate
	if renew {
		p, err := Issue(caPair, Request{CommonName: ClientName, Client: true, Lifetime: LeafLifetime}, now)
		if err != nil {
			return err
		}
		c, err := tls.X509KeyPair(p.Cert, p.Key)
		if err != nil {
			return err
		}
		client = &c
	}
	r.mu.Lock()
	if client != nil {
		r.client, r.clientR = client, now.Add(2*LeafLifetime/3)
	}
	r.ca, r.pool, r.serving = caPair, pool, &servingCert
	r.mu.Unlock()
	if r.APIService != "" {
		return r.caBundle(ctx, caPair.Cert)
	}
	return nil
}

// due says whether the certificate is missing, not the CA's, or past two thirds of its life.
func due(pemCert []byte, pool *x509.CertPool, now time.Time) bool {
	c, err := parseCert(pemCert)
	if err != nil {
		return true
	}
	if _, err := c.Verify(x509.VerifyOptions{Roots: pool, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return true
	}
	return now.After(c.NotBefore.Add(2 * c.NotAfter.Sub(c.NotBefore) / 3))
}

// secret reads the secret name, lets fill change it, and creates or updates it; a conflict
// with another replica is an error, retried at the next reconcile.
func (r *Rotator) secret(ctx context.Context, ns, name string, fill func(*corev1.Secret) (bool, error)) (*corev1.Secret, error) {
	s := &corev1.Secret{}
	err := r.Reader.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, s)
	create := apierrors.IsNotFound(err)
	if err != nil && !create {
		return nil, fmt.Errorf("reading secret %s/%s: %w", ns, name, err)
	}
	if create {
		s = &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name,
			Labels: map[string]string{"app.kubernetes.io/part-of": "imp", "app.kubernetes.io/managed-by": "imp-operator"}},
			Type: corev1.SecretTypeTLS}
	}
	if s.Data == nil {
		s.Data = map[string][]byte{}
	}
	changed, err := fill(s)
	if err != nil || !changed {
		return s, err
	}
	if create {
		err = r.Client.Create(ctx, s)
	} else {
		err = r.Client.Update(ctx, s)
	}
	if err != nil {
		return nil, fmt.Errorf("writing secret %s/%s: %w", ns, name, err)
	}
	r.Log.Info("issued", "secret", ns+"/"+name)
	return s, nil
}

func (r *Rotator) caNamespace() string {
	if r.CANamespace != "" {
		return r.CANamespace
	}
	return r.Namespace
}

var apiServiceGVK = schema.GroupVersionKind{Group: "apiregistration.k8s.io", Version: "v1", Kind: "APIService"}

// caBundle puts ca in the APIService's caBundle, unless it is there.
func (r *Rotator) caBundle(ctx context.Context, ca []byte) error {
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(apiServiceGVK)
	if err := r.Reader.Get(ctx, types.NamespacedName{Name: r.APIService}, u); err != nil {
		return fmt.Errorf("reading APIService %s: %w", r.APIService, err)
	}
	have, _, _ := unstructured.NestedString(u.Object, "spec", "caBundle")
	want := b64(ca)
	if have == want {
		return nil
	}
	patch := []byte(fmt.Sprintf(`{"spec":{"caBundle":%q}}`, want))
	if err := r.Client.Patch(ctx, u, client.RawPatch(types.MergePatchType, patch)); err != nil {
		return fmt.Errorf("setting APIService %s's caBundle: %w", r.APIService, err)
	}
	return nil
}

// ServingCertificate is the subresource server's current certificate.
func (r *Rotator) ServingCertificate() (*tls.Certificate, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.serving == nil {
		return nil, errors.New("no serving certificate issued yet")
	}
	return r.serving, nil
}

// CA is the current access CA, which signs the agents' certificates.
func (r *Rotator) CA() (Pair, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.ca.Cert == nil {
		return Pair{}, errors.New("no access CA loaded yet")
	}
	return r.ca, nil
}

// AgentClientTLS is the client side of the agents' mutual TLS: the current client certificate,
// and the agent verified against the current CA under the name the configuration's
// ServerName gives, AgentDNSName of the node dialed (a configuration per node).
func (r *Rotator) AgentClientTLS() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			r.mu.RLock()
			defer r.mu.RUnlock()
			if r.client == nil {
				return nil, errors.New("no client certificate issued yet")
			}
			return r.client, nil
		},
		// The CA may change while the process runs: verified here instead of by RootCAs.
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			r.mu.RLock()
			pool := r.pool
			r.mu.RUnlock()
			if pool == nil || len(cs.PeerCertificates) == 0 {
				return errors.New("no CA to verify the agent against yet")
			}
			inter := x509.NewCertPool()
			for _, c := range cs.PeerCertificates[1:] {
				inter.AddCert(c)
			}
			if !strings.HasPrefix(cs.ServerName, AgentName+".") {
				return fmt.Errorf("no agent's name to verify (server name %q)", cs.ServerName)
			}
			_, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, DNSName: cs.ServerName})
			return err
		},
	}
}

func b64(b []byte) string { return base64.StdEncoding.EncodeToString(b) }
