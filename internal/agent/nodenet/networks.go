// Package nodenet keeps the node's side of the VMs' networks over hostnet: each ImpNetwork with
// VMs here plumbed (bridge, rules, overlay entries for its VMs on other nodes), each VM attached
// (its tap), its declared ports exposed at an endpoint address of the node's block, and the
// other nodes' endpoint blocks routed.
package nodenet

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sort"
	"sync"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/guestinit"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impnetworks,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impipaddresses,verbs=get;list;watch

// networkIndex indexes the fleet's addresses by the name of their ImpNetwork.
const networkIndex = "spec.network"

// Networks is the agent's network controller: for each ImpNetwork with VMs on this node it
// keeps the node's bridge, rules and overlay device current, the overlay's forwarding entries
// pointing at the network's VMs on other nodes; when the last local VM leaves, it removes them.
// It reads the other nodes' VMs from fleet, a cache of the ImpIPAddresses: each names its VM's
// address and node and changes only when one of them does, so that no agent hears of the
// status changes of every VM of the cluster.
type Networks struct {
	Client    client.Client
	APIReader client.Reader
	Recorder  events.EventRecorder
	NodeName  string
	Net       *hostnet.Host
	// Changed is told when the networks plumbed here change (the node report says them).
	Changed func()
	// Policies, when set, sets a VM's NetworkPolicies as it is attached, before its VMM runs.
	Policies Policies
	// Domains, when set, runs the domain egress proxy of each network here that names
	// domains (egressproxy.Proxies).
	Domains interface {
		Ensure(n hostnet.Network, domains []string, present bool) error
	}

	fleet cache.Cache

	// kicks asks for a network's reconcile when a VM of this node attaches to or detaches from
	// it: the addresses of the fleet change at placement, before the VM is attached here.
	kicks chan event.GenericEvent

	mu    sync.Mutex
	known map[types.NamespacedName]hostnet.Network // plumbed here, for removal after deletion
	state map[types.NamespacedName]impv1.NodeNetwork
}

// SetupWithManager has mgr run the networks' controller.
func (n *Networks) SetupWithManager(mgr ctrl.Manager) error {
	var err error
	n.fleet, err = cache.New(mgr.GetConfig(), cache.Options{Scheme: mgr.GetScheme(), Mapper: mgr.GetRESTMapper(),
		ByObject: map[client.Object]cache.ByObject{&impv1.ImpIPAddress{}: {}}})
	if err != nil {
		return fmt.Errorf("creating the fleet cache: %w", err)
	}
	if err := n.fleet.IndexField(context.Background(), &impv1.ImpIPAddress{}, networkIndex, func(o client.Object) []string {
		return []string{o.(*impv1.ImpIPAddress).Spec.Network}
	}); err != nil {
		return err
	}
	if err := mgr.Add(n.fleet); err != nil {
		return err
	}
	n.known = map[types.NamespacedName]hostnet.Network{}
	n.kicks = make(chan event.GenericEvent, 1024)
	n.state = map[types.NamespacedName]impv1.NodeNetwork{}
	addressToNetwork := handler.TypedEnqueueRequestsFromMapFunc(func(_ context.Context, ip *impv1.ImpIPAddress) []reconcile.Request {
		return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: ip.Namespace, Name: ip.Spec.Network}}}
	})
	return ctrl.NewControllerManagedBy(mgr).
		Named("imp-agent-network").
		For(&impv1.ImpNetwork{}).
		WatchesRawSource(source.Kind(n.fleet, &impv1.ImpIPAddress{}, addressToNetwork)).
		WatchesRawSource(source.Channel(n.kicks, &handler.EnqueueRequestForObject{})).
		// Another node's overlay address changing moves its VMs' forwarding entries.
		Watches(&impv1.ImpNode{}, handler.EnqueueRequestsFromMapFunc(func(context.Context, client.Object) []reconcile.Request {
			return n.all()
		})).
		Complete(n)
}

// Kick asks for the reconcile of network key, or of every network plumbed here when key is
// empty (a VM left and its network is not known).
func (n *Networks) Kick(key types.NamespacedName) {
	keys := []types.NamespacedName{key}
	if key.Name == "" {
		keys = nil
		for _, r := range n.all() {
			keys = append(keys, r.NamespacedName)
		}
	}
	for _, k := range keys {
		select {
		case n.kicks <- event.GenericEvent{Object: &impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: k.Namespace, Name: k.Name}}}:
		default: // full: the next address or node change reconciles it
		}
	}
}

