// Package ipam hands out ImpNetwork addresses to ImpVMs. Every allocation is an ImpIPAddress
// object named "<network>.<address>": the API server refuses a second object of that name, so
// no two VMs can ever hold one address, whatever the number of reconciles, operator restarts or
// overlapping leaders. The allocator's memory of used addresses only makes the search fast; it
// is rebuilt from the API and never trusted over it.
package ipam

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// ErrExhausted is returned when a network has no free address.
var ErrExhausted = errors.New("ipam: network has no free address")

// Writer creates, patches and deletes ImpIPAddress objects.
type Writer interface {
	Create(ctx context.Context, obj client.Object, opts ...client.CreateOption) error
	Patch(ctx context.Context, obj client.Object, patch client.Patch, opts ...client.PatchOption) error
	Delete(ctx context.Context, obj client.Object, opts ...client.DeleteOption) error
}

// Allocator allocates and releases addresses.
type Allocator struct {
	reader client.Reader // uncached: a list must show every claim made so far
	writer Writer
	scheme *runtime.Scheme

	mu   sync.Mutex
	nets map[types.NamespacedName]*network
}

type network struct {
	mu     sync.Mutex
	synced bool
	used   map[netip.Addr]types.UID // holder, empty when unknown
	byVM   map[types.UID]netip.Addr
	nodeOf map[types.UID]string // the node each holder's address names
}

// New returns an allocator. reader must read from the API server, not from a cache (a
// manager's GetAPIReader), so that its lists show every claim made so far.
func New(reader client.Reader, writer Writer, scheme *runtime.Scheme) *Allocator {
	return &Allocator{reader: reader, writer: writer, scheme: scheme, nets: map[types.NamespacedName]*network{}}
}

func (a *Allocator) network(key types.NamespacedName) *network {
	a.mu.Lock()
	defer a.mu.Unlock()
	n, ok := a.nets[key]
	if !ok {
		n = &network{}
		a.nets[key] = n
	}
	return n
}

// lockSynced returns the network key locked, its claims loaded from the API once.
func (a *Allocator) lockSynced(ctx context.Context, key types.NamespacedName) (*network, error) {
	n := a.network(key)
	n.mu.Lock()
	if !n.synced {
		if err := a.sync(ctx, key, n); err != nil {
			n.mu.Unlock()
			return nil, err
		}
	}
	return n, nil
}

// sync reloads the network's claims from the API. Called with n.mu held.
func (a *Allocator) sync(ctx context.Context, key types.NamespacedName, n *network) error {
	var list impv1.ImpIPAddressList
	if err := a.reader.List(ctx, &list, client.InNamespace(key.Namespace), client.MatchingLabels{impv1.NetworkLabel: key.Name}); err != nil {
		return fmt.Errorf("listing addresses of network %s: %w", key, err)
	}
	n.used = make(map[netip.Addr]types.UID, len(list.Items))
	n.byVM = make(map[types.UID]netip.Addr, len(list.Items))
	n.nodeOf = make(map[types.UID]string, len(list.Items))
	for _, c := range list.Items {
		addr, err := netip.ParseAddr(c.Spec.Address)
		if err != nil {
			continue // the schema forbids it; nothing to reserve
		}
		n.used[addr] = c.Spec.VMRef.UID
		n.byVM[c.Spec.VMRef.UID] = addr
		n.nodeOf[c.Spec.VMRef.UID] = c.Spec.NodeName
	}
	n.synced = true
	return nil
}

