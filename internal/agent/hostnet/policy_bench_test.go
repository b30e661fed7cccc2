package hostnet_test

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/netpolicy"
	"github.com/syscode-labs/imp/internal/testnetns"
)

// TestBenchNetpol is `make bench-netpol` (IMP_BENCH=netpol): a node with 1,000 NetworkPolicies
// and 1,000 pods' and 1,000 VMs' addresses, 50 VMs of its own on one network (two of them
// guests in namespaces behind their taps), measures:
//   - the time to apply a change on the node — a pod relabelled into the peers of other
//     policies: every local VM's policy computed, and those that changed set, as the enforcer
//     does, P50 and P99 over rounds;
//   - a TCP stream between the two guests (bridged) and from a pod to a guest's endpoint address
//     (routed, DNAT), each with no policy and with both guests under policies with 1,000 peers:
//     MiB/s, medians of alternated runs, and the ratio (target ≥ 0.9×).
func TestBenchNetpol(t *testing.T) {
	if os.Getenv("IMP_BENCH") != "netpol" {
		t.Skip("a benchmark: make bench-netpol")
	}
	const (
		policies, pods, peers, local = 1000, 1000, 1000, 50
		rounds                       = 20
	)
	node, pod := testnetns.New(t, "imp-hn-bnp"), testnetns.New(t, "imp-hn-bnpp")
	testnetns.Link(t, node, "eth1", "192.168.78.1/24", pod, "eth0", "192.168.78.2/24")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	ph := testnetns.Handle(t, pod)
	pl, _ := ph.LinkByName("eth0")
	must(ph.RouteAdd(&netlink.Route{LinkIndex: pl.Attrs().Index, Gw: net.ParseIP("192.168.78.1")}))
	h := open(t, node, "")
	n := network("bnp", "10.64.0.0/16", 0, true)

	// The world: pods in 10.200.0.0/16, VMs of the network in 10.64.0.0/16 (the local ones
	// first), policies each selecting one local VM's label (app=vm-<i mod 50>) and admitting
	// pods of one label and VMs of another.
	w := &netpolicy.World{Namespaces: map[string]map[string]string{"bench": {"team": "bench"}}}
	for i := range pods {
		w.Pods = append(w.Pods, netpolicy.Pod{Namespace: "bench", Labels: map[string]string{"app": fmt.Sprint("pod-", i%100)},
			IPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 200, byte(i >> 8), byte(i)})}})
	}
	var locals []netpolicy.VM
	for i := range peers {
		vm := netpolicy.VM{Namespace: "bench", Name: fmt.Sprint("vm-", i), Labels: map[string]string{"app": fmt.Sprint("vm-", i%local), "n": fmt.Sprint(i)},
			Network: n.Key(), Address: netip.AddrFrom4([4]byte{10, 64, byte((i + 2) >> 8), byte(i + 2)})}
		w.VMs = append(w.VMs, vm)
		if i < local {
			locals = append(locals, vm)
		}
	}
	for i := range policies {
		w.Policies = append(w.Policies, &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: fmt.Sprint("p-", i)},
			Spec: networkingv1.NetworkPolicySpec{
				PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": fmt.Sprint("vm-", i%local)}},
				PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress},
				Ingress: []networkingv1.NetworkPolicyIngressRule{{
					From:  []networkingv1.NetworkPolicyPeer{{PodSelector: sel("app", fmt.Sprint("pod-", i%100))}, {PodSelector: sel("n", fmt.Sprint(i))}},
					Ports: []networkingv1.NetworkPolicyPort{{Port: ptr.To(intstr.FromInt32(int32(8000 + i%20)))}, {Port: ptr.To(intstr.FromInt32(5001))}},
				}},
				Egress: []networkingv1.NetworkPolicyEgressRule{{To: []networkingv1.NetworkPolicyPeer{{PodSelector: sel("app", fmt.Sprint("pod-", i%100))},
					{IPBlock: &networkingv1.IPBlock{CIDR: "10.64.0.0/16"}}}}},
			}})
	}
	// The local VMs: taps, the first two with guests behind them.
	a, b := locals[0], locals[1]
	ga := guestBehind(t, h, n, "vm-0", a.Address.String())
	gb := guestBehind(t, h, n, "vm-1", b.Address.String())
	for _, vm := range locals[2:] {
		attach(t, h, n, vm.Name, vm.Address.String())
	}
	sink(t, gb, ":5001")
	endpoint := netip.MustParseAddr("100.72.0.9")
	must(h.Expose(n, "vm-1", b.Address, hostnet.Exposure{Endpoint: endpoint, Ports: []hostnet.Port{{Protocol: 6, Port: 5001}}}))

	// apply is the enforcer's work for a change: every local VM's policy computed, and set
	// where it changed (the enforcer compares with what it set last).
	last := make([]hostnet.Policy, len(locals))
	changed := 0
	apply := func(w *netpolicy.World) (compile, set time.Duration) {
		start := time.Now()
		ps := make([]hostnet.Policy, len(locals))
		for i, vm := range locals {
			ps[i] = w.Compile(vm)
		}
		compile = time.Since(start)
		start = time.Now()
		for i, vm := range locals {
			if reflect.DeepEqual(ps[i], last[i]) && last[i].Ingress != nil {
				continue
			}
			changed++
			must(h.SetPolicy(n, vm.Name, vm.Address, ps[i]))
			last[i] = ps[i]
		}
		return compile, time.Since(start)
	}
	c0, s0 := apply(w)
	changed = 0
	peersOfB := 0
	for _, al := range w.Compile(b).Ingress {
		peersOfB += len(al.Network) + len(al.Outside)
	}
	fmt.Printf("netpol: %d policies, %d pods, %d VMs' addresses, %d local VMs; the first apply: compile %v, set %v; VM b admits %d peer prefixes\n",
		policies, pods, peers, local, c0.Round(time.Millisecond), s0.Round(time.Millisecond), peersOfB)

	var totals, compiles []time.Duration
	for r := range rounds {
		// Pod r moves into a label other policies admit.
		p := &w.Pods[r]
		p.Labels = map[string]string{"app": fmt.Sprint("pod-", (r*7+1)%100)}
		w2 := &netpolicy.World{Namespaces: w.Namespaces, Pods: w.Pods, VMs: w.VMs, Policies: w.Policies} // a fresh World per change, as the enforcer builds
		c, s := apply(w2)
		compiles, totals = append(compiles, c), append(totals, c+s)
	}
	fmt.Printf("netpol: apply a change on the node (compile every local VM, set those changed: %.1f VMs a change): P50 %v, P99 %v (compile P50 %v)\n",
		float64(changed)/rounds, pct(totals, 50), pct(totals, 99), pct(compiles, 50))

	// Throughput: alternated runs with no policy and with both guests under theirs.
	policed := map[bool][]float64{}
	routed := map[bool][]float64{}
	for run := range 6 {
		on := run%2 == 1
		for _, vm := range locals[:2] {
			p := hostnet.Policy{}
			if on {
				p = w.Compile(vm)
				// The stream's own peers: a admits nothing new; b admits a and the pod.
				if vm.Name == b.Name {
					p.Ingress = append(p.Ingress, hostnet.Allow{Network: []netip.Prefix{netip.PrefixFrom(a.Address, 32)},
						Outside: []netip.Prefix{netip.MustParsePrefix("192.168.78.2/32")}})
				}
			}
			must(h.SetPolicy(n, vm.Name, vm.Address, p))
		}
		policed[on] = append(policed[on], stream(t, ga, b.Address.String()+":5001"))
		routed[on] = append(routed[on], stream(t, pod, endpoint.String()+":5001"))
	}
	for _, c := range []struct {
		what string
		m    map[bool][]float64
	}{{"a→b bridged", policed}, {"pod→b's endpoint, routed", routed}} {
		off, on := median(c.m[false]), median(c.m[true])
		fmt.Printf("netpol: TCP stream %s: %.0f MiB/s with no policy, %.0f MiB/s under policy: %.2f× (target ≥ 0.9×)\n", c.what, off, on, on/off)
	}
}

// sink accepts TCP on addr in ns and reads each connection to its end.
func sink(t *testing.T, ns, addr string) {
	t.Helper()
	testnetns.Serve(t, ns, addr, func(c net.Conn) { _, _ = io.Copy(io.Discard, c); c.Close() })
}

// stream sends to addr from ns for two seconds and returns MiB/s.
func stream(t *testing.T, ns, addr string) float64 {
	t.Helper()
	var mib float64
	err := testnetns.Do(ns, func() error {
		c, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		buf := make([]byte, 256<<10)
		var sent int64
		start := time.Now()
		for time.Since(start) < 2*time.Second {
			k, err := c.Write(buf)
			if err != nil {
				return err
			}
			sent += int64(k)
		}
		mib = float64(sent) / (1 << 20) / time.Since(start).Seconds()
		return nil
	})
	if err != nil {
		t.Fatalf("stream to %s: %v", addr, err)
	}
	return mib
}

func pct(ds []time.Duration, p int) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*p/100)].Round(10 * time.Microsecond)
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

func sel(k, v string) *metav1.LabelSelector {
	return &metav1.LabelSelector{MatchLabels: map[string]string{k: v}}
}
