// Package volumeholder keeps, for each placed ImpVM with PersistentVolumeClaims, a holder pod on
// the VM's node in the VM's namespace whose volumes are the VM's claims: the kubelet attaches,
// mounts (Filesystem) or maps (Block) them for the pod, as for any pod, so that every volume
// type and CSI driver the cluster has serves VMs; the VM's agent hands them to the VMM from the
// pod's container (docs/volumes.md). The pod goes through the scheduler, pinned to the VM's
// node, so that WaitForFirstConsumer claims are provisioned there. It passes restricted Pod
// Security: it runs nothing but a process that waits. Its state is the VM's
// status.volumeHolder, which the VM's run waits for.
package volumeholder

import (
	"context"
	"fmt"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups="",resources=persistentvolumeclaims,verbs=get;list;watch
// +kubebuilder:rbac:groups=policy,resources=poddisruptionbudgets,verbs=get;list;watch;create;update;delete
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impvms/status,verbs=get;patch

// Labels of a holder pod.
const (
	// HolderLabel marks IMP's holder pods (the operator caches no other pod).
	HolderLabel = "imp.dev/volume-holder"
	// VMLabel is the name of the VM whose claims the pod holds.
	VMLabel = "imp.dev/vm"
	// ManagedByLabel is ManagedBy on the holder pods and their disruption budgets (the
	// operator caches no other budget).
	ManagedByLabel = "app.kubernetes.io/managed-by"
	ManagedBy      = "imp"
)

// HoldArg is the holder container's argument to its image's entrypoint (imp-operator hold):
// wait for SIGTERM, do nothing else.
const HoldArg = "hold"

// Reconciler keeps the holder pods of ImpVMs.
type Reconciler struct {
	Client    client.Client
	APIReader client.Reader
	// Image is the holder's image (the operator's: its entrypoint runs "hold").
	Image string
}

// PodName is the holder pod of VM uid's placement instance.
func PodName(uid types.UID, instance int64) string {
	return "imp-vol-" + string(uid) + "-" + strconv.FormatInt(instance, 10)
}

// Reconcile makes the VM's holder pod when the VM is placed and has claims, removes holders of
// other placements (and all once the VM has no placement, ended, or is going with its VMM
// gone), and reports the holder in status.volumeHolder.
func (r *Reconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	vm := &impv1.ImpVM{}
	if err := r.Client.Get(ctx, req.NamespacedName, vm); err != nil {
		return reconcile.Result{}, client.IgnoreNotFound(err)
	}
	want := ""
	if wanted(vm) {
		want = PodName(vm.UID, vm.Status.Instance)
	}
	// Holders of other placements (or of none): gone, the VMM they served having stopped.
	var pods corev1.PodList
	if err := r.Client.List(ctx, &pods, client.InNamespace(vm.Namespace), client.MatchingLabels{HolderLabel: "true", VMLabel: vm.Name}); err != nil {
		return reconcile.Result{}, fmt.Errorf("listing holder pods: %w", err)
	}
	var cur *corev1.Pod
	for i := range pods.Items {
		p := &pods.Items[i]
		if !metav1.IsControlledBy(p, vm) {
			continue
		}
		if p.Name == want {
			cur = p
			continue
		}
		if p.DeletionTimestamp.IsZero() {
			if err := r.Client.Delete(ctx, p); client.IgnoreNotFound(err) != nil {
				return reconcile.Result{}, fmt.Errorf("removing holder pod %s: %w", p.Name, err)
			}
			log.FromContext(ctx).Info("removed a holder pod", "pod", p.Name)
		}
	}
	if want == "" {
		if vm.Status.VolumeHolder != nil {
			if err := r.unguard(ctx, vm); err != nil {
				return reconcile.Result{}, err
			}
		}
		return reconcile.Result{}, r.report(ctx, vm, nil)
	}
	status := &impv1.VolumeHolderStatus{PodName: want, NodeName: vm.Status.NodeName}
	if r.Image == "" {
		status.Message = "the operator has no --volume-holder-image: no pod can hold the VM's claims"
		return reconcile.Result{}, r.report(ctx, vm, status)
	}
	pod, claims, why, err := r.pod(ctx, vm, want)
	if err != nil {
		return reconcile.Result{}, err
	}
	status.Claims = claims
	if why != "" {
		status.Message = why
		return reconcile.Result{RequeueAfter: claimWait}, r.report(ctx, vm, status)
	}
	if cur != nil && !sameHolder(cur, pod) {
		// A pod of the holder's name that is not the holder IMP makes (one a tenant made first,
		// with other volumes, containers or image): never trusted, removed.
		if cur.DeletionTimestamp.IsZero() {
			if err := r.Client.Delete(ctx, cur); client.IgnoreNotFound(err) != nil {
				return reconcile.Result{}, fmt.Errorf("removing pod %s, which is not the holder IMP makes: %w", cur.Name, err)
			}
			log.FromContext(ctx).Info("removed a pod of the holder's name that IMP did not make", "pod", cur.Name)
		}
		status.Message = "a pod of the holder's name that IMP did not make is being removed"
		return reconcile.Result{RequeueAfter: time.Second}, r.report(ctx, vm, status)
	}
	if cur == nil {
		if err := r.Client.Create(ctx, pod); err != nil && !apierrors.IsAlreadyExists(err) {
			status.Message = "the pod was refused: " + err.Error()
			return reconcile.Result{RequeueAfter: claimWait}, r.report(ctx, vm, status)
		}
		status.Message = "made; waiting for its node to run it"
		return reconcile.Result{}, r.report(ctx, vm, status)
	}
	if err := r.guard(ctx, vm); err != nil {
		return reconcile.Result{}, err
	}
	status.PodUID = string(cur.UID)
	status.ContainerID, status.Ready, status.Message = podReady(cur)
	return reconcile.Result{}, r.report(ctx, vm, status)
}

// BudgetName is the PodDisruptionBudget that guards the holder pods of VM uid.
func BudgetName(uid types.UID) string { return "imp-vol-" + string(uid) }

// guard makes the VM's PodDisruptionBudget, which no eviction of its holder pod may pass (a
// node drain, say): the kubelet would detach the claims under the running VMM. The VM owns it.
// Deleting the pod is not an eviction; the VM's placement ending removes it. A budget of its
// name that is not the VM's is removed and made again; the VM's, changed, is put back.
func (r *Reconciler) guard(ctx context.Context, vm *impv1.ImpVM) error {
	want := budget(vm)
	if err := controllerutil.SetControllerReference(vm, want, r.Client.Scheme()); err != nil {
		return err
	}
	cur := &policyv1.PodDisruptionBudget{}
	switch err := r.Client.Get(ctx, client.ObjectKeyFromObject(want), cur); {
	case apierrors.IsNotFound(err):
		if err := r.Client.Create(ctx, want); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("guarding the holder pod of %s against eviction: %w", vm.Name, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("reading the disruption budget of %s's holder: %w", vm.Name, err)
	case !metav1.IsControlledBy(cur, vm):
		if err := r.Client.Delete(ctx, cur); client.IgnoreNotFound(err) != nil {
			return fmt.Errorf("removing disruption budget %s, which is not %s's: %w", cur.Name, vm.Name, err)
		}
		log.FromContext(ctx).Info("removed a disruption budget of the holder's name that IMP did not make", "budget", cur.Name)
		return nil // made again at the deletion's event
	case equality.Semantic.DeepEqual(cur.Spec, want.Spec) && labels.SelectorFromSet(want.Labels).Matches(labels.Set(cur.Labels)):
		return nil
	}
	cur.Spec = want.Spec
	for k, v := range want.Labels {
		metav1.SetMetaDataLabel(&cur.ObjectMeta, k, v)
	}
	if err := r.Client.Update(ctx, cur); err != nil {
		return fmt.Errorf("putting back the disruption budget of %s's holder: %w", vm.Name, err)
	}
	log.FromContext(ctx).Info("put back a changed disruption budget", "budget", cur.Name)
	return nil
}

// budget is the PodDisruptionBudget guarding vm's holder pods: none may be evicted.
func budget(vm *impv1.ImpVM) *policyv1.PodDisruptionBudget {
	return &policyv1.PodDisruptionBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: vm.Namespace, Name: BudgetName(vm.UID), Labels: map[string]string{
			VMLabel: vm.Name, ManagedByLabel: ManagedBy,
		}},
		Spec: policyv1.PodDisruptionBudgetSpec{
			MaxUnavailable: ptr.To(intstr.FromInt32(0)),
			Selector:       &metav1.LabelSelector{MatchLabels: map[string]string{HolderLabel: "true", VMLabel: vm.Name}},
		},
	}
}

