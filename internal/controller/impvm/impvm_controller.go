// Package impvm is the operator's ImpVM reconciler: it resolves a VM's class and network,
// places it on a node with room, allocates its address, and drives its lifecycle from what the
// node's agent reports (restarts with back-off, halting, node loss, expiry, deletion).
package impvm

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/failpoint"
	"github.com/syscode-labs/imp/internal/ipam"
	"github.com/syscode-labs/imp/internal/placement"
	"github.com/syscode-labs/imp/internal/runsecret"
)

// +kubebuilder:rbac:groups="",resources=secrets;configmaps,verbs=get
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch;update;patch;delete
// +kubebuilder:rbac:groups=imp.dev,resources=impvms/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impvms/finalizers,verbs=update
// +kubebuilder:rbac:groups=imp.dev,resources=impvmclasses;impnodes,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impnetworks,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impquotas,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impipaddresses,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// EventRecorder records Events about objects (k8s.io/client-go/tools/events).
type EventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// Options tune the reconciler.
type Options struct {
	// NodeLostGracePeriod is how long a VM's node may be NotReady, with its agent silent too,
	// before the VM is reported NodeUnreachable. It is placed again only once the node is
	// fenced: the Node deleted, or tainted node.kubernetes.io/out-of-service.
	NodeLostGracePeriod time.Duration
	// AgentHeartbeatTimeout is how long a node's agent may go without a new heartbeat before
	// the node takes no more VMs.
	AgentHeartbeatTimeout time.Duration
	// RestartBackoffBase and RestartBackoffMax bound the delay before a restart: base doubles
	// with each restart, up to max; a run that lasted 10 minutes resets it to base.
	RestartBackoffBase, RestartBackoffMax time.Duration
	// DeletionTimeout is how long deletion waits for the node's agent to confirm the VM is gone
	// before each Warning Event saying it still waits; the address and capacity stay held until
	// the agent confirms or the node is deleted or fenced.
	DeletionTimeout time.Duration
	// ReservedCIDRs are ranges no ImpNetwork may overlap: VMs on such a network are not
	// placed.
	ReservedCIDRs []netip.Prefix
	// StartingReportDelay is how long an agent's report that a run is starting, or that its
	// guest is booting, waits before the VM's phase shows it. A report overtaken meanwhile
	// (the guest ready, the run failed) is never written on its own: a VM that boots within
	// the delay goes from Scheduled to Running in one status write. 0 shows each report at
	// once.
	StartingReportDelay time.Duration
	// RunSecretNamespace is IMP's namespace, where each VM's run Secret goes
	// (runsecret.DefaultNamespace when empty).
	RunSecretNamespace string
	// Traces is where the spans of the VMs' starts go (package tracing); nil: nowhere, and no
	// VM is annotated with its trace.
	Traces trace.TracerProvider
}

// DefaultOptions are the operator's defaults.
func DefaultOptions() Options {
	return Options{
		NodeLostGracePeriod:   5 * time.Minute,
		AgentHeartbeatTimeout: 2 * time.Minute,
		RestartBackoffBase:    10 * time.Second,
		RestartBackoffMax:     5 * time.Minute,
		DeletionTimeout:       5 * time.Minute,
		StartingReportDelay:   time.Second,
	}
}

// Reconciler reconciles ImpVMs.
type Reconciler struct {
	Client    client.Client
	APIReader client.Reader // uncached reads, for the ledger's first load
	Status    StatusPatcher // the VMs' status writes
	Scheme    *runtime.Scheme
	Recorder  EventRecorder
	Clock     clock.PassiveClock
	Ledger    *placement.Ledger
	IPAM      *ipam.Allocator
	// Warm is the warm pool ledger: claims are bound to idle members through it. Nil: claims
	// are restored from their pools' templates.
	Warm    WarmMembers
	Options Options

	ledgerOnce  sync.Mutex
	ledgerReady bool
	holders     sync.Map  // types.NamespacedName → types.UID of the VM holding there
	announced   announced // what each VM's last reconcile computed, for its Events
	beats       heartbeats
	fleet       fleet // placement's view of the nodes, kept by the watches
	traces      startTraces

	freed chan event.GenericEvent // capacity was released: retry unplaced VMs
}

