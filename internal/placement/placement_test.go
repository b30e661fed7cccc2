package placement

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

const gi = int64(1) << 30

type nodeOpt func(*Node)

func node(name string, vcpus int32, memGi int64, opts ...nodeOpt) Node {
	n := Node{
		Node: &corev1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{impv1.NodeEnabledLabel: "true"}},
			Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{
				{Type: corev1.NodeReady, Status: corev1.ConditionTrue},
				{Type: corev1.NodeMemoryPressure, Status: corev1.ConditionFalse},
			}},
		},
		Report: &impv1.ImpNode{Status: impv1.ImpNodeStatus{
			Allocatable: &impv1.NodeResources{VCPUs: vcpus, Memory: *resource.NewQuantity(memGi*gi, resource.BinarySI)},
			VMMs:        []impv1.VMMCapability{{Kind: impv1.VMMQEMU, Acceleration: "tcg"}},
			Conditions:  []metav1.Condition{{Type: impv1.ReadyCondition, Status: metav1.ConditionTrue}},
		}},
	}
	for _, o := range opts {
		o(&n)
	}
	return n
}

func cond(t corev1.NodeConditionType, s corev1.ConditionStatus) nodeOpt {
	return func(n *Node) {
		for i := range n.Node.Status.Conditions {
			if n.Node.Status.Conditions[i].Type == t {
				n.Node.Status.Conditions[i].Status = s
				return
			}
		}
		n.Node.Status.Conditions = append(n.Node.Status.Conditions, corev1.NodeCondition{Type: t, Status: s})
	}
}

func req(vcpus int64, memGi int64) Request {
	return Request{VCPUs: vcpus, MemoryBytes: memGi * gi, Labels: (&impv1.ImpVMSpec{}).RequiredNodeLabels()}
}

func TestFits(t *testing.T) {
	tests := []struct {
		name    string
		req     Request
		node    Node
		wantWhy string
	}{
		{name: "fits", req: req(1, 1), node: node("n", 4, 8)},
		{name: "not opted in", req: req(1, 1), node: node("n", 4, 8, func(n *Node) { n.Node.Labels = nil }), wantWhy: whyLabels},
		{name: "selector adds a label the node lacks", req: Request{Labels: (&impv1.ImpVMSpec{NodeSelector: map[string]string{"pool": "a"}}).RequiredNodeLabels()}, node: node("n", 4, 8), wantWhy: whyLabels},
		{name: "cordoned", req: req(1, 1), node: node("n", 4, 8, func(n *Node) { n.Node.Spec.Unschedulable = true }), wantWhy: whyCordoned},
		{name: "not ready", req: req(1, 1), node: node("n", 4, 8, cond(corev1.NodeReady, corev1.ConditionFalse)), wantWhy: whyNotReady},
		{name: "ready unknown", req: req(1, 1), node: node("n", 4, 8, func(n *Node) { n.Node.Status.Conditions = nil }), wantWhy: whyNotReady},
		{name: "memory pressure", req: req(1, 1), node: node("n", 4, 8, cond(corev1.NodeMemoryPressure, corev1.ConditionTrue)), wantWhy: whyMemPressure},
		{name: "disk pressure", req: req(1, 1), node: node("n", 4, 8, cond(corev1.NodeDiskPressure, corev1.ConditionTrue)), wantWhy: whyDiskPress},
		{name: "pid pressure", req: req(1, 1), node: node("n", 4, 8, cond(corev1.NodePIDPressure, corev1.ConditionTrue)), wantWhy: whyPIDPressure},
		{
			name: "untolerated taint", req: req(1, 1), wantWhy: whyTaint,
			node: node("n", 4, 8, func(n *Node) {
				n.Node.Spec.Taints = []corev1.Taint{{Key: "dedicated", Value: "db", Effect: corev1.TaintEffectNoSchedule}}
			}),
		},
		{
			name: "tolerated taint",
			req: func() Request {
				r := req(1, 1)
				r.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpEqual, Value: "db", Effect: corev1.TaintEffectNoSchedule}}
				return r
			}(),
			node: node("n", 4, 8, func(n *Node) {
				n.Node.Spec.Taints = []corev1.Taint{{Key: "dedicated", Value: "db", Effect: corev1.TaintEffectNoSchedule}}
			}),
		},
		{
			name: "PreferNoSchedule does not exclude", req: req(1, 1),
			node: node("n", 4, 8, func(n *Node) {
				n.Node.Spec.Taints = []corev1.Taint{{Key: "soft", Effect: corev1.TaintEffectPreferNoSchedule}}
			}),
		},
		{
			name: "condition taints are read as their conditions", req: req(1, 1),
			node: node("n", 4, 8, func(n *Node) {
				n.Node.Spec.Taints = []corev1.Taint{{Key: corev1.TaintNodeNotReady, Effect: corev1.TaintEffectNoSchedule}}
			}),
		},
		{name: "no agent report", req: req(1, 1), node: node("n", 4, 8, func(n *Node) { n.Report = nil }), wantWhy: whyNoAgent},
		{name: "agent not ready", req: req(1, 1), node: node("n", 4, 8, func(n *Node) { n.Report.Status.Conditions[0].Status = metav1.ConditionFalse }), wantWhy: whyNoAgent},
		{name: "agent stopped reporting", req: req(1, 1), node: node("n", 4, 8, func(n *Node) { n.AgentSilent = true }), wantWhy: whyAgentSilent},
		{name: "VMM not offered", req: Request{VMM: impv1.VMMFirecracker, Labels: req(1, 1).Labels}, node: node("n", 4, 8), wantWhy: whyNoVMM},
		{name: "VMM offered", req: Request{VMM: impv1.VMMQEMU, Labels: req(1, 1).Labels}, node: node("n", 4, 8)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ok, why := Fits(tt.req, tt.node)
			if ok != (tt.wantWhy == "") || why != tt.wantWhy {
				t.Errorf("Fits = %v, %q; want why %q", ok, why, tt.wantWhy)
			}
		})
	}
}

