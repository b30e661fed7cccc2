package impvm_test

import (
	"context"
	"slices"
	"testing"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/testcluster"
)

// The chart's MutatingAdmissionPolicy adds the operator's finalizer as an ImpVM is created, so
// that the operator's first write of a VM is its placement; it keeps finalizers the VM came
// with and never adds its own twice.
func TestFinalizerAddedAtAdmission(t *testing.T) {
	cl := testcluster.Require(t, shared)
	cl.InstallChartObjects(t, "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")
	ns := cl.Namespace(t)
	ctx := context.Background()
	tryCreate := func(finalizers ...string) ([]string, error) {
		vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "vm", Finalizers: finalizers},
			Spec: impv1.ImpVMSpec{Image: "registry.test/app:1", Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))}}}
		err := cl.Client.Create(ctx, vm, client.DryRunAll)
		return vm.Finalizers, err
	}
	create := func(finalizers ...string) []string {
		got, err := tryCreate(finalizers...)
		if err != nil {
			t.Fatalf("creating (dry run) with finalizers %v: %v", finalizers, err)
		}
		return got
	}
	// Later tests of this package create VMs with the policy in place, so this waits out the
	// API server's loading it too.
	testcluster.WaitForMutation(t, func() (bool, error) {
		got, err := tryCreate()
		return slices.Contains(got, impv1.VMFinalizer), err
	})
	for _, tc := range []struct {
		in, want []string
	}{
		{nil, []string{impv1.VMFinalizer}},
		{[]string{"example.com/keep"}, []string{"example.com/keep", impv1.VMFinalizer}},
		{[]string{impv1.VMFinalizer}, []string{impv1.VMFinalizer}},
		{[]string{"example.com/keep", impv1.VMFinalizer}, []string{"example.com/keep", impv1.VMFinalizer}},
	} {
		if got := create(tc.in...); !slices.Equal(got, tc.want) {
			t.Errorf("created with finalizers %v: has %v, want %v", tc.in, got, tc.want)
		}
	}
}