// Allocate returns the address vm holds on net, allocating one when it holds none, and makes
// the address name node, where vm is being placed. The address changes only when the VM's
// node does: agents route the overlay from addresses, not from every change of every VM.
func (a *Allocator) Allocate(ctx context.Context, net *impv1.ImpNetwork, vm *impv1.ImpVM, node string) (netip.Addr, error) {
	prefix, err := net.Spec.Prefix()
	if err != nil {
		return netip.Addr{}, err
	}
	gw, err := net.Spec.GatewayAddr()
	if err != nil {
		return netip.Addr{}, err
	}
	key := client.ObjectKeyFromObject(net)
	n, err := a.lockSynced(ctx, key)
	if err != nil {
		return netip.Addr{}, err
	}
	defer n.mu.Unlock()
	if addr, ok := n.byVM[vm.UID]; ok && prefix.Contains(addr) {
		return addr, a.locate(ctx, net, vm.UID, n, addr, node)
	}
	for attempt := 0; attempt < 2; attempt++ {
		addr, err := a.claimFree(ctx, net, vm, node, n, prefix, gw)
		if !errors.Is(err, ErrExhausted) || attempt == 1 {
			return addr, err
		}
		// Our memory may hold addresses released behind our back: look again at the API.
		if err := a.sync(ctx, key, n); err != nil {
			return netip.Addr{}, err
		}
		if addr, ok := n.byVM[vm.UID]; ok && prefix.Contains(addr) {
			return addr, a.locate(ctx, net, vm.UID, n, addr, node)
		}
	}
	return netip.Addr{}, ErrExhausted
}

// locate makes the address addr that uid holds name node, when it names another.
func (a *Allocator) locate(ctx context.Context, net *impv1.ImpNetwork, uid types.UID, n *network, addr netip.Addr, node string) error {
	if n.nodeOf[uid] == node {
		return nil
	}
	claim := &impv1.ImpIPAddress{ObjectMeta: metav1.ObjectMeta{Namespace: net.Namespace, Name: impv1.IPAddressName(net.Name, addr.String())}}
	patch := client.RawPatch(types.MergePatchType, []byte(fmt.Sprintf(`{"spec":{"nodeName":%q}}`, node)))
	if err := a.writer.Patch(ctx, claim, patch); err != nil {
		return fmt.Errorf("moving address %s of network %s to node %s: %w", addr, net.Name, node, err)
	}
	n.nodeOf[uid] = node
	return nil
}

func (a *Allocator) claimFree(ctx context.Context, net *impv1.ImpNetwork, vm *impv1.ImpVM, node string, n *network, prefix netip.Prefix, gw netip.Addr) (netip.Addr, error) {
	bcast := impv1.Broadcast(prefix)
	for addr := prefix.Addr().Next(); addr.IsValid() && addr != bcast; addr = addr.Next() {
		if addr == gw {
			continue
		}
		if _, taken := n.used[addr]; taken {
			continue
		}
		claim := &impv1.ImpIPAddress{
			ObjectMeta: metav1.ObjectMeta{
				Namespace: net.Namespace,
				Name:      impv1.IPAddressName(net.Name, addr.String()),
				Labels:    map[string]string{impv1.NetworkLabel: net.Name, impv1.VMUIDLabel: string(vm.UID)},
			},
			Spec: impv1.ImpIPAddressSpec{
				Network:  net.Name,
				Address:  addr.String(),
				VMRef:    impv1.VMReference{Name: vm.Name, UID: vm.UID},
				NodeName: node,
				VMLabels: vm.Labels,
				VMPorts:  impv1.NamedPorts(vm.Spec.Ports),
			},
		}
		if err := controllerutil.SetOwnerReference(vm, claim, a.scheme); err != nil {
			return netip.Addr{}, fmt.Errorf("owning address %s by VM %s: %w", addr, vm.Name, err)
		}
		err := a.writer.Create(ctx, claim)
		switch {
		case apierrors.IsAlreadyExists(err):
			n.used[addr] = "" // someone holds it; our memory was behind
			continue
		case err != nil:
			return netip.Addr{}, fmt.Errorf("claiming address %s of network %s: %w", addr, net.Name, err)
		}
		n.used[addr] = vm.UID
		n.byVM[vm.UID] = addr
		n.nodeOf[vm.UID] = node
		return addr, nil
	}
	return netip.Addr{}, ErrExhausted
}

