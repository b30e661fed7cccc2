package impvm_test

import (
	"context"
	"sort"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/controller/impvmtemplate"
)

func (e *env) template(name string) *impv1.ImpVMTemplate {
	return &impv1.ImpVMTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}, Spec: impv1.ImpVMTemplateSpec{
		VM: impv1.ImpVMSpec{Image: "registry.test/app:1", Command: []string{"/app", "serve"},
			Resources:    &impv1.VMResources{VCPUs: ptr.To[int32](2), Memory: ptr.To(resource.MustParse("512Mi"))},
			NodeSelector: map[string]string{"imp.test/pool": e.pool}},
		SnapshotWhen: &impv1.SnapshotWhen{Command: []string{"test", "-e", "/warm"}},
	}}
}

func (e *env) copyOf(name, template string) *impv1.ImpVM {
	return &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}, Spec: impv1.ImpVMSpec{
		TemplateRef:  &impv1.TemplateReference{Name: template},
		NodeSelector: map[string]string{"imp.test/pool": e.pool}}}
}

func (e *env) getTemplate(name string) *impv1.ImpVMTemplate {
	t := &impv1.ImpVMTemplate{}
	if err := e.c.Get(context.Background(), types.NamespacedName{Namespace: e.ns, Name: name}, t); err != nil {
		return nil
	}
	return t
}

// templateSnapshots are the template's snapshots as "node/phase" (revision current or old).
func (e *env) templateSnapshots(name string) []string {
	t := e.getTemplate(name)
	if t == nil {
		return nil
	}
	var out []string
	for _, s := range t.Status.Snapshots {
		old := ""
		if s.Revision != t.Status.Revision {
			old = "old:"
		}
		out = append(out, old+strings.TrimPrefix(s.NodeName, e.ns+"-")+"/"+string(s.Phase))
	}
	sort.Strings(out)
	return out
}

// readyReason is the reason of the VM's Ready condition.
func readyReason(vm *impv1.ImpVM) string {
	if c := condition(vm, impv1.ReadyCondition); c != nil {
		return c.Reason
	}
	return ""
}