// scope carries what one reconcile learned, for the status computation.
type scope struct {
	vm             *impv1.ImpVM
	oldPhase       impv1.VMPhase
	oldSchedReason string
	schedReason    string // why the VM is not placed
	schedMsg       string
	nodeLost       bool
	unreachable    string // why the VM's node is unreachable (not fenced: the VM stays placed)
	oldReadyReason string
	waitReason     string // why a placed VM waits before its node may start it (a template's snapshot)
	waitMsg        string
	suspendRefused string // why a suspension was not carried out (a quota)
	oldSuspReason  string
	expired        bool // deleted by this reconcile: nothing else to do
	requeue        time.Duration
	pool           *impv1.ImpWarmPool // a claim's pool
	warmMsg        string             // why a claim was not handed a member of its pool
}

func (s *scope) requeueAfter(d time.Duration) {
	if d > 0 && (s.requeue == 0 || d < s.requeue) {
		s.requeue = d
	}
}

// Reconcile moves one ImpVM towards what its spec asks.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (_ ctrl.Result, reterr error) {
	vm := &impv1.ImpVM{}
	if err := r.Client.Get(ctx, req.NamespacedName, vm); err != nil {
		if apierrors.IsNotFound(err) {
			// Gone without passing through reconcileDelete (its finalizer removed by hand):
			// what it held is free.
			r.traces.forget(req.NamespacedName)
			if uid, ok := r.holders.LoadAndDelete(req.NamespacedName); ok {
				r.Ledger.Release(uid.(types.UID))
				r.signalFreed()
			}
			r.announced.forget(req.NamespacedName)
		}
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if err := r.loadLedger(ctx); err != nil {
		return ctrl.Result{}, err
	}
	if !vm.DeletionTimestamp.IsZero() {
		return r.reconcileDelete(ctx, vm)
	}
	began := r.Clock.Now()
	if orig := vm.DeepCopy(); !controllerutil.ContainsFinalizer(vm, impv1.VMFinalizer) || r.traces.annotate(vm) {
		// The finalizer, and the trace annotation with it (traces on): one write. Where the
		// chart's admission policy added the finalizer, the annotation is a write of its own.
		controllerutil.AddFinalizer(vm, impv1.VMFinalizer)
		r.traces.annotate(vm)
		if err := r.Client.Patch(ctx, vm, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
			return ctrl.Result{}, fmt.Errorf("adding finalizer: %w", err)
		}
	}

	orig := vm.DeepCopy()
	s := &scope{vm: vm, oldPhase: vm.Status.Phase}
	if c := meta.FindStatusCondition(vm.Status.Conditions, impv1.ScheduledCondition); c != nil && c.Status == metav1.ConditionFalse {
		s.oldSchedReason = c.Reason
	}
	if c := meta.FindStatusCondition(vm.Status.Conditions, impv1.ReadyCondition); c != nil {
		s.oldReadyReason = c.Reason
	}
	if c := meta.FindStatusCondition(vm.Status.Conditions, impv1.SuspendedCondition); c != nil {
		s.oldSuspReason = c.Reason
	}
	defer func() {
		computeStatus(s, r.Clock.Now())
		if reterr == nil {
			vm.Status.ObservedGeneration = vm.Generation
		}
		// A new run is published only with its run Secret written first: what it needs of the
		// namespace's Secrets and ConfigMaps, which its node's agent cannot read itself. A
		// failure is retried; the run goes out either way, and fails on the node with the
		// reason if the Secret is still missing, for the runStrategy to retry.
		st, was := vm.Status, orig.Status
		if st.NodeName != "" && vm.DeletionTimestamp.IsZero() && (st.Instance != was.Instance || st.RestartCount != was.RestartCount) && runsecret.Needed(vm) {
			if err := runsecret.Write(ctx, r.Client, r.APIReader, r.runSecretNamespace(), vm); err != nil {
				reterr = errors.Join(reterr, err)
			}
		}
		if err := r.patchStatus(ctx, orig, vm); err != nil {
			reterr = errors.Join(reterr, err)
			return
		}
		r.recordTransition(s)
		r.traces.observe(ctx, orig, vm, began, r.Clock.Now())
	}()

	for _, phase := range []func(context.Context, *scope) error{
		r.reconcileExpiry,
		r.reconcilePlacement,
		r.reconcileTemplate,
		r.reconcileVolumes,
		r.reconcileSuspension,
		r.reconcileRuns,
	} {
		if err := phase(ctx, s); err != nil {
			return ctrl.Result{}, err
		}
		if s.expired {
			break
		}
	}
	return ctrl.Result{RequeueAfter: s.requeue}, nil
}