// ReleaseOn deletes the address vm holds on net, if it holds one, and returns it: asked of
// the allocator's memory of the network (loaded from the API once), so that asking for a VM
// that holds none costs no request.
func (a *Allocator) ReleaseOn(ctx context.Context, net *impv1.ImpNetwork, vm *impv1.ImpVM) (netip.Addr, error) {
	n, err := a.lockSynced(ctx, client.ObjectKeyFromObject(net))
	if err != nil {
		return netip.Addr{}, err
	}
	defer n.mu.Unlock()
	addr, ok := n.byVM[vm.UID]
	if !ok {
		return netip.Addr{}, nil
	}
	claim := &impv1.ImpIPAddress{}
	err = a.reader.Get(ctx, types.NamespacedName{Namespace: net.Namespace, Name: impv1.IPAddressName(net.Name, addr.String())}, claim)
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return netip.Addr{}, fmt.Errorf("reading address %s of network %s: %w", addr, net.Name, err)
	case claim.Spec.VMRef.UID == vm.UID: // our memory may be behind: only vm's own goes
		if err := a.writer.Delete(ctx, claim, client.Preconditions{UID: &claim.UID}); err != nil && !apierrors.IsNotFound(err) {
			return netip.Addr{}, fmt.Errorf("releasing address %s of network %s: %w", addr, net.Name, err)
		}
	}
	delete(n.byVM, vm.UID)
	delete(n.nodeOf, vm.UID)
	if n.used[addr] == vm.UID {
		delete(n.used, addr)
	}
	return addr, nil
}

// Release deletes every address vm holds in its namespace.
func (a *Allocator) Release(ctx context.Context, vm *impv1.ImpVM) error {
	var list impv1.ImpIPAddressList
	if err := a.reader.List(ctx, &list, client.InNamespace(vm.Namespace), client.MatchingLabels{impv1.VMUIDLabel: string(vm.UID)}); err != nil {
		return fmt.Errorf("listing addresses of VM %s: %w", vm.Name, err)
	}
	for i := range list.Items {
		c := &list.Items[i]
		if c.Spec.VMRef.UID != vm.UID {
			continue // a label edited by hand does not make an address vm's
		}
		if err := a.writer.Delete(ctx, c, client.Preconditions{UID: &c.UID}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("releasing address %s: %w", c.Name, err)
		}
		n := a.network(types.NamespacedName{Namespace: c.Namespace, Name: c.Spec.Network})
		n.mu.Lock()
		if addr, ok := n.byVM[vm.UID]; ok {
			delete(n.used, addr)
			delete(n.byVM, vm.UID)
			delete(n.nodeOf, vm.UID)
		}
		n.mu.Unlock()
	}
	return nil
}

// Backfill names, in each address that names no node, the node its VM is placed on: addresses
// an operator made before addresses named nodes. The operator runs it once as it starts to
// lead; agents route the overlay from addresses alone.
func (a *Allocator) Backfill(ctx context.Context) (int, error) {
	var list impv1.ImpIPAddressList
	if err := a.reader.List(ctx, &list); err != nil {
		return 0, fmt.Errorf("listing addresses: %w", err)
	}
	done := 0
	for i := range list.Items {
		c := &list.Items[i]
		if c.Spec.NodeName != "" {
			continue
		}
		var vm impv1.ImpVM
		if err := a.reader.Get(ctx, types.NamespacedName{Namespace: c.Namespace, Name: c.Spec.VMRef.Name}, &vm); err != nil ||
			vm.UID != c.Spec.VMRef.UID || vm.Status.NodeName == "" {
			continue // gone, another VM of that name, or not placed: nothing to route
		}
		patch := client.RawPatch(types.MergePatchType, []byte(fmt.Sprintf(`{"spec":{"nodeName":%q}}`, vm.Status.NodeName)))
		if err := a.writer.Patch(ctx, c, patch); err != nil && !apierrors.IsNotFound(err) {
			return done, fmt.Errorf("naming the node of address %s: %w", c.Name, err)
		}
		done++
	}
	return done, nil
}

// Forget drops the allocator's memory of a network (it was deleted or its CIDR changed).
func (a *Allocator) Forget(key types.NamespacedName) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.nets, key)
}