func (n *Networks) all() []reconcile.Request {
	n.mu.Lock()
	defer n.mu.Unlock()
	var reqs []reconcile.Request
	for key := range n.known {
		reqs = append(reqs, reconcile.Request{NamespacedName: key})
	}
	return reqs
}

// Policies sets the NetworkPolicies of a VM attached to n at ip.
type Policies interface {
	Apply(ctx context.Context, vm *impv1.ImpVM, n hostnet.Network, ip netip.Addr) error
}

// Fleet is the cache of every ImpIPAddress of the cluster, once the controller is set up.
func (n *Networks) Fleet() cache.Cache { return n.fleet }

// HostNetwork is the node's form of vm's ImpNetwork, read from the cache.
func (n *Networks) HostNetwork(ctx context.Context, vm *impv1.ImpVM) (hostnet.Network, error) {
	ref := vm.Spec.NetworkRef
	if ref == nil {
		return hostnet.Network{}, errors.New("the VM has no network")
	}
	net := &impv1.ImpNetwork{}
	if err := n.Client.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: ref.Name}, net); err != nil {
		return hostnet.Network{}, fmt.Errorf("reading ImpNetwork %s: %w", ref.Name, err)
	}
	return hostNetwork(net)
}

// hostNetwork is net as hostnet plumbs it.
func hostNetwork(net *impv1.ImpNetwork) (hostnet.Network, error) {
	p, err := net.Spec.Prefix()
	if err != nil {
		return hostnet.Network{}, err
	}
	gw, err := net.Spec.GatewayAddr()
	if err != nil {
		return hostnet.Network{}, err
	}
	eg, err := hostEgress(net.Spec.Egress)
	if err != nil {
		return hostnet.Network{}, err
	}
	return hostnet.Network{Namespace: net.Namespace, Name: net.Name, UID: string(net.UID), VNI: uint32(net.Status.VNI),
		Prefix: p, Gateway: gw, NAT: net.Spec.NAT.Enabled, Egress: eg}, nil
}

// hostEgress is the node's form of a network's egress policy: public addresses only when
// the network says nothing.
func hostEgress(spec *impv1.EgressSpec) (hostnet.Egress, error) {
	if spec == nil {
		return hostnet.PublicEgress, nil
	}
	e := hostnet.Egress{Internet: spec.Internet != impv1.EgressInternetDeny, Proxy: len(spec.Domains) > 0}
	rules := func(in []impv1.EgressRule) ([]hostnet.EgressRule, error) {
		var out []hostnet.EgressRule
		for _, r := range in {
			p, err := netip.ParsePrefix(r.CIDR)
			if err != nil || !p.Addr().Is4() {
				return nil, fmt.Errorf("egress cidr %q is not an IPv4 CIDR", r.CIDR)
			}
			hr := hostnet.EgressRule{Prefix: p.Masked()}
			for _, port := range r.Ports {
				pr := hostnet.PortRange{Protocol: unix.IPPROTO_TCP, From: uint16(port.Port), To: uint16(port.Port)}
				if port.Protocol == corev1.ProtocolUDP {
					pr.Protocol = unix.IPPROTO_UDP
				}
				if port.EndPort != nil {
					if *port.EndPort < 1 || *port.EndPort > 65535 {
						return nil, fmt.Errorf("egress endPort %d of %s is not a port", *port.EndPort, r.CIDR)
					}
					pr.To = uint16(*port.EndPort)
				}
				if port.Port < 1 || port.Port > 65535 || pr.To < pr.From {
					return nil, fmt.Errorf("egress port %d-%d of %s is not a port range", pr.From, pr.To, r.CIDR)
				}
				hr.Ports = append(hr.Ports, pr)
			}
			out = append(out, hr)
		}
		return out, nil
	}
	var err error
	if e.Allow, err = rules(spec.Allow); err != nil {
		return hostnet.Egress{}, err
	}
	if e.Deny, err = rules(spec.Deny); err != nil {
		return hostnet.Egress{}, err
	}
	return e, nil
}

