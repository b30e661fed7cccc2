package hostnet_test

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/net/dns/dnsmessage"

	"github.com/syscode-labs/imp/internal/agent/egressproxy"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/testnetns"
)

// TestDomainEgress: a NAT network whose egress names allowed.test and *.allowed.test, a guest
// behind its tap, and an "internet" namespace the test made beside the node with an HTTP and
// a TLS server (answering with the name asked for) and a DNS server. The guest reaches the
// allowed names over HTTP and TLS, wherever it dialled; another name, an IP address for a name,
// a name resolving to the node's address or to a private one, and an allowed name dialled at an
// internal address (its /etc/hosts pointing there) are each reset at once, never left hanging;
// the resolver is the node's, not the guest's; ports other than 80 and 443 are the network's
// CIDR rules'; every decision is reported with the name.
func TestDomainEgress(t *testing.T) {
	node, inet := testnetns.New(t, "imp-hn-dom"), testnetns.New(t, "imp-hn-domi")
	testnetns.Link(t, node, "eth1", "203.0.113.1/24", inet, "eth0", "203.0.113.10/24")
	ih := testnetns.Handle(t, inet)
	il, _ := ih.LinkByName("eth0")
	for _, a := range []string{"203.0.113.11/24"} {
		p := netip.MustParsePrefix(a)
		if err := ih.AddrAdd(il, addr(p)); err != nil {
			t.Fatal(err)
		}
	}
	serveHTTP(t, inet, "203.0.113.10:80")
	serveHTTP(t, inet, "203.0.113.11:80")
	serveTLS(t, inet, "203.0.113.10:443")
	serveHTTP(t, inet, "203.0.113.11:8080")
	serveDNS(t, inet, "203.0.113.10:53", map[string]string{
		"allowed.test.":      "203.0.113.10",
		"api.allowed.test.":  "203.0.113.10",
		"other.test.":        "203.0.113.11",
		"home.allowed.test.": "203.0.113.1", // the node's own address
		"db.allowed.test.":   "10.1.2.3",    // private
	})

	h := open(t, node, "")
	n := network("dom", "10.73.0.0/24", 0, true)
	n.Egress.Proxy = true
	g := guestBehind(t, h, n, "vm-d", "10.73.0.2")
	var mu sync.Mutex
	var decided []egressproxy.Decision
	ps := &egressproxy.Proxies{Host: h, Nameserver: "203.0.113.10:53", Decided: func(_ hostnet.Network, d egressproxy.Decision) {
		mu.Lock()
		decided = append(decided, d)
		mu.Unlock()
	}}
	t.Cleanup(ps.Stop)
	if err := ps.Ensure(n, []string{"allowed.test", "*.allowed.test"}, true); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name, dial, host string
		tls              bool
		want             string // the answer's start, or "reset"
		result           string
	}{
		{"an allowed name over HTTP", "203.0.113.10:80", "allowed.test", false, "http hello from allowed.test", egressproxy.Allowed},
		{"an allowed name over TLS", "203.0.113.10:443", "allowed.test", true, "tls hello from allowed.test", egressproxy.Allowed},
		{"a wildcard's name, dialled elsewhere: the node's answer is used", "203.0.113.11:80", "api.allowed.test", false, "http hello from api.allowed.test at 203.0.113.10", egressproxy.Allowed},
		{"another name", "203.0.113.11:80", "other.test", false, "reset", egressproxy.RefusedDomain},
		{"another name over TLS", "203.0.113.10:443", "other.test", true, "reset", egressproxy.RefusedDomain},
		{"an address for a name", "203.0.113.11:80", "203.0.113.11", false, "reset", egressproxy.RefusedNoName},
		{"an allowed name resolving to the node", "203.0.113.10:80", "home.allowed.test", false, "reset", egressproxy.RefusedInternal},
		{"an allowed name resolving to a private address", "203.0.113.10:80", "db.allowed.test", false, "reset", egressproxy.RefusedInternal},
		{"an allowed name dialled at a private address (the guest's /etc/hosts)", "192.168.1.1:80", "allowed.test", false, "reset", egressproxy.RefusedDestination},
		{"an allowed name dialled at the node's address", "203.0.113.1:80", "allowed.test", false, "reset", egressproxy.RefusedDestination},
		{"a name the node cannot resolve", "203.0.113.10:80", "gone.allowed.test", false, "reset", egressproxy.RefusedUnresolved},
		{"another port: the network's CIDR rules, not the proxy", "203.0.113.11:8080", "other.test", false, "http hello from other.test at 203.0.113.11", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mu.Lock()
			before := len(decided)
			mu.Unlock()
			start := time.Now()
			got := fetchFrom(t, g, tc.dial, tc.host, tc.tls)
			if !strings.HasPrefix(got, tc.want) {
				t.Errorf("%s via %s: %q, want %q", tc.host, tc.dial, got, tc.want)
			}
			if tc.want == "reset" && time.Since(start) > 2*time.Second {
				t.Errorf("the refusal took %v: left hanging", time.Since(start))
			}
			mu.Lock()
			defer mu.Unlock()
			if tc.result == "" {
				if len(decided) != before {
					t.Errorf("the proxy saw a connection to port 8080: %+v", decided[before:])
				}
				return
			}
			if len(decided) != before+1 || decided[before].Result != tc.result {
				t.Errorf("decisions %+v, want one %s", decided[before:], tc.result)
				return
			}
			if d := decided[before]; tc.result != egressproxy.RefusedNoName && d.Name != tc.host || d.Client.Addr() != netip.MustParseAddr("10.73.0.2") {
				t.Errorf("the decision names %q from %s, want %q from the guest", d.Name, d.Client, tc.host)
			}
		})
	}

	// A kept-alive connection let out for allowed.test whose second request names other.test
	// (a shared front end would route it there): the first is answered, the second is not.
	if err := testnetns.Do(g, func() error {
		c, err := net.DialTimeout("tcp", "203.0.113.10:80", 3*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		br := bufio.NewReader(c)
		for i, host := range []string{"allowed.test", "other.test"} {
			fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\n\r\n", host)
			resp, err := http.ReadResponse(br, nil)
			if i == 0 && err != nil {
				return fmt.Errorf("the first request: %w", err)
			}
			if i == 1 && err == nil {
				b := make([]byte, 64)
				k, _ := resp.Body.Read(b)
				t.Errorf("a second request for another host was answered: %q", b[:k])
			}
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	// The list changes: other.test allowed from then on; the proxy stops with its domains.
	if err := ps.Ensure(n, []string{"other.test"}, true); err != nil {
		t.Fatal(err)
	}
	if got := fetchFrom(t, g, "203.0.113.11:80", "other.test", false); !strings.HasPrefix(got, "http hello from other.test") {
		t.Errorf("other.test once allowed: %q", got)
	}
	if got := fetchFrom(t, g, "203.0.113.10:80", "allowed.test", false); got != "reset" {
		t.Errorf("allowed.test no longer allowed: %q", got)
	}
	if err := ps.Ensure(n, nil, true); err != nil {
		t.Fatal(err)
	}
	if got := fetchFrom(t, g, "203.0.113.10:80", "allowed.test", false); strings.HasPrefix(got, "http hello") {
		t.Errorf("with the proxy stopped (rules still redirecting) a connection got out: %q", got)
	}
}

func addr(p netip.Prefix) *netlink.Addr {
	return &netlink.Addr{IPNet: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), 32)}}
}