func (r *Reconciler) patchStatus(ctx context.Context, orig, vm *impv1.ImpVM) error {
	if equality.Semantic.DeepEqual(orig.Status, vm.Status) {
		return nil
	}
	// A merge patch of the fields this reconcile changed: the agent's status.runtime is left
	// alone unless the operator changed it, which it never does.
	patch, err := statusPatch(orig, vm)
	if err != nil {
		return err
	}
	if err := r.Status.PatchStatus(ctx, client.ObjectKeyFromObject(vm), patch); err != nil {
		if vm.Status.NodeName != orig.Status.NodeName && vm.Status.NodeName != "" {
			// The placement did not commit; the ledger keeps the VM's hold so the retry makes
			// the same decision.
			return fmt.Errorf("committing placement on node %s: %w", vm.Status.NodeName, err)
		}
		if apierrors.IsNotFound(err) {
			return nil // deleted meanwhile
		}
		return fmt.Errorf("patching status: %w", err)
	}
	return nil
}

// loadLedger fills the ledger, once, with every placed VM in the API: before its first
// decision the operator must know what earlier decisions (its own before a restart, or a
// previous leader's) hold.
func (r *Reconciler) loadLedger(ctx context.Context) error {
	r.ledgerOnce.Lock()
	defer r.ledgerOnce.Unlock()
	if r.ledgerReady {
		return nil
	}
	var list impv1.ImpVMList
	if err := r.APIReader.List(ctx, &list); err != nil {
		return fmt.Errorf("loading placed VMs into the ledger: %w", err)
	}
	bound := boundInList(&list)
	for i := range list.Items {
		if !bound[list.Items[i].UID] { // a member handed to a claim: what it held is the claim's
			r.holdIfPlaced(&list.Items[i])
		}
	}
	r.ledgerReady = true
	log.FromContext(ctx).Info("placement ledger loaded", "vms", len(list.Items))
	return nil
}

// holdIfPlaced records what a VM holds on its node, if it is placed: all it asked for while
// it may run, its disk alone once it ended, until its node removed that.
func (r *Reconciler) holdIfPlaced(vm *impv1.ImpVM) {
	if vm.Status.NodeName == "" || vm.Status.Resources == nil || (isTerminal(vm.Status.Phase) && disksRemoved(vm)) || r.boundMember(vm) {
		return
	}
	res := vm.Status.Resources
	h := placement.Holding{Node: vm.Status.NodeName, Namespace: vm.Namespace, VCPUs: int64(res.VCPUs), Memory: res.Memory.Value(),
		Disk: res.NodeDiskBytes(), Suspended: vm.Status.Suspension != nil, Finished: isTerminal(vm.Status.Phase), VM: vm.Name, Claims: res.Claims}
	if res.MemoryOverhead != nil {
		h.Overhead = res.MemoryOverhead.Value()
	}
	r.Ledger.Hold(vm.UID, h)
	r.holders.Store(client.ObjectKeyFromObject(vm), vm.UID)
}

func isTerminal(p impv1.VMPhase) bool { return p == impv1.VMSucceeded || p == impv1.VMFailed }

// disksRemoved: the VM's node says it removed the disks of the VM's last run.
func disksRemoved(vm *impv1.ImpVM) bool {
	rt := vm.Status.Runtime
	return rt != nil && rt.DisksRemoved && rt.Instance == vm.Status.Instance
}

func (r *Reconciler) reconcileExpiry(ctx context.Context, s *scope) error {
	vm := s.vm
	if vm.Spec.ExpireAfter == nil {
		return nil
	}
	left := vm.CreationTimestamp.Add(vm.Spec.ExpireAfter.Duration).Sub(r.Clock.Now())
	if left > 0 {
		s.requeueAfter(left)
		return nil
	}
	r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Expired", "Delete", "VM existed for its expireAfter of %s; deleting it", vm.Spec.ExpireAfter.Duration)
	if err := r.Client.Delete(ctx, vm); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting expired VM: %w", err)
	}
	s.expired = true // the deletion's own reconcile takes it from here
	return nil
}