// Reconcile plumbs one network on this node, or removes it when no local VM uses it.
func (n *Networks) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	net := &impv1.ImpNetwork{}
	var hn hostnet.Network
	err := n.Client.Get(ctx, req.NamespacedName, net)
	switch {
	case apierrors.IsNotFound(err):
		n.mu.Lock()
		known, ok := n.known[req.NamespacedName]
		n.mu.Unlock()
		if !ok {
			return ctrl.Result{}, nil
		}
		hn = known // deleted while VMs still use it: kept until they go
	case err != nil:
		return ctrl.Result{}, err
	default:
		if hn, err = hostNetwork(net); err != nil {
			return ctrl.Result{}, nil // the operator reports an unusable spec
		}
	}
	peers, err := n.peers(ctx, req.NamespacedName)
	if err != nil {
		return ctrl.Result{}, err
	}
	present, err := n.Net.Sync(hn, peers)
	if err == nil && n.Domains != nil {
		var domains []string
		if net.UID != "" && net.Spec.Egress != nil {
			domains = net.Spec.Egress.Domains
		}
		err = n.Domains.Ensure(hn, domains, present)
	}
	n.record(req.NamespacedName, hn, present, err)
	if err != nil {
		if net.UID != "" {
			n.Recorder.Eventf(net, nil, corev1.EventTypeWarning, "NetworkFailed", "Plumb", "node %s: %v", n.NodeName, err)
		}
		return ctrl.Result{}, fmt.Errorf("plumbing network %s: %w", req.NamespacedName, err)
	}
	return ctrl.Result{}, nil
}

// peers are the network's VMs on other nodes that have an overlay address, by their addresses.
func (n *Networks) peers(ctx context.Context, key types.NamespacedName) ([]hostnet.Peer, error) {
	var ips impv1.ImpIPAddressList
	if err := n.fleet.List(ctx, &ips, client.InNamespace(key.Namespace), client.MatchingFields{networkIndex: key.Name}); err != nil {
		return nil, fmt.Errorf("listing the network's addresses: %w", err)
	}
	vteps := map[string]netip.Addr{}
	var peers []hostnet.Peer
	for _, c := range ips.Items {
		node := c.Spec.NodeName
		ip, err := netip.ParseAddr(c.Spec.Address)
		if node == "" || node == n.NodeName || err != nil {
			continue
		}
		vtep, ok := vteps[node]
		if !ok {
			var rep impv1.ImpNode
			switch err := n.Client.Get(ctx, types.NamespacedName{Name: node}, &rep); {
			case err == nil:
				vtep, _ = netip.ParseAddr(rep.Status.OverlayAddress)
			case !apierrors.IsNotFound(err): // a node without a report has no overlay yet
				return nil, fmt.Errorf("reading the report of node %s: %w", node, err)
			}
			vteps[node] = vtep
		}
		if vtep.IsValid() {
			peers = append(peers, hostnet.Peer{IP: ip, VTEP: vtep})
		}
	}
	return peers, nil
}

func (n *Networks) record(key types.NamespacedName, hn hostnet.Network, present bool, err error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	before, had := n.state[key]
	if !present && err == nil {
		delete(n.known, key)
		delete(n.state, key)
	} else {
		n.known[key] = hn
		st := impv1.NodeNetwork{Namespace: key.Namespace, Name: key.Name, Ready: err == nil}
		if err != nil {
			st.Message = err.Error()
		}
		n.state[key] = st
	}
	if after, has := n.state[key]; had != has || before != after {
		n.Changed()
	}
}

// Report lists the networks plumbed on the node for its ImpNode report.
func (n *Networks) Report() []impv1.NodeNetwork {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make([]impv1.NodeNetwork, 0, len(n.state))
	for _, st := range n.state {
		out = append(out, st)
	}
	sort.Slice(out, func(i, j int) bool {
		return out[i].Namespace+"/"+out[i].Name < out[j].Namespace+"/"+out[j].Name
	})
	return out
}

// Attach gives vm a tap on its network and returns it with the guest's network configuration;
// none for a VM without a network.
func (n *Networks) Attach(ctx context.Context, vm *impv1.ImpVM) (hostnet.Attachment, *guestinit.Net, error) {
	return n.attach(ctx, vm, n.Net.Attach)
}

