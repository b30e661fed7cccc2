// Package testinet is an internet for tests, in a network namespace the test made: HTTP and
// TLS servers that answer with the name asked for and a DNS server of fixed answers. Nothing
// of it is ever an outside address.
package testinet

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/syscode-labs/imp/internal/testnetns"
)

// ServeHTTP answers every request at addr in ns with "http hello from <Host> at <local address>".
func ServeHTTP(t testing.TB, ns, addr string) {
	t.Helper()
	var l net.Listener
	if err := testnetns.Do(ns, func() (err error) { l, err = net.Listen("tcp", addr); return err }); err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		local, _, _ := net.SplitHostPort(r.Context().Value(http.LocalAddrContextKey).(net.Addr).String())
		fmt.Fprintf(w, "http hello from %s at %s\n", r.Host, local)
	}), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Close() })
}

// ServeTLS answers over TLS at addr in ns, with a certificate of its own, "tls hello from <SNI>".
func ServeTLS(t testing.TB, ns, addr string) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), DNSNames: []string{"*.allowed.test", "allowed.test", "other.test"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	var l net.Listener
	if err := testnetns.Do(ns, func() (err error) { l, err = net.Listen("tcp", addr); return err }); err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "tls hello from %s\n", r.TLS.ServerName)
	}), ReadHeaderTimeout: 5 * time.Second, TLSConfig: &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}}
	go func() { _ = srv.ServeTLS(l, "", "") }()
	t.Cleanup(func() { srv.Close() })
}

// ServeDNS answers A queries at addr (UDP) in ns from names; anything else is NXDOMAIN. It
// returns what it was asked last (up to 64 queries: "from name type answer"), for a test that
// fails to say.
func ServeDNS(t testing.TB, ns, addr string, names map[string]string) (asked func() []string) {
	t.Helper()
	var pc net.PacketConn
	if err := testnetns.Do(ns, func() (err error) { pc, err = net.ListenPacket("udp", addr); return err }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	var mu sync.Mutex
	var log []string
	note := func(l string) {
		mu.Lock()
		defer mu.Unlock()
		if log = append(log, l); len(log) > 64 {
			log = log[1:]
		}
	}
	go func() {
		buf := make([]byte, 512)
		for {
			k, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			var p dnsmessage.Parser
			h, err := p.Start(buf[:k])
			if err != nil {
				continue
			}
			q, err := p.Question()
			if err != nil {
				continue
			}
			b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true})
			b.EnableCompression()
			_ = b.StartQuestions()
			_ = b.Question(q)
			ip, ok := names[q.Name.String()]
			if !ok || ip == "" {
				b = dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true, RCode: dnsmessage.RCodeNameError})
				_ = b.StartQuestions()
				_ = b.Question(q)
			} else if q.Type == dnsmessage.TypeA {
				_ = b.StartAnswers()
				_ = b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 1},
					dnsmessage.AResource{A: netip.MustParseAddr(ip).As4()})
			}
			out, err := b.Finish()
			if err == nil {
				_, _ = pc.WriteTo(out, from)
			}
			note(fmt.Sprintf("%s %s %s %q %v", from, q.Name, q.Type, ip, err))
		}
	}()
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), log...)
	}
}
