package access

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"
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
	if leaf, err := x509.ParseCertificate(pair.Certificate[0]); err == nil && time.Now().After(leaf.NotAfter) {
		return nil, fmt.Errorf("the serving certificate expired at %s", leaf.NotAfter)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, errors.New("no certificate in the client CA bundle")
	}
	return &loaded{cert: pair, pool: pool}, nil
}

// secret is a certificate the operator keeps in a Secret (tls.crt, tls.key, ca.crt), read
// through the API: it serves as soon as the Secret exists, with no wait for a kubelet to sync
// a volume.
type secret struct {
	get func(context.Context) (map[string][]byte, error)

	mu     sync.Mutex
	loaded *loaded
}

// refresh reads the Secret again; a Secret that cannot be read or parsed keeps what was
// loaded before.
func (s *secret) refresh(ctx context.Context) error {
	data, err := s.get(ctx)
	if err != nil {
		return err
	}
	l, err := load(data["tls.crt"], data["tls.key"], data["ca.crt"])
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.loaded = l
	s.mu.Unlock()
	return nil
}

func (s *secret) current() (*loaded, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.loaded == nil {
		return nil, errors.New("the access certificate is not loaded yet")
	}
	return s.loaded, nil
}
