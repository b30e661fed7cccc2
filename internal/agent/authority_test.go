package agent_test

import (
	"context"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/nodereport"
	"github.com/syscode-labs/imp/internal/testcluster"
)

// TestAgentWritesAreNodeScoped: with the chart's identity for the agent and its admission
// policy, an agent whose token names node A writes the status of VMs placed on A and A's
// ImpNode, and nothing else: not the status of a VM on node B, not a move of its own VM to B,
// not B's ImpNode; and an agent token that names no node writes nothing.
func TestAgentWritesAreNodeScoped(t *testing.T) {
	c := testcluster.Require(t, shared)
	c.InstallChartObjects(t, "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
	ctx := context.Background()
	ns := c.Namespace(t)
	sfx := ns[len(ns)-5:]
	nodeA, nodeB := "imp-auth-a-"+sfx, "imp-auth-b-"+sfx
	vms := map[string]*impv1.ImpVM{}
	for name, node := range map[string]string{"on-a": nodeA, "on-b": nodeB, "canary": nodeA} {
		vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: impv1.ImpVMSpec{Image: "registry.example/app:v1"}}
		vm.Spec.Resources = &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))}
		if err := c.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
		vm.Status.NodeName = node
		if err := c.Client.Status().Update(ctx, vm); err != nil {
			t.Fatal(err)
		}
		vms[name] = vm
	}
	if err := c.Client.Create(ctx, &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: nodeB}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, n := range []string{nodeA, nodeB} {
			_ = c.Client.Delete(context.Background(), &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: n}})
		}
	})
	asA, err := client.New(c.AsNode(t, testcluster.Agent, nodeA), client.Options{Scheme: c.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	anyNode, err := client.New(c.As(t, testcluster.Agent), client.Options{Scheme: c.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	report := func(cl client.Client, name, node, message string) error {
		return cl.Status().Patch(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}, client.RawPatch(types.MergePatchType,
			[]byte(`{"status":{"nodeName":"`+node+`","runtime":{"instance":1,"run":1,"state":"Starting","message":"`+message+`"}}}`)))
	}
	refused := func(err error, says string) bool {
		return apierrors.IsForbidden(err) || apierrors.IsInvalid(err) && strings.Contains(err.Error(), says)
	}
	// The policy takes a moment to be in force: waited for on a canary, whose writes harm no
	// assertion below.
	deadline := time.Now().Add(time.Minute)
	for err := report(anyNode, "canary", nodeA, "probe"); !refused(err, "names no node"); err = report(anyNode, "canary", nodeA, "probe") {
		if time.Now().After(deadline) {
			t.Fatalf("the admission policy never refused an agent token naming no node: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err := report(asA, "on-b", nodeB, "not mine"); !refused(err, "VMs placed on its node only") {
		t.Errorf("the agent of %s wrote the status of a VM on %s: %v", nodeA, nodeB, err)
	}
	if err := report(asA, "on-a", nodeA, "mine"); err != nil {
		t.Errorf("the agent of %s could not report its own VM: %v", nodeA, err)
	}
	// What the operator decides stays the operator's: a VM's resources (which the quota
	// ledger reloads: 1Ti would make the namespace's VMs QuotaExceeded on every node), its
	// phase, its address.
	for _, patch := range []string{
		`{"status":{"resources":{"vcpus":64,"memory":"1Ti","diskSize":"1Ti"}}}`,
		`{"status":{"phase":"Failed"}}`,
		`{"status":{"ip":"10.0.0.9"}}`,
		`{"status":{"runtime":{"instance":1,"run":1,"state":"Running"},"restartCount":7}}`,
		// A copy's snapshot is the operator's choice: an agent naming another would restore
		// whatever snapshot it liked into the VM.
		`{"status":{"template":{"revision":"r","image":"registry.example/app:v1","snapshot":"snap-b"}}}`,
		// The warm pool member a claim was handed is read by the operator's ledger: an agent
		// naming one would take it from its pool (another namespace's included), whose
		// controller would delete it.
		`{"status":{"start":"warm","warm":{"pool":"p","member":"p-x","memberUID":"00000000-0000-0000-0000-000000000001"}}}`,
		`{"status":{"image":"registry.example/other:v1"}}`,
		// A migration's hold on the VM is the operator's: an agent naming one could keep the
		// VM from every migration, or tell itself it may let the VM go.
		`{"status":{"migration":{"name":"m","uid":"00000000-0000-0000-0000-000000000002","phase":"Committed","targetNode":"x"}}}`,
	} {
		err := asA.Status().Patch(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "on-a"}}, client.RawPatch(types.MergePatchType, []byte(patch)))
		if !refused(err, "may write status.runtime of on-a only") {
			t.Errorf("the agent of %s patched %s: %v", nodeA, patch, err)
		}
	}
	if err := report(asA, "on-a", nodeB, "moved"); !refused(err, "VMs placed on its node only") {
		t.Errorf("the agent of %s moved its VM to %s: %v", nodeA, nodeB, err)
	}
	if err := report(anyNode, "on-a", nodeA, "no node"); !refused(err, "names no node") {
		t.Errorf("an agent token naming no node wrote a VM's status: %v", err)
	}
	if err := asA.Create(ctx, &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: nodeA}}); err != nil {
		t.Errorf("the agent of %s could not create its ImpNode: %v", nodeA, err)
	}
	other := &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: nodeB}}
	err = asA.Status().Patch(ctx, other, client.RawPatch(types.MergePatchType, []byte(`{"status":{"overlayAddress":"192.0.2.66"}}`)))
	if !refused(err, "its own ImpNode only") {
		t.Errorf("the agent of %s rewrote %s's overlay address: %v", nodeA, nodeB, err)
	}
	if err := asA.Create(ctx, &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: "imp-auth-c-" + sfx}}); !refused(err, "its own ImpNode only") {
		t.Errorf("the agent of %s created another node's ImpNode: %v", nodeA, err)
	}
	// Its endpoint block is the operator's to give: taking another node's would draw that
	// node's Services' traffic.
	own := &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: nodeA}}
	err = asA.Patch(ctx, own, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"endpointCIDR":"100.72.9.0/24"}}`)))
	if !refused(err, "may not set its ImpNode spec.endpointCIDR") {
		t.Errorf("the agent of %s chose its own endpoint block: %v", nodeA, err)
	}
	// Snapshots: those given to its node only; it may not take one for itself, nor give one away.
	for node, name := range map[string]string{nodeA: "snap-a", nodeB: "snap-b"} {
		snap := &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: impv1.ImpVMSnapshotSpec{VMName: "on-a"}}
		if err := c.Client.Create(ctx, snap); err != nil {
			t.Fatal(err)
		}
		snap.Status.NodeName = node
		if err := c.Client.Status().Update(ctx, snap); err != nil {
			t.Fatal(err)
		}
	}
	snapPatch := func(name, patch string) error {
		return asA.Status().Patch(ctx, &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}, client.RawPatch(types.MergePatchType, []byte(patch)))
	}
	if err := snapPatch("snap-a", `{"status":{"phase":"Taking"}}`); err != nil {
		t.Errorf("the agent of %s could not report its snapshot: %v", nodeA, err)
	}
	if err := snapPatch("snap-b", `{"status":{"phase":"Ready"}}`); !refused(err, "snapshots given to its node only") {
		t.Errorf("the agent of %s wrote the status of %s's snapshot: %v", nodeA, nodeB, err)
	}
	if err := snapPatch("snap-b", `{"status":{"nodeName":"`+nodeA+`"}}`); !refused(err, "snapshots given to its node only") {
		t.Errorf("the agent of %s took %s's snapshot: %v", nodeA, nodeB, err)
	}
	if err := snapPatch("snap-a", `{"status":{"nodeName":"`+nodeB+`"}}`); !refused(err, "snapshots given to its node only") {
		t.Errorf("the agent of %s gave its snapshot to %s: %v", nodeA, nodeB, err)
	}
	// Heartbeats: its own Lease, not another node's (which would keep a dead node placeable).
	beat := func(name, holder string) error {
		return asA.Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: testcluster.ChartNamespace, Name: name,
			Labels: map[string]string{impv1.AgentLeaseLabel: "true"}}, Spec: coordinationv1.LeaseSpec{HolderIdentity: &holder}})
	}
	if err := beat(impv1.AgentLeasePrefix+nodeB, nodeB); !refused(err, "its own heartbeat Lease only") {
		t.Errorf("the agent of %s beat for %s: %v", nodeA, nodeB, err)
	}
	if err := beat(impv1.AgentLeasePrefix+nodeA, nodeB); !refused(err, "its own heartbeat Lease only") {
		t.Errorf("the agent of %s beat in its Lease for %s: %v", nodeA, nodeB, err)
	}
	l, err := nodereport.RenewHeartbeat(ctx, asA, asA, testcluster.ChartNamespace, nodeA, time.Second, nil)
	if err != nil {
		t.Errorf("the agent of %s could not beat: %v", nodeA, err)
	} else {
		t.Cleanup(func() { _ = c.Client.Delete(context.Background(), l) })
		if _, err := nodereport.RenewHeartbeat(ctx, asA, asA, testcluster.ChartNamespace, nodeA, time.Second, l); err != nil {
			t.Errorf("the agent of %s could not renew its heartbeat: %v", nodeA, err)
		}
	}
	// NetworkPolicy: a VM's labels reach every node's policies through the operator's
	// ImpIPAddresses; an agent writing one, relabelling its own VM or writing a policy would
	// widen what other nodes let its VMs reach.
	addr := &impv1.ImpIPAddress{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: impv1.IPAddressName("net", "10.9.0.2")},
		Spec: impv1.ImpIPAddressSpec{Network: "net", Address: "10.9.0.2", VMRef: impv1.VMReference{Name: "on-a", UID: vms["on-a"].UID}, NodeName: nodeA}}
	if err := c.Client.Create(ctx, addr); err != nil {
		t.Fatal(err)
	}
	if err := asA.Patch(ctx, addr, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"vmLabels":{"app":"db"}}}`))); !apierrors.IsForbidden(err) {
		t.Errorf("the agent of %s relabelled a VM's address: %v", nodeA, err)
	}
	if err := asA.Patch(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "on-a"}},
		client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"labels":{"app":"db"}}}`))); !apierrors.IsForbidden(err) {
		t.Errorf("the agent of %s relabelled its VM: %v", nodeA, err)
	}
	if err := asA.Status().Patch(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "on-a"}},
		client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"labels":{"app":"db"}}}`))); err == nil {
		var vm impv1.ImpVM
		if err := c.Client.Get(ctx, client.ObjectKeyFromObject(vms["on-a"]), &vm); err != nil || vm.Labels["app"] == "db" {
			t.Errorf("the agent of %s relabelled its VM through its status: %v %v", nodeA, vm.Labels, err)
		}
	}
	pol := &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "open"}, Spec: networkingv1.NetworkPolicySpec{
		Ingress: []networkingv1.NetworkPolicyIngressRule{{}}}}
	if err := asA.Create(ctx, pol); !apierrors.IsForbidden(err) {
		t.Errorf("the agent of %s wrote a NetworkPolicy: %v", nodeA, err)
	}

	var got impv1.ImpVM
	if err := c.Client.Get(ctx, client.ObjectKeyFromObject(vms["on-b"]), &got); err != nil {
		t.Fatal(err)
	}
	if got.Status.Runtime != nil {
		t.Errorf("the VM on %s carries a report: %+v", nodeB, got.Status.Runtime)
	}
}

