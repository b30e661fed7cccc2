// Command net benchmarks the node side of ImpNetworks in a network namespace it creates (the
// node): the time to give one VM its tap and anti-spoofing rules in its network's namespace
// (P50 and P99 over n VMs, with the first VM of a network, which also creates the namespace,
// bridge, transit link and rules, reported apart), the 10th and the nth VM's (an attach must
// not cost more as VMs accumulate), and the time to sync a network's overlay with n peers on
// other nodes.
//
//	go run ./test/bench/net -n 100      (make bench-net; needs root)
package main

import (
	"flag"
	"fmt"
	"log"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"time"

	"github.com/vishvananda/netns"

	"github.com/syscode-labs/imp/internal/agent/hostnet"
)

func main() {
	n := flag.Int("n", 100, "VMs on the node")
	flag.Parse()
	if err := run(*n); err != nil {
		log.Fatal(err)
	}
}

func run(n int) error {
	name := fmt.Sprintf("imp-bench-net-%d", os.Getpid())
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // the thread dies in the new namespace, with the goroutine
		ns, err := netns.NewNamed(name)
		if err == nil {
			ns.Close()
		}
		errc <- err
	}()
	if err := <-errc; err != nil {
		return fmt.Errorf("creating a network namespace (root needed): %w", err)
	}
	defer netns.DeleteNamed(name)
	state, err := os.MkdirTemp("", "imp-bench-net-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(state)
	pins := filepath.Join(state, "netns")
	h, err := hostnet.Open(hostnet.Options{NetNS: "/var/run/netns/" + name, NSDir: pins, VTEP: netip.MustParseAddr("192.0.2.1"), StateDir: state})
	if err != nil {
		return err
	}
	defer h.Close()

	p := netip.MustParsePrefix("10.64.0.0/16")
	nw := hostnet.Network{Namespace: "bench", Name: "net", UID: "bench-net", VNI: 4242, Prefix: p, Gateway: p.Addr().Next(), NAT: true}
	var times []time.Duration
	var first time.Duration
	ip := nw.Gateway
	for i := 0; i < n; i++ {
		ip = ip.Next()
		start := time.Now()
		at, err := h.Attach(nw, fmt.Sprintf("vm-%d", i), ip)
		d := time.Since(start)
		if err != nil {
			return err
		}
		at.Tap.Close()
		if i == 0 {
			first = d
		} else {
			times = append(times, d)
		}
	}
	tenth, last := times[8], times[len(times)-1]
	sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
	pct := func(q float64) time.Duration { return times[int(q*float64(len(times)-1))].Round(10 * time.Microsecond) }

	peers := make([]hostnet.Peer, n)
	for i := range peers {
		ip = ip.Next()
		peers[i] = hostnet.Peer{IP: ip, VTEP: netip.AddrFrom4([4]byte{192, 0, 2, byte(2 + i%50)})}
	}
	start := time.Now()
	if _, err := h.Sync(nw, peers); err != nil {
		return err
	}
	syncFirst := time.Since(start)
	start = time.Now()
	if _, err := h.Sync(nw, peers); err != nil {
		return err
	}
	syncAgain := time.Since(start)

	fmt.Printf("network setup per VM (tap + anti-spoofing rules in the network's namespace), %d VMs on one node:\n", n)
	fmt.Printf("  first VM of the network (creates its namespace, bridge, transit link and rules): %v\n", first.Round(10*time.Microsecond))
	fmt.Printf("  P50 %v   P99 %v   the 10th VM: %v   the %dth VM: %v\n", pct(0.5), pct(0.99), tenth.Round(10*time.Microsecond), n, last.Round(10*time.Microsecond))
	fmt.Printf("overlay sync with %d peers on 50 nodes: first %v, unchanged %v\n", n, syncFirst.Round(10*time.Microsecond), syncAgain.Round(10*time.Microsecond))
	start = time.Now()
	if err := h.Prune(func(string) bool { return false }); err != nil {
		return err
	}
	fmt.Printf("removing all %d VMs and the network: %v\n", n, time.Since(start).Round(time.Millisecond))
	return nil
}
