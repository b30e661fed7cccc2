package ipam_test

import (
	"context"
	"errors"
	"os"
	"testing"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/ipam"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// vm is an ImpVM as the allocator sees it; it need not exist in the API.
func vm(ns, name string) *impv1.ImpVM {
	return &impv1.ImpVM{
		TypeMeta:   metav1.TypeMeta{APIVersion: impv1.GroupVersion.String(), Kind: "ImpVM"},
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(ns + "-" + name)},
	}
}

func setup(t *testing.T, cidr, gateway string) (*testcluster.Cluster, *impv1.ImpNetwork, func() *ipam.Allocator) {
	c := testcluster.Require(t, shared)
	ns := c.Namespace(t)
	net := &impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: cidr, Gateway: gateway}}
	if err := c.Client.Create(context.Background(), net); err != nil {
		t.Fatal(err)
	}
	return c, net, func() *ipam.Allocator { return ipam.New(c.Client, c.Client, c.Scheme) }
}

func allocate(t *testing.T, a *ipam.Allocator, net *impv1.ImpNetwork, v *impv1.ImpVM) string {
	t.Helper()
	addr, err := a.Allocate(context.Background(), net, v, "node-a")
	if err != nil {
		t.Fatalf("allocating for %s: %v", v.Name, err)
	}
	return addr.String()
}

func TestAllocateSkipsReservedAddressesUntilExhausted(t *testing.T) {
	_, net, alloc := setup(t, "10.9.0.0/29", "10.9.0.3")
	a := alloc()
	var got []string
	for _, n := range []string{"a", "b", "c", "d", "e"} {
		got = append(got, allocate(t, a, net, vm(net.Namespace, n)))
	}
	// .0 network, .3 gateway, .7 broadcast.
	want := []string{"10.9.0.1", "10.9.0.2", "10.9.0.4", "10.9.0.5", "10.9.0.6"}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("allocations = %v, want %v", got, want)
		}
	}
	if again := allocate(t, a, net, vm(net.Namespace, "c")); again != "10.9.0.4" {
		t.Errorf("a VM asking again got %s, want its own 10.9.0.4", again)
	}
	if _, err := a.Allocate(context.Background(), net, vm(net.Namespace, "f"), "node-a"); !errors.Is(err, ipam.ErrExhausted) {
		t.Errorf("sixth allocation: %v, want ErrExhausted", err)
	}
}

func TestANewAllocatorFindsExistingClaims(t *testing.T) {
	_, net, alloc := setup(t, "10.9.1.0/24", "")
	first := allocate(t, alloc(), net, vm(net.Namespace, "a"))
	restarted := alloc() // an operator restart: empty memory
	if got := allocate(t, restarted, net, vm(net.Namespace, "a")); got != first {
		t.Errorf("after a restart VM a got %s, want its claim %s", got, first)
	}
	if got := allocate(t, restarted, net, vm(net.Namespace, "b")); got == first {
		t.Errorf("after a restart VM b got a's address %s", got)
	}
}

func TestStaleMemoryCannotDoubleAllocate(t *testing.T) {
	_, net, alloc := setup(t, "10.9.2.0/24", "")
	a, b := alloc(), alloc() // two allocators: a leader and one that overlaps it
	x := allocate(t, a, net, vm(net.Namespace, "x"))
	y := allocate(t, b, net, vm(net.Namespace, "y"))
	z := allocate(t, a, net, vm(net.Namespace, "z")) // a's memory does not know y's claim
	if x == y || y == z || x == z {
		t.Errorf("two VMs share an address: x=%s y=%s z=%s", x, y, z)
	}
}

