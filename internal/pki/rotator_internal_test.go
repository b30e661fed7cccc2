package pki

import (
	"crypto/x509"
	"testing"
	"time"
)

// A leaf is issued again when it is missing, unreadable, not the current CA's, or two thirds
// through its life.
func TestDue(t *testing.T) {
	now := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	ca, err := NewCA("ca", now, CALifetime)
	if err != nil {
		t.Fatal(err)
	}
	other, err := NewCA("other", now, CALifetime)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca.Cert)
	leaf := func(ca Pair) []byte {
		p, err := Issue(ca, Request{CommonName: AgentName, DNSNames: []string{AgentName}, Server: true, Lifetime: LeafLifetime}, now)
		if err != nil {
			t.Fatal(err)
		}
		return p.Cert
	}
	mine := leaf(ca)
	for _, tc := range []struct {
		name string
		cert []byte
		at   time.Time
		want bool
	}{
		{"missing", nil, now, true},
		{"not PEM", []byte("garbage"), now, true},
		{"another CA's", leaf(other), now, true},
		{"fresh", mine, now, false},
		{"just before two thirds", mine, now.Add(2*LeafLifetime/3 - 6*time.Minute), false},
		{"past two thirds", mine, now.Add(2 * LeafLifetime / 3), true},
		{"expired", mine, now.Add(LeafLifetime + time.Hour), true},
	} {
		if got := due(tc.cert, pool, tc.at); got != tc.want {
			t.Errorf("%s: due %v, want %v", tc.name, got, tc.want)
		}
	}
}
