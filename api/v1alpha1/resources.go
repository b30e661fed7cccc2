package v1alpha1

import (
	"errors"
	"fmt"

	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/labels"
)

// DefaultDiskSize is the writable disk size of a VM whose spec and class leave it unset.
var DefaultDiskSize = resource.MustParse("1Gi")

// ErrIncompleteResources is returned by ResolveResources when neither the VM nor its class gives
// vCPUs or memory.
var ErrIncompleteResources = errors.New("v1alpha1: incomplete resources")

// ResolveResources combines a VM's spec with its class (nil when the VM names none): every field
// the spec sets wins over the class, the disk size falls back to DefaultDiskSize.
func ResolveResources(spec *ImpVMSpec, class *ImpVMClassSpec) (ResolvedResources, error) {
	var r ResolvedResources
	if class != nil {
		r.VCPUs = class.VCPUs
		r.Memory = class.Memory.DeepCopy()
		if class.DefaultDiskSize != nil {
			r.DiskSize = class.DefaultDiskSize.DeepCopy()
		}
		r.VMM = class.VMM
	}
	if res := spec.Resources; res != nil {
		if res.VCPUs != nil {
			r.VCPUs = *res.VCPUs
		}
		if res.Memory != nil {
			r.Memory = res.Memory.DeepCopy()
		}
	}
	if spec.DiskSize != nil {
		r.DiskSize = spec.DiskSize.DeepCopy()
	}
	if r.DiskSize.IsZero() {
		r.DiskSize = DefaultDiskSize.DeepCopy()
	}
	if spec.VMM != "" {
		r.VMM = spec.VMM
	}
	if v := spec.VolumeDiskSize(); !v.IsZero() {
		r.VolumeDiskSize = &v
	}
	switch {
	case r.VCPUs < 1:
		return ResolvedResources{}, fmt.Errorf("%w: no vcpus in spec.resources or the class", ErrIncompleteResources)
	case r.Memory.IsZero():
		return ResolvedResources{}, fmt.Errorf("%w: no memory in spec.resources or the class", ErrIncompleteResources)
	}
	return r, nil
}

// RequiredNodeLabels are the labels a node must carry to take the VM: the VM's nodeSelector
// plus NodeEnabledLabel=NodeEnabledValue, which no selector can replace.
func (s *ImpVMSpec) RequiredNodeLabels() labels.Set {
	set := make(labels.Set, len(s.NodeSelector)+1)
	for k, v := range s.NodeSelector {
		set[k] = v
	}
	set[NodeEnabledLabel] = NodeEnabledValue
	return set
}

// NodeDisk is all the VM holds of its node's disk: its writable disk and its disk volumes.
func (r *ResolvedResources) NodeDisk() resource.Quantity {
	q := r.DiskSize.DeepCopy()
	if r.VolumeDiskSize != nil {
		q.Add(*r.VolumeDiskSize)
	}
	return q
}

// NodeDiskBytes is NodeDisk in bytes.
func (r *ResolvedResources) NodeDiskBytes() int64 {
	q := r.NodeDisk()
	return q.Value()
}
