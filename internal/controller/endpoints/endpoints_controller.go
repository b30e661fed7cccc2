// Package endpoints puts ImpVMs behind Services: for every Service whose selector matches
// ImpVMs of its namespace it keeps EndpointSlices (managed-by imp.dev, so the cluster's own
// endpoint-slice controller leaves them alone and keeps its own, podless, slice) holding each
// selected VM's endpoint address, its declared ports as the Service's targetPorts resolve
// against them, its node and zone, and ready/serving/terminating from its readiness and
// lifecycle. kube-proxy, CoreDNS, Ingress and Gateway controllers then serve VMs as they serve
// pods. Selection never leaves the Service's namespace, and a VM is an endpoint only of ports
// it declares.
package endpoints

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// ManagedBy is the endpointslice.kubernetes.io/managed-by value of IMP's slices.
const ManagedBy = "imp.dev"

// maxEndpoints per slice, the endpoint-slice controller's default.
const maxEndpoints = 100

// Reconciler keeps the EndpointSlices of one Service at a time.
type Reconciler struct {
	Client client.Client
}

// +kubebuilder:rbac:groups="",resources=services,verbs=get;list;watch
// +kubebuilder:rbac:groups=discovery.k8s.io,resources=endpointslices,verbs=get;list;watch;create;update;delete
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impnodes,verbs=get;list;watch

// Reconcile makes the Service's IMP slices hold exactly its selected VMs' endpoints.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	var want []discoveryv1.EndpointSlice
	svc := &corev1.Service{}
	err := r.Client.Get(ctx, req.NamespacedName, svc)
	switch {
	case apierrors.IsNotFound(err):
		svc = nil
	case err != nil:
		return ctrl.Result{}, fmt.Errorf("reading Service %s: %w", req, err)
	}
	if svc != nil && svc.DeletionTimestamp.IsZero() && len(svc.Spec.Selector) > 0 && svc.Spec.Type != corev1.ServiceTypeExternalName {
		var vms impv1.ImpVMList
		if err := r.Client.List(ctx, &vms, client.InNamespace(svc.Namespace), client.MatchingLabelsSelector{Selector: labels.SelectorFromSet(svc.Spec.Selector)}); err != nil {
			return ctrl.Result{}, fmt.Errorf("listing the VMs Service %s selects: %w", req, err)
		}
		nodes := map[string]Node{}
		node := func(name string) Node {
			n, ok := nodes[name]
			if !ok {
				k := &corev1.Node{}
				if err := r.Client.Get(ctx, types.NamespacedName{Name: name}, k); err == nil {
					n.Zone = k.Labels[corev1.LabelTopologyZone]
				}
				imp := &impv1.ImpNode{}
				if err := r.Client.Get(ctx, types.NamespacedName{Name: name}, imp); err == nil {
					n.Block, _ = netip.ParsePrefix(imp.Spec.EndpointCIDR)
				}
				nodes[name] = n
			}
			return n
		}
		want = Slices(svc, vms.Items, node)
	}
	var have discoveryv1.EndpointSliceList
	if err := r.Client.List(ctx, &have, client.InNamespace(req.Namespace), client.MatchingLabels{
		discoveryv1.LabelServiceName: req.Name, discoveryv1.LabelManagedBy: ManagedBy,
	}); err != nil {
		return ctrl.Result{}, fmt.Errorf("listing the EndpointSlices of Service %s: %w", req, err)
	}
	byName := map[string]*discoveryv1.EndpointSlice{}
	for i := range have.Items {
		byName[have.Items[i].Name] = &have.Items[i]
	}
	for i := range want {
		w := &want[i]
		cur, ok := byName[w.Name]
		delete(byName, w.Name)
		switch {
		case !ok:
			if err := r.Client.Create(ctx, w); err != nil && !apierrors.IsAlreadyExists(err) {
				return ctrl.Result{}, fmt.Errorf("creating EndpointSlice %s: %w", w.Name, err)
			}
		case !equality.Semantic.DeepEqual(cur.Endpoints, w.Endpoints) || !equality.Semantic.DeepEqual(cur.Ports, w.Ports) ||
			!equality.Semantic.DeepEqual(cur.Labels, w.Labels) || !equality.Semantic.DeepEqual(cur.OwnerReferences, w.OwnerReferences):
			cur.Endpoints, cur.Ports, cur.Labels, cur.OwnerReferences = w.Endpoints, w.Ports, w.Labels, w.OwnerReferences
			if err := r.Client.Update(ctx, cur); err != nil {
				return ctrl.Result{}, fmt.Errorf("updating EndpointSlice %s: %w", w.Name, err)
			}
		}
	}
	for _, old := range byName {
		if err := r.Client.Delete(ctx, old); client.IgnoreNotFound(err) != nil {
			return ctrl.Result{}, fmt.Errorf("deleting EndpointSlice %s: %w", old.Name, err)
		}
	}
	return ctrl.Result{}, nil
}

