package agent_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/handover"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// TestWarmClaimsTakeOverMembers (issue 48): a warm pool of 2 members, restored copies of a
// template whose workload counts and serves its count with its host name. Three claims at once:
// two are handed the members' running guests, the third is restored. Each claim served warm is
// its own VM in its guest — its host name (the workload's too), address and MAC, its own
// Secret file and env, a guest channel token of its own, a draw from /dev/urandom no other
// makes — and runs in its member's VMM, which the member's deletion by its pool does not touch.
// The pool refills. A member whose guest does not take on the claim's identity (its channel
// token made wrong on the node: it ignores the request) is never handed out: the claim is
// restored instead, with an Event, and the member's VMM is stopped. A deleted claim takes its
// member's VMM with it.
func TestWarmClaimsTakeOverMembers(t *testing.T) {
	w := newWorld(t)
	c, ns, ctx := w.c, w.ns, context.Background()
	g := NewWithT(t)
	if err := c.Client.Create(ctx, &impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.89.0.0/24"}}); err != nil {
		t.Fatal(err)
	}
	spec := w.vm("", "counter").Spec
	spec.NodeSelector = nil
	spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
	if err := c.Client.Create(ctx, &impv1.ImpVMTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "tpl"}, Spec: impv1.ImpVMTemplateSpec{VM: spec}}); err != nil {
		t.Fatal(err)
	}
	pool := &impv1.ImpWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "p"}, Spec: impv1.ImpWarmPoolSpec{
		TemplateRef: impv1.TemplateReference{Name: "tpl"}, Replicas: ptr.To[int32](2),
		NodeSelector: map[string]string{"imp.test/node": w.node}, NetworkRef: &impv1.NetworkReference{Name: "net"}}}
	if err := c.Client.Create(ctx, pool); err != nil {
		t.Fatal(err)
	}
	idle := func() int32 {
		p := &impv1.ImpWarmPool{}
		_ = c.Client.Get(ctx, client.ObjectKeyFromObject(pool), p)
		return p.Status.Idle
	}
	began := time.Now()
	g.Eventually(idle).WithTimeout(12*time.Minute).WithPolling(200*time.Millisecond).Should(BeEquivalentTo(2), func() string {
		return fmt.Sprintf("template %+v", w.templateStatus("tpl"))
	})
	t.Logf("a pool of 2 idle members (its template's VM booted and snapshotted, two copies restored): %v", time.Since(began).Round(time.Millisecond))
	members := map[string]types.UID{}
	var list impv1.ImpVMList
	if err := c.Client.List(ctx, &list, client.InNamespace(ns), client.MatchingLabels{impv1.WarmPoolLabel: "p"}); err != nil {
		t.Fatal(err)
	}
	for _, m := range list.Items {
		members[m.Name] = m.UID
		// An idle member waits paused.
		dir := filepath.Join(w.stateDir, "vms", string(m.UID))
		g.Eventually(func() (string, error) { return qemu.Status(dir) }).WithTimeout(time.Minute).Should(Equal("paused"), m.Name)
		// Restored in the background: a tenth of a VM's CPU weight.
		if got := cpuWeight(m.UID); got != "10" && got != "102" {
			t.Errorf("member %s's CPU weight %q; want 10 (cgroup v2) or shares 102 (v1)", m.Name, got)
		}
	}

	claims := []string{"a", "b", "c"}
	for _, name := range claims {
		if err := c.Client.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "s-" + name},
			StringData: map[string]string{"token": "secret-of-" + name}}); err != nil {
			t.Fatal(err)
		}
	}
	began = time.Now()
	for _, name := range claims {
		vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: impv1.ImpVMSpec{
			WarmPoolRef:  &impv1.WarmPoolReference{Name: "p"},
			NetworkRef:   &impv1.NetworkReference{Name: "net"},
			Env:          []impv1.EnvVar{{Name: "GREETING", Value: "hello-" + name}},
			Volumes:      []impv1.Volume{{Name: "creds", Secret: &impv1.SecretVolumeSource{SecretName: "s-" + name}}},
			VolumeMounts: []impv1.VolumeMount{{Name: "creds", MountPath: "/etc/creds"}}}}
		if err := c.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	ready := func(name string) func() bool {
		return func() bool {
			v := w.get(name)
			return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
		}
	}
	for _, name := range claims {
		g.Eventually(ready(name)).WithTimeout(5*time.Minute).WithPolling(50*time.Millisecond).Should(BeTrue(), func() string {
			return fmt.Sprintf("%s: %+v, run %+v; events: %s", name, w.get(name).Status, w.get(name).Status.Runtime, eventsOf(c.Client, ns, name))
		})
	}
	t.Logf("three claims Ready (two warm, one restored): %v", time.Since(began).Round(time.Millisecond))
	starts := map[impv1.VMStart][]string{}
	for _, name := range claims {
		starts[w.get(name).Status.Start] = append(starts[w.get(name).Status.Start], name)
	}
	if len(starts[impv1.StartWarm]) != 2 || len(starts[impv1.StartRestored]) != 1 {
		var why strings.Builder
		for _, name := range claims {
			fmt.Fprintf(&why, "\n%s: %s", name, eventsOf(c.Client, ns, name))
		}
		t.Fatalf("claims by how they started: %v; want two warm and one restored; events:%s", starts, why.String())
	}
	tool := func(name string, args ...string) string {
		var out string
		g.Eventually(func() error {
			var err error
			out, err = w.tryExec(name, args...)
			return err
		}).WithTimeout(time.Minute).Should(Succeed(), name+" "+strings.Join(args, " "))
		return out
	}
	tokens, draws, handed := map[string]bool{}, map[string]bool{}, map[string]bool{}
	for _, name := range claims {
		v := w.get(name)
		if got := tool(name, "tool-read", "/proc/sys/kernel/hostname"); got != name {
			t.Errorf("%s's hostname: %q", name, got)
		}
		if got := tool(name, "tool-dial", "127.0.0.1:7000"); !strings.HasSuffix(got, " host "+name) {
			t.Errorf("%s's workload says %q; want its host name %s", name, got, name)
		}
		if got := tool(name, "tool-env", "GREETING"); got != "hello-"+name {
			t.Errorf("%s's env in exec: GREETING=%q", name, got)
		}
		if got := tool(name, "tool-read", "/etc/creds/token"); got != "secret-of-"+name {
			t.Errorf("%s's Secret file: %q", name, got)
		}
		mac := hostnet.MAC(netip.MustParseAddr(v.Status.IP)).String()
		if got := tool(name, "tool-ifaces"); !strings.Contains(got, v.Status.IP+"/") || !strings.Contains(got, mac) {
			t.Errorf("%s's interfaces %q; want its address %s and MAC %s", name, got, v.Status.IP, mac)
		}
		draws[tool(name, "tool-head", "/dev/urandom", "16")] = true
		m, err := vmrun.ReadMeta(filepath.Join(w.stateDir, "vms", string(v.HostUID())))
		if err != nil || m.UID != v.UID || m.Name != name {
			t.Fatalf("%s's run on the node: %+v, %v", name, m, err)
		}
		tokens[m.Token] = true
		if v.Status.Start != impv1.StartWarm {
			continue
		}
		wm := v.Status.Warm
		if members[wm.Member] != types.UID(wm.MemberUID) || handed[wm.Member] || v.HostUID() != members[wm.Member] {
			t.Errorf("%s was handed %+v; the members %v", name, wm, members)
		}
		handed[wm.Member] = true
		if got := cpuWeight(v.HostUID()); got != "100" && got != "1024" {
			t.Errorf("%s's CPU weight %q; want a VM's, 100 (cgroup v2) or shares 1024 (v1)", name, got)
		}
	}
	if len(tokens) != 3 || len(draws) != 3 {
		t.Errorf("guest channel tokens %d, /dev/urandom draws %d distinct of 3", len(tokens), len(draws))
	}
	// The handed members are deleted by their pool, their runs left to the claims; the pool
	// refills.
	for member := range handed {
		g.Eventually(func() *impv1.ImpVM { return w.get(member) }).WithTimeout(time.Minute).Should(BeNil(), member+" deleted")
	}
	for _, name := range starts[impv1.StartWarm] {
		if got := tool(name, "tool-read", "/proc/sys/kernel/hostname"); got != name {
			t.Errorf("%s after its member's deletion: %q", name, got)
		}
	}
	g.Eventually(idle).WithTimeout(5 * time.Minute).WithPolling(200 * time.Millisecond).Should(BeEquivalentTo(2))

	// Members whose guests ignore the claim's identity (the agent's record of their token made
	// wrong): a claim is restored instead, and the member it was handed is stopped, never
	// handed out.
	if err := c.Client.List(ctx, &list, client.InNamespace(ns), client.MatchingLabels{impv1.WarmPoolLabel: "p"}); err != nil {
		t.Fatal(err)
	}
	pids := map[string]int{}
	for _, m := range list.Items {
		dir := filepath.Join(w.stateDir, "vms", string(m.UID))
		mm, err := vmrun.ReadMeta(dir)
		if err != nil {
			t.Fatal(err)
		}
		mm.Token = "0123456789abcdef0123456789abcdef"
		if err := vmrun.WriteMeta(dir, mm); err != nil {
			t.Fatal(err)
		}
		rec, err := vmm.ReadRecord(dir)
		if err != nil {
			t.Fatal(err)
		}
		pids[m.Name] = rec.Pid
	}
	refused := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "refused"}, Spec: impv1.ImpVMSpec{
		WarmPoolRef: &impv1.WarmPoolReference{Name: "p"}, NetworkRef: &impv1.NetworkReference{Name: "net"}}}
	if err := c.Client.Create(ctx, refused); err != nil {
		t.Fatal(err)
	}
	g.Eventually(ready("refused")).WithTimeout(5*time.Minute).WithPolling(100*time.Millisecond).Should(BeTrue(), func() string {
		return fmt.Sprintf("%+v, run %+v; events: %s", w.get("refused").Status, w.get("refused").Status.Runtime, eventsOf(c.Client, ns, "refused"))
	})
	v := w.get("refused")
	if v.Status.Start != impv1.StartRestored || v.Status.Warm != nil || v.HostUID() != v.UID {
		t.Errorf("the claim whose member refused: start %q, warm %+v", v.Status.Start, v.Status.Warm)
	}
	if got := tool("refused", "tool-read", "/proc/sys/kernel/hostname"); got != "refused" {
		t.Errorf("the restored claim's hostname: %q", got)
	}
	var events corev1.EventList
	_ = c.Client.List(ctx, &events, client.InNamespace(ns))
	failed := ""
	for _, e := range events.Items {
		if e.Reason == impv1.ReasonWarmHandoverFailed && e.InvolvedObject.Name == "refused" {
			failed = e.Message
		}
	}
	if failed == "" {
		t.Error("no WarmHandoverFailed Event for the claim")
	}
	stopped := 0
	for name, pid := range pids {
		if syscall.Kill(pid, 0) != nil {
			stopped++
			if _, err := os.Stat(filepath.Join(w.stateDir, "vms", string(members[name]), handover.RecordFile)); err != nil && w.get(name) != nil {
				t.Errorf("member %s: stopped, without a record of its claim: %v", name, err)
			}
		}
	}
	if stopped != 1 {
		t.Errorf("%d members' VMMs stopped; want the one the claim was handed (Event: %q)", stopped, failed)
	}

	// A claim served warm, stopped and run again, keeps its runs under its member's UID: its
	// stopped run's configuration goes from there, its next run boots from its disk there.
	again := starts[impv1.StartWarm][0]
	hostDir := filepath.Join(w.stateDir, "vms", string(w.get(again).HostUID()))
	w.update(t, again, func(v *impv1.ImpVM) { v.Spec.RunStrategy = impv1.RunStrategyHalted })
	g.Eventually(func() impv1.VMPhase { return w.get(again).Status.Phase }).WithTimeout(3 * time.Minute).Should(Equal(impv1.VMStopped))
	if _, err := os.Stat(filepath.Join(hostDir, vmrun.ConfigDisk)); err == nil {
		t.Errorf("the stopped claim's configuration disk is still in %s", hostDir)
	}
	w.update(t, again, func(v *impv1.ImpVM) { v.Spec.RunStrategy = impv1.RunStrategyAlways })
	g.Eventually(ready(again)).WithTimeout(5 * time.Minute).WithPolling(100 * time.Millisecond).Should(BeTrue())
	if m, err := vmrun.ReadMeta(hostDir); err != nil || m.UID != w.get(again).UID || m.HostUID() != types.UID(filepath.Base(hostDir)) || m.Run == 0 {
		t.Errorf("the claim's next run: %+v, %v", m, err)
	}
	if got := tool(again, "tool-read", "/proc/sys/kernel/hostname"); got != again {
		t.Errorf("%s run again: hostname %q", again, got)
	}

	// A claim served warm, deleted, takes its member's VMM with it.
	for _, name := range starts[impv1.StartWarm] {
		v := w.get(name)
		host := string(v.HostUID())
		if err := c.Client.Delete(ctx, v); err != nil {
			t.Fatal(err)
		}
		g.Eventually(func() *impv1.ImpVM { return w.get(name) }).WithTimeout(2 * time.Minute).Should(BeNil())
		if left := vmm.Marked(host); len(left) > 0 {
			t.Errorf("VMMs of deleted claim %s (kept under %s): %v", name, host, left)
		}
		if _, err := os.Stat(filepath.Join(w.stateDir, "vms", host)); err == nil {
			t.Errorf("the state of deleted claim %s is still under %s", name, host)
		}
	}
}

