package guestinit

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
)

// loopbackUp brings up lo, which every guest has, on a network or not (port-forward reaches
// the guest's ports through it).
func loopbackUp() {
	if lo, err := netlink.LinkByName("lo"); err == nil {
		_ = netlink.LinkSetUp(lo)
	}
}

// configureNet brings up the interface with n's MAC: its MTU, address, and a default route
// through the gateway. The virtio-net driver probes asynchronously, so the interface is
// waited for.
func configureNet(n *Net, timeout time.Duration) error {
	mac, err := net.ParseMAC(n.MAC)
	if err != nil {
		return fmt.Errorf("network interface MAC %q: %w", n.MAC, err)
	}
	var link netlink.Link
	for deadline := time.Now().Add(timeout); link == nil; {
		links, err := netlink.LinkList()
		if err != nil {
			return fmt.Errorf("listing network interfaces: %w", err)
		}
		for _, l := range links {
			if l.Attrs().HardwareAddr.String() == mac.String() {
				link = l
			}
		}
		if link != nil {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no network interface with MAC %s", mac)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n.MTU > 0 {
		if err := netlink.LinkSetMTU(link, n.MTU); err != nil {
			return fmt.Errorf("setting MTU %d: %w", n.MTU, err)
		}
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: n.Address.Addr().AsSlice(), Mask: net.CIDRMask(n.Address.Bits(), 32)}}
	if err := netlink.AddrReplace(link, addr); err != nil {
		return fmt.Errorf("adding address %s: %w", n.Address, err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("bringing up %s: %w", link.Attrs().Name, err)
	}
	if n.Gateway.IsValid() {
		route := &netlink.Route{LinkIndex: link.Attrs().Index, Gw: n.Gateway.AsSlice()}
		if err := netlink.RouteReplace(route); err != nil {
			return fmt.Errorf("adding the default route via %s: %w", n.Gateway, err)
		}
	}
	return nil
}

// writeNetFiles writes /etc/resolv.conf and /etc/hosts into the root, as container runtimes do.
func writeNetFiles(n *Net, hostname string) error {
	if err := os.MkdirAll("/etc", 0o755); err != nil {
		return err
	}
	hosts := "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
	if hostname != "" {
		hosts += fmt.Sprintf("%s\t%s\n", n.Address.Addr(), hostname)
	}
	if err := replaceFile("/etc/hosts", hosts); err != nil {
		return err
	}
	if len(n.Nameservers) == 0 && len(n.Searches) == 0 {
		return nil
	}
	var b strings.Builder
	for _, s := range n.Nameservers {
		fmt.Fprintf(&b, "nameserver %s\n", s)
	}
	if len(n.Searches) > 0 {
		fmt.Fprintf(&b, "search %s\n", strings.Join(n.Searches, " "))
	}
	return replaceFile("/etc/resolv.conf", b.String())
}

// replaceFile writes path whole, replacing a symlink (images often link resolv.conf elsewhere).
func replaceFile(path, content string) error {
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".imp")
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return os.Rename(tmp, path)
}