// TestAgentCannotBecomeTheOperator: with the chart's identities, an agent's token (bound to its
// node) cannot get a token of the operator's ServiceAccount, impersonate it, or list the
// Secrets of IMP's namespace to find one; root on a VM node, holding the agent's token, gets
// no more than the agent's authority (and the chart keeps the operator off VM nodes).
func TestAgentCannotBecomeTheOperator(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	cs, err := kubernetes.NewForConfig(c.AsNode(t, testcluster.Agent, "imp-auth-op"))
	if err != nil {
		t.Fatal(err)
	}
	ns := testcluster.ChartNamespace
	// The client is the agent's, with the agent's rights: reading a Node is one of them.
	if _, err := cs.CoreV1().Nodes().Get(ctx, "imp-auth-op", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("the agent's client cannot do what the agent may: %v", err)
	}
	if _, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, testcluster.Operator, &authenticationv1.TokenRequest{}, metav1.CreateOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("the agent asked for the operator's token: %v", err)
	}
	if _, err := cs.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("the agent listed the Secrets of %s: %v", ns, err)
	}
	// Impersonation, asked of the API server's authorizer for the agent's identity (a client
	// that impersonates already cannot impersonate again).
	for _, attrs := range []authorizationv1.ResourceAttributes{
		{Verb: "impersonate", Resource: "serviceaccounts", Namespace: ns, Name: testcluster.Operator},
		{Verb: "impersonate", Resource: "users", Name: "system:serviceaccount:" + ns + ":" + testcluster.Operator},
		{Verb: "list", Group: "imp.dev", Resource: "impvms"}, // allowed: the review is the agent's
	} {
		sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
			User: "system:serviceaccount:" + ns + ":" + testcluster.Agent, Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"},
			ResourceAttributes: &attrs}}
		if err := c.Client.Create(ctx, sar); err != nil {
			t.Fatal(err)
		}
		if want := attrs.Verb == "list"; sar.Status.Allowed != want {
			t.Errorf("the agent may %s %s %s: %v, want %v", attrs.Verb, attrs.Resource, attrs.Name, sar.Status.Allowed, want)
		}
	}
	// The operator's own token works for what the operator does, so the refusals above are the
	// agent's.
	op, err := kubernetes.NewForConfig(c.As(t, testcluster.Operator))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := op.CoreV1().Secrets(ns).Get(ctx, "imp-no-such-run", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the operator's identity cannot read its run Secrets: %v", err)
	}
}