func (r *Reconciler) reconcilePlacement(ctx context.Context, s *scope) error {
	vm := s.vm
	if isTerminal(vm.Status.Phase) {
		// An ended VM's disks hold its node's disk and its quota until its node removed them,
		// or the node is gone (deleted, or out of service): then the VM leaves it.
		gone := disksRemoved(vm)
		if !gone && vm.Status.NodeName != "" {
			node := &corev1.Node{}
			err := r.Client.Get(ctx, types.NamespacedName{Name: vm.Status.NodeName}, node)
			if err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("getting node %s: %w", vm.Status.NodeName, err)
			}
			if gone = apierrors.IsNotFound(err) || outOfService(node); gone {
				vm.Status.NodeName = ""
			}
		}
		if gone {
			if _, held := r.Ledger.NodeOf(vm.UID); held {
				r.Ledger.Release(vm.UID)
				r.signalFreed()
			}
		}
		return nil
	}
	if vm.Status.NodeName != "" && !r.handoverFailed(s) {
		return r.checkNode(ctx, s)
	}
	if vm.Spec.RunStrategy == impv1.RunStrategyHalted {
		return nil // a halted VM holds no node until it is asked to run
	}

	// Template: a copy is placed as its template's VM.
	spec := &vm.Spec
	var tmpl *impv1.ImpVMTemplate
	if vm.IsCopy() {
		t, ok, err := r.template(ctx, s)
		if !ok || err != nil {
			return err
		}
		tmpl, spec = t, &t.Spec.VM
	}

	// Class.
	var class *impv1.ImpVMClassSpec
	if ref := spec.ClassRef; ref != nil {
		c := &impv1.ImpVMClass{}
		if err := r.Client.Get(ctx, types.NamespacedName{Name: ref.Name}, c); err != nil {
			if apierrors.IsNotFound(err) {
				s.schedReason, s.schedMsg = impv1.ReasonClassNotFound, fmt.Sprintf("ImpVMClass %q does not exist", ref.Name)
				return nil
			}
			return fmt.Errorf("getting ImpVMClass %s: %w", ref.Name, err)
		}
		class = &c.Spec
	}
	res, err := impv1.ResolveResources(spec, class)
	if err != nil && vm.Spec.SnapshotRef == nil { // a snapshot's copy takes the snapshot's
		if tmpl != nil {
			err = fmt.Errorf("ImpVMTemplate %s: %w", tmpl.Name, err)
		}
		s.schedReason, s.schedMsg = impv1.ReasonInvalidSpec, err.Error()
		return reconcile.TerminalError(err)
	}
	snapNode := ""
	if vm.Spec.SnapshotRef != nil {
		node, ok, err := r.restoreSource(ctx, s, &res)
		if !ok || err != nil {
			return err
		}
		snapNode = node
	}
	for k, v := range vm.Spec.NodeSelector {
		if errs := append(validation.IsQualifiedName(k), validation.IsValidLabelValue(v)...); len(errs) > 0 {
			s.schedReason, s.schedMsg = impv1.ReasonInvalidSpec, fmt.Sprintf("nodeSelector %s=%s: %v", k, v, errs)
			return reconcile.TerminalError(errors.New(s.schedMsg))
		}
	}

	// Network.
	var net *impv1.ImpNetwork
	if ref := vm.Spec.NetworkRef; ref != nil {
		net = &impv1.ImpNetwork{}
		if err := r.Client.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: ref.Name}, net); err != nil {
			if apierrors.IsNotFound(err) {
				s.schedReason, s.schedMsg = impv1.ReasonNetworkNotFound, fmt.Sprintf("ImpNetwork %q does not exist in namespace %s", ref.Name, vm.Namespace)
				return nil
			}
			return fmt.Errorf("getting ImpNetwork %s: %w", ref.Name, err)
		}
		if reserved, ok := net.Spec.ReservedOverlap(r.Options.ReservedCIDRs); ok {
			s.schedReason, s.schedMsg = impv1.ReasonReservedCIDR, fmt.Sprintf("ImpNetwork %s (%s) overlaps %s, which the cluster reserves", net.Name, net.Spec.CIDR, reserved)
			return nil
		}
	}

	// Quotas of the namespace.
	quotas, why, err := r.quotas(ctx, vm, spec, &res)
	if err != nil {
		return err
	}
	if why != "" {
		s.schedReason, s.schedMsg = impv1.ReasonQuotaExceeded, why
		return nil
	}

	// Node.
	nodes := r.candidates()
	if vm.Spec.NodeName != "" {
		nodes = onlyNode(nodes, vm.Spec.NodeName)
	}
	if snapNode != "" {
		nodes = onlyNode(nodes, snapNode) // the node holding the snapshot
	}
	if tmpl != nil && snapshotFor(tmpl, "") == "" {
		nodes = templateNodes(tmpl, res.VMM, nodes) // where the template's VM may run too
	}
	claims, nodes, ok, err := r.claimPlacement(ctx, s, nodes) // where its claims' volumes attach
	if !ok || err != nil {
		return errors.Join(err, r.releaseUnplaced(ctx, net, vm))
	}
	start := r.Clock.Now()
	req := placement.Request{
		VCPUs:       int64(res.VCPUs),
		MemoryBytes: res.Memory.Value(),
		VMM:         res.VMM,
		Labels:      vm.Spec.RequiredNodeLabels(),
		Tolerations: vm.Spec.Tolerations,
		Namespace:   vm.Namespace,
		DiskBytes:   res.NodeDiskBytes(),
		Quotas:      quotas,
		VM:          vm.Name,
		Claims:      claims,
	}
	var node string
	taken := r.takeMember(s, req, nodes)
	if taken != nil {
		node = taken.Node
	}
	if tmpl != nil && node == "" {
		// A copy goes to a node holding its template's snapshot if one has room; else to any,
		// where the snapshot is made first.
		if prefer := preferTemplateNodes(tmpl, nodes); len(prefer) > 0 {
			node, err = r.place(ctx, s, req, prefer)
		}
	}
	if node == "" {
		if tmpl != nil && snapshotFor(tmpl, "") == "" {
			// The template's snapshot is made where the copy goes: room for its VM too.
			req.Room = &placement.Room{VCPUs: int64(res.VCPUs), MemoryBytes: res.Memory.Value(), DiskBytes: res.DiskSize.Value()}
		}
		node, err = r.place(ctx, s, req, nodes)
	}
	var unsched *placement.Unschedulable
	if errors.As(err, &unsched) {
		s.schedReason, s.schedMsg = impv1.ReasonNoNodeAvailable, unsched.Message
		return r.releaseUnplaced(ctx, net, vm)
	}
	var inUse *placement.ClaimInUse
	if errors.As(err, &inUse) {
		s.schedReason, s.schedMsg = impv1.ReasonVolumeInUse, inUse.Error()
		s.requeueAfter(claimWait)
		return r.releaseUnplaced(ctx, net, vm)
	}
	var exceeded *placement.QuotaExceeded
	if errors.As(err, &exceeded) {
		s.schedReason, s.schedMsg = impv1.ReasonQuotaExceeded, exceeded.Message
		return r.releaseUnplaced(ctx, net, vm)
	}
	if err != nil {
		return fmt.Errorf("placing: %w", err)
	}

	// Address.
	var addr netip.Addr
	if net != nil {
		addr, err = r.IPAM.Allocate(ctx, net, vm, node)
		failpoint.Crash("operator-address-claimed")
		if err != nil {
			if taken != nil {
				r.giveBack(vm, taken)
			} else {
				r.Ledger.Release(vm.UID)
			}
			if errors.Is(err, ipam.ErrExhausted) {
				s.schedReason, s.schedMsg = impv1.ReasonNetworkExhausted, fmt.Sprintf("ImpNetwork %s (%s) has no free address", net.Name, net.Spec.CIDR)
				return nil
			}
			return fmt.Errorf("allocating an address on %s: %w", net.Name, err)
		}
	}

	vm.Status.NodeName = node
	for _, n := range nodes {
		if n.Node.Name == node {
			res.MemoryOverhead = resource.NewQuantity(placement.Overhead(n, res.VMM), resource.BinarySI)
		}
	}
	res.Claims = claims
	vm.Status.Resources = &res
	vm.Status.Template = nil
	if tmpl != nil {
		vm.Status.Template = templateStatus(tmpl, node)
		if ts := vm.Status.Template; ts.Snapshot != "" {
			if why, err := r.sameSize(ctx, vm, ts.Snapshot); err != nil || why != "" {
				ts.Snapshot = "" // a snapshot of another size: made again, or the copy waits
			}
		}
	}
	vm.Status.Start, vm.Status.Warm = startOf(vm), nil
	if taken != nil {
		warmStatus(vm, s.pool, taken)
	}
	vm.Status.Instance++
	r.holders.Store(client.ObjectKeyFromObject(vm), vm.UID)
	placementLatency.Observe(r.Clock.Since(firstSeen(vm, start)).Seconds())
	// One Event tells the placement and the address: each Event is a write to the API server.
	if addr.IsValid() {
		vm.Status.IP = addr.String()
	}
	if w := vm.Status.Warm; w != nil {
		at := ""
		if addr.IsValid() {
			at = fmt.Sprintf(", with address %s on ImpNetwork %s", addr, net.Name)
		}
		r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Scheduled", "Place", "Handed idle member %s of ImpWarmPool %s on node %s%s", w.Member, w.Pool, node, at)
	} else if addr.IsValid() {
		r.Recorder.Eventf(vm, net, corev1.EventTypeNormal, "Scheduled", "Place", "Placed on node %s (%d vCPUs, %s memory) with address %s on ImpNetwork %s%s",
			node, res.VCPUs, res.Memory.String(), addr, net.Name, s.warmNote())
	} else {
		r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Scheduled", "Place", "Placed on node %s (%d vCPUs, %s memory)%s", node, res.VCPUs, res.Memory.String(), s.warmNote())
	}
	log.FromContext(ctx).V(1).Info("placed", "node", klog.KRef("", node), "instance", vm.Status.Instance)
	return nil
}

