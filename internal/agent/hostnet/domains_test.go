package hostnet_test

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/syscode-labs/imp/internal/agent/egressproxy"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/testguest/reach"
	"github.com/syscode-labs/imp/internal/testinet"
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
	testinet.ServeHTTP(t, inet, "203.0.113.10:80")
	testinet.ServeHTTP(t, inet, "203.0.113.11:80")
	testinet.ServeTLS(t, inet, "203.0.113.10:443")
	testinet.ServeHTTP(t, inet, "203.0.113.11:8080")
	testinet.ServeDNS(t, inet, "203.0.113.10:53", map[string]string{
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

	// Asking a plain HTTP connection to become another protocol (after which nothing could be
	// checked) ends it; so does a request head past the bound, instead of growing without end.
	if err := testnetns.Do(g, func() error {
		for _, tc := range []struct{ what, req, answered string }{
			{"an upgrade", "GET / HTTP/1.1\r\nHost: allowed.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", ""},
			{"an endless second head", "GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\nGET / HTTP/1.1\r\nHost: allowed.test\r\nX-Long: " +
				strings.Repeat("a", 40<<10), "http hello from allowed.test"},
		} {
			c, err := net.DialTimeout("tcp", "203.0.113.10:80", 3*time.Second)
			if err != nil {
				return err
			}
			start := time.Now()
			_ = c.SetDeadline(start.Add(15 * time.Second))
			_, _ = io.WriteString(c, tc.req)
			b, err := io.ReadAll(c)
			c.Close()
			// Ended by the bound at once, not by the wait for more of the head (10 s).
			if errors.Is(err, os.ErrDeadlineExceeded) || time.Since(start) > 5*time.Second {
				t.Errorf("%s: ended after %v: %v", tc.what, time.Since(start), err)
			}
			if got := string(b); tc.answered == "" && got != "" || !strings.Contains(got, tc.answered) || strings.Count(got, "HTTP/1.1 200") > 1 {
				t.Errorf("%s: answered %q", tc.what, got)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	// With internet Deny, the allowed names are still reached: domains are what the network
	// allows over HTTP and HTTPS.
	closed := n
	closed.Egress.Internet = false
	if err := ps.Ensure(closed, []string{"allowed.test", "*.allowed.test"}, true); err != nil {
		t.Fatal(err)
	}
	if got := fetchFrom(t, g, "203.0.113.10:80", "allowed.test", false); !strings.HasPrefix(got, "http hello from allowed.test") {
		t.Errorf("allowed.test with internet Deny: %q", got)
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
// and returns the answer's first line, "reset" when the connection was reset, or the error.
func fetchFrom(t *testing.T, ns, dial, host string, useTLS bool) string {
	t.Helper()
	var out string
	if err := testnetns.Do(ns, func() error { out = reach.Get(host, dial, useTLS, 5*time.Second); return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}
