// Package impvmtemplate is the operator's ImpVMTemplate controller: it keeps a snapshot of the
// template's current revision on each node that needs one (a node where a copy waits for it,
// or that the template's nodeSelector names) — or one pushed snapshot for every node when the
// template has a registry. A snapshot is made by booting the template's VM (a builder: an
// ImpVM owned by the template, pinned to the node), snapshotting it once it is Ready (its
// readiness probe is the template's snapshotWhen command) and deleting it. Snapshots of an
// earlier revision go once no copy waits to restore them.
package impvmtemplate

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	ctrlbuilder "sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impvmtemplates,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impvmtemplates/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impvmtemplates/finalizers,verbs=update
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups=imp.dev,resources=impvmsnapshots,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch

// RetryAfter is how long a failed build (its VM or its snapshot Failed) is kept, for its
// reason to be read, before it is made again.
const RetryAfter = time.Minute

// Reconciler is the operator's ImpVMTemplate controller.
type Reconciler struct {
	Client client.Client
	// Clock times the retries of failed builds (the real clock when nil).
	Clock clock.PassiveClock
}

func (r *Reconciler) clock() clock.PassiveClock {
	if r.Clock == nil {
		return clock.RealClock{}
	}
	return r.Clock
}

// Revision is a hash of what a template's snapshot is made of: its VM and snapshot point.
func Revision(t *impv1.ImpVMTemplate) string {
	data, _ := json.Marshal(struct {
		VM   impv1.ImpVMSpec     `json:"vm"`
		When *impv1.SnapshotWhen `json:"when,omitempty"`
	}{t.Spec.VM, t.Spec.SnapshotWhen})
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])[:10]
}

// BuildName is the name of the builder VM, and of its snapshot, of revision rev on node.
func BuildName(t *impv1.ImpVMTemplate, rev, node string) string {
	sum := sha256.Sum256([]byte(rev + "/" + node))
	name := t.Name
	if len(name) > 40 {
		name = name[:40]
	}
	return fmt.Sprintf("%s-%s", name, hex.EncodeToString(sum[:])[:8])
}

// build is what the template has of one build: its VM and its snapshot, either may be nil.
type build struct {
	node, rev string
	vm        *impv1.ImpVM
	snap      *impv1.ImpVMSnapshot
	name      string
	refused   string // why its VM could not be created
}

// Reconcile keeps one template's snapshots.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	t := &impv1.ImpVMTemplate{}
	if err := r.Client.Get(ctx, req.NamespacedName, t); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !t.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil // its builders and snapshots are its dependents: collected
	}
	orig := t.DeepCopy()
	rev := Revision(t)
	builds, err := r.builds(ctx, t)
	if err != nil {
		return ctrl.Result{}, err
	}
	copies, err := r.copies(ctx, t)
	if err != nil {
		return ctrl.Result{}, err
	}
	needed, err := r.neededNodes(ctx, t, rev, builds, copies)
	if err != nil {
		return ctrl.Result{}, err
	}
	var requeue time.Duration
	targets := slices.Clone(needed)
	for _, b := range builds {
		// A build under way goes on though no node needs it any more: it will serve the next
		// copy (and a builder left as it is would run on for nothing).
		if failed, _ := b.failed(); b.rev == rev && !failed && !slices.Contains(targets, b.node) {
			targets = append(targets, b.node)
		}
	}
	for _, node := range targets {
		key := BuildName(t, rev, node)
		b := builds[key]
		if b == nil {
			b = &build{node: node, rev: rev, name: key}
			builds[key] = b
		}
		again, err := r.advance(ctx, t, b)
		if err != nil {
			return ctrl.Result{}, err
		}
		if again > 0 && (requeue == 0 || again < requeue) {
			requeue = again
		}
	}
	for key, b := range builds {
		if failed, _ := b.failed(); failed && b.rev == rev && !slices.Contains(needed, b.node) {
			// A failed build no node needs any more: not made again.
			if err := r.remove(ctx, b.objects()...); err != nil {
				return ctrl.Result{}, err
			}
			delete(builds, key)
			continue
		}
		if gone, err := r.collect(ctx, t, rev, b, copies); err != nil {
			return ctrl.Result{}, err
		} else if gone {
			delete(builds, key)
		}
	}
	t.Status.ObservedGeneration, t.Status.Revision = t.Generation, rev
	t.Status.Snapshots = statusOf(builds)
	ready := metav1.Condition{Type: impv1.TemplateReadyCondition, Status: metav1.ConditionFalse, Reason: impv1.ReasonTemplateNotReady,
		Message: "no snapshot of revision " + rev + " is Ready yet", ObservedGeneration: t.Generation}
	if len(needed) == 0 && !slices.ContainsFunc(t.Status.Snapshots, func(s impv1.TemplateSnapshot) bool { return s.Revision == rev }) {
		ready.Message = "no node needs a snapshot yet: one is made where the first copy is placed, or on the nodes nodeSelector names"
	}
	for _, s := range t.Status.Snapshots {
		if s.Revision == rev && s.Phase == impv1.TemplateReady {
			ready.Status, ready.Reason, ready.Message = metav1.ConditionTrue, "SnapshotReady", "copies start from ImpVMSnapshot "+s.Name
			break
		}
	}
	meta.SetStatusCondition(&t.Status.Conditions, ready)
	if !equality.Semantic.DeepEqual(orig.Status, t.Status) {
		// This controller alone writes a template's status, one reconcile of it at a time, and
		// computes all of it afresh: no lock, which a cache that lags its own last write
		// would make fail (and back off) for nothing.
		if err := r.Client.Status().Patch(ctx, t, client.MergeFrom(orig)); err != nil {
			return ctrl.Result{}, fmt.Errorf("writing the status of ImpVMTemplate %s: %w", t.Name, err)
		}
	}
	return ctrl.Result{RequeueAfter: requeue}, nil
}