// releaseUnplaced releases the address an unplaced VM holds on net: one an operator claimed
// and then died before writing the placement (the address names a node the VM is not on).
// A VM that waits for room holds no address, so that waiting VMs do not drain a small
// network; it gets one again when it is placed.
func (r *Reconciler) releaseUnplaced(ctx context.Context, net *impv1.ImpNetwork, vm *impv1.ImpVM) error {
	if net == nil {
		return nil
	}
	released, err := r.IPAM.ReleaseOn(ctx, net, vm)
	if err != nil {
		return fmt.Errorf("releasing the address of an unplaced VM: %w", err)
	}
	if released.IsValid() {
		log.FromContext(ctx).Info("released the address of a VM that is not placed", "address", released, "network", net.Name)
	}
	return nil
}

// firstSeen is when the VM was created, or start when its second-precision creation time is
// later than that (clock skew).
func firstSeen(vm *impv1.ImpVM, start time.Time) time.Time {
	if c := vm.CreationTimestamp.Time; !c.IsZero() && c.Before(start) {
		return c
	}
	return start
}

// checkNode handles a placed VM whose node may be gone. A VM is taken off its node only when
// the node is fenced, so that it never runs twice with one address and disk: the Node was
// deleted, or tainted node.kubernetes.io/out-of-service (Kubernetes' own signal that a node is
// shut down). A node whose kubelet is NotReady and whose agent is silent, both for the grace
// period, is unreachable: the VM is reported so, and stays until the node is fenced or returns.
func (r *Reconciler) checkNode(ctx context.Context, s *scope) error {
	vm := s.vm
	name := vm.Status.NodeName
	node := &corev1.Node{}
	err := r.Client.Get(ctx, types.NamespacedName{Name: name}, node)
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("getting node %s: %w", name, err)
	}
	var why string
	switch {
	case apierrors.IsNotFound(err):
		why = "was deleted"
	case outOfService(node):
		why = "is out of service (taint " + corev1.TaintNodeOutOfService + ")"
	default:
		r.holdIfPlaced(vm)
		grace := r.Options.NodeLostGracePeriod
		notReady := r.notReadyFor(node)
		silent := grace // no report at all: nothing says the agent lives
		if report, renewed := r.fleet.agent(name); report != nil {
			silent = r.beats.silentFor(name, lastBeat(renewed, report.Status.HeartbeatTime), r.Clock.Now())
		}
		if notReady >= grace && silent >= grace {
			s.unreachable = fmt.Sprintf("node %s: its kubelet is not Ready and its IMP agent has not reported for %s. The VM may still run there, "+
				"so it is not started elsewhere until the node is fenced: delete the Node, or taint it %s:NoExecute once it is shut down",
				name, grace, corev1.TaintNodeOutOfService)
			s.requeueAfter(grace) // a heartbeat that resumes without any other change
		} else if notReady > 0 {
			s.requeueAfter(grace - min(notReady, silent))
		}
		return nil
	}

	// The VM leaves its node. The old node's agent must not run it again: an agent runs only
	// VMs whose status.nodeName is its own node, and only their current instance.
	s.nodeLost = true
	vm.Status.NodeName = ""
	vm.Status.NextRestartAt = nil
	r.Ledger.Release(vm.UID)
	r.signalFreed()
	if vm.Spec.RunStrategy == impv1.RunStrategyOnce {
		vm.Status.Phase = impv1.VMFailed
		r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "NodeLost", "Fail", "Node %s %s; runStrategy Once does not run the VM again", name, why)
		return nil
	}
	// A new instance elsewhere (Always, RerunOnFailure), or none until asked (Halted).
	r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "NodeLost", "Reschedule", "Node %s %s; placing the VM again", name, why)
	return nil
}

