// Package impquota is the operator's ImpQuota reconciler: it reports what the VMs of the
// quota's namespace hold (status.used, and used/hard for kubectl get). Enforcement is not here:
// the ImpVM reconciler's placement ledger holds the quota when it places or suspends a VM.
package impquota

import (
	"context"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impquotas,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impquotas/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impvmsnapshots,verbs=get;list;watch

// Reconciler reconciles ImpQuotas.
type Reconciler struct {
	Client client.Client
}

// Reconcile computes one quota's status.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	q := &impv1.ImpQuota{}
	if err := r.Client.Get(ctx, req.NamespacedName, q); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	var vms impv1.ImpVMList
	if err := r.Client.List(ctx, &vms, client.InNamespace(q.Namespace)); err != nil {
		return ctrl.Result{}, fmt.Errorf("listing the namespace's VMs: %w", err)
	}
	var snaps impv1.ImpVMSnapshotList
	if err := r.Client.List(ctx, &snaps, client.InNamespace(q.Namespace)); err != nil {
		return ctrl.Result{}, fmt.Errorf("listing the namespace's snapshots: %w", err)
	}
	orig := q.DeepCopy()
	q.Status.ObservedGeneration = q.Generation
	q.Status.Hard = q.Spec.Hard
	q.Status.Used = Used(vms.Items)
	n, storage := UsedBySnapshots(snaps.Items, vms.Items)
	q.Status.Used.Snapshots, q.Status.Used.SnapshotStorage = &n, &storage
	q.Status.Summary = summary(q.Status.Used, q.Spec.Hard)
	if equality.Semantic.DeepEqual(orig.Status, q.Status) {
		return ctrl.Result{}, nil
	}
	if err := r.Client.Status().Patch(ctx, q, client.MergeFrom(orig)); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	return ctrl.Result{}, nil
}

// Used is what vms hold against a quota, as the placement ledger counts them: those placed
// and not Succeeded or Failed, and the disks of those that ended until their node removed them.
func Used(vms []impv1.ImpVM) impv1.QuotaResources {
	var n, cpus int32
	var mem, disk, susp resource.Quantity
	mem.Format, disk.Format, susp.Format = resource.BinarySI, resource.BinarySI, resource.BinarySI
	for i := range vms {
		st := &vms[i].Status
		if st.NodeName == "" || st.Resources == nil {
			continue
		}
		if st.Phase == impv1.VMSucceeded || st.Phase == impv1.VMFailed {
			if rt := st.Runtime; rt == nil || !rt.DisksRemoved || rt.Instance != st.Instance {
				disk.Add(st.Resources.NodeDisk())
			}
			continue
		}
		n++
		cpus += st.Resources.VCPUs
		mem.Add(st.Resources.Memory)
		disk.Add(st.Resources.NodeDisk())
		if st.Suspension != nil {
			susp.Add(st.Resources.Memory)
		}
	}
	return impv1.QuotaResources{VMs: &n, VCPUs: &cpus, Memory: &mem, Disk: &disk, SuspendedMemory: &susp}
}

// UsedBySnapshots is what snaps hold against a quota: those that hold files or are being taken
// (given to a node, not Failed), with their size once taken, else their VM's memory and disk
// size (of vms), what they may take at most.
func UsedBySnapshots(snaps []impv1.ImpVMSnapshot, vms []impv1.ImpVM) (int32, resource.Quantity) {
	var n int32
	var storage resource.Quantity
	storage.Format = resource.BinarySI
	for i := range snaps {
		st := &snaps[i].Status
		if st.NodeName == "" || st.Phase == impv1.SnapshotFailed || st.FilesRemoved {
			continue
		}
		n++
		if st.Size != nil {
			storage.Add(*st.Size)
			continue
		}
		storage.Add(SnapshotEstimate(snaps[i].Spec.VMName, vms))
	}
	return n, storage
}

// SnapshotEstimate is the most a snapshot of the VM named vm (of vms) takes: its memory and
// its disk size.
func SnapshotEstimate(vm string, vms []impv1.ImpVM) resource.Quantity {
	var q resource.Quantity
	q.Format = resource.BinarySI
	for i := range vms {
		if vms[i].Name == vm && vms[i].Status.Resources != nil {
			q.Add(vms[i].Status.Resources.Memory)
			q.Add(vms[i].Status.Resources.DiskSize)
		}
	}
	return q
}

