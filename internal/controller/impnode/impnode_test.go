package impnode

import (
	"context"
	"net/netip"
	"os"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// TestReportedAddressesOutsideTheirBlockHoldNothing: a compromised node's agent reports its VMs
// at addresses of other blocks; a node that joins still gets the lowest free block. Addresses of
// VMs whose node left (no ImpNode) still hold theirs; a node that came back may get its old block.
func TestReportedAddressesOutsideTheirBlockHoldNothing(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	mgr, err := ctrl.NewManager(c.As(t, testcluster.Operator), ctrl.Options{
		Scheme: c.Scheme, Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0",
		Controller: config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		t.Fatal(err)
	}
	rng := netip.MustParsePrefix("100.73.0.0/20")
	if err := (&Reconciler{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Range: rng, BlockBits: 24}).SetupWithManager(mgr); err != nil {
		t.Fatal(err)
	}
	node := func(name, block string) {
		t.Helper()
		n := &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: ns + "-" + name}, Spec: impv1.ImpNodeSpec{EndpointCIDR: block}}
		if err := c.Client.Create(ctx, n); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Client.Delete(context.Background(), n) })
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
	// A node that left keeps its VMs' addresses until they go: block 3 is not free.
	vm("left", "gone", "100.73.3.9")
	// Node b has no block yet; a VM of its reports one from before (it left and came back).
	node("b", "")
	vm("b-old", "b", "100.73.1.7")

	mctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := mgr.Start(mctx); err != nil {
			t.Errorf("manager: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })

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
	g.Eventually(block("b")).WithTimeout(30 * time.Second).Should(Equal("100.73.1.0/24"))
	node("c", "")
	g.Eventually(block("c")).WithTimeout(30 * time.Second).Should(Equal("100.73.2.0/24"))
	node("d", "")
	g.Eventually(block("d")).WithTimeout(30*time.Second).Should(Equal("100.73.4.0/24"), "block 3 holds a VM of a node that left")
}