func TestPlaceChoosesMostFreeMemoryThenName(t *testing.T) {
	l := NewLedger()
	nodes := []Node{node("b", 8, 8), node("a", 8, 8), node("c", 8, 4)}
	var got []string
	for i := 0; i < 7; i++ {
		n, err := l.Place(types.UID(fmt.Sprint(i)), req(1, 2), nodes)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, n)
	}
	// a and b tie at 8Gi free: a first, then b (8Gi > 6Gi), a, b; at 4Gi all three tie: a, then
	// b (4Gi > a's 2Gi), then c (4Gi > 2Gi, 2Gi).
	if want := "a b a b a b c"; strings.Join(got, " ") != want {
		t.Errorf("placements = %v, want %s", got, want)
	}
}

func TestPlaceIsIdempotentAndReleases(t *testing.T) {
	l := NewLedger()
	nodes := []Node{node("a", 2, 2)}
	first, err := l.Place("vm", req(2, 2), nodes)
	if err != nil {
		t.Fatal(err)
	}
	again, err := l.Place("vm", req(2, 2), nodes)
	if err != nil || again != first {
		t.Fatalf("second Place of the same VM = %q, %v; want %q", again, err, first)
	}
	if _, err := l.Place("other", req(1, 1), nodes); err == nil {
		t.Fatal("a full node took another VM")
	}
	l.Release("vm")
	if cpu, mem := l.Used("a"); cpu != 0 || mem != 0 {
		t.Errorf("after release node a holds %d vCPUs, %d bytes", cpu, mem)
	}
	if _, err := l.Place("other", req(1, 1), nodes); err != nil {
		t.Errorf("released capacity not reusable: %v", err)
	}
}

