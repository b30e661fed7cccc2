// Package placement decides which node an ImpVM runs on. It is pure logic over a snapshot of
// nodes plus a Ledger of what placed VMs hold; the ImpVM reconciler feeds it and commits its
// decisions to the API.
//
// A node fits a VM when it carries every required label (imp/enabled=true always among them),
// is Ready and schedulable, has no memory, disk or PID pressure, every NoSchedule/NoExecute
// taint is tolerated, its agent reports Ready, keeps reporting and offers the VMM the VM asks for, and its
// allocatable vCPUs and memory minus what the ledger says placed VMs hold cover the VM.
// Among fitting nodes the one with the most free memory wins, then the lexically first name,
// so that decisions are deterministic.
package placement

import (
	"fmt"
	"sort"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// Request is what a VM needs of a node, and the quotas of its namespace.
type Request struct {
	VCPUs       int64
	MemoryBytes int64
	VMM         impv1.VMMKind // empty: any
	Labels      labels.Set    // required node labels
	Tolerations []corev1.Toleration
	// Namespace, DiskBytes and Quotas: what the VM counts against its namespace's quotas.
	Namespace string
	DiskBytes int64
	Quotas    []Quota
	// VM names the VM (for messages); Claims are the PersistentVolumeClaims ("namespace/name")
	// it must hold alone (ReadWriteOnce): no other VM of the ledger may hold one of them.
	VM     string
	Claims []string
	// Room is what the node must have free beside the VM, without holding it: a copy of a
	// template placed where the template's snapshot is still to be made leaves room for the VM
	// that makes it (with its VMM's overhead).
	Room *Room
}

// ClaimInUse is returned when a claim the VM must hold alone is held by another VM.
type ClaimInUse struct{ Claim, By string }

func (c *ClaimInUse) Error() string {
	return fmt.Sprintf("PersistentVolumeClaim %s is ReadWriteOnce and attached to VM %s: the VM waits until that VM is gone", c.Claim, c.By)
}

// Room is capacity a placement leaves free on its node.
type Room struct {
	VCPUs, MemoryBytes, DiskBytes int64
}

// Quota is one ImpQuota of a namespace as placement enforces it: nil is unbounded.
type Quota struct {
	Name                                      string
	VMs, VCPUs, Memory, Disk, SuspendedMemory *int64
}

// Usage is what the VMs of a namespace that hold a placement hold together.
type Usage struct {
	VMs, VCPUs, Memory, Disk, SuspendedMemory int64
}

// QuotaExceeded is returned when placing a VM would take its namespace past a quota.
type QuotaExceeded struct{ Message string }

func (q *QuotaExceeded) Error() string { return q.Message }

// exceeds returns why adding req to used passes q, or "".
func (q Quota) exceeds(used Usage, req Request) string {
	for _, c := range []struct {
		name        string
		hard        *int64
		used, asked int64
		bytes       bool
	}{
		{"vms", q.VMs, used.VMs, 1, false},
		{"vcpus", q.VCPUs, used.VCPUs, req.VCPUs, false},
		{"memory", q.Memory, used.Memory, req.MemoryBytes, true},
		{"disk", q.Disk, used.Disk, req.DiskBytes, true},
	} {
		if c.hard == nil || c.used+c.asked <= *c.hard {
			continue
		}
		f := func(n int64) string {
			if c.bytes {
				return resource.NewQuantity(n, resource.BinarySI).String()
			}
			return fmt.Sprint(n)
		}
		return fmt.Sprintf("ImpQuota %s: %s %s of %s used, asked %s", q.Name, c.name, f(c.used), f(*c.hard), f(c.asked))
	}
	return ""
}

// Node is a node as placement sees it: the Node object and its agent's report (nil when the
// node's agent never reported), and whether that agent has stopped reporting.
type Node struct {
	Node   *corev1.Node
	Report *impv1.ImpNode
	// AgentSilent: the agent's heartbeat has not changed within the operator's bound; its
	// report may describe a node that no longer runs anything.
	AgentSilent bool
}

// Why a node does not fit, as counted in an Unschedulable message.
const (
	whyLabels      = "do not match the VM's node selector (imp/enabled=true is required)"
	whyNotReady    = "are not Ready"
	whyCordoned    = "are unschedulable"
	whyMemPressure = "have MemoryPressure"
	whyDiskPress   = "have DiskPressure"
	whyPIDPressure = "have PIDPressure"
	whyTaint       = "have a taint the VM does not tolerate"
	whyNoAgent     = "have no ready IMP agent"
	whyAgentSilent = "have an IMP agent that stopped reporting"
	whyNoVMM       = "do not offer the VMM the VM asks for"
	whyNoCPU       = "have too few free vCPUs"
	whyNoMemory    = "have too little free memory"
	whyNoDisk      = "have too little free disk for the VM's diskSize and disk volumes"
)

// Fits reports whether n can take a VM asking for req, ignoring capacity, and if not, why.
func Fits(req Request, n Node) (bool, string) {
	return fits(req, labels.SelectorFromSet(req.Labels), n)
}

// fits is Fits with req.Labels as a selector, made once for all the nodes.
func fits(req Request, sel labels.Selector, n Node) (bool, string) {
	node := n.Node
	switch {
	case !sel.Matches(labels.Set(node.Labels)):
		return false, whyLabels
	case node.Spec.Unschedulable:
		return false, whyCordoned
	case nodeCondition(node, corev1.NodeReady) != corev1.ConditionTrue:
		return false, whyNotReady
	case nodeCondition(node, corev1.NodeMemoryPressure) == corev1.ConditionTrue:
		return false, whyMemPressure
	case nodeCondition(node, corev1.NodeDiskPressure) == corev1.ConditionTrue:
		return false, whyDiskPress
	case nodeCondition(node, corev1.NodePIDPressure) == corev1.ConditionTrue:
		return false, whyPIDPressure
	case !tolerates(req.Tolerations, node.Spec.Taints):
		return false, whyTaint
	case n.Report == nil || n.Report.Status.Allocatable == nil ||
		!meta.IsStatusConditionTrue(n.Report.Status.Conditions, impv1.ReadyCondition):
		return false, whyNoAgent
	case n.AgentSilent:
		return false, whyAgentSilent
	case !offers(n.Report, req.VMM):
		return false, whyNoVMM
	}
	return true, ""
}

func nodeCondition(n *corev1.Node, t corev1.NodeConditionType) corev1.ConditionStatus {
	for _, c := range n.Status.Conditions {
		if c.Type == t {
			return c.Status
		}
	}
	return corev1.ConditionUnknown
}

// conditionTaints are the taints Kubernetes' node lifecycle controller derives from node
// conditions and spec.unschedulable. Placement reads those conditions itself, first hand, so
// these taints neither add to nor relax its rules (a VM tolerating memory-pressure still never
// lands on a node under MemoryPressure).
var conditionTaints = map[string]bool{
	corev1.TaintNodeNotReady:           true,
	corev1.TaintNodeUnreachable:        true,
	corev1.TaintNodeUnschedulable:      true,
	corev1.TaintNodeMemoryPressure:     true,
	corev1.TaintNodeDiskPressure:       true,
	corev1.TaintNodePIDPressure:        true,
	corev1.TaintNodeNetworkUnavailable: true,
}

func tolerates(tols []corev1.Toleration, taints []corev1.Taint) bool {
	for i := range taints {
		taint := &taints[i]
		if taint.Effect == corev1.TaintEffectPreferNoSchedule || conditionTaints[taint.Key] {
			continue
		}
		ok := false
		for j := range tols {
			if tols[j].ToleratesTaint(klog.Background(), taint, false) {
				ok = true
				break
			}
		}
		if !ok {
			return false
		}
	}
	return true
}

func offers(r *impv1.ImpNode, kind impv1.VMMKind) bool {
	if len(r.Status.VMMs) == 0 {
		return false
	}
	if kind == "" {
		return true
	}
	for _, v := range r.Status.VMMs {
		if v.Kind == kind {
			return true
		}
	}
	return false
}

// Unschedulable is returned when no node fits; its message counts the reasons the way
// kube-scheduler does ("0/5 nodes are available: 2 are not Ready, 3 have too little free memory").
type Unschedulable struct{ Message string }

func (u *Unschedulable) Error() string { return u.Message }

type holding struct {
	node   string
	vcpus  int64
	memory int64 // on the node: the guest's and its VMM's
	// What the VM counts against its namespace's quotas.
	namespace   string
	guestMemory int64
	disk        int64
	suspended   bool
	// finished: the VM ended (Succeeded or Failed) and holds its disk alone, until its node
	// removes it.
	finished bool
	// vm and claims: the VM's name and the claims it holds alone.
	vm     string
	claims []string
}

// nodeDisk is what h holds of its node's disk: its disk, and a suspended VM's memory file.
func (h holding) nodeDisk() int64 {
	if h.suspended {
		return h.disk + h.guestMemory
	}
	return h.disk
}

// Holding is what a placed VM holds: on its node, vCPUs and its guest's memory plus its VMM's
// overhead; in its namespace, vCPUs, its guest's memory and its disk.
type Holding struct {
	Node, Namespace               string
	VCPUs, Memory, Overhead, Disk int64
	// Suspended: the VM is suspended or being suspended (its memory counts as such, and its
	// memory file against the node's disk).
	Suspended bool
	// Finished: the VM ended (Succeeded or Failed) and its disks are still on its node: it
	// holds its disk there and in its namespace, nothing else, and is no VM of the quota.
	Finished bool
	// VM and Claims: as a Request's.
	VM     string
	Claims []string
}

// Ledger counts what placed VMs hold on each node. It is the operator's memory of its own
// decisions: a decision is counted the moment it is made, before the API write that commits it,
// so that concurrent reconciles can never overbook a node; it is rebuilt from the API (every VM
// with a node) when the operator starts.
type Ledger struct {
	mu      sync.Mutex
	byVM    map[types.UID]holding
	usage   map[string]holding   // per node: vcpus, memory and disk held
	nsUsage map[string]Usage     // per namespace
	claims  map[string]types.UID // claim held alone → the VM holding it
}

// NewLedger returns an empty ledger.
func NewLedger() *Ledger {
	return &Ledger{byVM: map[types.UID]holding{}, usage: map[string]holding{}, nsUsage: map[string]Usage{}, claims: map[string]types.UID{}}
}

// Hold records what VM uid holds. It is idempotent, and moves the holding when the VM is now on
// another node.
func (l *Ledger) Hold(uid types.UID, h Holding) {
	l.mu.Lock()
	defer l.mu.Unlock()
	hh := holding{node: h.Node, vcpus: h.VCPUs, memory: h.Memory + h.Overhead, namespace: h.Namespace, guestMemory: h.Memory, disk: h.Disk,
		suspended: h.Suspended, vm: h.VM, claims: h.Claims}
	if h.Finished {
		hh = finished(hh)
	}
	l.hold(uid, hh)
}

// finished is what h holds once its VM ended: its disk.
func finished(h holding) holding {
	return holding{node: h.node, namespace: h.namespace, disk: h.disk, finished: true}
}

// Finish counts VM uid, which ended, as holding its disk alone: its vCPUs and memory are free,
// its disk is not until Release (when its node removed it).
func (l *Ledger) Finish(uid types.UID) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if h, ok := l.byVM[uid]; ok && !h.finished {
		l.hold(uid, finished(h))
	}
}