func TestReleaseDeletesOnlyTheVMsClaims(t *testing.T) {
	c, net, alloc := setup(t, "10.9.3.0/24", "")
	ctx := context.Background()
	a := alloc()
	one, two := vm(net.Namespace, "one"), vm(net.Namespace, "two")
	allocate(t, a, net, one)
	twoAddr := allocate(t, a, net, two)

	// Someone relabels two's claim with one's UID: the label alone must not make it one's.
	claim := &impv1.ImpIPAddress{}
	if err := c.Client.Get(ctx, types.NamespacedName{Namespace: net.Namespace, Name: impv1.IPAddressName("net", twoAddr)}, claim); err != nil {
		t.Fatal(err)
	}
	claim.Labels[impv1.VMUIDLabel] = string(one.UID)
	if err := c.Client.Update(ctx, claim); err != nil {
		t.Fatal(err)
	}
	if err := a.Release(ctx, one); err != nil {
		t.Fatal(err)
	}
	var left impv1.ImpIPAddressList
	if err := c.Client.List(ctx, &left, client.InNamespace(net.Namespace)); err != nil {
		t.Fatal(err)
	}
	if len(left.Items) != 1 || left.Items[0].Spec.Address != twoAddr {
		t.Errorf("after releasing one, claims left: %+v; want only two's %s", left.Items, twoAddr)
	}
	// one's address is free again.
	if got := allocate(t, a, net, vm(net.Namespace, "three")); got != "10.9.3.2" {
		t.Errorf("next allocation %s, want the released 10.9.3.2", got)
	}
}

// TestAddressNamesItsNode: an address names the node of its VM from its creation, is written
// again only when the VM moves (not when it is placed again on the same node, nor by another
// operator's allocator), and Backfill names the node in an address made before addresses did.
func TestAddressNamesItsNode(t *testing.T) {
	c, net, alloc := setup(t, "10.9.5.0/24", "")
	ctx := context.Background()
	get := func(addr string) *impv1.ImpIPAddress {
		t.Helper()
		claim := &impv1.ImpIPAddress{}
		if err := c.Client.Get(ctx, types.NamespacedName{Namespace: net.Namespace, Name: impv1.IPAddressName("net", addr)}, claim); err != nil {
			t.Fatal(err)
		}
		return claim
	}
	v := vm(net.Namespace, "mover")
	addr := allocate(t, alloc(), net, v)
	first := get(addr)
	if first.Spec.NodeName != "node-a" {
		t.Fatalf("a new address names node %q, want node-a", first.Spec.NodeName)
	}
	for _, a := range []*ipam.Allocator{alloc(), alloc()} { // placed again, by a restarted operator
		if got := allocate(t, a, net, v); got != addr {
			t.Fatalf("placed again, the VM got %s, want %s", got, addr)
		}
	}
	if again := get(addr); again.ResourceVersion != first.ResourceVersion {
		t.Errorf("placing the VM again on its node wrote its address (resourceVersion %s → %s)", first.ResourceVersion, again.ResourceVersion)
	}
	a := alloc()
	if got, err := a.Allocate(ctx, net, v, "node-b"); err != nil || got.String() != addr {
		t.Fatalf("moving the VM: %v %v", got, err)
	}
	if moved := get(addr); moved.Spec.NodeName != "node-b" {
		t.Errorf("the moved VM's address names %q, want node-b", moved.Spec.NodeName)
	}

	// An address from before: no node, its VM placed on node-c.
	old := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: net.Namespace, Name: "old"},
		Spec: impv1.ImpVMSpec{Image: "registry.example/app:1", Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))}}}
	if err := c.Client.Create(ctx, old); err != nil {
		t.Fatal(err)
	}
	old.Status.NodeName = "node-c"
	if err := c.Client.Status().Update(ctx, old); err != nil {
		t.Fatal(err)
	}
	legacy := &impv1.ImpIPAddress{ObjectMeta: metav1.ObjectMeta{Namespace: net.Namespace, Name: impv1.IPAddressName("net", "10.9.5.200")},
		Spec: impv1.ImpIPAddressSpec{Network: "net", Address: "10.9.5.200", VMRef: impv1.VMReference{Name: "old", UID: old.UID}}}
	if err := c.Client.Create(ctx, legacy); err != nil {
		t.Fatal(err)
	}
	if n, err := alloc().Backfill(ctx); err != nil || n < 1 {
		t.Fatalf("Backfill: %d, %v", n, err)
	}
	if got := get("10.9.5.200"); got.Spec.NodeName != "node-c" {
		t.Errorf("after Backfill the old address names %q, want node-c", got.Spec.NodeName)
	}
	// The rest of an address stays immutable.
	moved := get(addr)
	moved.Spec.Address = "10.9.5.201"
	if err := c.Client.Update(ctx, moved); err == nil {
		t.Errorf("an address's address changed")
	}
}
