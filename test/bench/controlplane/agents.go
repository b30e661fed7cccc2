package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/nodereport"
	"github.com/syscode-labs/imp/internal/agent/runreport"
	"github.com/syscode-labs/imp/internal/runsecret"
)

// simAgent is one node's agent as the API server sees it: it reports its ImpNode and
// heartbeats, watches what the real agent watches (its node's ImpVMs; with fleet, every
// ImpNetwork, ImpIPAddress and ImpNode, for the overlay), and answers each run placed on its
// node with the real agent's reports: Starting, then Running (booting) after start, then
// Running with the guest ready after boot; and a deletion with Gone. It makes the real agent's
// patches (runreport.RuntimePatch).
type simAgent struct {
	node      string
	c         client.Client
	start     time.Duration // placement seen → VMM started
	boot      time.Duration // VMM started → guest ready
	delay     time.Duration // the real agent's StartingReportDelay
	handover  time.Duration // a claim seen → its member's guest took on the claim's identity
	vcpus     int32         // the node's allocatable vCPUs
	heartbeat time.Duration
	lease     *coordinationv1.Lease // the heartbeat Lease written last
	beats     int
	// impNodeBeats: beat by patching the ImpNode's heartbeatTime, as agents before the
	// Lease did (for comparison).
	impNodeBeats bool

	events *eventCounts

	mu        sync.Mutex
	seen      map[types.UID]string // the last run reported for each VM: "instance/run/state"
	kick      chan struct{}
	informers cache.Cache // its node's ImpVMs, and the fleet's objects with -fleet
}

// eventCounts are the watch events the simulated agents received, by resource.
type eventCounts struct {
	vms, addresses, networks, nodes atomic.Int64
}

// newSimAgent connects an agent for node with its own connection to the API server, as a real
// agent on its own host has: agents sharing one HTTP/2 connection would share its stream
// limit.
func newSimAgent(cfg *rest.Config, scheme *runtime.Scheme, node string, fleet bool, ev *eventCounts) (*simAgent, error) {
	cfg = rest.CopyConfig(cfg)
	cfg.Dial = (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext // no shared transport
	cfg.UserAgent = "imp-agent-sim/" + node
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return nil, err
	}
	a := &simAgent{node: node, c: c, events: ev, seen: map[types.UID]string{}, kick: make(chan struct{}, 1)}
	byObject := map[client.Object]cache.ByObject{&impv1.ImpVM{}: {Field: fields.OneTermEqualSelector("status.nodeName", node)}}
	if fleet {
		byObject[&impv1.ImpIPAddress{}] = cache.ByObject{}
		byObject[&impv1.ImpNetwork{}] = cache.ByObject{}
		byObject[&impv1.ImpNode{}] = cache.ByObject{}
	}
	a.informers, err = cache.New(cfg, cache.Options{Scheme: scheme, ByObject: byObject})
	if err != nil {
		return nil, err
	}
	return a, nil
}

// run registers the node's report and serves its VMs until ctx ends.
func (a *simAgent) run(ctx context.Context, fleet bool) error {
	if err := a.report(ctx); err != nil {
		return err
	}
	counted := func(n *atomic.Int64, f func()) toolscache.ResourceEventHandlerFuncs {
		return toolscache.ResourceEventHandlerFuncs{
			AddFunc:    func(any) { n.Add(1); f() },
			UpdateFunc: func(any, any) { n.Add(1); f() },
			DeleteFunc: func(any) { n.Add(1); f() },
		}
	}
	inf, err := a.informers.GetInformer(ctx, &impv1.ImpVM{})
	if err != nil {
		return err
	}
	if _, err := inf.AddEventHandler(counted(&a.events.vms, a.poke)); err != nil {
		return err
	}
	// The snapshots given to the node (a template's, for warm pools).
	sinf, err := a.informers.GetInformer(ctx, &impv1.ImpVMSnapshot{})
	if err != nil {
		return err
	}
	if _, err := sinf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc: func(any) { a.poke() }, UpdateFunc: func(any, any) { a.poke() },
	}); err != nil {
		return err
	}
	if fleet {
		for obj, n := range map[client.Object]*atomic.Int64{&impv1.ImpIPAddress{}: &a.events.addresses, &impv1.ImpNetwork{}: &a.events.networks, &impv1.ImpNode{}: &a.events.nodes} {
			inf, err := a.informers.GetInformer(ctx, obj)
			if err != nil {
				return err
			}
			if _, err := inf.AddEventHandler(counted(n, func() {})); err != nil {
				return err
			}
		}
	}
	go func() { _ = a.informers.Start(ctx) }()
	if !a.informers.WaitForCacheSync(ctx) {
		return fmt.Errorf("agent %s: syncing its cache", a.node)
	}
	beat := time.NewTicker(a.heartbeat)
	defer beat.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-beat.C:
			if err := a.beat(ctx); err != nil && ctx.Err() == nil {
				return err
			}
		case <-a.kick:
			a.sync(ctx)
		}
	}
}

