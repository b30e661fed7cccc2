// Package testnetns gives tests network namespaces of their own, so that host networking is
// exercised for real without touching the machine's interfaces.
package testnetns

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// New creates a named network namespace with its loopback up, removed when the test ends, and
// returns its path. It skips the test when namespaces cannot be created (not root).
func New(t testing.TB, name string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("network namespaces need root")
	}
	_ = netns.DeleteNamed(name) // a leftover of an interrupted run
	err := onThread(func() error {
		ns, err := netns.NewNamed(name)
		if err != nil {
			return err
		}
		return ns.Close()
	})
	if err != nil {
		t.Fatalf("creating network namespace %s: %v", name, err)
	}
	t.Cleanup(func() { _ = netns.DeleteNamed(name) })
	path := filepath.Join("/var/run/netns", name)
	if err := Do(path, resetInherited); err != nil {
		t.Fatalf("resetting %s's IPv4 settings: %v", name, err)
	}
	h := Handle(t, path)
	lo, err := h.LinkByName("lo")
	if err == nil {
		err = h.LinkSetUp(lo)
	}
	if err != nil {
		t.Fatalf("bringing up lo in %s: %v", name, err)
	}
	return path
}

// inherited are the IPv4 settings a new namespace copies from the host's (with the kernel's
// default net.core.devconf_inherit_init_net, 0) that a node's other software changes while
// tests run (a real node's CNI and kube-proxy, the e2e's or make dev's: forwarding,
// route_localnet), with the kernel's defaults: a test's namespace starts as on a fresh kernel,
// whatever the host's are.
var inherited = map[string]string{
	"net/ipv4/ip_forward":                  "0",
	"net/ipv4/conf/default/forwarding":     "0",
	"net/ipv4/conf/all/route_localnet":     "0",
	"net/ipv4/conf/default/route_localnet": "0",
}

// resetInherited sets the current namespace's inherited settings to the kernel's defaults.
func resetInherited() error {
	for k, v := range inherited {
		if err := os.WriteFile("/proc/sys/"+k, []byte(v), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// Handle is a netlink handle in the namespace at path, closed when the test ends.
func Handle(t testing.TB, path string) *netlink.Handle {
	t.Helper()
	ns, err := netns.GetFromPath(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	return h
}

// Do runs f on a thread inside the namespace at path. Sockets f opens stay in it.
func Do(path string, f func() error) error {
	return onThread(func() error {
		ns, err := netns.GetFromPath(path)
		if err != nil {
			return err
		}
		defer ns.Close()
		if err := netns.Set(ns); err != nil {
			return fmt.Errorf("entering %s: %w", path, err)
		}
		return f()
	})
}

// onThread runs f on a locked thread that dies afterwards, so no goroutine inherits the
// namespace f may have entered.
func onThread(f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		errc <- f()
	}()
	return <-errc
}

// Link joins namespaces a and b with a veth pair named nameA/nameB, addressed with the given
// CIDRs (an empty CIDR leaves that end without an address), both ends up.
func Link(t testing.TB, a, nameA, cidrA, b, nameB, cidrB string) {
	t.Helper()
	ha, hb := Handle(t, a), Handle(t, b)
	nsB, err := netns.GetFromPath(b)
	if err != nil {
		t.Fatal(err)
	}
	defer nsB.Close()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: nameA}, PeerName: nameB, PeerNamespace: netlink.NsFd(nsB)}
	if err := ha.LinkAdd(veth); err != nil {
		t.Fatalf("creating veth %s/%s: %v", nameA, nameB, err)
	}
	for _, end := range []struct {
		h          *netlink.Handle
		name, cidr string
	}{{ha, nameA, cidrA}, {hb, nameB, cidrB}} {
		l, err := end.h.LinkByName(end.name)
		if err != nil {
			t.Fatal(err)
		}
		if end.cidr != "" {
			ip, ipnet, err := net.ParseCIDR(end.cidr)
			if err != nil {
				t.Fatal(err)
			}
			ipnet.IP = ip
			if err := end.h.AddrAdd(l, &netlink.Addr{IPNet: ipnet}); err != nil {
				t.Fatal(err)
			}
		}
		if err := end.h.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
	}
}

// Switch joins spaces to one segment, as a switch would: a namespace of its own named sw with
// a bridge, and a veth from each of spaces (named link there, addressed with the CIDR of the
// same index of cidrs) to a port of the bridge.
func Switch(t testing.TB, sw, link string, spaces, cidrs []string) {
	t.Helper()
	path := New(t, sw)
	h := Handle(t, path)
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}}
	if err := h.LinkAdd(br); err != nil {
		t.Fatalf("creating the bridge of %s: %v", sw, err)
	}
	if err := h.LinkSetUp(br); err != nil {
		t.Fatal(err)
	}
	for i, space := range spaces {
		port := fmt.Sprintf("port%d", i)
		Link(t, space, link, cidrs[i], path, port, "")
		l, err := h.LinkByName(port)
		if err == nil {
			err = h.LinkSetMaster(l, br)
		}
		if err != nil {
			t.Fatalf("putting %s on the bridge of %s: %v", port, sw, err)
		}
	}
}

// Serve listens on TCP addr in ns and gives each connection to handle, on a goroutine of its
// own, until the test ends.
func Serve(t testing.TB, ns, addr string, handle func(net.Conn)) {
	t.Helper()
	var l net.Listener
	if err := Do(ns, func() (err error) { l, err = net.Listen("tcp", addr); return err }); err != nil {
		t.Fatalf("listening on %s in %s: %v", addr, ns, err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go handle(c)
		}
	}()
}

// PinDir is a directory for the network namespaces a test's code pins (bind mounts); when the
// test ends, whatever is still pinned there is unmounted before the directory goes.
func PinDir(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	t.Cleanup(func() {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			_ = unix.Unmount(filepath.Join(dir, e.Name()), unix.MNT_DETACH)
		}
	})
	return dir
}