// Node is what a VM's endpoint needs of its node: its zone, and its endpoint block, which the
// VM's address must be of (an address outside it, whatever its node's agent reports, is no
// endpoint).
type Node struct {
	Zone  string
	Block netip.Prefix
}

// Slices are the EndpointSlices svc should have for vms (of its namespace, matching its
// selector): one group of slices per distinct set of resolved ports, at most maxEndpoints each,
// named for the Service and a hash of their ports and place.
func Slices(svc *corev1.Service, vms []impv1.ImpVM, node func(name string) Node) []discoveryv1.EndpointSlice {
	type group struct {
		ports     []discoveryv1.EndpointPort
		endpoints []discoveryv1.Endpoint
	}
	groups := map[string]*group{}
	sort.Slice(vms, func(i, j int) bool { return vms[i].Name < vms[j].Name })
	for i := range vms {
		vm := &vms[i]
		if vm.Namespace != svc.Namespace {
			continue // never across namespaces, whatever a caller hands us
		}
		ep, ok := endpoint(vm, node)
		if !ok {
			continue
		}
		ports := resolvePorts(svc, vm)
		if len(ports) == 0 {
			continue // it declares none of the Service's ports
		}
		key := portsKey(ports)
		g := groups[key]
		if g == nil {
			g = &group{ports: ports}
			groups[key] = g
		}
		g.endpoints = append(g.endpoints, ep)
	}
	keys := make([]string, 0, len(groups))
	for k := range groups {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var out []discoveryv1.EndpointSlice
	for _, k := range keys {
		g := groups[k]
		for chunk := 0; chunk*maxEndpoints < len(g.endpoints); chunk++ {
			eps := g.endpoints[chunk*maxEndpoints : min(len(g.endpoints), (chunk+1)*maxEndpoints)]
			out = append(out, discoveryv1.EndpointSlice{
				ObjectMeta: metav1.ObjectMeta{
					Namespace: svc.Namespace,
					Name:      sliceName(svc.Name, fmt.Sprintf("%s/%s/%d", svc.Name, k, chunk)),
					Labels: map[string]string{
						discoveryv1.LabelServiceName: svc.Name,
						discoveryv1.LabelManagedBy:   ManagedBy,
					},
					OwnerReferences: []metav1.OwnerReference{{
						APIVersion: "v1", Kind: "Service", Name: svc.Name, UID: svc.UID,
						Controller: ptr.To(true),
					}},
				},
				AddressType: discoveryv1.AddressTypeIPv4,
				Endpoints:   eps,
				Ports:       g.ports,
			})
		}
	}
	return out
}

// endpoint is vm's endpoint, when its current run has an endpoint address of its node's block.
func endpoint(vm *impv1.ImpVM, node func(string) Node) (discoveryv1.Endpoint, bool) {
	st := vm.Status
	rt := st.Runtime
	// Suspended because it was idle: its node holds what arrives for it and wakes it, so it
	// stays a ready endpoint while it is suspended and while it is being suspended (a gap would
	// have a node's proxy refuse what should wake it; docs/suspend.md).
	idle := st.Suspension != nil && st.Suspension.Reason == impv1.SuspendReasonIdle
	if rt == nil || rt.Endpoint == "" || st.NodeName == "" || rt.Instance != st.Instance || rt.Run != st.RestartCount ||
		(rt.State != impv1.RuntimeRunning && !(idle && (rt.State == impv1.RuntimeSuspending || rt.State == impv1.RuntimeSuspended))) {
		return discoveryv1.Endpoint{}, false
	}
	n := node(st.NodeName)
	addr, err := netip.ParseAddr(rt.Endpoint)
	if err != nil || !n.Block.IsValid() || !n.Block.Contains(addr) {
		return discoveryv1.Endpoint{}, false
	}
	// Serving: Ready, and the run itself says so (the condition may be a moment behind it).
	serving := idle || (meta.IsStatusConditionTrue(st.Conditions, impv1.ReadyCondition) && rt.GuestReady && ptr.Deref(rt.Ready, true))
	terminating := !vm.DeletionTimestamp.IsZero() || vm.Spec.RunStrategy == impv1.RunStrategyHalted || (st.Suspension != nil && !idle)
	ep := discoveryv1.Endpoint{
		Addresses: []string{rt.Endpoint},
		Conditions: discoveryv1.EndpointConditions{
			Ready: ptr.To(serving && !terminating), Serving: ptr.To(serving), Terminating: ptr.To(terminating),
		},
		NodeName:  ptr.To(st.NodeName),
		TargetRef: &corev1.ObjectReference{APIVersion: impv1.GroupVersion.String(), Kind: "ImpVM", Namespace: vm.Namespace, Name: vm.Name, UID: vm.UID},
	}
	if len(validation.IsDNS1123Label(vm.Name)) == 0 {
		ep.Hostname = ptr.To(vm.Name) // a headless Service's DNS name per VM
	}
	if n.Zone != "" {
		ep.Zone = ptr.To(n.Zone)
	}
	return ep, true
}

// resolvePorts are svc's ports as vm's run serves them: a numeric targetPort (or, without one,
// the port) that the run forwards with the same protocol, or the forwarded port a named
// targetPort names. Other ports are left out: a Service reaches nothing else of a VM. The run's
// ports are spec.ports as it started (status.runtime.ports), which a later change to the spec
// does not alter until the next start.
func resolvePorts(svc *corev1.Service, vm *impv1.ImpVM) []discoveryv1.EndpointPort {
	declared := vm.Spec.Ports
	if rt := vm.Status.Runtime; rt != nil {
		declared = rt.Ports
	}
	var out []discoveryv1.EndpointPort
	for _, sp := range svc.Spec.Ports {
		proto := sp.Protocol
		if proto == "" {
			proto = corev1.ProtocolTCP
		}
		target := sp.TargetPort
		for _, vp := range declared {
			vproto := vp.Protocol
			if vproto == "" {
				vproto = corev1.ProtocolTCP
			}
			if vproto != proto {
				continue
			}
			match := false
			switch {
			case target.Type == intstr.String && target.StrVal != "":
				match = vp.Name == target.StrVal
			case target.IntVal != 0:
				match = vp.Port == target.IntVal
			default:
				match = vp.Port == sp.Port
			}
			if match {
				out = append(out, discoveryv1.EndpointPort{Name: ptr.To(sp.Name), Port: ptr.To(vp.Port), Protocol: ptr.To(proto), AppProtocol: sp.AppProtocol})
				break
			}
		}
	}
	return out
}

func portsKey(ports []discoveryv1.EndpointPort) string {
	var b strings.Builder
	for _, p := range ports {
		fmt.Fprintf(&b, "%s/%s/%d;", ptr.Deref(p.Name, ""), ptr.Deref(p.Protocol, ""), ptr.Deref(p.Port, 0))
	}
	return b.String()
}

// sliceName is the Service's name (cut to fit) and a hash of key.
func sliceName(svc, key string) string {
	h := sha256.Sum256([]byte(key))
	if len(svc) > 40 {
		svc = svc[:40]
	}
	return strings.TrimSuffix(svc, "-") + "-imp-" + hex.EncodeToString(h[:])[:10]
}

// SetupWithManager watches Services, the ImpVMs they may select (a VM's change reaches the
// Services of its namespace whose selectors match its labels before or after), and IMP's
// EndpointSlices (anyone's change to one is undone).
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	c := mgr.GetClient()
	servicesOf := func(ctx context.Context, objs ...client.Object) []reconcile.Request {
		// Only a VM that declares ports or has an endpoint address can be in a slice: the
		// others' changes wake no Service, and list nothing.
		var vms []client.Object
		for _, o := range objs {
			if vm, ok := o.(*impv1.ImpVM); ok && (len(vm.Spec.Ports) > 0 || vm.Status.Runtime != nil && vm.Status.Runtime.Endpoint != "") {
				vms = append(vms, vm)
			}
		}
		if len(vms) == 0 {
			return nil
		}
		var svcs corev1.ServiceList
		if err := c.List(ctx, &svcs, client.InNamespace(vms[0].GetNamespace())); err != nil {
			return nil
		}
		var reqs []reconcile.Request
		for _, s := range svcs.Items {
			if len(s.Spec.Selector) == 0 {
				continue
			}
			sel := labels.SelectorFromSet(s.Spec.Selector)
			for _, vm := range vms {
				if sel.Matches(labels.Set(vm.GetLabels())) {
					reqs = append(reqs, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: s.Namespace, Name: s.Name}})
					break
				}
			}
		}
		return reqs
	}
	add := func(q workqueue.TypedRateLimitingInterface[reconcile.Request], reqs []reconcile.Request) {
		for _, r := range reqs {
			q.Add(r)
		}
	}
	vmHandler := handler.Funcs{
		CreateFunc: func(ctx context.Context, e event.CreateEvent, q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
			add(q, servicesOf(ctx, e.Object))
		},
		UpdateFunc: func(ctx context.Context, e event.UpdateEvent, q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
			add(q, servicesOf(ctx, e.ObjectOld, e.ObjectNew))
		},
		DeleteFunc: func(ctx context.Context, e event.DeleteEvent, q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
			add(q, servicesOf(ctx, e.Object))
		},
	}
	ours := predicate.NewPredicateFuncs(func(o client.Object) bool { return o.GetLabels()[discoveryv1.LabelManagedBy] == ManagedBy })
	return ctrl.NewControllerManagedBy(mgr).
		Named("endpoints").
		For(&corev1.Service{}).
		Watches(&impv1.ImpVM{}, vmHandler).
		Watches(&discoveryv1.EndpointSlice{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			if name := o.GetLabels()[discoveryv1.LabelServiceName]; name != "" {
				return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: name}}}
			}
			return nil
		}), builder.WithPredicates(ours)).
		Complete(r)
}