// Suspend counts VM uid's memory as suspended, unless that takes its namespace past one of
// quotas; it returns why it did not. A VM that holds nothing, or is counted already, passes.
func (l *Ledger) Suspend(uid types.UID, quotas []Quota) (refused string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	h, ok := l.byVM[uid]
	if !ok || h.suspended {
		return ""
	}
	used := l.nsUsage[h.namespace]
	for _, q := range quotas {
		if q.SuspendedMemory != nil && used.SuspendedMemory+h.guestMemory > *q.SuspendedMemory {
			f := func(n int64) string { return resource.NewQuantity(n, resource.BinarySI).String() }
			return fmt.Sprintf("ImpQuota %s: suspendedMemory %s of %s used, asked %s", q.Name, f(used.SuspendedMemory), f(*q.SuspendedMemory), f(h.guestMemory))
		}
	}
	h.suspended = true
	l.hold(uid, h)
	return ""
}

// Resume stops counting VM uid's memory as suspended.
func (l *Ledger) Resume(uid types.UID) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if h, ok := l.byVM[uid]; ok && h.suspended {
		h.suspended = false
		l.hold(uid, h)
	}
}

func (l *Ledger) hold(uid types.UID, h holding) {
	l.release(uid)
	l.byVM[uid] = h
	for _, c := range h.claims {
		l.claims[c] = uid
	}
	u := l.usage[h.node]
	u.vcpus += h.vcpus
	u.memory += h.memory
	u.disk += h.nodeDisk()
	l.usage[h.node] = u
	n := l.nsUsage[h.namespace]
	if !h.finished {
		n.VMs++
	}
	n.VCPUs += h.vcpus
	n.Memory += h.guestMemory
	n.Disk += h.disk
	if h.suspended {
		n.SuspendedMemory += h.guestMemory
	}
	l.nsUsage[h.namespace] = n
}

