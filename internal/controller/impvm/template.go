package impvm

import (
	"context"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/placement"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impvmtemplates,verbs=get;list;watch

// indexTemplate indexes ImpVMs by the ImpVMTemplate they are copies of.
const indexTemplate = "spec.templateRef.name"

// template gets the template a copy (spec.templateRef) names, in the VM's namespace (another
// namespace's cannot be named). It returns false, with the scope's reason set, while there is
// none, or when the VM cannot be a copy of it.
func (r *Reconciler) template(ctx context.Context, s *scope) (*impv1.ImpVMTemplate, bool, error) {
	vm := s.vm
	name := vm.TemplateName()
	if vm.IsClaim() {
		pool, ok, err := r.warmPool(ctx, s)
		if !ok || err != nil {
			return nil, false, err
		}
		name = pool.Spec.TemplateRef.Name
	}
	t := &impv1.ImpVMTemplate{}
	if err := r.Client.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: name}, t); err != nil {
		if apierrors.IsNotFound(err) {
			s.schedReason, s.schedMsg = impv1.ReasonTemplateNotFound, fmt.Sprintf("ImpVMTemplate %q does not exist in namespace %s", name, vm.Namespace)
			return nil, false, nil
		}
		return nil, false, fmt.Errorf("getting ImpVMTemplate %s: %w", name, err)
	}
	if !t.DeletionTimestamp.IsZero() {
		s.schedReason, s.schedMsg = impv1.ReasonTemplateNotFound, fmt.Sprintf("ImpVMTemplate %s is being deleted", t.Name)
		return nil, false, nil
	}
	if (vm.Spec.NetworkRef != nil) != (t.Spec.VM.NetworkRef != nil) {
		has := map[bool]string{true: "has a network interface", false: "has no network interface"}
		s.schedReason, s.schedMsg = impv1.ReasonTemplateIncompatible, fmt.Sprintf("the VM of ImpVMTemplate %s %s; a copy must too (its devices are the template's)", t.Name, has[t.Spec.VM.NetworkRef != nil])
		return nil, false, reconcile.TerminalError(fmt.Errorf("%s", s.schedMsg))
	}
	if vm.SetsWorkload() && !beforeWorkload(t) {
		s.schedReason, s.schedMsg = impv1.ReasonTemplateIncompatible, fmt.Sprintf("ImpVMTemplate %s is snapshotted with its workload running: a copy can set command, args or workingDir only when the template sets snapshotWhen.beforeWorkload", t.Name)
		return nil, false, reconcile.TerminalError(fmt.Errorf("%s", s.schedMsg))
	}
	if t.Status.Revision == "" {
		s.schedReason, s.schedMsg = impv1.ReasonTemplateNotReady, fmt.Sprintf("ImpVMTemplate %s has not been looked at yet", t.Name)
		return nil, false, nil
	}
	return t, true, nil
}

// templateSnapshots are the snapshots of t's current revision a copy can start from: a pushed
// one (for every node: pushed), else those Ready on a node (by node).
func templateSnapshots(t *impv1.ImpVMTemplate) (pushed string, byNode map[string]string) {
	byNode = map[string]string{}
	for _, ts := range t.Status.Snapshots {
		if ts.Revision != t.Status.Revision || ts.Phase != impv1.TemplateReady {
			continue
		}
		if ts.Pushed && pushed == "" {
			pushed = ts.Name
		}
		byNode[ts.NodeName] = ts.Name
	}
	return pushed, byNode
}

// snapshotFor is the snapshot of t a copy on node starts from, or "" while there is none.
func snapshotFor(t *impv1.ImpVMTemplate, node string) string {
	pushed, byNode := templateSnapshots(t)
	if s, ok := byNode[node]; ok {
		return s
	}
	return pushed
}

// beforeWorkload is true for a template snapshotted before its workload starts: its copies
// start it, and may set their own command, args and workingDir.
func beforeWorkload(t *impv1.ImpVMTemplate) bool {
	return t.Spec.SnapshotWhen != nil && t.Spec.SnapshotWhen.BeforeWorkload
}

// templateStatus is what a copy of t placed on node records of it.
func templateStatus(t *impv1.ImpVMTemplate, node string) *impv1.TemplateStatus {
	vm := &t.Spec.VM
	return &impv1.TemplateStatus{Name: t.Name, Revision: t.Status.Revision, Snapshot: snapshotFor(t, node), Image: vm.Image,
		Command: vm.Command, Args: vm.Args, WorkingDir: vm.WorkingDir, BeforeWorkload: beforeWorkload(t)}
}

// preferTemplateNodes: of nodes, those holding a Ready snapshot of t (all of them when its
// snapshot is pushed, or none is Ready anywhere).
func preferTemplateNodes(t *impv1.ImpVMTemplate, nodes []placement.Node) []placement.Node {
	pushed, byNode := templateSnapshots(t)
	if pushed != "" || len(byNode) == 0 {
		return nil
	}
	var out []placement.Node
	for _, n := range nodes {
		if _, ok := byNode[n.Node.Name]; ok {
			out = append(out, n)
		}
	}
	return out
}