// unguard removes the VM's PodDisruptionBudget once it has no holder.
func (r *Reconciler) unguard(ctx context.Context, vm *impv1.ImpVM) error {
	pdb := &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Namespace: vm.Namespace, Name: BudgetName(vm.UID)}}
	if err := r.Client.Delete(ctx, pdb); client.IgnoreNotFound(err) != nil {
		return fmt.Errorf("removing the disruption budget of %s's holder: %w", vm.Name, err)
	}
	return nil
}

// claimWait is how often a holder waiting for a claim looks again: claims are not watched.
const claimWait = 5 * time.Second

// wanted reports whether vm's placement needs a holder: it has claims, is placed, and has not
// ended; a VM going keeps it until its node says the VMM is gone.
func wanted(vm *impv1.ImpVM) bool {
	if len(vm.Spec.Claims()) == 0 || vm.Status.NodeName == "" {
		return false
	}
	if vm.Status.Phase == impv1.VMSucceeded || vm.Status.Phase == impv1.VMFailed {
		return false
	}
	if !vm.DeletionTimestamp.IsZero() {
		rt := vm.Status.Runtime
		return rt != nil && rt.State != impv1.RuntimeGone
	}
	return true
}

// pod is the holder pod of vm named name, with the claims as it holds them; why says what it
// waits for instead (a claim missing).
func (r *Reconciler) pod(ctx context.Context, vm *impv1.ImpVM, name string) (*corev1.Pod, []impv1.HeldClaim, string, error) {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: vm.Namespace, Name: name, Labels: map[string]string{
			HolderLabel: "true", VMLabel: vm.Name, ManagedByLabel: ManagedBy,
		}},
		Spec: corev1.PodSpec{
			// Pinned to the VM's node, through the scheduler: it binds WaitForFirstConsumer
			// claims there.
			Affinity: &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
				NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchFields: []corev1.NodeSelectorRequirement{{
					Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{vm.Status.NodeName}}}}}}}},
			// The VM's node took the VM: its taints are the VM's to tolerate, the holder goes
			// where the VM is.
			Tolerations:                   []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
			AutomountServiceAccountToken:  ptr.To(false),
			EnableServiceLinks:            ptr.To(false),
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			SecurityContext: &corev1.PodSecurityContext{
				RunAsNonRoot: ptr.To(true), RunAsUser: ptr.To[int64](65534), RunAsGroup: ptr.To[int64](65534),
				SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
			},
		},
	}
	c := corev1.Container{
		Name: "hold", Image: r.Image, Args: []string{HoldArg},
		SecurityContext: &corev1.SecurityContext{
			AllowPrivilegeEscalation: ptr.To(false), ReadOnlyRootFilesystem: ptr.To(true), Privileged: ptr.To(false),
			Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
		},
		Resources: corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("1m"), corev1.ResourceMemory: resource.MustParse("8Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("32Mi")},
		},
	}
	var claims []impv1.HeldClaim
	for _, v := range vm.Spec.Volumes {
		src := v.PersistentVolumeClaim
		if src == nil {
			continue
		}
		pvc := &corev1.PersistentVolumeClaim{}
		if err := r.APIReader.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: src.ClaimName}, pvc); err != nil {
			if apierrors.IsNotFound(err) {
				return nil, claims, fmt.Sprintf("PersistentVolumeClaim %q does not exist in namespace %s", src.ClaimName, vm.Namespace), nil
			}
			return nil, nil, "", fmt.Errorf("getting PersistentVolumeClaim %s: %w", src.ClaimName, err)
		}
		block := pvc.Spec.VolumeMode != nil && *pvc.Spec.VolumeMode == corev1.PersistentVolumeBlock
		size := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
		readOnly := src.ReadOnly || (len(pvc.Spec.AccessModes) == 1 && pvc.Spec.AccessModes[0] == corev1.ReadOnlyMany)
		claims = append(claims, impv1.HeldClaim{Volume: v.Name, Block: block, SizeBytes: size.Value(), ReadOnly: readOnly})
		podVol := "v-" + v.Name
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: podVol, VolumeSource: corev1.VolumeSource{
			PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: src.ClaimName, ReadOnly: readOnly}}})
		if block {
			c.VolumeDevices = append(c.VolumeDevices, corev1.VolumeDevice{Name: podVol, DevicePath: impv1.HolderDeviceDir + "/" + v.Name})
		} else {
			c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: podVol, MountPath: impv1.HolderMountDir + "/" + v.Name, ReadOnly: readOnly})
		}
	}
	pod.Spec.Containers = []corev1.Container{c}
	if err := controllerutil.SetControllerReference(vm, pod, r.Client.Scheme()); err != nil {
		return nil, nil, "", err
	}
	return pod, claims, "", nil
}