// NamespaceUsage returns what the placed VMs of namespace ns hold.
func (l *Ledger) NamespaceUsage(ns string) Usage {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.nsUsage[ns]
}

// Release forgets what VM uid holds.
func (l *Ledger) Release(uid types.UID) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.release(uid)
}

func (l *Ledger) release(uid types.UID) {
	h, ok := l.byVM[uid]
	if !ok {
		return
	}
	delete(l.byVM, uid)
	for _, c := range h.claims {
		if l.claims[c] == uid {
			delete(l.claims, c)
		}
	}
	u := l.usage[h.node]
	u.vcpus -= h.vcpus
	u.memory -= h.memory
	u.disk -= h.nodeDisk()
	if u.vcpus == 0 && u.memory == 0 && u.disk == 0 {
		delete(l.usage, h.node)
	} else {
		l.usage[h.node] = u
	}
	n := l.nsUsage[h.namespace]
	if !h.finished {
		n.VMs--
	}
	n.VCPUs -= h.vcpus
	n.Memory -= h.guestMemory
	n.Disk -= h.disk
	if h.suspended {
		n.SuspendedMemory -= h.guestMemory
	}
	if n == (Usage{}) {
		delete(l.nsUsage, h.namespace)
	} else {
		l.nsUsage[h.namespace] = n
	}
}