// TestCopiesOfATemplate: a copy is placed as its template's VM (its resources, image and
// command), and waits with TemplateNotReady on its node while the template's snapshot is made
// there: a builder VM pinned to the node, with the snapshot point as its readiness probe,
// snapshotted once Ready, then deleted. A second copy goes to the node holding the snapshot
// and starts at once. A new revision (the image changed) leaves the copies alone; its snapshot
// is made where the next copy is placed, and the old one goes once no copy waits for it. A copy
// of no template, or one whose network differs, waits with a reason.
func TestCopiesOfATemplate(t *testing.T) {
	e := newEnv(t)
	e.node("a", 8, 8)
	e.node("b", 8, 8)
	e.startOperator()
	e.startAgent(nil)
	ctx := context.Background()
	g := NewWithT(t)

	tmpl := e.template("web")
	e.create(tmpl)
	eventually(t, func() string { return e.getTemplate("web").Status.Revision }).ShouldNot(BeEmpty())
	rev := e.getTemplate("web").Status.Revision
	if c := apimeta.FindStatusCondition(e.getTemplate("web").Status.Conditions, impv1.TemplateReadyCondition); c == nil || c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "no node needs a snapshot yet") {
		t.Errorf("Ready of a template no copy needs: %+v", c)
	}
	consistently(t, func() int { return len(e.list()) }, time.Second).Should(BeZero()) // nothing made ahead of time

	// The first copy: placed as the template's VM, waiting for the snapshot of its node.
	e.create(e.copyOf("c1", "web"))
	eventually(t, func() string { return e.get("c1").Status.NodeName }).ShouldNot(BeEmpty())
	c1 := e.get("c1")
	node := c1.Status.NodeName
	if r := c1.Status.Resources; r == nil || r.VCPUs != 2 || r.Memory.String() != "512Mi" {
		t.Errorf("the copy's resources %+v, want the template's", r)
	}
	if ts := c1.Status.Template; ts == nil || ts.Revision != rev || ts.Image != "registry.test/app:1" || strings.Join(ts.Command, " ") != "/app serve" {
		t.Errorf("the copy's template status %+v", ts)
	}
	build := impvmtemplate.BuildName(tmpl, rev, node)
	eventually(t, func() *impv1.ImpVM { return e.get(build) }).ShouldNot(BeNil())
	b := e.get(build)
	if b.Spec.NodeName != node || b.Spec.ReadinessProbe == nil || strings.Join(b.Spec.ReadinessProbe.Exec.Command, " ") != "test -e /warm" ||
		!metav1.IsControlledBy(b, e.getTemplate("web")) {
		t.Errorf("the builder: node %q, readiness %+v, owners %v", b.Spec.NodeName, b.Spec.ReadinessProbe, b.OwnerReferences)
	}
	// The builder runs (the double makes it Ready), is snapshotted, and goes; the copy starts.
	eventually(t, func() string { return e.get("c1").Status.Template.Snapshot }).Should(Equal(build))
	eventually(t, func() *impv1.ImpVM { return e.get(build) }).Should(BeNil())
	eventually(t, func() string { return readyReason(e.get("c1")) }).Should(Equal(impv1.ReasonGuestReady))
	if rt := e.get("c1").Status.Runtime; rt == nil || rt.RestoredFrom != build {
		t.Errorf("the copy's run %+v, want restored from %s", rt, build)
	}
	g.Expect(e.templateSnapshots("web")).To(Equal([]string{strings.TrimPrefix(node, e.ns+"-") + "/Ready"}))
	if c := apimeta.FindStatusCondition(e.getTemplate("web").Status.Conditions, impv1.TemplateReadyCondition); c == nil || c.Status != metav1.ConditionTrue {
		t.Errorf("Ready of the template: %+v", c)
	}

	// The second copy: on the node that has the snapshot, started from it at once.
	e.create(e.copyOf("c2", "web"))
	eventually(t, func() string { return readyReason(e.get("c2")) }).Should(Equal(impv1.ReasonGuestReady))
	if c2 := e.get("c2"); c2.Status.NodeName != node || c2.Status.Template.Snapshot != build {
		t.Errorf("c2 on %s from %q, want %s from %s", c2.Status.NodeName, c2.Status.Template.Snapshot, node, build)
	}
	if n := e.events()["Unschedulable"]; n != 0 {
		t.Errorf("%d Unschedulable events", n)
	}

	// A new revision: the copies run on; the next copy, placed where the old snapshot is, waits
	// for the new one made there; the old one goes once no copy waits for it.
	tmpl = e.getTemplate("web")
	tmpl.Spec.VM.Image = "registry.test/app:2"
	if err := e.c.Update(ctx, tmpl); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() string { return e.getTemplate("web").Status.Revision }).ShouldNot(Equal(rev))
	rev2 := e.getTemplate("web").Status.Revision
	eventually(t, func() []string { return e.templateSnapshots("web") }).Should(BeEmpty())
	e.create(e.copyOf("c3", "web"))
	eventually(t, func() string { return readyReason(e.get("c3")) }).Should(Equal(impv1.ReasonGuestReady))
	c3 := e.get("c3")
	if ts := c3.Status.Template; ts.Revision != rev2 || ts.Image != "registry.test/app:2" || ts.Snapshot != impvmtemplate.BuildName(tmpl, rev2, c3.Status.NodeName) {
		t.Errorf("c3's template status %+v", ts)
	}
	for _, name := range []string{"c1", "c2"} {
		if vm := e.get(name); vm.Status.Template.Image != "registry.test/app:1" || vm.Status.Instance != 1 {
			t.Errorf("%s changed with the template: %+v instance %d", name, vm.Status.Template, vm.Status.Instance)
		}
	}

	// Waiting with a reason.
	e.create(e.copyOf("orphan", "nothing"))
	eventually(t, func() string { return scheduled(e.get("orphan")) }).Should(Equal(impv1.ReasonTemplateNotFound))
	// Another namespace's template cannot be named: a copy looks in its own.
	foreign := e.template("foreign")
	foreign.Namespace = e.cl.Namespace(t)
	e.create(foreign)
	e.create(e.copyOf("thief", "foreign"))
	eventually(t, func() string { return scheduled(e.get("thief")) }).Should(Equal(impv1.ReasonTemplateNotFound))
	netted := e.copyOf("netted", "web")
	netted.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
	e.create(netted)
	eventually(t, func() string { return scheduled(e.get("netted")) }).Should(Equal(impv1.ReasonTemplateIncompatible))
	if c := condition(e.get("netted"), impv1.ScheduledCondition); !strings.Contains(c.Message, "has no network interface; a copy must too") {
		t.Errorf("message %q", c.Message)
	}

	// The template's snapshots are its dependents (the cluster's garbage collector, which
	// envtest does not run, deletes them with it).
	var snaps impv1.ImpVMSnapshotList
	if err := e.c.List(ctx, &snaps, client.InNamespace(e.ns)); err != nil || len(snaps.Items) == 0 {
		t.Fatalf("snapshots %v: %v", snaps.Items, err)
	}
	for _, sn := range snaps.Items {
		if !metav1.IsControlledBy(&sn, e.getTemplate("web")) || sn.Labels[impv1.TemplateLabel] != "web" {
			t.Errorf("snapshot %s: owners %v, labels %v", sn.Name, sn.OwnerReferences, sn.Labels)
		}
	}
}