func TestUnschedulableMessageCountsReasons(t *testing.T) {
	l := NewLedger()
	l.Hold("big", Holding{Node: "full", VCPUs: 1, Memory: 8 * gi})
	nodes := []Node{
		node("full", 8, 8),
		node("nr", 8, 8, cond(corev1.NodeReady, corev1.ConditionFalse)),
		node("mp", 8, 8, cond(corev1.NodeMemoryPressure, corev1.ConditionTrue)),
		node("small", 1, 64),
	}
	_, err := l.Place("vm", req(2, 1), nodes)
	var u *Unschedulable
	if !errors.As(err, &u) {
		t.Fatalf("want *Unschedulable, got %v", err)
	}
	want := "0/4 nodes are available: 1 are not Ready, 1 have MemoryPressure, 1 have too few free vCPUs, 1 have too little free memory"
	if u.Message != want {
		t.Errorf("message = %q\nwant      %q", u.Message, want)
	}
}

// TestPlaceConcurrentNeverOverbooks races many placements against few nodes.
func TestPlaceConcurrentNeverOverbooks(t *testing.T) {
	l := NewLedger()
	nodes := []Node{node("a", 4, 4), node("b", 4, 4), node("c", 4, 4)}
	var wg sync.WaitGroup
	var mu sync.Mutex
	placed := 0
	for i := 0; i < 100; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := l.Place(types.UID(fmt.Sprint(i)), req(1, 1), nodes); err == nil {
				mu.Lock()
				placed++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if placed != 12 {
		t.Errorf("placed %d VMs of 1 vCPU/1Gi on 3 nodes of 4 vCPUs/4Gi, want 12", placed)
	}
	for _, n := range []string{"a", "b", "c"} {
		if cpu, mem := l.Used(n); cpu != 4 || mem != 4*gi {
			t.Errorf("node %s holds %d vCPUs, %d bytes", n, cpu, mem)
		}
	}
}

// TestPlaceCountsVMMOverhead: each VM holds its memory plus what its node reports a VMM of
// the kind it runs under holds beyond it, so many small VMs cannot overrun a node.
func TestPlaceCountsVMMOverhead(t *testing.T) {
	withOverhead := func(n *Node) {
		n.Report.Status.VMMs = []impv1.VMMCapability{
			{Kind: impv1.VMMFirecracker, Acceleration: "kvm", MemoryOverhead: resource.NewQuantity(8<<20, resource.BinarySI)},
			{Kind: impv1.VMMQEMU, Acceleration: "kvm", MemoryOverhead: resource.NewQuantity(64<<20, resource.BinarySI)},
		}
	}
	for _, tt := range []struct {
		name string
		vmm  impv1.VMMKind
		want int // VMs of 128 MiB placed on a node offering 1 GiB
	}{
		{"the node's best (firecracker, 8 MiB each)", "", 7},
		{"qemu (64 MiB each)", impv1.VMMQEMU, 5},
	} {
		t.Run(tt.name, func(t *testing.T) {
			l := NewLedger()
			nodes := []Node{node("n", 64, 1, withOverhead)}
			placed := 0
			for i := range 20 {
				if _, err := l.Place(types.UID(fmt.Sprint(i)), Request{VCPUs: 1, MemoryBytes: 128 << 20, VMM: tt.vmm}, nodes); err == nil {
					placed++
				}
			}
			if placed != tt.want {
				t.Errorf("placed %d VMs, want %d", placed, tt.want)
			}
			if _, mem := l.Used("n"); mem > gi {
				t.Errorf("the node holds %d bytes, more than its 1 GiB", mem)
			}
		})
	}
}

// TestPlaceEnforcesQuotas: the ledger counts what each namespace holds and refuses a VM that
// would take it past a quota, naming the quota, the limit and the amounts; namespaces are
// apart; a release makes room; suspensions count against suspendedMemory.
func TestPlaceEnforcesQuotas(t *testing.T) {
	i64 := func(n int64) *int64 { return &n }
	nodes := []Node{node("n", 64, 64)}
	for _, tt := range []struct {
		name    string
		quota   Quota
		vm      Request
		placed  int
		message string
	}{
		{"vms", Quota{Name: "q", VMs: i64(2)}, req(1, 1), 2, "ImpQuota q: vms 2 of 2 used, asked 1"},
		{"vcpus", Quota{Name: "q", VCPUs: i64(5)}, req(2, 1), 2, "ImpQuota q: vcpus 4 of 5 used, asked 2"},
		{"memory", Quota{Name: "q", Memory: i64(3 * gi)}, req(1, 1), 3, "ImpQuota q: memory 3Gi of 3Gi used, asked 1Gi"},
		{"disk", Quota{Name: "q", Disk: i64(10 * gi)}, Request{VCPUs: 1, MemoryBytes: gi, DiskBytes: 4 * gi}, 2, "ImpQuota q: disk 8Gi of 10Gi used, asked 4Gi"},
		{"unbounded", Quota{Name: "q"}, req(1, 1), 6, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			l := NewLedger()
			r := tt.vm
			r.Namespace, r.Quotas = "team", []Quota{tt.quota}
			placed, msg := 0, ""
			for i := range 6 {
				_, err := l.Place(types.UID(fmt.Sprint(i)), r, nodes)
				var qe *QuotaExceeded
				switch {
				case err == nil:
					placed++
				case errors.As(err, &qe):
					msg = qe.Message
				default:
					t.Fatal(err)
				}
			}
			if placed != tt.placed || msg != tt.message {
				t.Errorf("placed %d, refused with %q; want %d, %q", placed, msg, tt.placed, tt.message)
			}
			// Another namespace is not bounded by this one's quota.
			other := tt.vm
			other.Namespace = "other"
			if _, err := l.Place("other", other, nodes); err != nil {
				t.Errorf("a VM of another namespace: %v", err)
			}
			if tt.message != "" {
				l.Release("0")
				if _, err := l.Place("again", r, nodes); err != nil {
					t.Errorf("after a release: %v", err)
				}
			}
		})
	}

	l := NewLedger()
	for _, uid := range []types.UID{"a", "b"} {
		l.Hold(uid, Holding{Node: "n", Namespace: "team", VCPUs: 1, Memory: gi})
	}
	q := []Quota{{Name: "q", SuspendedMemory: i64(gi)}}
	if why := l.Suspend("a", q); why != "" {
		t.Fatalf("the first suspension was refused: %s", why)
	}
	if why := l.Suspend("b", q); why != "ImpQuota q: suspendedMemory 1Gi of 1Gi used, asked 1Gi" {
		t.Errorf("the second suspension: %q", why)
	}
	l.Resume("a")
	if why := l.Suspend("b", q); why != "" {
		t.Errorf("after a resume: %q", why)
	}
	if u := l.NamespaceUsage("team"); u != (Usage{VMs: 2, VCPUs: 2, Memory: 2 * gi, SuspendedMemory: gi}) {
		t.Errorf("usage %+v", u)
	}
}

