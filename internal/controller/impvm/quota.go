package impvm

import (
	"context"
	"fmt"
	"slices"

	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/placement"
)

// quotas returns the ImpQuotas of the VM's namespace as placement enforces them, or why the VM
// alone breaks one: a class the quota does not allow, or a size past its perVM bounds.
func (r *Reconciler) quotas(ctx context.Context, vm *impv1.ImpVM, spec *impv1.ImpVMSpec, res *impv1.ResolvedResources) ([]placement.Quota, string, error) {
	list, err := r.listQuotas(ctx, vm.Namespace)
	if err != nil {
		return nil, "", err
	}
	out := make([]placement.Quota, 0, len(list))
	for i := range list {
		q := &list[i]
		if why := perVM(q, vm, spec, res); why != "" {
			return nil, "ImpQuota " + q.Name + ": " + why, nil
		}
		out = append(out, placementQuota(q))
	}
	return out, "", nil
}

// namespaceQuotas returns the ImpQuotas of namespace ns as the ledger enforces them.
func (r *Reconciler) namespaceQuotas(ctx context.Context, ns string) ([]placement.Quota, error) {
	list, err := r.listQuotas(ctx, ns)
	if err != nil {
		return nil, err
	}
	out := make([]placement.Quota, 0, len(list))
	for i := range list {
		out = append(out, placementQuota(&list[i]))
	}
	return out, nil
}

func (r *Reconciler) listQuotas(ctx context.Context, ns string) ([]impv1.ImpQuota, error) {
	var list impv1.ImpQuotaList
	if err := r.Client.List(ctx, &list, client.InNamespace(ns)); err != nil {
		return nil, fmt.Errorf("listing ImpQuotas: %w", err)
	}
	return list.Items, nil
}

// perVM says how the VM alone breaks q's class list or per-VM bounds, or "". spec is what
// the VM is placed as: its own spec, or its template's VM (whose class a copy takes). A copy of
// a snapshot has the snapshot's size, which the per-VM bounds check.
func perVM(q *impv1.ImpQuota, vm *impv1.ImpVM, spec *impv1.ImpVMSpec, res *impv1.ResolvedResources) string {
	if allowed := q.Spec.AllowedClasses; len(allowed) > 0 && vm.Spec.SnapshotRef == nil {
		switch {
		case spec.ClassRef == nil:
			return fmt.Sprintf("the VM names no class; allowed: %v", allowed)
		case !slices.Contains(allowed, spec.ClassRef.Name):
			return fmt.Sprintf("class %s is not allowed; allowed: %v", spec.ClassRef.Name, allowed)
		}
	}
	b := q.Spec.PerVM
	if b == nil {
		return ""
	}
	switch {
	case b.VCPUs != nil && res.VCPUs > *b.VCPUs:
		return fmt.Sprintf("a VM may have at most %d vCPUs, asked %d", *b.VCPUs, res.VCPUs)
	case b.Memory != nil && res.Memory.Cmp(*b.Memory) > 0:
		return fmt.Sprintf("a VM may have at most %s memory, asked %s", b.Memory, &res.Memory)
	case b.Disk != nil && res.NodeDiskBytes() > b.Disk.Value():
		d := res.NodeDisk()
		return fmt.Sprintf("a VM may have at most %s disk, asked %s (its writable disk and disk volumes)", b.Disk, &d)
	}
	return ""
}

func placementQuota(q *impv1.ImpQuota) placement.Quota {
	h := q.Spec.Hard
	i32 := func(p *int32) *int64 {
		if p == nil {
			return nil
		}
		v := int64(*p)
		return &v
	}
	qty := func(p *resource.Quantity) *int64 {
		if p == nil {
			return nil
		}
		v := p.Value()
		return &v
	}
	return placement.Quota{Name: q.Name, VMs: i32(h.VMs), VCPUs: i32(h.VCPUs), Memory: qty(h.Memory), Disk: qty(h.Disk), SuspendedMemory: qty(h.SuspendedMemory)}
}