// TestCopiesOfATemplateBeforeItsWorkload: a template snapshotted before its workload has its
// VM built holding it (the operator's mark; no probes, which are the workload's), and its copies
// record it: a copy's own command, args and workingDir are its workload, over the template's.
// A copy of a template snapshotted with its workload running cannot set them: it waits,
// TemplateIncompatible, with why.
func TestCopiesOfATemplateBeforeItsWorkload(t *testing.T) {
	e := newEnv(t)
	e.node("a", 8, 8)
	e.startOperator()
	double := e.startAgent(nil)

	held := e.template("held")
	held.Spec.SnapshotWhen = &impv1.SnapshotWhen{BeforeWorkload: true}
	held.Spec.VM.ReadinessProbe = &impv1.Probe{ProbeHandler: corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: []string{"true"}}}}
	e.create(held)
	e.create(e.template("web"))
	own := e.copyOf("own", "held")
	own.Spec.Args, own.Spec.WorkingDir = []string{"run", "--job=7"}, "/work"
	e.create(own)
	eventually(t, func() string { return readyReason(e.get("own")) }).Should(Equal(impv1.ReasonGuestReady))
	vm := e.get("own")
	if ts := vm.Status.Template; ts == nil || !ts.BeforeWorkload || strings.Join(ts.Command, " ") != "/app serve" || ts.WorkingDir != "" {
		t.Errorf("the copy's template status %+v", ts)
	}
	if w := vm.Workload(); strings.Join(w.Command, " ") != "/app serve" || strings.Join(w.Args, " ") != "run --job=7" || w.WorkingDir != "/work" || w.Image != "registry.test/app:1" {
		t.Errorf("the copy's workload %+v; want the template's command with its own args and workingDir", w)
	}
	var snaps impv1.ImpVMSnapshotList
	if err := e.c.List(context.Background(), &snaps, client.InNamespace(e.ns)); err != nil || len(snaps.Items) != 1 {
		t.Fatalf("snapshots %v: %v", snaps.Items, err)
	}
	// The builder is gone once snapshotted; what it was is in the double's record of runs.
	b, ok := double.started(snaps.Items[0].Spec.VMName)
	if !ok || b.Annotations[impv1.HoldWorkloadAnnotation] != "true" || b.Spec.ReadinessProbe != nil {
		t.Errorf("the builder (started %v): annotations %v, readiness %+v", ok, b.Annotations, b.Spec.ReadinessProbe)
	}

	refused := e.copyOf("refused", "web")
	refused.Spec.Command = []string{"/bin/sh"}
	e.create(refused)
	eventually(t, func() string { return scheduled(e.get("refused")) }).Should(Equal(impv1.ReasonTemplateIncompatible))
	if c := condition(e.get("refused"), impv1.ScheduledCondition); !strings.Contains(c.Message, "snapshotWhen.beforeWorkload") {
		t.Errorf("message %q", c.Message)
	}
}

// TestTemplatesAheadOfTimeAndPushed: a template with a nodeSelector has its snapshot made on
// each node it selects before any copy; one with a registry makes one snapshot, pushed, that
// copies on every node start from.
func TestTemplatesAheadOfTimeAndPushed(t *testing.T) {
	e := newEnv(t)
	e.node("a", 8, 8)
	e.node("b", 8, 8)
	e.startOperator()
	e.startAgent(nil)

	ahead := e.template("ahead")
	ahead.Spec.NodeSelector = map[string]string{"imp.test/pool": e.pool}
	e.create(ahead)
	eventually(t, func() []string { return e.templateSnapshots("ahead") }).Should(Equal([]string{"a/Ready", "b/Ready"}))
	e.create(e.copyOf("ahead-1", "ahead"))
	eventually(t, func() string { return readyReason(e.get("ahead-1")) }).Should(Equal(impv1.ReasonGuestReady))

	pushed := e.template("pushed")
	pushed.Spec.Registry = &impv1.SnapshotRegistry{Repository: "registry.test/snapshots"}
	e.create(pushed)
	for i := range 4 {
		cp := e.copyOf(name("pushed", i), "pushed")
		cp.Spec.NodeName = e.ns + "-" + []string{"a", "b"}[i%2] // two on each node
		e.create(cp)
	}
	for i := range 4 {
		eventually(t, func() string { return readyReason(e.get(name("pushed", i))) }).Should(Equal(impv1.ReasonGuestReady))
	}
	snaps := e.templateSnapshots("pushed")
	if len(snaps) != 1 || !strings.HasSuffix(snaps[0], "/Ready") {
		t.Fatalf("the pushed template's snapshots: %v, want one", snaps)
	}
	nodes := map[string]bool{}
	for i := range 4 {
		vm := e.get(name("pushed", i))
		nodes[vm.Status.NodeName] = true
		if vm.Status.Template.Snapshot != e.getTemplate("pushed").Status.Snapshots[0].Name {
			t.Errorf("%s restores %q", vm.Name, vm.Status.Template.Snapshot)
		}
	}
	if len(nodes) != 2 {
		t.Errorf("the copies of the pushed template ran on %v, want both nodes", nodes)
	}
}