// notReadyFor is how long node has not been Ready (0 when it is).
func (r *Reconciler) notReadyFor(node *corev1.Node) time.Duration {
	ready := readyCondition(node)
	if ready != nil && ready.Status == corev1.ConditionTrue {
		return 0
	}
	since := node.CreationTimestamp.Time
	if ready != nil {
		since = ready.LastTransitionTime.Time
	}
	return max(r.Clock.Since(since), time.Nanosecond)
}

func outOfService(node *corev1.Node) bool {
	for _, t := range node.Spec.Taints {
		if t.Key == corev1.TaintNodeOutOfService && t.Effect == corev1.TaintEffectNoExecute {
			return true
		}
	}
	return false
}

func readyCondition(n *corev1.Node) *corev1.NodeCondition {
	for i := range n.Status.Conditions {
		if n.Status.Conditions[i].Type == corev1.NodeReady {
			return &n.Status.Conditions[i]
		}
	}
	return nil
}

// currentRun returns the agent's report when it is about the VM's current instance and run.
func currentRun(vm *impv1.ImpVM) *impv1.RuntimeStatus {
	rt := vm.Status.Runtime
	if rt == nil || rt.Instance != vm.Status.Instance || rt.Run != vm.Status.RestartCount {
		return nil
	}
	return rt
}