func (a *simAgent) poke() {
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

// beat renews the agent's heartbeat Lease as the real agent does (nodereport.RenewHeartbeat), and
// every third beat reads the Node as its report does (30 s against 10 s); the report itself
// writes nothing, as nothing changed.
func (a *simAgent) beat(ctx context.Context) error {
	if a.impNodeBeats {
		now := metav1.Now()
		patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"status":{"heartbeatTime":%q}}`, now.UTC().Format(time.RFC3339)))
		if err := a.c.Status().Patch(ctx, &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: a.node}}, patch); err != nil {
			return fmt.Errorf("agent %s: reporting: %w", a.node, err)
		}
		return nil
	}
	a.beats++
	if a.beats%3 == 0 {
		var n corev1.Node
		if err := a.c.Get(ctx, types.NamespacedName{Name: a.node}, &n); err != nil {
			return fmt.Errorf("agent %s: reading its Node: %w", a.node, err)
		}
	}
	l, err := nodereport.RenewHeartbeat(ctx, a.c, a.c, runsecret.DefaultNamespace, a.node, a.heartbeat, a.lease)
	if err != nil {
		return fmt.Errorf("agent %s: %w", a.node, err)
	}
	a.lease = l
	return nil
}

// report creates the node's ImpNode, with the real agent's requests: the Node read, then a
// status patch.
func (a *simAgent) report(ctx context.Context) error {
	var n corev1.Node
	if err := a.c.Get(ctx, types.NamespacedName{Name: a.node}, &n); err != nil {
		return fmt.Errorf("agent %s: reading its Node: %w", a.node, err)
	}
	now := metav1.Now()
	rep := &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: a.node}}
	rep.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: n.Name, UID: n.UID}}
	if err := a.c.Create(ctx, rep); err != nil {
		return fmt.Errorf("agent %s: creating its ImpNode: %w", a.node, err)
	}
	rep.Status = impv1.ImpNodeStatus{
		Capacity:      &impv1.NodeResources{VCPUs: a.vcpus, Memory: resource.MustParse("256Gi")},
		Allocatable:   &impv1.NodeResources{VCPUs: a.vcpus, Memory: resource.MustParse("256Gi")},
		VMMs:          []impv1.VMMCapability{{Kind: impv1.VMMFirecracker, Acceleration: "kvm"}},
		Features:      []string{impv1.FeatureWarmHandover},
		Conditions:    []metav1.Condition{{Type: impv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: impv1.ReasonAgentReady, Message: "simulated", LastTransitionTime: now}},
		HeartbeatTime: &now,
	}
	if err := a.c.Status().Patch(ctx, rep, client.MergeFrom(&impv1.ImpNode{ObjectMeta: rep.ObjectMeta})); err != nil {
		return fmt.Errorf("agent %s: reporting: %w", a.node, err)
	}
	return nil
}

// sync answers every VM of the node whose run has not been answered yet.
func (a *simAgent) sync(ctx context.Context) {
	var list impv1.ImpVMList
	if err := a.informers.List(ctx, &list); err != nil {
		return
	}
	for i := range list.Items {
		vm := &list.Items[i]
		st := vm.Status
		if st.NodeName != a.node {
			continue
		}
		key := fmt.Sprintf("%d/%d", st.Instance, st.RestartCount)
		base := impv1.RuntimeStatus{Instance: st.Instance, Run: st.RestartCount}
		switch {
		case !vm.DeletionTimestamp.IsZero():
			if a.answer(vm.UID, key+"/gone") {
				base.State = impv1.RuntimeGone
				go a.patch(ctx, vm, base, 0)
			}
		case vm.Labels[noStartLabel] == "true":
		case st.Warm != nil && st.Start == impv1.StartWarm:
			// Handed a member: its guest takes on the claim's identity, then one report.
			if a.answer(vm.UID, key+"/start") {
				now := metav1.Now()
				rt := base
				rt.State, rt.StartedAt, rt.GuestReady, rt.Message = impv1.RuntimeRunning, &now, true, "handed member "+st.Warm.Member
				go a.patch(ctx, vm, rt, a.handover)
			}
		case vm.IsCopy() && vm.RestoreFrom() == "":
			// A copy waits for its template's snapshot, as the real agent does.
		case a.answer(vm.UID, key+"/start"):
			go a.startRun(ctx, vm, base)
		}
	}
	a.snapshots(ctx)
}

// snapshots takes the snapshots given to the node at once, as of the VM they are of.
func (a *simAgent) snapshots(ctx context.Context) {
	var list impv1.ImpVMSnapshotList
	if err := a.informers.List(ctx, &list); err != nil {
		return
	}
	for i := range list.Items {
		s := &list.Items[i]
		if s.Status.NodeName != a.node || s.Status.Phase != impv1.SnapshotPending || !s.DeletionTimestamp.IsZero() {
			continue
		}
		vm := &impv1.ImpVM{}
		if err := a.informers.Get(ctx, types.NamespacedName{Namespace: s.Namespace, Name: s.Spec.VMName}, vm); err != nil || vm.Status.Resources == nil {
			continue
		}
		if !a.answer(s.UID, "taken") {
			continue
		}
		res := vm.Status.Resources
		st := impv1.ImpVMSnapshotStatus{Phase: impv1.SnapshotReady, NodeName: a.node, Source: &impv1.SnapshotSource{VMUID: vm.UID, Image: benchImage,
			VMM: impv1.VMMFirecracker, VCPUs: res.VCPUs, Memory: res.Memory, DiskSize: res.DiskSize, Network: vm.Spec.NetworkRef != nil}}
		p, _ := json.Marshal(map[string]any{"status": st})
		go func() {
			_ = a.c.Status().Patch(ctx, s.DeepCopy(), client.RawPatch(types.MergePatchType, p))
		}()
	}
}

// answer records that the VM's run key is being answered; false when it already was.
func (a *simAgent) answer(uid types.UID, key string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.seen[uid] == key {
		return false
	}
	a.seen[uid] = key
	return true
}

// startRun reports a run as the real agent does: Starting and booting each only when the next
// report does not overtake it within the report delay (agent.Options.StartingReportDelay).
func (a *simAgent) startRun(ctx context.Context, vm *impv1.ImpVM, base impv1.RuntimeStatus) {
	rt := base
	if a.start >= a.delay {
		rt.State, rt.Message = impv1.RuntimeStarting, "preparing disks"
		if !a.patch(ctx, vm, rt, a.delay) {
			return
		}
	}
	if !a.sleep(ctx, a.start-min(a.start, a.delay)) {
		return
	}
	started := metav1.Now()
	rt.State, rt.StartedAt, rt.Message = impv1.RuntimeRunning, &started, "the guest is booting"
	if a.boot >= a.delay {
		if !a.patch(ctx, vm, rt, a.delay) {
			return
		}
	}
	boot := a.boot.Milliseconds()
	rt.GuestReady, rt.BootMilliseconds, rt.Message = true, &boot, "the guest is ready"
	a.patch(ctx, vm, rt, a.boot-min(a.boot, a.delay))
}

func (a *simAgent) sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return true
	}
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}

func (a *simAgent) patch(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus, after time.Duration) bool {
	if !a.sleep(ctx, after) {
		return false
	}
	p, err := runreport.RuntimePatch(rt)
	if err != nil {
		return false
	}
	obj := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: vm.Namespace, Name: vm.Name}}
	return a.c.Status().Patch(ctx, obj, client.RawPatch(types.MergePatchType, p)) == nil
}