// templateNodes: of nodes, those where t's VM may run (its selectors, tolerations and VMM):
// a copy that finds no snapshot of t where it goes has it made there.
func templateNodes(t *impv1.ImpVMTemplate, vmm impv1.VMMKind, nodes []placement.Node) []placement.Node {
	req := placement.Request{Labels: t.Spec.VM.RequiredNodeLabels(), Tolerations: t.Spec.VM.Tolerations, VMM: vmm}
	var out []placement.Node
	for _, n := range nodes {
		if ok, _ := placement.Fits(req, n); ok {
			out = append(out, n)
		}
	}
	return out
}

// reconcileTemplate gives a placed copy whose node had no snapshot of its template the one
// made there since, with the template as it is now (the copy has not run). Until then the copy
// waits: TemplateNotReady.
func (r *Reconciler) reconcileTemplate(ctx context.Context, s *scope) error {
	vm := s.vm
	ts := vm.Status.Template
	if !vm.IsCopy() || vm.Status.NodeName == "" || ts == nil || ts.Snapshot != "" || isTerminal(vm.Status.Phase) {
		return nil
	}
	name := vm.TemplateName()
	t := &impv1.ImpVMTemplate{}
	if err := r.Client.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: name}, t); err != nil {
		if apierrors.IsNotFound(err) {
			s.waitReason, s.waitMsg = impv1.ReasonTemplateNotFound, fmt.Sprintf("ImpVMTemplate %q does not exist in namespace %s", name, vm.Namespace)
			return nil
		}
		return fmt.Errorf("getting ImpVMTemplate %s: %w", name, err)
	}
	if now := templateStatus(t, vm.Status.NodeName); now.Snapshot != "" {
		if vm.SetsWorkload() && !now.BeforeWorkload {
			s.waitReason, s.waitMsg = impv1.ReasonTemplateIncompatible, fmt.Sprintf("ImpVMTemplate %s is now snapshotted with its workload running: the copy's own command, args or workingDir cannot start it; delete and recreate the copy", t.Name)
			return nil
		}
		// The copy was placed with the size its template had then: it restores a snapshot of
		// that size only (a template replaced by a bigger one waits; its disk would not be
		// the one the node and the quota count).
		if why, err := r.sameSize(ctx, vm, now.Snapshot); err != nil || why != "" {
			s.waitReason, s.waitMsg = impv1.ReasonTemplateIncompatible, why+": delete and recreate the copy"
			return err
		}
		vm.Status.Template = now
		return nil
	}
	s.waitReason, s.waitMsg = impv1.ReasonTemplateNotReady, fmt.Sprintf("the snapshot of ImpVMTemplate %s for node %s is being made", t.Name, vm.Status.NodeName)
	for _, sn := range t.Status.Snapshots {
		if sn.NodeName == vm.Status.NodeName && sn.Revision == t.Status.Revision {
			s.waitMsg = fmt.Sprintf("the snapshot of ImpVMTemplate %s for node %s is %s", t.Name, vm.Status.NodeName, sn.Phase)
			if sn.Message != "" {
				s.waitMsg += ": " + sn.Message
			}
		}
	}
	return nil
}

// sameSize says why the copy vm, placed, cannot restore the snapshot name (its VM had another
// size or VMM than the copy was placed with), or "".
func (r *Reconciler) sameSize(ctx context.Context, vm *impv1.ImpVM, name string) (string, error) {
	snap := &impv1.ImpVMSnapshot{}
	if err := r.Client.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: name}, snap); err != nil {
		return "", client.IgnoreNotFound(err)
	}
	src, res := snap.Status.Source, vm.Status.Resources
	if src == nil || res == nil {
		return "", nil // the node checks the files
	}
	if src.VCPUs != res.VCPUs || src.Memory.Cmp(res.Memory) != 0 || src.DiskSize.Cmp(res.DiskSize) != 0 || (res.VMM != "" && res.VMM != src.VMM) {
		return fmt.Sprintf("ImpVMSnapshot %s of its template is of a VM with %d vCPUs, %s memory, %s disk under %s; the copy was placed with %d, %s, %s",
			name, src.VCPUs, &src.Memory, &src.DiskSize, src.VMM, res.VCPUs, &res.Memory, &res.DiskSize), nil
	}
	return "", nil
}

// forTemplate: the copies of the template that wait for it (not placed, or placed without a
// snapshot yet).
func (r *Reconciler) forTemplate(ctx context.Context, o client.Object) []reconcile.Request {
	var list impv1.ImpVMList
	if err := r.Client.List(ctx, &list, client.InNamespace(o.GetNamespace()), client.MatchingFields{indexTemplate: o.GetName()}); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "listing the copies of a template")
		return nil
	}
	var out []reconcile.Request
	for i := range list.Items {
		vm := &list.Items[i]
		if ts := vm.Status.Template; vm.Status.NodeName == "" || ts == nil || ts.Snapshot == "" {
			out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(vm)})
		}
	}
	return append(out, r.claimsOfTemplate(ctx, o)...)
}
