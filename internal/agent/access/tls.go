package access

import (
	"cmp"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	certv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/syscode-labs/imp/internal/pki"
)

// TLSConfig serves with the certificate in certFile and keyFile and accepts only a client whose
// certificate chains to a CA in caFile and whose common name is clientName. The files are read
// again when they change (a Secret volume's rotation), at most once per handshake.
func TLSConfig(certFile, keyFile, caFile, clientName string) (*tls.Config, error) {
	f := &files{cert: certFile, key: keyFile, ca: caFile}
	if _, err := f.current(); err != nil {
		return nil, err
	}
	return tlsConfig(f, clientName), nil
}

// source is where a serving certificate and the client CA come from: files or a Secret.
type source interface {
	current() (*loaded, error)
}

// tlsConfig serves the certificate of src, as it is at each handshake, to clientName only.
func tlsConfig(f source, clientName string) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			l, err := f.current()
			if err != nil {
				return nil, err
			}
			return &tls.Config{
				MinVersion:   tls.VersionTLS13,
				Certificates: []tls.Certificate{l.cert},
				ClientCAs:    l.pool,
				ClientAuth:   tls.RequireAndVerifyClientCert,
				VerifyPeerCertificate: func(_ [][]byte, chains [][]*x509.Certificate) error {
					if len(chains) == 0 || chains[0][0].Subject.CommonName != clientName {
						return fmt.Errorf("client certificate is not %q's", clientName)
					}
					return nil
				},
			}, nil
		},
	}
}

// files are the certificate, key and CA bundle, loaded again when one changes.
type files struct {
	cert, key, ca string

	mu     sync.Mutex
	stamp  string
	loaded *loaded
}

type loaded struct {
	cert tls.Certificate
	pool *x509.CertPool
}

func (f *files) current() (*loaded, error) {
	stamp := ""
	for _, p := range []string{f.cert, f.key, f.ca} {
		fi, err := os.Stat(p)
		if err != nil {
			return nil, err
		}
		stamp += fmt.Sprintf("%s:%d:%d;", p, fi.Size(), fi.ModTime().UnixNano())
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.loaded != nil && stamp == f.stamp {
		return f.loaded, nil
	}
	var data [3][]byte
	for i, p := range []string{f.cert, f.key, f.ca} {
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, err
		}
		data[i] = b
	}
	l, err := load(data[0], data[1], data[2])
	if err != nil {
		return nil, fmt.Errorf("%s: %w", f.cert, err)
	}
	f.stamp, f.loaded = stamp, l
	return f.loaded, nil
}

// load parses a serving certificate, its key and the client CA bundle.
func load(cert, key, ca []byte) (*loaded, error) {
	pair, err := tls.X509KeyPair(cert, key)
	if err != nil {
		return nil, fmt.Errorf("loading the serving certificate: %w", err)
	}
	if pair.Leaf == nil {
		if pair.Leaf, err = x509.ParseCertificate(pair.Certificate[0]); err != nil {
			return nil, err
		}
	}
	if time.Now().After(pair.Leaf.NotAfter) {
		return nil, fmt.Errorf("the serving certificate expired at %s", pair.Leaf.NotAfter)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, errors.New("no certificate in the client CA bundle")
	}
	return &loaded{cert: pair, pool: pool}, nil
}

// +kubebuilder:rbac:groups=certificates.k8s.io,resources=certificatesigningrequests,verbs=create;get

// CSR obtains the endpoint's certificate for its node through the certificates API: a key
// made here, which never leaves the node, and a request the operator signs (pki.SignerName)
// once it has checked that the requester's token is bound to that node. Like the kubelet's,
// the certificate and its key are kept on the node (Dir), so that a restarted agent serves at
// once, without waiting for the operator.
type CSR struct {
	// Client creates and reads CertificateSigningRequests.
	Client client.Client
	Node   string
	// Dir keeps the certificate, its CA and its key (KeptFile, mode 0600); empty: memory only.
	Dir string
	// Poll is how often the request is read until it is signed (default 1 s); Timeout how long
	// that may take (default 5 minutes).
	Poll, Timeout time.Duration
}

// KeptFile is the file of CSR.Dir that holds the certificate, its CA and its key, PEM.
const KeptFile = "access.pem"