// Readdressing is the networks as the network step of a run whose VMM runs and holds its tap
// (a warm pool member handed to its claim, a restore finished after an agent restart) sees
// them: Attach moves the tap's anti-spoofing rules to the VM's MAC and address, without
// opening the tap (TUNSETIFF on a tap a VMM holds is EBUSY); what the guest sends from any
// other is dropped from then on.
type Readdressing struct{ *Networks }

// Attach moves the rules of vm's tap to vm's address and returns the guest's network
// configuration; the attachment has no tap.
func (n Readdressing) Attach(ctx context.Context, vm *impv1.ImpVM) (hostnet.Attachment, *guestinit.Net, error) {
	return n.attach(ctx, vm, n.Net.Readdress)
}

// Tapping is the networks as what stands in for an idle-suspended VM sees them (package idle):
// Attach opens the VM's tap, which its VMM let go of, and changes nothing of it or its rules.
type Tapping struct{ *Networks }

// Attach opens vm's tap and returns it with the guest's network configuration.
func (n Tapping) Attach(ctx context.Context, vm *impv1.ImpVM) (hostnet.Attachment, *guestinit.Net, error) {
	return n.attach(ctx, vm, func(hn hostnet.Network, uid string, ip netip.Addr) (hostnet.Attachment, error) {
		at, err := n.Net.OpenTap(hn, uid)
		at.IP = ip
		return at, err
	})
}

// Traffic is what vm's tap carried: the frames delivered to it (for its MAC) and those it sent
// past its anti-spoofing rules (hostnet.TapCounters), for its idle policy (package idle).
func (n *Networks) Traffic(_ context.Context, vm *impv1.ImpVM) (in, out uint64, err error) {
	ref := vm.Spec.NetworkRef
	if ref == nil {
		return 0, 0, nil
	}
	n.mu.Lock()
	hn, ok := n.known[types.NamespacedName{Namespace: vm.Namespace, Name: ref.Name}]
	n.mu.Unlock()
	if !ok {
		return 0, 0, fmt.Errorf("ImpNetwork %s is not plumbed on the node", ref.Name)
	}
	return n.Net.TapCounters(hn, string(vm.HostUID()))
}

func (n *Networks) attach(ctx context.Context, vm *impv1.ImpVM, attach func(hostnet.Network, string, netip.Addr) (hostnet.Attachment, error)) (hostnet.Attachment, *guestinit.Net, error) {
	var none hostnet.Attachment
	ref := vm.Spec.NetworkRef
	if ref == nil {
		return none, nil, nil
	}
	ip, err := netip.ParseAddr(vm.Status.IP)
	if err != nil {
		return none, nil, errors.New("the VM has a network but no address recorded by its placement")
	}
	net := &impv1.ImpNetwork{}
	if err := n.APIReader.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: ref.Name}, net); err != nil {
		return none, nil, fmt.Errorf("reading ImpNetwork %s: %w", ref.Name, err)
	}
	hn, err := hostNetwork(net)
	if err != nil {
		return none, nil, fmt.Errorf("ImpNetwork %s: %w", ref.Name, err)
	}
	at, err := attach(hn, string(vm.HostUID()), ip)
	if err != nil {
		return none, nil, fmt.Errorf("attaching to ImpNetwork %s: %w", ref.Name, err)
	}
	if n.Policies != nil {
		if err := n.Policies.Apply(ctx, vm, hn, ip); err != nil {
			if at.Tap != nil {
				at.Tap.Close()
			}
			return none, nil, fmt.Errorf("setting the NetworkPolicies of the VM: %w", err)
		}
	}
	n.Kick(types.NamespacedName{Namespace: vm.Namespace, Name: ref.Name})
	gn := &guestinit.Net{Address: netip.PrefixFrom(ip, hn.Prefix.Bits()), Gateway: hn.Gateway, MTU: n.Net.MTU(), MAC: hostnet.MAC(ip).String()}
	if dns := net.Spec.DNS; dns != nil {
		gn.Nameservers, gn.Searches = dns.Nameservers, dns.Searches
	}
	return at, gn, nil
}
