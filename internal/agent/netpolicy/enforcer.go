package netpolicy

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
)

// +kubebuilder:rbac:groups=networking.k8s.io,resources=networkpolicies,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=namespaces,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=services,verbs=get;list;watch
// +kubebuilder:rbac:groups=discovery.k8s.io,resources=endpointslices,verbs=get;list;watch

// Setter sets a VM's policy in its network's namespace (hostnet.Host).
type Setter interface {
	SetPolicy(n hostnet.Network, vmUID string, ip netip.Addr, p hostnet.Policy) error
}

// Networks gives the node's form of a VM's ImpNetwork.
type Networks interface {
	HostNetwork(ctx context.Context, vm *impv1.ImpVM) (hostnet.Network, error)
}

// Enforcer keeps the policy of every VM of this node current: one computation for all of
// them whenever a NetworkPolicy, a namespace's labels, a pod's address or labels, a VM's
// address or labels change; a VM whose policy is unchanged is not touched.
type Enforcer struct {
	// Client reads this node's VMs (the agent's cache).
	Client   client.Client
	Net      Setter
	Networks Networks
	Recorder events.EventRecorder
	// Fleet is a cache of every ImpIPAddress (the network controller's): the VMs as peers.
	Fleet cache.Cache

	objects cache.Cache // NetworkPolicies, Namespaces, Pods

	mu      sync.Mutex
	applied map[types.UID]string // the hash of the policy set for each VM (its host UID)
	// setting is held from reading the caches to setting the policies, by a reconcile and by
	// an attach's Apply: neither sets a policy computed before the other's.
	setting sync.Mutex
}

// key is the one request of the enforcer: every VM is computed at once.
var key = reconcile.Request{NamespacedName: types.NamespacedName{Name: "network-policies"}}

// SetupWithManager has mgr run the enforcer, with a cache of its own for the NetworkPolicies,
// namespaces and pods of the cluster. Pods are kept trimmed to what a policy reads.
func (e *Enforcer) SetupWithManager(mgr ctrl.Manager) error {
	var err error
	e.objects, err = cache.New(mgr.GetConfig(), cache.Options{Scheme: mgr.GetScheme(), Mapper: mgr.GetRESTMapper(),
		ByObject: map[client.Object]cache.ByObject{
			&corev1.Pod{}:                {Transform: trimPod},
			&corev1.Namespace{}:          {Transform: trimMeta},
			&corev1.Service{}:            {Transform: trimService},
			&discoveryv1.EndpointSlice{}: {Transform: trimSlice},
		}})
	if err != nil {
		return fmt.Errorf("creating the NetworkPolicy cache: %w", err)
	}
	if err := mgr.Add(e.objects); err != nil {
		return err
	}
	e.applied = map[types.UID]string{}
	all := func(context.Context, client.Object) []reconcile.Request { return []reconcile.Request{key} }
	podChanged := predicate.TypedFuncs[*corev1.Pod]{UpdateFunc: func(ev event.TypedUpdateEvent[*corev1.Pod]) bool {
		return podChange(ev.ObjectOld, ev.ObjectNew)
	}}
	nsChanged := predicate.TypedFuncs[*corev1.Namespace]{UpdateFunc: func(ev event.TypedUpdateEvent[*corev1.Namespace]) bool {
		return !mapsEqual(ev.ObjectOld.Labels, ev.ObjectNew.Labels)
	}}
	svcChanged := predicate.TypedFuncs[*corev1.Service]{UpdateFunc: func(ev event.TypedUpdateEvent[*corev1.Service]) bool {
		return fmt.Sprint(ev.ObjectOld.Spec.ClusterIPs, ev.ObjectOld.Spec.Ports) != fmt.Sprint(ev.ObjectNew.Spec.ClusterIPs, ev.ObjectNew.Spec.Ports)
	}}
	vmChanged := predicate.TypedFuncs[*impv1.ImpVM]{UpdateFunc: func(ev event.TypedUpdateEvent[*impv1.ImpVM]) bool {
		o, n := ev.ObjectOld, ev.ObjectNew
		return o.Status.IP != n.Status.IP || !mapsEqual(o.Labels, n.Labels) || fmt.Sprint(o.Spec.Ports) != fmt.Sprint(n.Spec.Ports) || o.HostUID() != n.HostUID()
	}}
	return ctrl.NewControllerManagedBy(mgr).Named("imp-agent-netpolicy").
		WatchesRawSource(source.Kind(e.objects, &networkingv1.NetworkPolicy{}, handler.TypedEnqueueRequestsFromMapFunc(func(ctx context.Context, o *networkingv1.NetworkPolicy) []reconcile.Request { return all(ctx, o) }))).
		WatchesRawSource(source.Kind(e.objects, &corev1.Namespace{}, handler.TypedEnqueueRequestsFromMapFunc(func(ctx context.Context, o *corev1.Namespace) []reconcile.Request { return all(ctx, o) }), nsChanged)).
		WatchesRawSource(source.Kind(e.objects, &corev1.Pod{}, handler.TypedEnqueueRequestsFromMapFunc(func(ctx context.Context, o *corev1.Pod) []reconcile.Request { return all(ctx, o) }), podChanged)).
		WatchesRawSource(source.Kind(e.objects, &corev1.Service{}, handler.TypedEnqueueRequestsFromMapFunc(func(ctx context.Context, o *corev1.Service) []reconcile.Request { return all(ctx, o) }), svcChanged)).
		WatchesRawSource(source.Kind(e.objects, &discoveryv1.EndpointSlice{}, handler.TypedEnqueueRequestsFromMapFunc(func(ctx context.Context, o *discoveryv1.EndpointSlice) []reconcile.Request { return all(ctx, o) }))).
		WatchesRawSource(source.Kind(e.Fleet, &impv1.ImpIPAddress{}, handler.TypedEnqueueRequestsFromMapFunc(func(ctx context.Context, o *impv1.ImpIPAddress) []reconcile.Request { return all(ctx, o) }))).
		WatchesRawSource(source.Kind(mgr.GetCache(), &impv1.ImpVM{}, handler.TypedEnqueueRequestsFromMapFunc(func(ctx context.Context, o *impv1.ImpVM) []reconcile.Request { return all(ctx, o) }), vmChanged)).
		Complete(e)
}