// TestCopiesLeaveRoomForTheirTemplate: a copy placed where its template's snapshot is still to
// be made leaves room there for the VM that makes it, so that copies waiting for a snapshot
// never fill the node its VM needs. One node with room for two: of two copies created at once,
// one waits (NoNodeAvailable) while the template's VM runs beside the other, then both start.
func TestCopiesLeaveRoomForTheirTemplate(t *testing.T) {
	e := newEnv(t)
	e.node("a", 4, 8)
	e.startOperator()
	e.startAgent(nil)
	e.create(e.template("web"))
	eventually(t, func() string { return e.getTemplate("web").Status.Revision }).ShouldNot(BeEmpty())
	e.create(e.copyOf("c1", "web"), e.copyOf("c2", "web"))
	for _, name := range []string{"c1", "c2"} {
		eventually(t, func() string { return readyReason(e.get(name)) }).Should(Equal(impv1.ReasonGuestReady), name)
	}
	if n := e.events()["Unschedulable"]; n != 1 {
		t.Errorf("%d Unschedulable events, want 1 (the copy that waited for room)", n)
	}
}

// TestCopiesFollowTheirTemplatesClassAndNodes: a copy names no class, so a namespace's allowed
// classes are checked against its template's; and it goes only where its template's VM may run
// too (its selectors), since its snapshot is made where the copy goes.
func TestCopiesFollowTheirTemplatesClassAndNodes(t *testing.T) {
	e := newEnv(t)
	e.node("a", 8, 8, func(n *corev1.Node) { n.Labels["imp.test/zone"] = "x" })
	e.node("b", 8, 8)
	e.startOperator()
	e.startAgent(nil)
	small, big := e.ns+"-small", e.ns+"-big"
	for _, name := range []string{small, big} {
		class := &impv1.ImpVMClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: impv1.ImpVMClassSpec{VCPUs: 1, Memory: resource.MustParse("256Mi")}}
		e.create(class)
		t.Cleanup(func() { _ = e.c.Delete(context.Background(), class) })
	}
	e.create(&impv1.ImpQuota{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "classes"}, Spec: impv1.ImpQuotaSpec{AllowedClasses: []string{small}}})
	for name, class := range map[string]string{"allowed": small, "refused": big} {
		tmpl := e.template(name)
		tmpl.Spec.VM.Resources, tmpl.Spec.VM.ClassRef = nil, &impv1.ClassReference{Name: class}
		tmpl.Spec.VM.NodeSelector["imp.test/zone"] = "x"
		e.create(tmpl)
		eventually(t, func() string { return e.getTemplate(name).Status.Revision }).ShouldNot(BeEmpty())
	}
	for i := range 3 {
		e.create(e.copyOf(name("allowed", i), "allowed"))
	}
	e.create(e.copyOf("refused-0", "refused"))
	for i := range 3 {
		eventually(t, func() string { return readyReason(e.get(name("allowed", i))) }).Should(Equal(impv1.ReasonGuestReady))
		if node := e.get(name("allowed", i)).Status.NodeName; node != e.ns+"-a" {
			t.Errorf("%s on %s, where its template's VM may not run", name("allowed", i), node)
		}
	}
	eventually(t, func() string { return scheduled(e.get("refused-0")) }).Should(Equal(impv1.ReasonQuotaExceeded))
	if c := condition(e.get("refused-0"), impv1.ScheduledCondition); !strings.Contains(c.Message, "class "+big+" is not allowed") {
		t.Errorf("message %q", c.Message)
	}
}