// sameHolder reports whether cur is the holder want describes: its volumes, containers,
// image, mounts, devices and security context, nothing more (no init or ephemeral container,
// no host namespace).
func sameHolder(cur, want *corev1.Pod) bool {
	c, w := cur.Spec, want.Spec
	if len(c.Containers) != 1 || len(c.InitContainers) != 0 || len(c.EphemeralContainers) != 0 || c.HostPID || c.HostIPC || c.HostNetwork || c.HostUsers != nil {
		return false
	}
	cc, wc := c.Containers[0], w.Containers[0]
	return equality.Semantic.DeepEqual(c.Volumes, w.Volumes) && cc.Image == wc.Image && equality.Semantic.DeepEqual(cc.Args, wc.Args) &&
		len(cc.Command) == 0 && equality.Semantic.DeepEqual(cc.VolumeMounts, wc.VolumeMounts) && equality.Semantic.DeepEqual(cc.VolumeDevices, wc.VolumeDevices) &&
		equality.Semantic.DeepEqual(cc.SecurityContext, wc.SecurityContext) && equality.Semantic.DeepEqual(c.SecurityContext, w.SecurityContext)
}

// podReady says whether the holder runs with its volumes attached (and its container's ID), or
// what it waits for.
func podReady(p *corev1.Pod) (string, bool, string) {
	if !p.DeletionTimestamp.IsZero() {
		return "", false, "being deleted"
	}
	if p.Status.Phase == corev1.PodRunning {
		for _, cs := range p.Status.ContainerStatuses {
			if cs.Name == "hold" && cs.State.Running != nil && cs.ContainerID != "" {
				return cs.ContainerID, true, "running on node " + p.Spec.NodeName
			}
		}
	}
	msg := "phase " + string(p.Status.Phase)
	if p.Status.Phase == "" {
		msg = "phase Pending"
	}
	for _, c := range p.Status.Conditions {
		if c.Status != corev1.ConditionTrue && c.Message != "" {
			msg += fmt.Sprintf("; %s: %s", c.Type, c.Message)
		}
	}
	for _, cs := range p.Status.ContainerStatuses {
		if w := cs.State.Waiting; w != nil {
			msg += fmt.Sprintf("; container %s: %s", w.Reason, w.Message)
		}
	}
	return "", false, msg
}