// Reconcile computes and sets the policy of every VM of the node that is on a network.
func (e *Enforcer) Reconcile(ctx context.Context, _ reconcile.Request) (reconcile.Result, error) {
	e.setting.Lock()
	defer e.setting.Unlock()
	var vms impv1.ImpVMList
	if err := e.Client.List(ctx, &vms); err != nil {
		return reconcile.Result{}, fmt.Errorf("listing the node's VMs: %w", err)
	}
	w, err := e.world(ctx, func(w *World) bool {
		for i := range vms.Items {
			if len(w.Selecting(target(&vms.Items[i], "", netip.Addr{}))) > 0 {
				return true
			}
		}
		return false
	})
	if err != nil {
		return reconcile.Result{}, err
	}
	seen := map[types.UID]bool{}
	// A warm member handed to a claim runs as the claim: its own ImpVM, still listed until it
	// goes, is not enforced (both would set the one run's policy, each at its own address).
	handed := map[types.UID]bool{}
	for i := range vms.Items {
		if vm := &vms.Items[i]; vm.HostUID() != vm.UID {
			handed[vm.HostUID()] = true
		}
	}
	var failed []string
	for i := range vms.Items {
		vm := &vms.Items[i]
		if handed[vm.UID] {
			continue
		}
		seen[vm.HostUID()] = true
		if err := e.enforce(ctx, w, vm); err != nil {
			failed = append(failed, vm.Name)
			ctrl.LoggerFrom(ctx).Error(err, "setting the VM's network policy", "vm", client.ObjectKeyFromObject(vm))
			if e.Recorder != nil {
				e.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "NetworkPolicyFailed", "Enforce",
					"the node could not apply the NetworkPolicies that select the VM (its last policy stays): %v", err)
			}
		}
	}
	e.mu.Lock()
	for uid := range e.applied {
		if !seen[uid] {
			delete(e.applied, uid)
		}
	}
	e.mu.Unlock()
	if len(failed) > 0 {
		return reconcile.Result{}, fmt.Errorf("the network policy of %d VMs (%s) is not set", len(failed), strings.Join(failed, ", "))
	}
	return reconcile.Result{}, nil
}