// TestPlaceCountsDisk: a node whose report carries disk takes VMs while their diskSizes fit in
// it, and says so when one does not; a node that reports no disk (an older agent) bounds none.
func TestPlaceCountsDisk(t *testing.T) {
	withDisk := func(giB int64) nodeOpt {
		return func(n *Node) { n.Report.Status.Allocatable.Disk = resource.NewQuantity(giB*gi, resource.BinarySI) }
	}
	disk := func(r Request, giB int64) Request { r.DiskBytes = giB * gi; return r }
	tests := []struct {
		name   string
		nodes  []Node
		placed []int64 // diskSizes of VMs placed first, in GiB
		ask    int64
		want   string // node, or "" when unschedulable
	}{
		{"fits", []Node{node("a", 8, 8, withDisk(10))}, []int64{4, 4}, 2, "a"},
		{"full", []Node{node("a", 8, 8, withDisk(10))}, []int64{4, 4}, 3, ""},
		{"the other node fits", []Node{node("a", 8, 8, withDisk(10)), node("b", 8, 2, withDisk(100))}, []int64{9}, 5, "b"},
		{"no disk reported", []Node{node("a", 8, 8)}, []int64{400}, 400, "a"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := NewLedger()
			for i, d := range tt.placed {
				if _, err := l.Place(types.UID(fmt.Sprint("vm", i)), disk(req(1, 1), d), tt.nodes[:1]); err != nil {
					t.Fatal(err)
				}
			}
			got, err := l.Place("new", disk(req(1, 1), tt.ask), tt.nodes)
			if tt.want == "" {
				var u *Unschedulable
				if !errors.As(err, &u) || !strings.Contains(u.Message, "too little free disk") {
					t.Errorf("Place = %q, %v; want unschedulable for disk", got, err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Errorf("Place = %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}

// BenchmarkPlace places VMs over 1,000 nodes, one at a time and from 4 goroutines (the
// operator's workers): go test -run '^$' -bench Place ./internal/placement/
func BenchmarkPlace(b *testing.B) {
	nodes := make([]Node, 1000)
	for i := range nodes {
		nodes[i] = node(fmt.Sprintf("node-%04d", i), 1<<20, 1<<20)
	}
	r := req(1, 1)
	b.Run("serial", func(b *testing.B) {
		l := NewLedger()
		for i := 0; b.Loop(); i++ {
			if _, err := l.Place(types.UID(fmt.Sprint(i)), r, nodes); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("parallel", func(b *testing.B) {
		l := NewLedger()
		var n sync.Mutex
		i := 0
		b.SetParallelism(2) // 4 workers on 2 cores
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				n.Lock()
				i++
				uid := types.UID(fmt.Sprint(i))
				n.Unlock()
				if _, err := l.Place(uid, r, nodes); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
}

// TestWhatStaysOnDiskIsCounted (issue 27, item 6): a VM that ended frees its vCPUs, memory
// and place among the quota's VMs, but its disk holds its node's disk and its namespace's disk
// quota until Release (its node removed it); a suspended VM's memory file holds its node's disk.
func TestWhatStaysOnDiskIsCounted(t *testing.T) {
	n := node("a", 8, 8, func(n *Node) { n.Report.Status.Allocatable.Disk = resource.NewQuantity(10*gi, resource.BinarySI) })
	disk := func(r Request, giB int64) Request { r.DiskBytes, r.Namespace = giB*gi, "team"; return r }
	q := []Quota{{Name: "q", Disk: &[]int64{10 * gi}[0]}}
	l := NewLedger()
	if _, err := l.Place("once", disk(req(4, 4), 8), []Node{n}); err != nil {
		t.Fatal(err)
	}
	l.Finish("once")
	l.Finish("once") // idempotent
	if u := l.NamespaceUsage("team"); u != (Usage{Disk: 8 * gi}) {
		t.Errorf("usage of the ended VM %+v; want its disk alone", u)
	}
	if vcpus, mem := l.Used("a"); vcpus != 0 || mem != 0 {
		t.Errorf("the ended VM holds %d vCPUs, %d bytes", vcpus, mem)
	}
	// Its disk still fills the node, and the quota: another of 8 GiB fits in neither.
	var u *Unschedulable
	if _, err := l.Place("next", disk(req(1, 1), 8), []Node{n}); !errors.As(err, &u) || !strings.Contains(u.Message, "too little free disk") {
		t.Errorf("a VM placed on the ended VM's disk: %v", err)
	}
	r := disk(req(1, 1), 4)
	r.Quotas = q
	var qe *QuotaExceeded
	if _, err := l.Place("next", r, []Node{n}); !errors.As(err, &qe) || qe.Message != "ImpQuota q: disk 8Gi of 10Gi used, asked 4Gi" {
		t.Errorf("the quota with an ended VM's disk: %v", err)
	}
	// Its node removed the disk.
	l.Release("once")
	if _, err := l.Place("next", disk(req(1, 1), 8), []Node{n}); err != nil {
		t.Errorf("after the disk went: %v", err)
	}
	l.Release("next")

	// A suspended VM's memory is on the node's disk.
	if _, err := l.Place("s", disk(req(1, 4), 2), []Node{n}); err != nil {
		t.Fatal(err)
	}
	if why := l.Suspend("s", nil); why != "" {
		t.Fatal(why)
	}
	if _, err := l.Place("t", disk(req(1, 1), 5), []Node{n}); !errors.As(err, &u) {
		t.Errorf("a VM placed on a suspended VM's memory file: %v", err)
	}
	l.Resume("s")
	if _, err := l.Place("t", disk(req(1, 1), 5), []Node{n}); err != nil {
		t.Errorf("after the resume: %v", err)
	}
}

// TestClaimsAreHeldAlone: a VM holding a claim alone keeps every other VM naming it unplaced,
// across a rebuild of the ledger from the VMs' holdings; an ended VM, or a released one, frees it.
func TestClaimsAreHeldAlone(t *testing.T) {
	nodes := []Node{node("a", 8, 8)}
	l := NewLedger()
	withClaim := func(vm string) Request { r := req(1, 1); r.VM, r.Claims = vm, []string{"ns/data"}; return r }
	if _, err := l.Place("u1", withClaim("first"), nodes); err != nil {
		t.Fatal(err)
	}
	var inUse *ClaimInUse
	if _, err := l.Place("u2", withClaim("second"), nodes); !errors.As(err, &inUse) || inUse.By != "first" || inUse.Claim != "ns/data" {
		t.Fatalf("a second VM naming the claim: %v", err)
	}
	if _, err := l.Place("u3", req(1, 1), nodes); err != nil {
		t.Errorf("a VM without the claim: %v", err)
	}
	// Rebuilt from the holdings (an operator restart).
	l2 := NewLedger()
	l2.Hold("u1", Holding{Node: "a", VCPUs: 1, Memory: gi, VM: "first", Claims: []string{"ns/data"}})
	if _, err := l2.Place("u2", withClaim("second"), nodes); !errors.As(err, &inUse) {
		t.Errorf("after a rebuild, a second VM naming the claim: %v", err)
	}
	l2.Finish("u1")
	if _, err := l2.Place("u2", withClaim("second"), nodes); err != nil {
		t.Errorf("after the holder ended: %v", err)
	}
	l.Release("u1")
	if _, err := l.Place("u2", withClaim("second"), nodes); err != nil {
		t.Errorf("after the holder was released: %v", err)
	}
}

// TestHandMovesAHolding: a warm pool member's holding becomes its claim's, on its node: the
// node's and the namespace's usage do not change; a retry returns the claim's node; a VM that
// holds nothing hands nothing.
func TestHandMovesAHolding(t *testing.T) {
	l := NewLedger()
	l.Hold("member", Holding{Node: "n1", Namespace: "ns", VCPUs: 2, Memory: 512 << 20, Overhead: 32 << 20, Disk: 1 << 30, VM: "p-x"})
	vcpus, mem := l.Used("n1")
	usage := l.NamespaceUsage("ns")
	node, ok := l.Hand("member", "claim", "c")
	if !ok || node != "n1" {
		t.Fatalf("Hand = %q, %v; want n1", node, ok)
	}
	if v, m := l.Used("n1"); v != vcpus || m != mem {
		t.Errorf("the node's usage went from %d vCPUs, %d B to %d, %d", vcpus, mem, v, m)
	}
	if u := l.NamespaceUsage("ns"); u != usage {
		t.Errorf("the namespace's usage went from %+v to %+v", usage, u)
	}
	if _, held := l.NodeOf("member"); held {
		t.Error("the member still holds its node")
	}
	if n, held := l.NodeOf("claim"); !held || n != "n1" {
		t.Errorf("the claim holds %q, %v", n, held)
	}
	if node, ok := l.Hand("member", "claim", "c"); !ok || node != "n1" {
		t.Errorf("a retry: %q, %v", node, ok)
	}
	if _, ok := l.Hand("nobody", "other", "o"); ok {
		t.Error("a VM that holds nothing handed something")
	}
}
