package v1alpha1_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// readObject reads one YAML object and the "# want: ..." lines above it.
func readObject(t *testing.T, path string) (*unstructured.Unstructured, []string) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var wants []string
	for _, line := range strings.Split(string(data), "\n") {
		if w, ok := strings.CutPrefix(line, "# want: "); ok {
			wants = append(wants, w)
		}
	}
	u := &unstructured.Unstructured{}
	if err := yaml.Unmarshal(data, &u.Object); err != nil {
		t.Fatalf("parsing %s: %v", path, err)
	}
	return u, wants
}

func inNamespace(u *unstructured.Unstructured, ns string) {
	if u.GetKind() != "ImpVMClass" {
		u.SetNamespace(ns)
	}
}

func TestSamplesAreAccepted(t *testing.T) {
	c := testcluster.Require(t, shared)
	ns := c.Namespace(t)
	files, err := filepath.Glob("../../config/samples/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no samples found: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			u, _ := readObject(t, f)
			inNamespace(u, ns)
			if err := c.Client.Create(context.Background(), u, client.DryRunAll); err != nil {
				t.Errorf("sample rejected: %v", err)
			}
		})
	}
}

func TestInvalidObjectsAreRejected(t *testing.T) {
	c := testcluster.Require(t, shared)
	ns := c.Namespace(t)
	files, err := filepath.Glob("testdata/invalid/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no invalid objects found: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			u, wants := readObject(t, f)
			if len(wants) == 0 {
				t.Fatalf("%s has no '# want:' line", f)
			}
			inNamespace(u, ns)
			err := c.Client.Create(context.Background(), u, client.DryRunAll)
			if !apierrors.IsInvalid(err) {
				t.Fatalf("want an Invalid error, got %v", err)
			}
			for _, w := range wants {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not mention %q:\n%v", w, err)
				}
			}
		})
	}
}

func minimalVM(ns, name string) *impv1.ImpVM {
	return &impv1.ImpVM{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: impv1.ImpVMSpec{
			Image:     "docker.io/library/busybox:1.36",
			Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("256Mi"))},
		},
	}
}

func TestDefaults(t *testing.T) {
	c := testcluster.Require(t, shared)
	ns := c.Namespace(t)
	ctx := context.Background()

	vm := minimalVM(ns, "defaults")
	if err := c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	if vm.Spec.RunStrategy != impv1.RunStrategyAlways {
		t.Errorf("runStrategy defaulted to %q, want Always", vm.Spec.RunStrategy)
	}
	if vm.Spec.TerminationGracePeriodSeconds == nil || *vm.Spec.TerminationGracePeriodSeconds != 30 {
		t.Errorf("terminationGracePeriodSeconds defaulted to %v, want 30", vm.Spec.TerminationGracePeriodSeconds)
	}

	net := &impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.1.0.0/24"}}
	if err := c.Client.Create(ctx, net); err != nil {
		t.Fatal(err)
	}
	if net.Spec.NAT.Enabled {
		t.Error("nat.enabled defaulted to true, want false")
	}
}