// Apply sets vm's policy as it is attached to n at ip, before its VMM starts: a VM never
// runs a moment without the policy that selects it. The caches are waited for.
func (e *Enforcer) Apply(ctx context.Context, vm *impv1.ImpVM, n hostnet.Network, ip netip.Addr) error {
	if !e.objects.WaitForCacheSync(ctx) || !e.Fleet.WaitForCacheSync(ctx) {
		return fmt.Errorf("waiting for the NetworkPolicy caches: %w", ctx.Err())
	}
	e.setting.Lock()
	defer e.setting.Unlock()
	w, err := e.world(ctx, func(w *World) bool { return len(w.Selecting(target(vm, "", netip.Addr{}))) > 0 })
	if err != nil {
		return err
	}
	return e.set(w, vm, n, ip, true)
}

// enforce sets the policy of vm, when it is on a network and attached here.
func (e *Enforcer) enforce(ctx context.Context, w *World, vm *impv1.ImpVM) error {
	if vm.Spec.NetworkRef == nil || !vm.DeletionTimestamp.IsZero() {
		return nil
	}
	ip, err := netip.ParseAddr(vm.Status.IP)
	if err != nil {
		return nil // not placed with an address yet: its attach applies the policy
	}
	n, err := e.Networks.HostNetwork(ctx, vm)
	if err != nil {
		return err
	}
	err = e.set(w, vm, n, ip, false)
	if errors.Is(err, hostnet.ErrNotOnNode) {
		return nil // not attached here (yet, or any more): its attach applies it
	}
	return err
}

// target is vm as the policies see it, on network (its key) at ip.
func target(vm *impv1.ImpVM, network string, ip netip.Addr) VM {
	return VM{Namespace: vm.Namespace, Name: vm.Name, Labels: vm.Labels, Network: network, Address: ip, Ports: namedPorts(impv1.NamedPorts(vm.Spec.Ports))}
}

// set sets vm's policy, unless it is what the enforcer last set (always when fresh: its tap
// was just made, or remade).
func (e *Enforcer) set(w *World, vm *impv1.ImpVM, n hostnet.Network, ip netip.Addr, fresh bool) error {
	p := w.Compile(target(vm, n.Key(), ip))
	sum := policyHash(n, ip, p)
	uid := vm.HostUID()
	e.mu.Lock()
	same := e.applied[uid] == sum
	e.mu.Unlock()
	if same && !fresh {
		return nil
	}
	if err := e.Net.SetPolicy(n, string(uid), ip, p); err != nil {
		return err
	}
	e.mu.Lock()
	e.applied[uid] = sum
	e.mu.Unlock()
	return nil
}

// Forget drops what the enforcer set for the VM (its tap is gone): a later attach sets it
// anew.
func (e *Enforcer) Forget(uid types.UID) {
	e.mu.Lock()
	delete(e.applied, uid)
	e.mu.Unlock()
}

func policyHash(n hostnet.Network, ip netip.Addr, p hostnet.Policy) string {
	sum := sha256.New()
	fmt.Fprintln(sum, n.UID, ip, p.Ingress == nil, p.Egress == nil)
	for _, side := range [][]hostnet.Allow{p.Ingress, p.Egress} {
		for _, a := range side {
			fmt.Fprintln(sum, a.Network, a.Outside, a.Ports)
		}
		fmt.Fprintln(sum, "|")
	}
	return hex.EncodeToString(sum.Sum(nil))
}

