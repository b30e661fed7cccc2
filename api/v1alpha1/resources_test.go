package v1alpha1

import (
	"errors"
	"testing"

	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/utils/ptr"
)

func q(s string) *resource.Quantity { v := resource.MustParse(s); return &v }

func TestResolveResources(t *testing.T) {
	class := &ImpVMClassSpec{VCPUs: 2, Memory: resource.MustParse("1Gi"), DefaultDiskSize: q("4Gi"), VMM: VMMFirecracker}
	tests := []struct {
		name    string
		spec    ImpVMSpec
		class   *ImpVMClassSpec
		want    ResolvedResources
		wantErr error
	}{
		{
			name:  "class only",
			spec:  ImpVMSpec{ClassRef: &ClassReference{Name: "small"}},
			class: class,
			want:  ResolvedResources{VCPUs: 2, Memory: resource.MustParse("1Gi"), DiskSize: resource.MustParse("4Gi"), VMM: VMMFirecracker},
		},
		{
			name:  "inline resources override the class field by field",
			spec:  ImpVMSpec{ClassRef: &ClassReference{Name: "small"}, Resources: &VMResources{Memory: q("3Gi")}, DiskSize: q("10Gi"), VMM: VMMQEMU},
			class: class,
			want:  ResolvedResources{VCPUs: 2, Memory: resource.MustParse("3Gi"), DiskSize: resource.MustParse("10Gi"), VMM: VMMQEMU},
		},
		{
			name: "inline only gets the default disk and no VMM preference",
			spec: ImpVMSpec{Resources: &VMResources{VCPUs: ptr.To[int32](1), Memory: q("256Mi")}},
			want: ResolvedResources{VCPUs: 1, Memory: resource.MustParse("256Mi"), DiskSize: DefaultDiskSize},
		},
		{
			name:    "no memory anywhere",
			spec:    ImpVMSpec{Resources: &VMResources{VCPUs: ptr.To[int32](1)}},
			wantErr: ErrIncompleteResources,
		},
		{
			name:    "nothing at all",
			spec:    ImpVMSpec{},
			wantErr: ErrIncompleteResources,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ResolveResources(&tt.spec, tt.class)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("error = %v, want %v", err, tt.wantErr)
			}
			if err != nil {
				return
			}
			if got.VCPUs != tt.want.VCPUs || got.Memory.Cmp(tt.want.Memory) != 0 ||
				got.DiskSize.Cmp(tt.want.DiskSize) != 0 || got.VMM != tt.want.VMM {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestResolveResourcesDoesNotAliasTheClass(t *testing.T) {
	class := &ImpVMClassSpec{VCPUs: 1, Memory: resource.MustParse("512Mi")}
	got, err := ResolveResources(&ImpVMSpec{}, class)
	if err != nil {
		t.Fatal(err)
	}
	got.Memory.Add(resource.MustParse("1Gi"))
	if class.Memory.String() != "512Mi" {
		t.Errorf("class memory changed to %s", class.Memory.String())
	}
}

func TestRequiredNodeLabels(t *testing.T) {
	tests := []struct {
		name     string
		selector map[string]string
		want     labels.Set
	}{
		{name: "no selector", want: labels.Set{NodeEnabledLabel: "true"}},
		{name: "selector is added to", selector: map[string]string{"pool": "a"}, want: labels.Set{"pool": "a", NodeEnabledLabel: "true"}},
		{name: "selector cannot override", selector: map[string]string{NodeEnabledLabel: "false"}, want: labels.Set{NodeEnabledLabel: "true"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := ImpVMSpec{NodeSelector: tt.selector}
			before := labels.Set(tt.selector).String()
			got := spec.RequiredNodeLabels()
			if !labels.Equals(got, tt.want) {
				t.Errorf("got %v, want %v", got, tt.want)
			}
			if after := labels.Set(spec.NodeSelector).String(); after != before {
				t.Errorf("the spec's own selector changed from %q to %q", before, after)
			}
		})
	}
}

// TestHostUID: a claim served warm keeps its run under its member's UID; any other VM, a
// claim restored included, under its own.
func TestHostUID(t *testing.T) {
	warm := &WarmStatus{Pool: "p", Member: "p-x", MemberUID: "member"}
	for _, tc := range []struct {
		name string
		vm   ImpVM
		want string
	}{
		{"a VM", ImpVM{}, "own"},
		{"a claim served warm", ImpVM{Spec: ImpVMSpec{WarmPoolRef: &WarmPoolReference{Name: "p"}}, Status: ImpVMStatus{Start: StartWarm, Warm: warm}}, "member"},
		{"a claim restored", ImpVM{Spec: ImpVMSpec{WarmPoolRef: &WarmPoolReference{Name: "p"}}, Status: ImpVMStatus{Start: StartRestored}}, "own"},
		{"a claim whose handover failed", ImpVM{Spec: ImpVMSpec{WarmPoolRef: &WarmPoolReference{Name: "p"}}, Status: ImpVMStatus{Start: StartWarm}}, "own"},
		{"not a claim", ImpVM{Status: ImpVMStatus{Start: StartWarm, Warm: warm}}, "own"},
	} {
		tc.vm.UID = "own"
		if got := tc.vm.HostUID(); string(got) != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
	}
}