// builds are the template's builder VMs and snapshots, by name.
func (r *Reconciler) builds(ctx context.Context, t *impv1.ImpVMTemplate) (map[string]*build, error) {
	sel := client.MatchingLabels{impv1.TemplateLabel: t.Name}
	var vms impv1.ImpVMList
	if err := r.Client.List(ctx, &vms, client.InNamespace(t.Namespace), sel); err != nil {
		return nil, fmt.Errorf("listing the builders of ImpVMTemplate %s: %w", t.Name, err)
	}
	var snaps impv1.ImpVMSnapshotList
	if err := r.Client.List(ctx, &snaps, client.InNamespace(t.Namespace), sel); err != nil {
		return nil, fmt.Errorf("listing the snapshots of ImpVMTemplate %s: %w", t.Name, err)
	}
	out := map[string]*build{}
	get := func(o metav1.Object) *build {
		if !metav1.IsControlledBy(o, t) {
			return nil // labelled by someone else: not the template's
		}
		b := out[o.GetName()]
		if b == nil {
			b = &build{node: o.GetAnnotations()[nodeAnnotation], rev: o.GetLabels()[impv1.TemplateRevisionLabel], name: o.GetName()}
			out[o.GetName()] = b
		}
		return b
	}
	for i := range vms.Items {
		if b := get(&vms.Items[i]); b != nil {
			b.vm = &vms.Items[i]
		}
	}
	for i := range snaps.Items {
		// A build's snapshot is of its own builder: one of another VM, labelled and owned
		// by hand, is not the template's.
		if s := &snaps.Items[i]; s.Spec.VMName == s.Name {
			if b := get(s); b != nil {
				b.snap = s
			}
		}
	}
	return out, nil
}

// nodeAnnotation records on a builder and its snapshot the node the build is for.
const nodeAnnotation = "imp.dev/template-node"

// anyNode is the node of a build that may go to any (a pushed template's).
const anyNode = ""

// copies are the VMs of the template's namespace that are copies of it.
func (r *Reconciler) copies(ctx context.Context, t *impv1.ImpVMTemplate) ([]impv1.ImpVM, error) {
	var vms impv1.ImpVMList
	if err := r.Client.List(ctx, &vms, client.InNamespace(t.Namespace)); err != nil {
		return nil, fmt.Errorf("listing the copies of ImpVMTemplate %s: %w", t.Name, err)
	}
	out := vms.Items[:0]
	for _, vm := range vms.Items {
		if vm.TemplateName() == t.Name {
			out = append(out, vm)
		}
	}
	return out, nil
}