// world reads the policies from the cache and, when needs says a VM is selected by one, the
// namespaces, pods and VMs their peers are chosen from: a node none of whose VMs any policy
// selects reads no pod.
func (e *Enforcer) world(ctx context.Context, needs func(*World) bool) (*World, error) {
	var pols networkingv1.NetworkPolicyList
	if err := e.objects.List(ctx, &pols); err != nil {
		return nil, fmt.Errorf("listing NetworkPolicies: %w", err)
	}
	w := &World{Namespaces: map[string]map[string]string{}}
	for i := range pols.Items {
		w.Policies = append(w.Policies, &pols.Items[i])
	}
	if len(w.Policies) == 0 || !needs(w) {
		return w, nil
	}
	var nss corev1.NamespaceList
	if err := e.objects.List(ctx, &nss); err != nil {
		return nil, fmt.Errorf("listing namespaces: %w", err)
	}
	for _, ns := range nss.Items {
		w.Namespaces[ns.Name] = ns.Labels
	}
	var pods corev1.PodList
	if err := e.objects.List(ctx, &pods); err != nil {
		return nil, fmt.Errorf("listing pods: %w", err)
	}
	for i := range pods.Items {
		if p, ok := podPeer(&pods.Items[i]); ok {
			w.Pods = append(w.Pods, p)
		}
	}
	if err := e.services(ctx, w); err != nil {
		return nil, err
	}
	var ips impv1.ImpIPAddressList
	if err := e.Fleet.List(ctx, &ips); err != nil {
		return nil, fmt.Errorf("listing ImpIPAddresses: %w", err)
	}
	for _, ip := range ips.Items {
		a, err := netip.ParseAddr(ip.Spec.Address)
		if err != nil || !ip.DeletionTimestamp.IsZero() {
			continue
		}
		w.VMs = append(w.VMs, VM{Namespace: ip.Namespace, Name: ip.Spec.VMRef.Name, Labels: ip.Spec.VMLabels,
			Network: ip.Namespace + "/" + ip.Spec.Network, Address: a, Ports: namedPorts(ip.Spec.VMPorts)})
	}
	return w, nil
}

func namedPorts(ps []impv1.VMPort) []NamedPort {
	out := make([]NamedPort, 0, len(ps))
	for _, p := range ps {
		out = append(out, NamedPort{Name: p.Name, Protocol: p.Protocol, Port: p.Port})
	}
	return out
}

// podPeer is a pod as a policy's peer: one with an address of its own (not the node's: a
// pod on the host's network is not told apart from its node), not finished.
func podPeer(p *corev1.Pod) (Pod, bool) {
	if p.Spec.HostNetwork || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
		return Pod{}, false
	}
	out := Pod{Namespace: p.Namespace, Labels: p.Labels}
	for _, ip := range p.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out.IPs = append(out.IPs, a)
		}
	}
	for _, c := range p.Spec.Containers {
		for _, port := range c.Ports {
			if port.Name != "" {
				out.Ports = append(out.Ports, NamedPort{Name: port.Name, Protocol: port.Protocol, Port: port.ContainerPort})
			}
		}
	}
	return out, len(out.IPs) > 0
}