func TestInstanceFieldsAreImmutable(t *testing.T) {
	c := testcluster.Require(t, shared)
	ns := c.Namespace(t)
	ctx := context.Background()

	withAll := func(vm *impv1.ImpVM) {
		vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
		vm.Spec.DiskSize = ptr.To(resource.MustParse("2Gi"))
		vm.Spec.VMM = impv1.VMMQEMU
	}
	tests := []struct {
		name    string
		setup   func(*impv1.ImpVM) // before create
		mutate  func(*impv1.ImpVM)
		wantErr string // empty: the update is accepted
	}{
		{name: "memory changed", mutate: func(vm *impv1.ImpVM) { vm.Spec.Resources.Memory = ptr.To(resource.MustParse("512Mi")) }, wantErr: "spec.resources: Invalid value: resources are immutable"},
		{name: "resources removed", mutate: func(vm *impv1.ImpVM) {
			vm.Spec.Resources = nil
			vm.Spec.ClassRef = &impv1.ClassReference{Name: "small"}
		}, wantErr: "spec.resources: Invalid value: resources are immutable"},
		{name: "class added", mutate: func(vm *impv1.ImpVM) { vm.Spec.ClassRef = &impv1.ClassReference{Name: "small"} }, wantErr: "spec.classRef: Invalid value: classRef is immutable"},
		{name: "network added", mutate: func(vm *impv1.ImpVM) { vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"} }, wantErr: "networkRef is immutable"},
		{name: "network changed", setup: withAll, mutate: func(vm *impv1.ImpVM) { vm.Spec.NetworkRef.Name = "other" }, wantErr: "spec.networkRef: Invalid value: networkRef is immutable"},
		{name: "disk size added", mutate: func(vm *impv1.ImpVM) { vm.Spec.DiskSize = ptr.To(resource.MustParse("2Gi")) }, wantErr: "diskSize is immutable"},
		{name: "disk size changed", setup: withAll, mutate: func(vm *impv1.ImpVM) { vm.Spec.DiskSize = ptr.To(resource.MustParse("3Gi")) }, wantErr: "diskSize is immutable"},
		{name: "vmm added", mutate: func(vm *impv1.ImpVM) { vm.Spec.VMM = impv1.VMMQEMU }, wantErr: "vmm is immutable"},
		{name: "vmm changed", setup: withAll, mutate: func(vm *impv1.ImpVM) { vm.Spec.VMM = impv1.VMMFirecracker }, wantErr: "vmm is immutable"},
		{name: "image is a workload field", mutate: func(vm *impv1.ImpVM) { vm.Spec.Image = "docker.io/library/alpine:3.20" }},
		{name: "runStrategy is mutable", setup: withAll, mutate: func(vm *impv1.ImpVM) { vm.Spec.RunStrategy = impv1.RunStrategyHalted }},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			vm := minimalVM(ns, fmt.Sprintf("vm-%d", i))
			if tt.setup != nil {
				tt.setup(vm)
			}
			if err := c.Client.Create(ctx, vm); err != nil {
				t.Fatal(err)
			}
			tt.mutate(vm)
			err := c.Client.Update(ctx, vm)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Errorf("update rejected: %v", err)
			case tt.wantErr != "" && (!apierrors.IsInvalid(err) || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("want Invalid mentioning %q, got %v", tt.wantErr, err)
			}
		})
	}
}

func TestNetworkCIDRIsFixedWhileAllocated(t *testing.T) {
	c := testcluster.Require(t, shared)
	ns := c.Namespace(t)
	ctx := context.Background()

	net := &impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.1.0.0/24"}}
	if err := c.Client.Create(ctx, net); err != nil {
		t.Fatal(err)
	}
	net.Spec.CIDR = "10.2.0.0/24"
	if err := c.Client.Update(ctx, net); err != nil {
		t.Fatalf("changing the cidr of an unused network: %v", err)
	}

	net.Status.Allocated = 1
	if err := c.Client.Status().Update(ctx, net); err != nil {
		t.Fatal(err)
	}
	net.Spec.CIDR = "10.3.0.0/24"
	err := c.Client.Update(ctx, net)
	if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "spec.cidr cannot change while addresses of the network are allocated") {
		t.Errorf("want Invalid for a cidr change with allocations, got %v", err)
	}
	net.Spec.CIDR = "10.2.0.0/24"
	net.Spec.Gateway = "10.2.0.9"
	err = c.Client.Update(ctx, net)
	if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "spec.gateway cannot change") {
		t.Errorf("want Invalid for a gateway change with allocations, got %v", err)
	}
}

func TestVMsSelectableByNode(t *testing.T) {
	c := testcluster.Require(t, shared)
	ns := c.Namespace(t)
	ctx := context.Background()

	for _, n := range []struct{ vm, node string }{{"a", "node-1"}, {"b", "node-2"}, {"c", "node-1"}} {
		vm := minimalVM(ns, n.vm)
		if err := c.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
		vm.Status.NodeName = n.node
		if err := c.Client.Status().Update(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	var list impv1.ImpVMList
	if err := c.Client.List(ctx, &list, client.InNamespace(ns), client.MatchingFields{"status.nodeName": "node-1"}); err != nil {
		t.Fatalf("listing by status.nodeName: %v", err)
	}
	var got []string
	for _, vm := range list.Items {
		got = append(got, vm.Name)
	}
	if strings.Join(got, ",") != "a,c" {
		t.Errorf("VMs on node-1 = %v, want [a c]", got)
	}
}