func summary(used, hard impv1.QuotaResources) impv1.QuotaSummary {
	i := func(u, h *int32) string {
		if h == nil {
			return fmt.Sprint(*u)
		}
		return fmt.Sprintf("%d/%d", *u, *h)
	}
	q := func(u, h *resource.Quantity) string {
		if h == nil {
			return u.String()
		}
		return u.String() + "/" + h.String()
	}
	s := impv1.QuotaSummary{VMs: i(used.VMs, hard.VMs), VCPUs: i(used.VCPUs, hard.VCPUs), Memory: q(used.Memory, hard.Memory), Disk: q(used.Disk, hard.Disk)}
	if used.Snapshots != nil && used.SnapshotStorage != nil && (*used.Snapshots > 0 || hard.Snapshots != nil || hard.SnapshotStorage != nil) {
		s.Snapshots = i(used.Snapshots, hard.Snapshots) + " (" + q(used.SnapshotStorage, hard.SnapshotStorage) + ")"
	}
	return s
}

// SetupWithManager registers the reconciler: a quota is computed again when it changes or any
// VM of its namespace does.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&impv1.ImpQuota{}).
		Named("impquota").
		Watches(&impv1.ImpVM{}, handler.EnqueueRequestsFromMapFunc(r.forVM)).
		Watches(&impv1.ImpVMSnapshot{}, handler.EnqueueRequestsFromMapFunc(r.forVM)).
		Complete(r)
}

func (r *Reconciler) forVM(ctx context.Context, o client.Object) []reconcile.Request {
	var list impv1.ImpQuotaList
	// Read for their names only: the cache's objects, not copies (this runs on every VM event).
	if err := r.Client.List(ctx, &list, client.InNamespace(o.GetNamespace()), client.UnsafeDisableDeepCopy); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "listing ImpQuotas")
		return nil
	}
	out := make([]reconcile.Request, 0, len(list.Items))
	for i := range list.Items {
		out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
	}
	return out
}

var (
	usedDesc = prometheus.NewDesc("imp_quota_used", "What the VMs and snapshots of an ImpQuota's namespace hold, by resource (vms, vcpus, memory and disk in bytes, suspended_memory, snapshots, snapshot_storage in bytes), from its status.",
		[]string{"namespace", "quota", "resource"}, nil)
	hardDesc = prometheus.NewDesc("imp_quota_hard", "An ImpQuota's hard limit, by resource (as imp_quota_used); absent when unbounded.",
		[]string{"namespace", "quota", "resource"}, nil)
)

type collector struct{ reader client.Reader }

// Collector returns the package's scrape-time collector, reading objects through reader (the
// manager's cache).
func Collector(reader client.Reader) prometheus.Collector { return collector{reader: reader} }

func (c collector) Describe(ch chan<- *prometheus.Desc) { ch <- usedDesc; ch <- hardDesc }

func (c collector) Collect(ch chan<- prometheus.Metric) {
	var list impv1.ImpQuotaList
	if err := c.reader.List(context.Background(), &list); err != nil {
		ch <- prometheus.NewInvalidMetric(usedDesc, err)
		return
	}
	for _, q := range list.Items {
		for _, m := range []struct {
			desc *prometheus.Desc
			r    impv1.QuotaResources
		}{{usedDesc, q.Status.Used}, {hardDesc, q.Spec.Hard}} {
			for name, v := range values(m.r) {
				ch <- prometheus.MustNewConstMetric(m.desc, prometheus.GaugeValue, v, q.Namespace, q.Name, name)
			}
		}
	}
}

func values(r impv1.QuotaResources) map[string]float64 {
	out := map[string]float64{}
	if r.VMs != nil {
		out["vms"] = float64(*r.VMs)
	}
	if r.VCPUs != nil {
		out["vcpus"] = float64(*r.VCPUs)
	}
	if r.Snapshots != nil {
		out["snapshots"] = float64(*r.Snapshots)
	}
	for name, q := range map[string]*resource.Quantity{"memory": r.Memory, "disk": r.Disk, "suspended_memory": r.SuspendedMemory, "snapshot_storage": r.SnapshotStorage} {
		if q != nil {
			out[name] = float64(q.Value())
		}
	}
	return out
}