// neededNodes are the nodes that need a build of revision rev: those where a copy waits for a
// snapshot, and those nodeSelector names, that have none of rev that is not Failed. With a
// registry one build serves every node: the first needed node gets it, if there is none yet.
func (r *Reconciler) neededNodes(ctx context.Context, t *impv1.ImpVMTemplate, rev string, builds map[string]*build, copies []impv1.ImpVM) ([]string, error) {
	want := map[string]bool{}
	for _, vm := range copies {
		if ts := vm.Status.Template; vm.Status.NodeName != "" && ts != nil && ts.Snapshot == "" && vm.DeletionTimestamp.IsZero() &&
			vm.Status.Phase != impv1.VMSucceeded && vm.Status.Phase != impv1.VMFailed {
			want[vm.Status.NodeName] = true
		}
	}
	if t.Spec.NodeSelector != nil {
		var nodes corev1.NodeList
		sel := labels.Merge(labels.Set(t.Spec.NodeSelector), labels.Set{impv1.NodeEnabledLabel: impv1.NodeEnabledValue})
		if err := r.Client.List(ctx, &nodes, client.MatchingLabelsSelector{Selector: labels.SelectorFromSet(sel)}); err != nil {
			return nil, fmt.Errorf("listing the nodes of ImpVMTemplate %s: %w", t.Name, err)
		}
		for _, n := range nodes.Items {
			if n.DeletionTimestamp.IsZero() {
				want[n.Name] = true
			}
		}
	}
	nodes := make([]string, 0, len(want))
	for n := range want {
		nodes = append(nodes, n)
	}
	sort.Strings(nodes)
	if t.Spec.Registry != nil && len(nodes) > 0 {
		// One build of this revision, on whichever node has room, serves every node once
		// pushed; another is made only in place of a failed one.
		for _, b := range builds {
			if b.rev == rev {
				return []string{b.node}, nil
			}
		}
		return []string{anyNode}, nil
	}
	return nodes, nil
}

// advance moves one build of the current revision on: its VM made, snapshotted once Ready,
// then deleted; a failed build kept for RetryAfter, then made again.
func (r *Reconciler) advance(ctx context.Context, t *impv1.ImpVMTemplate, b *build) (time.Duration, error) {
	if failed, since := b.failed(); failed {
		if left := RetryAfter - r.clock().Since(since); left > 0 {
			return left, nil
		}
		ctrl.LoggerFrom(ctx).Info("making a failed template build again", "build", b.name, "node", b.node)
		if err := r.remove(ctx, b.objects()...); err != nil {
			return 0, err
		}
		return time.Second, nil // once they are gone
	}
	switch {
	case b.snap != nil && b.snap.Status.Phase == impv1.SnapshotReady:
		// Made: its VM is not needed any more.
		if b.vm != nil {
			if err := r.remove(ctx, b.vm); err != nil {
				return 0, err
			}
		}
		b.vm = nil
	case b.snap != nil && b.vm == nil:
		// Being taken of a builder that is gone (deleted after a failure while a cache still
		// showed it Ready): it never will be; the build begins again.
		if err := r.remove(ctx, b.snap); err != nil {
			return 0, err
		}
		return time.Second, nil
	case b.snap != nil:
		// Being taken.
	case b.vm == nil:
		vm := builder(t, b.rev, b.node)
		if err := controllerutil.SetControllerReference(t, vm, r.Client.Scheme()); err != nil {
			return 0, err
		}
		switch err := r.Client.Create(ctx, vm); {
		case apierrors.IsForbidden(err) || apierrors.IsInvalid(err):
			// Refused (a quota's admission policy, a class the namespace may not use): said
			// in the status, and tried again later.
			b.refused = fmt.Sprintf("its VM %s was refused: %v", vm.Name, err)
			return time.Minute, nil
		case err != nil && !apierrors.IsAlreadyExists(err):
			return 0, fmt.Errorf("creating the builder VM of ImpVMTemplate %s on node %s: %w", t.Name, b.node, err)
		}
		b.vm = vm
	case !b.vm.DeletionTimestamp.IsZero():
		// A builder being deleted (after a failure): a new one once it is gone.
	case meta.IsStatusConditionTrue(b.vm.Status.Conditions, impv1.ReadyCondition) && (b.node == anyNode || b.vm.Status.NodeName == b.node):
		snap := &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: t.Namespace, Name: b.vm.Name,
			Labels:      map[string]string{impv1.TemplateLabel: t.Name, impv1.TemplateRevisionLabel: b.rev},
			Annotations: map[string]string{nodeAnnotation: b.node}},
			Spec: impv1.ImpVMSnapshotSpec{VMName: b.vm.Name, Registry: t.Spec.Registry.DeepCopy()}}
		if err := controllerutil.SetControllerReference(t, snap, r.Client.Scheme()); err != nil {
			return 0, err
		}
		if err := r.Client.Create(ctx, snap); err != nil && !apierrors.IsAlreadyExists(err) {
			return 0, fmt.Errorf("snapshotting the builder VM of ImpVMTemplate %s: %w", t.Name, err)
		}
		b.snap = snap
	}
	return 0, nil
}

