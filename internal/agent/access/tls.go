package access

import (
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
	}, nil
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
	cert, err := tls.LoadX509KeyPair(f.cert, f.key)
	if err != nil {
		return nil, fmt.Errorf("loading the serving certificate: %w", err)
	}
	if leaf, err := x509.ParseCertificate(cert.Certificate[0]); err == nil && time.Now().After(leaf.NotAfter) {
		return nil, fmt.Errorf("the serving certificate in %s expired at %s", f.cert, leaf.NotAfter)
	}
	pem, err := os.ReadFile(f.ca)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, errors.New("no certificate in the client CA bundle " + f.ca)
	}
	f.stamp, f.loaded = stamp, &loaded{cert: cert, pool: pool}
	return f.loaded, nil
}
