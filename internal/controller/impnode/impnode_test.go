package impnode

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// TestReportedAddressesOutsideTheirBlockHoldNothing: a compromised node's agent reports its VMs
// at addresses of other blocks; a node that joins still gets the lowest free block. Addresses of
// VMs whose node left the cluster still hold theirs, not those of a node whose ImpNode alone is
// gone; a node that came back with VMs of its old block gets that block again.
func TestReportedAddressesOutsideTheirBlockHoldNothing(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	create := func(o client.Object) {
		t.Helper()
		if err := c.Client.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Client.Delete(context.Background(), o) })
	}
	kubeNode := func(name string) { create(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: ns + "-" + name}}) }
	node := func(name, block string) {
		kubeNode(name)
		create(&impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: ns + "-" + name}, Spec: impv1.ImpNodeSpec{EndpointCIDR: block}})
	}
	vm := func(name, nodeName, endpoint string) {
		t.Helper()
		v := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: impv1.ImpVMSpec{Image: "registry.test/web:1",
			Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("256Mi"))}}}
		if err := c.Client.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
		v.Status.NodeName, v.Status.Instance = ns+"-"+nodeName, 1
		v.Status.Runtime = &impv1.RuntimeStatus{Instance: 1, State: impv1.RuntimeRunning, Endpoint: endpoint}
		if err := c.Client.Status().Update(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	// Node a is compromised: its agent reports two VMs in blocks 1 and 2, outside its block 0.
	node("a", "100.73.0.0/24")
	vm("a-1", "a", "100.73.0.9")
	vm("spoof-1", "a", "100.73.1.9")
	vm("spoof-2", "a", "100.73.2.9")
	// A node that left the cluster keeps its VMs' addresses until they go: block 3 is not free.
	vm("left", "gone", "100.73.3.9")
	// Node x's ImpNode is gone (its agent can have it collected), not the node: block 5 is free.
	kubeNode("x")
	vm("x-1", "x", "100.73.5.9")
	// Node b came back without a block; a VM of its reports one of its old block, 4.
	node("b", "")
	vm("b-old", "b", "100.73.4.7")

	startBlocks(t, c, "100.73.0.0/20")

	block := func(name string) func() string {
		return func() string {
			n := &impv1.ImpNode{}
			if err := c.Client.Get(ctx, types.NamespacedName{Name: ns + "-" + name}, n); err != nil {
				return err.Error()
			}
			return n.Spec.EndpointCIDR
		}
	}
	g := NewWithT(t)
	g.Eventually(block("b")).WithTimeout(30*time.Second).Should(Equal("100.73.4.0/24"), "the block node b's VMs still have")
	for _, n := range []struct{ name, want string }{{"c", "100.73.1.0/24"}, {"d", "100.73.2.0/24"}, {"e", "100.73.5.0/24"}} {
		node(n.name, "")
		g.Eventually(block(n.name)).WithTimeout(30 * time.Second).Should(Equal(n.want))
	}
}

// TestNodesJoiningAtOnceGetBlocksOfTheirOwn: a fleet's ImpNodes made at once each get a block
// of their own, though the blocks taken are read from the cache, which lags the assignments
// that come one after another.
func TestNodesJoiningAtOnceGetBlocksOfTheirOwn(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	startBlocks(t, c, "100.74.0.0/20")
	const n = 12
	for i := range n {
		node := &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%d", ns, i)}}
		if err := c.Client.Create(ctx, node); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Client.Delete(context.Background(), node) })
	}
	blocks := func() map[string]string {
		got := map[string]string{}
		for i := range n {
			node := &impv1.ImpNode{}
			if err := c.Client.Get(ctx, types.NamespacedName{Name: fmt.Sprintf("%s-%d", ns, i)}, node); err == nil && node.Spec.EndpointCIDR != "" {
				got[node.Name] = node.Spec.EndpointCIDR
			}
		}
		return got
	}
	NewWithT(t).Eventually(func() int { return len(blocks()) }).WithTimeout(30 * time.Second).Should(Equal(n))
	// A second assignment to a node (a pass on a stale copy) would show as a change: give
	// the passes woken by the assignments time to run, then look again.
	first := blocks()
	NewWithT(t).Consistently(blocks).WithTimeout(2 * time.Second).Should(Equal(first))
	owners := map[string]string{}
	for name, b := range first {
		if other, taken := owners[b]; taken {
			t.Errorf("nodes %s and %s both have block %s", other, name, b)
		}
		owners[b] = name
	}
}

// startBlocks runs the reconciler, in a manager of its own, over the endpoint range rng with
// blocks of /24, until the test ends.
func startBlocks(t *testing.T, c *testcluster.Cluster, rng string) {
	t.Helper()
	mgr, err := ctrl.NewManager(c.As(t, testcluster.Operator), ctrl.Options{
		Scheme: c.Scheme, Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0",
		Controller: config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := (&Reconciler{Client: mgr.GetClient(), Range: netip.MustParsePrefix(rng), BlockBits: 24}).SetupWithManager(mgr); err != nil {
		t.Fatal(err)
	}
	testcluster.RunManager(t, mgr)
}