// idleMember makes a template tpl of spec and a pool p of one member on the world's node, and
// returns the member once it is idle (within timeout).
func (w *world) idleMember(t *testing.T, spec impv1.ImpVMTemplateSpec, timeout time.Duration) impv1.ImpVM {
	t.Helper()
	c, ns, ctx := w.c, w.ns, context.Background()
	if err := c.Client.Create(ctx, &impv1.ImpVMTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "tpl"}, Spec: spec}); err != nil {
		t.Fatal(err)
	}
	pool := &impv1.ImpWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "p"}, Spec: impv1.ImpWarmPoolSpec{
		TemplateRef: impv1.TemplateReference{Name: "tpl"}, Replicas: ptr.To[int32](1),
		NodeSelector: map[string]string{"imp.test/node": w.node}}}
	if err := c.Client.Create(ctx, pool); err != nil {
		t.Fatal(err)
	}
	// Gone before the world's agent and operator stop (cleanups run last first): a member left
	// with its finalizer would keep its namespace, and the next tests' operators busy, for good.
	t.Cleanup(func() {
		_ = c.Client.Delete(ctx, pool)
		_ = c.Client.DeleteAllOf(ctx, &impv1.ImpVM{}, client.InNamespace(ns))
		deadline := time.Now().Add(3 * time.Minute)
		for time.Now().Before(deadline) {
			var left impv1.ImpVMList
			if err := c.Client.List(ctx, &left, client.InNamespace(ns)); err == nil && len(left.Items) == 0 {
				return
			}
			time.Sleep(200 * time.Millisecond)
		}
		t.Errorf("the VMs of namespace %s were not removed", ns)
	})
	NewWithT(t).Eventually(func() int32 {
		p := &impv1.ImpWarmPool{}
		_ = c.Client.Get(ctx, client.ObjectKeyFromObject(pool), p)
		return p.Status.Idle
	}).WithTimeout(timeout).WithPolling(100*time.Millisecond).Should(BeEquivalentTo(1), func() string {
		return fmt.Sprintf("template %+v", w.templateStatus("tpl"))
	})
	var list impv1.ImpVMList
	if err := c.Client.List(ctx, &list, client.InNamespace(ns), client.MatchingLabels{impv1.WarmPoolLabel: "p"}); err != nil || len(list.Items) != 1 {
		t.Fatalf("members %d: %v", len(list.Items), err)
	}
	return list.Items[0]
}