// fetchFrom sends one GET for host to dial from ns (over TLS with host as the server name)
// and returns the answer's body, "reset" when the connection was reset, or the error.
func fetchFrom(t *testing.T, ns, dial, host string, useTLS bool) string {
	t.Helper()
	var out string
	err := testnetns.Do(ns, func() error {
		c, err := net.DialTimeout("tcp", dial, 3*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if useTLS {
			tc := tls.Client(c, &tls.Config{ServerName: host, InsecureSkipVerify: true}) //nolint:gosec // the test's own server
			if err := tc.Handshake(); err != nil {
				return err
			}
			c = tc
		}
		if _, err := fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", host); err != nil {
			return err
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b := make([]byte, 256)
		k, _ := resp.Body.Read(b)
		out = strings.TrimSpace(string(b[:k]))
		return nil
	})
	if errors.Is(err, syscall.ECONNRESET) {
		return "reset"
	}
	if err != nil {
		return "error: " + err.Error()
	}
	return out
}

// serveHTTP answers every request at addr in ns with "http hello from <Host> at <local address>".
func serveHTTP(t *testing.T, ns, addr string) {
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

// serveTLS answers over TLS at addr in ns, with a certificate of its own, "tls hello from <SNI>".
func serveTLS(t *testing.T, ns, addr string) {
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

// serveDNS answers A queries at addr (UDP) in ns from names; anything else is NXDOMAIN.
func serveDNS(t *testing.T, ns, addr string, names map[string]string) {
	t.Helper()
	var pc net.PacketConn
	if err := testnetns.Do(ns, func() (err error) { pc, err = net.ListenPacket("udp", addr); return err }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
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
		}
	}()
}