// podChange says whether what a policy reads of a pod changed.
func podChange(o, n *corev1.Pod) bool {
	po, okO := podPeer(o)
	pn, okN := podPeer(n)
	return okO != okN || !mapsEqual(o.Labels, n.Labels) || fmt.Sprint(po.IPs, po.Ports) != fmt.Sprint(pn.IPs, pn.Ports)
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// trimPod keeps of a pod what a policy reads: its name, namespace, labels, whether it is on
// the host's network, its named container ports, phase and addresses.
func trimPod(o any) (any, error) {
	p, ok := o.(*corev1.Pod)
	if !ok {
		return o, nil
	}
	out := &corev1.Pod{ObjectMeta: trimmed(p.ObjectMeta)}
	out.Spec.HostNetwork = p.Spec.HostNetwork
	for _, c := range p.Spec.Containers {
		var ports []corev1.ContainerPort
		for _, port := range c.Ports {
			if port.Name != "" {
				ports = append(ports, corev1.ContainerPort{Name: port.Name, Protocol: port.Protocol, ContainerPort: port.ContainerPort})
			}
		}
		if len(ports) > 0 {
			out.Spec.Containers = append(out.Spec.Containers, corev1.Container{Name: c.Name, Ports: ports})
		}
	}
	out.Status.Phase = p.Status.Phase
	out.Status.PodIPs = p.Status.PodIPs
	return out, nil
}

// trimMeta keeps of an object its name, namespace and labels (a namespace's).
func trimMeta(o any) (any, error) {
	if ns, ok := o.(*corev1.Namespace); ok {
		return &corev1.Namespace{ObjectMeta: trimmed(ns.ObjectMeta)}, nil
	}
	return o, nil
}

func trimmed(m metav1.ObjectMeta) metav1.ObjectMeta {
	return metav1.ObjectMeta{Name: m.Name, Namespace: m.Namespace, UID: m.UID, ResourceVersion: m.ResourceVersion, Labels: m.Labels,
		DeletionTimestamp: m.DeletionTimestamp}
}

// services reads the Services with a ClusterIP and their ready endpoints from the caches.
func (e *Enforcer) services(ctx context.Context, w *World) error {
	var svcs corev1.ServiceList
	if err := e.objects.List(ctx, &svcs); err != nil {
		return fmt.Errorf("listing Services: %w", err)
	}
	var slices discoveryv1.EndpointSliceList
	if err := e.objects.List(ctx, &slices); err != nil {
		return fmt.Errorf("listing EndpointSlices: %w", err)
	}
	bySvc := map[types.NamespacedName][]*discoveryv1.EndpointSlice{}
	for i := range slices.Items {
		s := &slices.Items[i]
		if s.AddressType != discoveryv1.AddressTypeIPv4 {
			continue
		}
		key := types.NamespacedName{Namespace: s.Namespace, Name: s.Labels[discoveryv1.LabelServiceName]}
		bySvc[key] = append(bySvc[key], s)
	}
	for _, svc := range svcs.Items {
		out := Service{Namespace: svc.Namespace, Name: svc.Name}
		for _, ip := range svc.Spec.ClusterIPs {
			if a, err := netip.ParseAddr(ip); err == nil && a.Is4() {
				out.ClusterIPs = append(out.ClusterIPs, a)
			}
		}
		if len(out.ClusterIPs) == 0 {
			continue // headless, or not yet given an address
		}
		for _, sp := range svc.Spec.Ports {
			port := ServicePort{Protocol: sp.Protocol, Port: sp.Port}
			for _, s := range bySvc[types.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}] {
				for _, p := range s.Ports {
					if p.Port == nil || ptr.Deref(p.Name, "") != sp.Name || ptr.Deref(p.Protocol, "") != sp.Protocol {
						continue
					}
					for _, ep := range s.Endpoints {
						// Ready ones, and serving ones too: kube-proxy falls back to serving
						// (terminating) endpoints when none is ready.
						c := ep.Conditions
						if c.Ready != nil && !*c.Ready && (c.Serving == nil || !*c.Serving) {
							continue
						}
						for _, a := range ep.Addresses {
							if ip, err := netip.ParseAddr(a); err == nil && *p.Port > 0 && *p.Port <= 65535 {
								port.Endpoints = append(port.Endpoints, netip.AddrPortFrom(ip, uint16(*p.Port)))
							}
						}
					}
				}
			}
			out.Ports = append(out.Ports, port)
		}
		w.Services = append(w.Services, out)
	}
	return nil
}

// trimService keeps of a Service its name, namespace, addresses and ports.
func trimService(o any) (any, error) {
	s, ok := o.(*corev1.Service)
	if !ok {
		return o, nil
	}
	out := &corev1.Service{ObjectMeta: trimmed(s.ObjectMeta)}
	out.Spec.ClusterIPs = s.Spec.ClusterIPs
	for _, p := range s.Spec.Ports {
		out.Spec.Ports = append(out.Spec.Ports, corev1.ServicePort{Name: p.Name, Protocol: p.Protocol, Port: p.Port})
	}
	return out, nil
}

// trimSlice keeps of an EndpointSlice its Service, ports and endpoints' addresses and
// conditions.
func trimSlice(o any) (any, error) {
	s, ok := o.(*discoveryv1.EndpointSlice)
	if !ok {
		return o, nil
	}
	out := &discoveryv1.EndpointSlice{ObjectMeta: trimmed(s.ObjectMeta), AddressType: s.AddressType, Ports: s.Ports}
	for _, ep := range s.Endpoints {
		out.Endpoints = append(out.Endpoints, discoveryv1.Endpoint{Addresses: ep.Addresses, Conditions: ep.Conditions})
	}
	return out, nil
}
