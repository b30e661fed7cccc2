// Package pullnet is how the agent reaches image registries: the tenant names the registry, and
// the agent runs in the node's network, so a reference such as 127.0.0.1:10255/x:y (or a
// registry's redirect to 169.254.169.254) would make the agent fetch from the node's loopback
// services or the cloud's metadata and show the answer in the tenant's status. A registry on a
// loopback, link-local or unspecified address is dialled only when the node's flags name it.
package pullnet

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
)

// Transport returns the transport of registry requests: every connection, redirects
// included, is checked where it is dialled, against the addresses the host resolves to, so that
// a name that resolves to loopback is refused as the address itself is. allowed names the
// local registries that may be reached: "host:port", or "host" for any of its ports.
func Transport(allowed []string) *http.Transport {
	d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	// The node's proxy (HTTPS_PROXY, NO_PROXY) is used as before: a connection to the proxy is
	// checked as any other, so a proxy on the node's loopback must be named too.
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		host, port, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, err
		}
		ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		if err != nil {
			return nil, err
		}
		for _, ip := range ips {
			if Local(ip) && !slices.Contains(allowed, addr) && !slices.Contains(allowed, host) {
				return nil, fmt.Errorf("registry %s is on %s, a loopback or link-local address of the node: the agent reaches it only where its --local-registry flag names it", addr, ip)
			}
		}
		// Dial what was checked, not a second resolution.
		var errs error
		for _, ip := range ips {
			c, err := d.DialContext(ctx, network, net.JoinHostPort(ip.Unmap().String(), port))
			if err == nil {
				return c, nil
			}
			errs = err
		}
		if errs == nil {
			errs = fmt.Errorf("no address for %s", host)
		}
		return nil, errs
	}
	return t
}

// Local says whether ip is the node's own or its link's: loopback, link-local, unspecified.
func Local(ip netip.Addr) bool {
	ip = ip.Unmap()
	return ip.IsLoopback() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() || ip.IsUnspecified() || ip.IsInterfaceLocalMulticast()
}

// NameOptions are the options an image reference is parsed with: a loopback registry, and those
// named insecure ("host:port"), are reached over plain HTTP.
func NameOptions(image string, insecure []string) []name.Option {
	host, _, _ := strings.Cut(image, "/")
	h, _, _ := strings.Cut(host, ":")
	if h == "localhost" || strings.HasPrefix(h, "127.") || h == "[::1]" || slices.Contains(insecure, host) {
		return []name.Option{name.Insecure}
	}
	return nil
}