// eventsOf is what the Events of the namespace's object name say, one a line.
func eventsOf(c client.Client, ns, name string) string {
	var events corev1.EventList
	_ = c.List(context.Background(), &events, client.InNamespace(ns))
	var b strings.Builder
	for _, e := range events.Items {
		if e.InvolvedObject.Name == name {
			fmt.Fprintf(&b, "\n  %s %s %s: %s", e.EventTime.Format("15:04:05.000"), e.Type, e.Reason, e.Message)
		}
	}
	return b.String()
}

// cpuWeight is the CPU weight of the VMM kept under uid: cgroup v2's cpu.weight, or v1's
// cpu.shares.
func cpuWeight(uid types.UID) string {
	for _, f := range []string{
		filepath.Join(cgroup.Root, cgroup.Parent, string(uid), "cpu.weight"),
		filepath.Join(cgroup.Root, "cpu", cgroup.Parent, string(uid), "cpu.shares"),
	} {
		if b, err := os.ReadFile(f); err == nil {
			return strings.TrimSpace(string(b))
		}
	}
	return ""
}

// TestHeldWorkloadStartsAsTheCopys (issue 48): a template snapshotted before its workload
// (snapshotWhen.beforeWorkload) holds it: neither its VM nor a warm pool's member restored from
// it ever runs it. A claim handed the member, and a copy restored from the template, each start
// the workload at their restore as their own: their own args and command, env and host name.
func TestHeldWorkloadStartsAsTheCopys(t *testing.T) {
	w := newWorld(t)
	c, ns, ctx := w.c, w.ns, context.Background()
	g := NewWithT(t)
	spec := w.vm("", "counter").Spec
	spec.NodeSelector = nil
	spec.Env = []impv1.EnvVar{{Name: "GREETING", Value: "the-template's"}}
	member := w.idleMember(t, impv1.ImpVMTemplateSpec{VM: spec, SnapshotWhen: &impv1.SnapshotWhen{BeforeWorkload: true}}, 12*time.Minute)
	if ts := member.Status.Template; ts == nil || !ts.BeforeWorkload {
		t.Fatalf("the member's template status %+v; want beforeWorkload", ts)
	}
	if got := w.console(&member); strings.Contains(got, "hello from imp") {
		t.Fatalf("the held member ran the workload:\n%s", got)
	}

	claim := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "a"}, Spec: impv1.ImpVMSpec{
		WarmPoolRef: &impv1.WarmPoolReference{Name: "p"}, Args: []string{"serve"},
		Env: []impv1.EnvVar{{Name: "GREETING", Value: "the-claim's"}}}}
	cp := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "b"}, Spec: impv1.ImpVMSpec{
		TemplateRef: &impv1.TemplateReference{Name: "tpl"}, Command: []string{"/bin/hello"}, Args: []string{"serve"},
		WorkingDir: "/bin", NodeSelector: map[string]string{"imp.test/node": w.node},
		Env: []impv1.EnvVar{{Name: "GREETING", Value: "the-copy's"}}}}
	began := time.Now()
	for _, vm := range []*impv1.ImpVM{claim, cp} {
		if err := c.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"a", "b"} {
		want := map[string]string{"a": "GREETING=the-claim's host=a pid=", "b": "GREETING=the-copy's host=b pid="}[name]
		g.Eventually(func() bool {
			v := w.get(name)
			return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
		}).WithTimeout(5*time.Minute).WithPolling(50*time.Millisecond).Should(BeTrue(), func() string {
			return fmt.Sprintf("%s: %+v, run %+v; events: %s", name, w.get(name).Status, w.get(name).Status.Runtime, eventsOf(c.Client, ns, name))
		})
		t.Logf("%s Ready %v after its create (the claim's and the copy's at once)", name, time.Since(began).Round(time.Millisecond))
		v := w.get(name)
		// The workload's first line, once, as this VM; then its ticks (serve).
		g.Eventually(func() string { return w.console(v) }).WithTimeout(time.Minute).Should(ContainSubstring("hello: tick 1"), name)
		console := w.console(v)
		if n := strings.Count(console, "hello from imp:"); n != 1 || !strings.Contains(console, want) {
			t.Errorf("%s's console (%d workload starts; want one with %q):\n%s", name, n, want, console)
		}
		if name == "b" && !strings.Contains(console, "wd=/bin") {
			t.Errorf("the copy's workload did not start in its workingDir:\n%s", console)
		}
	}
	if got := w.get("a"); got.Status.Start != impv1.StartWarm || got.HostUID() != member.UID {
		t.Errorf("the claim started %q under %s; want warm, handed member %s", got.Status.Start, got.HostUID(), member.UID)
	}
	if got := w.get("b"); got.Status.Start != impv1.StartRestored {
		t.Errorf("the copy started %q; want restored", got.Status.Start)
	}
}