// Hand moves what VM from holds to VM to, named vm (a warm pool's member handed to a claim:
// the same guest, now the claim's). The namespace's usage and the node's do not change. It
// returns the node to holds, and false when neither holds anything. A retry (to holds already)
// returns to's node.
func (l *Ledger) Hand(from, to types.UID, vm string) (string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if have, ok := l.byVM[to]; ok {
		return have.node, true
	}
	h, ok := l.byVM[from]
	if !ok {
		return "", false
	}
	l.release(from)
	h.vm = vm
	l.hold(to, h)
	return h.node, true
}

// NodeOf returns the node VM uid holds resources on.
func (l *Ledger) NodeOf(uid types.UID) (string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	h, ok := l.byVM[uid]
	return h.node, ok
}

// Used returns the vCPUs and memory (bytes) held on node.
func (l *Ledger) Used(node string) (vcpus, memory int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	u := l.usage[node]
	return u.vcpus, u.memory
}

// Overhead is the memory the VMM that a VM asking for kind ("" for the node's best) would run
// under holds on node n beyond the VM's memory, as n's agent reports it.
func Overhead(n Node, kind impv1.VMMKind) int64 {
	if n.Report == nil {
		return 0
	}
	for _, v := range n.Report.Status.VMMs {
		if kind == "" || v.Kind == kind {
			if v.MemoryOverhead != nil {
				return v.MemoryOverhead.Value()
			}
			return 0
		}
	}
	return 0
}