// report writes status.volumeHolder, when it changed.
func (r *Reconciler) report(ctx context.Context, vm *impv1.ImpVM, st *impv1.VolumeHolderStatus) error {
	if equality.Semantic.DeepEqual(vm.Status.VolumeHolder, st) {
		return nil
	}
	orig := vm.DeepCopy()
	vm.Status.VolumeHolder = st
	if err := r.Client.Status().Patch(ctx, vm, client.MergeFrom(orig)); client.IgnoreNotFound(err) != nil {
		return fmt.Errorf("reporting the volume holder of %s: %w", vm.Name, err)
	}
	return nil
}

// SetupWithManager watches ImpVMs and the holder pods and disruption budgets they own. The
// manager's cache must hold holder pods alone (CacheOptions: label HolderLabel), and IMP's
// budgets alone (label app.kubernetes.io/managed-by=imp).
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	hasClaims := predicate.NewPredicateFuncs(func(o client.Object) bool {
		vm, ok := o.(*impv1.ImpVM)
		return ok && (len(vm.Spec.Claims()) > 0 || vm.Status.VolumeHolder != nil)
	})
	return ctrl.NewControllerManagedBy(mgr).Named("imp-volume-holders").
		For(&impv1.ImpVM{}, builder.WithPredicates(hasClaims)).
		Owns(&corev1.Pod{}).
		Owns(&policyv1.PodDisruptionBudget{}).
		Complete(r)
}