// reconcileRuns applies the runStrategy to a run that exited.
func (r *Reconciler) reconcileRuns(_ context.Context, s *scope) error {
	vm := s.vm
	rt := currentRun(vm)
	if at, err := time.Parse(time.RFC3339Nano, vm.Annotations[impv1.RestartRequestedAnnotation]); err == nil &&
		rt != nil && rt.State == impv1.RuntimeRunning && rt.StartedAt != nil && at.Truncate(time.Second).After(rt.StartedAt.Time) && vm.Status.Suspension == nil {
		// A restart asked for after this run began (second precision: a request in the very
		// second the run began is too early): the next run; the agent stops this one.
		vm.Status.RestartCount++
		r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Restarting", "Restart", "Restarting (restart %d) as asked at %s", vm.Status.RestartCount, at.Format(time.RFC3339))
		return nil
	}
	if vm.Status.NodeName != "" && !isTerminal(vm.Status.Phase) && rt != nil && rt.State == impv1.RuntimeStopped &&
		vm.Spec.RunStrategy != impv1.RunStrategyHalted && vm.DeletionTimestamp.IsZero() {
		// Stopped on purpose and asked to run again (kubectl imp start): a new run.
		vm.Status.RestartCount++
		r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Starting", "Start", "Starting the stopped VM again (runStrategy %s)", vm.Spec.RunStrategy)
		return nil
	}
	if vm.Status.NodeName == "" || isTerminal(vm.Status.Phase) || rt == nil || rt.State != impv1.RuntimeExited {
		return nil
	}
	// A run its liveness or startup probe killed failed, whatever code the workload exited with.
	failed := rt.ExitCode == nil || *rt.ExitCode != 0 || rt.Reason == impv1.ReasonLivenessProbeFailed
	restart := false
	switch vm.Spec.RunStrategy {
	case impv1.RunStrategyAlways:
		restart = true
	case impv1.RunStrategyRerunOnFailure:
		restart = failed
	}
	if !restart {
		if vm.Spec.RunStrategy == impv1.RunStrategyHalted {
			return nil // stopped on purpose; stays placed
		}
		vm.Status.Phase = impv1.VMSucceeded
		if failed {
			vm.Status.Phase = impv1.VMFailed
		}
		r.Ledger.Finish(vm.UID) // its disks stay until its node's retention removes them
		r.signalFreed()
		return nil
	}
	delay := restartDelay(vm.Status.RestartCount, rt, r.Options)
	at := r.Clock.Now()
	if rt.FinishedAt != nil {
		at = rt.FinishedAt.Add(delay)
	}
	if left := at.Sub(r.Clock.Now()); left > 0 {
		t := metav1.NewTime(at)
		vm.Status.NextRestartAt = &t
		s.requeueAfter(left)
		return nil
	}
	vm.Status.NextRestartAt = nil
	vm.Status.RestartCount++
	r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Restarting", "Restart", "Restarting (restart %d) after the workload exited: %s", vm.Status.RestartCount, exitText(rt))
	return nil
}

// restartDelay is the back-off before restart number restarts+1: base·2^restarts up to max,
// or base after a run that lasted ten minutes.
func restartDelay(restarts int32, rt *impv1.RuntimeStatus, o Options) time.Duration {
	if rt.StartedAt != nil && rt.FinishedAt != nil && rt.FinishedAt.Sub(rt.StartedAt.Time) >= 10*time.Minute {
		return o.RestartBackoffBase
	}
	d := o.RestartBackoffBase
	for i := int32(0); i < restarts && d < o.RestartBackoffMax; i++ {
		d *= 2
	}
	return min(d, o.RestartBackoffMax)
}