// kept is the certificate a CSR obtained before; nil when there is none, or it is not this
// node's, or it expired.
func (c *CSR) kept() *loaded {
	if c.Dir == "" {
		return nil
	}
	b, err := os.ReadFile(filepath.Join(c.Dir, KeptFile))
	if err != nil {
		return nil
	}
	var certs, key []byte
	for block, rest := pem.Decode(b); block != nil; block, rest = pem.Decode(rest) {
		if block.Type == "CERTIFICATE" {
			certs = append(certs, pem.EncodeToMemory(block)...)
		} else {
			key = pem.EncodeToMemory(block)
		}
	}
	leaf, ca := pem.Decode(certs)
	if leaf == nil {
		return nil
	}
	l, err := load(pem.EncodeToMemory(leaf), key, ca)
	if err != nil || !slices.Equal(l.cert.Leaf.DNSNames, []string{pki.AgentDNSName(c.Node)}) {
		return nil
	}
	return l
}

// keep writes the certificate, its CA and its key to Dir, replacing what was there.
func (c *CSR) keep(chain, key []byte) error {
	if c.Dir == "" {
		return nil
	}
	if err := os.MkdirAll(c.Dir, 0o700); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(c.Dir, KeptFile+".*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	_, err = tmp.Write(append(append([]byte{}, chain...), key...))
	if err = errors.Join(err, tmp.Sync(), tmp.Close()); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), filepath.Join(c.Dir, KeptFile))
}

// renewAt is two thirds through l's life.
func renewAt(l *loaded) time.Time {
	leaf := l.cert.Leaf
	return leaf.NotBefore.Add(2 * leaf.NotAfter.Sub(leaf.NotBefore) / 3)
}

// issue asks for a certificate and waits until it is signed; it returns what to serve and when
// to ask again (two thirds through its life).
func (c *CSR) issue(ctx context.Context) (*loaded, time.Time, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, time.Time{}, err
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: pki.AgentName}, DNSNames: []string{pki.AgentDNSName(c.Node)}}, key)
	if err != nil {
		return nil, time.Time{}, err
	}
	csr := &certv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{GenerateName: pki.AgentName + "-" + c.Node + "-"},
		Spec: certv1.CertificateSigningRequestSpec{
			Request:    pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}),
			SignerName: pki.SignerName,
			// Client use too: the agent connects to another node's agent for a migration.
			Usages:            []certv1.KeyUsage{certv1.UsageDigitalSignature, certv1.UsageServerAuth, certv1.UsageClientAuth},
			ExpirationSeconds: ptr.To(int32(pki.LeafLifetime / time.Second)),
		},
	}
	if err := c.Client.Create(ctx, csr); err != nil {
		return nil, time.Time{}, fmt.Errorf("requesting the access certificate: %w", err)
	}
	poll, timeout := cmp.Or(c.Poll, time.Second), cmp.Or(c.Timeout, 5*time.Minute)
	deadline := time.Now().Add(timeout)
	for len(csr.Status.Certificate) == 0 {
		for _, cond := range csr.Status.Conditions {
			if (cond.Type == certv1.CertificateDenied || cond.Type == certv1.CertificateFailed) && cond.Status == corev1.ConditionTrue {
				return nil, time.Time{}, fmt.Errorf("access certificate request %s %s: %s", csr.Name, cond.Type, cond.Message)
			}
		}
		if time.Now().After(deadline) {
			return nil, time.Time{}, fmt.Errorf("access certificate request %s not signed after %v (is the operator running?)", csr.Name, timeout)
		}
		select {
		case <-ctx.Done():
			return nil, time.Time{}, ctx.Err()
		case <-time.After(poll):
		}
		if err := c.Client.Get(ctx, client.ObjectKeyFromObject(csr), csr); err != nil {
			return nil, time.Time{}, fmt.Errorf("reading access certificate request %s: %w", csr.Name, err)
		}
	}
	// The leaf, then the CA that signed it, whose clients the endpoint accepts.
	leafPEM, rest := pem.Decode(csr.Status.Certificate)
	if leafPEM == nil {
		return nil, time.Time{}, fmt.Errorf("access certificate request %s: no certificate", csr.Name)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, time.Time{}, err
	}
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
	l, err := load(pem.EncodeToMemory(leafPEM), keyPEM, rest)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("access certificate request %s: %w", csr.Name, err)
	}
	if err := c.keep(csr.Status.Certificate, keyPEM); err != nil {
		return nil, time.Time{}, fmt.Errorf("keeping the access certificate in %s: %w", c.Dir, err)
	}
	return l, renewAt(l), nil
}

// holder is the certificate an endpoint serves now.
type holder struct {
	mu     sync.Mutex
	loaded *loaded
}

func (h *holder) set(l *loaded) {
	h.mu.Lock()
	h.loaded = l
	h.mu.Unlock()
}

func (h *holder) current() (*loaded, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.loaded == nil {
		return nil, errors.New("the access certificate is not loaded yet")
	}
	return h.loaded, nil
}
