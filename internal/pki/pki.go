// Package pki issues the certificates of IMP's own mutual TLS: a CA, and the certificates it
// signs for the agents' access endpoint (servers) and the subresource server (a client).
// Keys are ECDSA P-256; everything is PEM.
package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"time"
)

// Pair is a certificate and its key, PEM-encoded.
type Pair struct {
	Cert, Key []byte
}

// NewCA makes a self-signed CA named name, valid for lifetime.
func NewCA(name string, now time.Time, lifetime time.Duration) (Pair, error) {
	tmpl := &x509.Certificate{
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-5 * time.Minute),
		NotAfter:              now.Add(lifetime),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	return issue(tmpl, nil, nil)
}

// Request is a leaf certificate to issue.
type Request struct {
	CommonName string
	DNSNames   []string
	IPs        []net.IP
	// Server and Client: the certificate's uses.
	Server, Client bool
	Lifetime       time.Duration
	// PublicKey, when set, is the key to certify (a signing request's, whose private key
	// stays with its requester): the Pair issued has no Key.
	PublicKey crypto.PublicKey
}

// Issue signs r with ca.
func Issue(ca Pair, r Request, now time.Time) (Pair, error) {
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: r.CommonName},
		DNSNames:    r.DNSNames,
		IPAddresses: r.IPs,
		NotBefore:   now.Add(-5 * time.Minute),
		NotAfter:    now.Add(r.Lifetime),
		KeyUsage:    x509.KeyUsageDigitalSignature,
	}
	if r.Server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	}
	if r.Client {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	}
	return issue(tmpl, &ca, r.PublicKey)
}

func issue(tmpl *x509.Certificate, ca *Pair, pub crypto.PublicKey) (Pair, error) {
	var key *ecdsa.PrivateKey
	if pub == nil {
		var err error
		if key, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader); err != nil {
			return Pair{}, err
		}
		pub = &key.PublicKey
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return Pair{}, err
	}
	tmpl.SerialNumber = serial
	parent, signer := tmpl, any(key)
	if ca == nil && key == nil {
		return Pair{}, errors.New("a request's public key needs a CA to sign it")
	}
	if ca != nil {
		pair, err := tls.X509KeyPair(ca.Cert, ca.Key)
		if err != nil {
			return Pair{}, fmt.Errorf("reading the CA: %w", err)
		}
		if parent, err = x509.ParseCertificate(pair.Certificate[0]); err != nil {
			return Pair{}, err
		}
		signer = pair.PrivateKey
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, pub, signer)
	if err != nil {
		return Pair{}, fmt.Errorf("signing %q: %w", tmpl.Subject.CommonName, err)
	}
	p := Pair{Cert: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
	if key != nil {
		keyDER, err := x509.MarshalECPrivateKey(key)
		if err != nil {
			return Pair{}, err
		}
		p.Key = pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
	}
	return p, nil
}

// Expiry is the end of the first certificate in pemCert.
func Expiry(pemCert []byte) (time.Time, error) {
	c, err := parseCert(pemCert)
	if err != nil {
		return time.Time{}, err
	}
	return c.NotAfter, nil
}

// parseCert is the first certificate in pemCert.
func parseCert(pemCert []byte) (*x509.Certificate, error) {
	b, _ := pem.Decode(pemCert)
	if b == nil {
		return nil, errors.New("no PEM certificate")
	}
	return x509.ParseCertificate(b.Bytes)
}