func exitText(rt *impv1.RuntimeStatus) string {
	switch {
	case rt.Reason == impv1.ReasonLivenessProbeFailed && rt.ExitCode != nil:
		return fmt.Sprintf("%s (exit code %d)", rt.Message, *rt.ExitCode)
	case rt.Reason == impv1.ReasonLivenessProbeFailed, rt.Reason == impv1.ReasonBootTimeout:
		return rt.Message
	case rt.ExitCode != nil:
		return fmt.Sprintf("exit code %d", *rt.ExitCode)
	case rt.Reason != "":
		return rt.Reason
	}
	return "no exit code"
}

func (r *Reconciler) runSecretNamespace() string {
	if ns := r.Options.RunSecretNamespace; ns != "" {
		return ns
	}
	return runsecret.DefaultNamespace
}

// reconcileDelete waits for the node's agent to confirm the VM is gone, then releases the
// VM's address and node and lets the API server delete it.
func (r *Reconciler) reconcileDelete(ctx context.Context, vm *impv1.ImpVM) (ctrl.Result, error) {
	r.traces.forget(client.ObjectKeyFromObject(vm))
	if !controllerutil.ContainsFinalizer(vm, impv1.VMFinalizer) {
		return ctrl.Result{}, nil
	}
	if node := vm.Status.NodeName; node != "" && !agentConfirmedGone(vm) {
		n := &corev1.Node{}
		err := r.Client.Get(ctx, types.NamespacedName{Name: node}, n)
		switch {
		case apierrors.IsNotFound(err):
			r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "NodeGone", "Delete", "Node %s no longer exists; releasing the VM without its agent's confirmation", node)
		case err != nil:
			return ctrl.Result{}, fmt.Errorf("getting node %s: %w", node, err)
		case outOfService(n):
			r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "NodeGone", "Delete", "Node %s is out of service (taint %s); releasing the VM without its agent's confirmation", node, corev1.TaintNodeOutOfService)
		default:
			// Only the agent's word that the VMM is gone, or the node's end, releases the
			// VM's address and capacity: a VMM that still runs keeps them, however long its
			// grace period, and a timer never hands them to another VM.
			if vm.Status.Phase != impv1.VMStopping {
				orig := vm.DeepCopy()
				vm.Status.Phase = impv1.VMStopping
				if err := r.patchStatus(ctx, orig, vm); err != nil {
					return ctrl.Result{}, err
				}
			}
			waited := r.Clock.Since(vm.DeletionTimestamp.Time)
			if waited < r.Options.DeletionTimeout {
				return ctrl.Result{RequeueAfter: r.Options.DeletionTimeout - waited}, nil
			}
			r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "DeletionTimeout", "Delete",
				"The agent of node %s has not confirmed for %s that the VM is gone; its address and capacity stay held until it does, or until the node is deleted or tainted %s.",
				node, waited.Round(time.Second), corev1.TaintNodeOutOfService)
			return ctrl.Result{RequeueAfter: r.Options.DeletionTimeout}, nil
		}
	}
	if err := runsecret.Delete(ctx, r.Client, r.runSecretNamespace(), vm); err != nil {
		return ctrl.Result{}, err
	}
	// Only a VM on a network has addresses (networkRef is immutable): the others skip the
	// uncached list.
	if vm.Spec.NetworkRef != nil {
		if err := r.IPAM.Release(ctx, vm); err != nil {
			return ctrl.Result{}, err
		}
	}
	r.Ledger.Release(vm.UID)
	orig := vm.DeepCopy()
	controllerutil.RemoveFinalizer(vm, impv1.VMFinalizer)
	if err := r.Client.Patch(ctx, vm, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); apierrors.IsConflict(err) {
		// The VM changed since the cache gave it (its agent's Gone report, usually): not an
		// error. The change's watch event brings the VM back, as it is now.
		return ctrl.Result{}, nil
	} else if err != nil && !apierrors.IsNotFound(err) {
		return ctrl.Result{}, fmt.Errorf("removing finalizer: %w", err)
	}
	r.signalFreed()
	return ctrl.Result{}, nil
}

// agentConfirmedGone: the node's agent removed the VM's VMM, disks and state (any instance: a
// deletion removes them all).
func agentConfirmedGone(vm *impv1.ImpVM) bool {
	rt := vm.Status.Runtime
	return rt != nil && rt.Instance == vm.Status.Instance && rt.State == impv1.RuntimeGone
}

// signalFreed asks for the unplaced VMs to be tried again; signals coalesce (the channel holds
// one).
func (r *Reconciler) signalFreed() {
	select {
	case r.freed <- event.GenericEvent{Object: &impv1.ImpVM{}}:
	default:
	}
}