// failed says whether the build failed (its snapshot failed, or its VM did), and since when.
func (b *build) failed() (bool, time.Time) {
	if b.snap != nil && b.snap.Status.Phase == impv1.SnapshotFailed {
		if c := meta.FindStatusCondition(b.snap.Status.Conditions, impv1.SnapshotReadyCondition); c != nil {
			return true, c.LastTransitionTime.Time
		}
		return true, b.snap.CreationTimestamp.Time
	}
	if b.vm != nil && b.vm.Status.Phase == impv1.VMFailed {
		if c := meta.FindStatusCondition(b.vm.Status.Conditions, impv1.ReadyCondition); c != nil {
			return true, c.LastTransitionTime.Time
		}
		return true, b.vm.CreationTimestamp.Time
	}
	return false, time.Time{}
}

// builder is the VM of a build: the template's VM on node, Ready when the snapshot point is
// reached.
func builder(t *impv1.ImpVMTemplate, rev, node string) *impv1.ImpVM {
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: t.Namespace, Name: BuildName(t, rev, node),
		Labels:      map[string]string{impv1.TemplateLabel: t.Name, impv1.TemplateRevisionLabel: rev},
		Annotations: map[string]string{nodeAnnotation: node}},
		Spec: *t.Spec.VM.DeepCopy()}
	vm.Spec.NodeName = node // anyNode: placed as any VM
	vm.Spec.RunStrategy = impv1.RunStrategyAlways
	if w := t.Spec.SnapshotWhen; w != nil && w.BeforeWorkload {
		// Snapshotted once the guest is ready and holds the workload; the probes are the
		// workload's, and each copy runs its own.
		vm.Annotations[impv1.HoldWorkloadAnnotation] = "true"
		vm.Spec.StartupProbe, vm.Spec.ReadinessProbe, vm.Spec.LivenessProbe = nil, nil, nil
	}
	if w := t.Spec.SnapshotWhen; w != nil && len(w.Command) > 0 {
		vm.Spec.ReadinessProbe = &impv1.Probe{ProbeHandler: corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: slices.Clone(w.Command)}},
			PeriodSeconds: 1, TimeoutSeconds: 10, SuccessThreshold: 1, FailureThreshold: 3}
	}
	return vm
}

// collect removes what is left of a build that is not wanted: a builder of an earlier
// revision, and a snapshot of one once no copy waits to restore it. It reports whether the
// build is gone.
func (r *Reconciler) collect(ctx context.Context, t *impv1.ImpVMTemplate, rev string, b *build, copies []impv1.ImpVM) (bool, error) {
	if b.rev == rev {
		return false, nil
	}
	if b.vm != nil {
		if err := r.remove(ctx, b.vm); err != nil {
			return false, err
		}
	}
	b.vm = nil
	if b.snap == nil {
		return true, nil
	}
	for i := range copies {
		if waitsFor(&copies[i], b.snap.Name) {
			return false, nil
		}
	}
	return true, r.remove(ctx, b.snap)
}

// waitsFor says whether the copy vm still needs the snapshot name: it was given it and has not
// restored it yet in its current placement.
func waitsFor(vm *impv1.ImpVM, name string) bool {
	st := vm.Status
	if st.Template == nil || st.Template.Snapshot != name || !vm.DeletionTimestamp.IsZero() ||
		st.Phase == impv1.VMSucceeded || st.Phase == impv1.VMFailed {
		return false
	}
	rt := st.Runtime
	restored := rt != nil && rt.Instance == st.Instance && (rt.Run > 0 || (rt.RestoredFrom == name && rt.State == impv1.RuntimeRunning))
	return !restored
}

// objects are the build's VM and snapshot, those it has.
func (b *build) objects() []client.Object {
	var out []client.Object
	if b.snap != nil {
		out = append(out, b.snap)
	}
	if b.vm != nil {
		out = append(out, b.vm)
	}
	return out
}