// Place chooses a node for VM uid among nodes and holds req's resources there, with the memory
// overhead of the VMM it will run under (Overhead), atomically with respect to every other
// Place. A VM that already holds a node gets that node again.
//
// What does not depend on what other VMs hold (labels, conditions, taints, the agent, the VMM)
// is checked before taking the ledger's lock, so that concurrent placements wait for each
// other only while the free capacity of the nodes that fit is compared.
func (l *Ledger) Place(uid types.UID, req Request, nodes []Node) (string, error) {
	why := map[string]int{}
	sel := labels.SelectorFromSet(req.Labels)
	type candidate struct {
		name             string
		vcpus, mem, disk int64 // allocatable; disk -1 when not reported
		overhead         int64
	}
	fit := make([]candidate, 0, len(nodes))
	for _, n := range nodes {
		if ok, reason := fits(req, sel, n); !ok {
			why[reason]++
			continue
		}
		alloc := n.Report.Status.Allocatable
		c := candidate{name: n.Node.Name, vcpus: int64(alloc.VCPUs), mem: alloc.Memory.Value(), disk: -1, overhead: Overhead(n, req.VMM)}
		if alloc.Disk != nil {
			c.disk = alloc.Disk.Value()
		}
		fit = append(fit, c)
	}

	l.mu.Lock()
	defer l.mu.Unlock()
	if h, ok := l.byVM[uid]; ok {
		return h.node, nil
	}
	for _, c := range req.Claims {
		if by, ok := l.claims[c]; ok && by != uid {
			return "", &ClaimInUse{Claim: c, By: l.byVM[by].vm}
		}
	}
	for _, q := range req.Quotas {
		if why := q.exceeds(l.nsUsage[req.Namespace], req); why != "" {
			return "", &QuotaExceeded{Message: why}
		}
	}
	room := Room{}
	if req.Room != nil {
		room = *req.Room
	}
	best, bestFree, bestOverhead := "", int64(-1), int64(0)
	for _, c := range fit {
		used := l.usage[c.name]
		freeMem := c.mem - used.memory
		roomMem := room.MemoryBytes
		if roomMem > 0 {
			roomMem += c.overhead
		}
		switch {
		case c.vcpus-used.vcpus < req.VCPUs+room.VCPUs:
			why[whyNoCPU]++
		case freeMem < req.MemoryBytes+c.overhead+roomMem:
			why[whyNoMemory]++
		case c.disk >= 0 && c.disk-used.disk < req.DiskBytes+room.DiskBytes:
			why[whyNoDisk]++
		case freeMem > bestFree || (freeMem == bestFree && c.name < best):
			best, bestFree, bestOverhead = c.name, freeMem, c.overhead
		}
	}
	if best == "" {
		return "", &Unschedulable{Message: unschedulableMessage(len(nodes), why)}
	}
	l.hold(uid, holding{node: best, vcpus: req.VCPUs, memory: req.MemoryBytes + bestOverhead,
		namespace: req.Namespace, guestMemory: req.MemoryBytes, disk: req.DiskBytes, vm: req.VM, claims: req.Claims})
	return best, nil
}

func unschedulableMessage(total int, why map[string]int) string {
	reasons := make([]string, 0, len(why))
	for r, n := range why {
		reasons = append(reasons, fmt.Sprintf("%d %s", n, r))
	}
	sort.Strings(reasons)
	msg := fmt.Sprintf("0/%d nodes are available", total)
	if len(reasons) > 0 {
		msg += ": " + strings.Join(reasons, ", ")
	}
	return msg
}