// remove deletes objs, but those being deleted already.
func (r *Reconciler) remove(ctx context.Context, objs ...client.Object) error {
	for _, o := range objs {
		if !o.GetDeletionTimestamp().IsZero() {
			continue
		}
		if err := r.Client.Delete(ctx, o, client.Preconditions{UID: ptrUID(o)}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("deleting %s: %w", o.GetName(), err)
		}
	}
	return nil
}

func ptrUID(o client.Object) *types.UID {
	if o.GetUID() == "" {
		return nil
	}
	uid := o.GetUID()
	return &uid
}

// statusOf reports the builds, newest revision first, then by node.
func statusOf(builds map[string]*build) []impv1.TemplateSnapshot {
	out := make([]impv1.TemplateSnapshot, 0, len(builds))
	for _, b := range builds {
		s := impv1.TemplateSnapshot{NodeName: b.node, Name: b.name, Revision: b.rev, Phase: impv1.TemplateBuilding}
		switch {
		case s.NodeName != anyNode:
		case b.snap != nil:
			s.NodeName = b.snap.Status.NodeName
		case b.vm != nil:
			s.NodeName = b.vm.Status.NodeName
		}
		switch {
		case b.snap != nil && b.snap.Status.Phase == impv1.SnapshotReady:
			s.Phase = impv1.TemplateReady
			s.Pushed = b.snap.Spec.Registry != nil && b.snap.Status.Digest != ""
			if b.snap.Spec.Registry != nil && !s.Pushed {
				s.Message = "pushing to " + b.snap.Spec.Registry.Repository
				if b.snap.Status.Reason != "" {
					s.Message += ": " + b.snap.Status.Reason + ": " + b.snap.Status.Message
				}
			}
		case b.snap != nil && b.snap.Status.Phase == impv1.SnapshotFailed:
			s.Phase, s.Message = impv1.TemplateFailed, fmt.Sprintf("ImpVMSnapshot %s failed: %s: %s", b.snap.Name, b.snap.Status.Reason, b.snap.Status.Message)
		case b.snap != nil:
			s.Phase, s.Message = impv1.TemplateTaking, b.snap.Status.Message
		case b.vm != nil && b.vm.Status.Phase == impv1.VMFailed:
			s.Phase, s.Message = impv1.TemplateFailed, "its VM failed: "+readyMessage(b.vm)
		case b.vm != nil:
			s.Message = fmt.Sprintf("its VM %s is %s: %s", b.vm.Name, phaseOr(b.vm.Status.Phase), readyMessage(b.vm))
		case b.refused != "":
			s.Message = b.refused
		}
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Revision != out[j].Revision {
			return out[i].Revision < out[j].Revision
		}
		return out[i].NodeName < out[j].NodeName
	})
	return out
}

func readyMessage(vm *impv1.ImpVM) string {
	for _, t := range []string{impv1.ScheduledCondition, impv1.ReadyCondition} {
		if c := meta.FindStatusCondition(vm.Status.Conditions, t); c != nil && c.Status == metav1.ConditionFalse {
			return c.Reason + ": " + c.Message
		}
	}
	return "starting"
}

func phaseOr(p impv1.VMPhase) string {
	if p == "" {
		return "Pending"
	}
	return string(p)
}

// SetupWithManager registers the controller.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&impv1.ImpVMTemplate{}).
		Named("impvmtemplate").
		Owns(&impv1.ImpVM{}).
		Owns(&impv1.ImpVMSnapshot{}).
		// A copy placed, or gone: the nodes that need a snapshot.
		Watches(&impv1.ImpVM{}, handler.EnqueueRequestsFromMapFunc(forCopy)).
		// A node labelled: the templates that make snapshots ahead of time.
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(r.ahead), ctrlbuilder.WithPredicates(predicate.LabelChangedPredicate{})).
		Complete(r)
}

// forCopy: the template of a copy.
func forCopy(_ context.Context, o client.Object) []reconcile.Request {
	vm, ok := o.(*impv1.ImpVM)
	if !ok || vm.TemplateName() == "" {
		return nil
	}
	return []reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: vm.Namespace, Name: vm.TemplateName()}}}
}

// ahead: the templates with a nodeSelector.
func (r *Reconciler) ahead(ctx context.Context, _ client.Object) []reconcile.Request {
	var list impv1.ImpVMTemplateList
	if err := r.Client.List(ctx, &list); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "listing templates")
		return nil
	}
	var out []reconcile.Request
	for i := range list.Items {
		if list.Items[i].Spec.NodeSelector != nil {
			out = append(out, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
		}
	}
	return out
}
