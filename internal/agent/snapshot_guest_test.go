package agent_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/agent/snapshot"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/guestsession"
	"github.com/syscode-labs/imp/internal/testcluster"
	"github.com/syscode-labs/imp/internal/testguest"
	"github.com/syscode-labs/imp/internal/testnetns"
	"github.com/syscode-labs/imp/internal/testregistry"
)

// TestSnapshotRestore: a running VM whose workload counts in memory is snapshotted; two new
// VMs naming the snapshot come up restored, not booted: the count carries on from the
// snapshot's, and each has its own address, MAC, hostname, Secret value (rotated after the
// snapshot), guest channel token and random stream, its own disk writes, and reaches the other
// over their network; the source ran on throughout. A VM of another namespace cannot name the
// snapshot, nor one asking for another VMM; a snapshot whose files say they were taken on
// another host (kernel) is refused by the node; a deleted snapshot's files go, and a VM naming
// it then waits with SnapshotNotFound.
func TestSnapshotRestore(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns, other := c.Namespace(t), c.Namespace(t)
	sfx := ns[len(ns)-5:]
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	host := testregistry.Start(t, "", "")
	testguest.Image(t, host, "hello")
	node := testnetns.New(t, "imp-n-"+sfx)
	nodeName := "imp-snap-" + sfx
	readyNode(t, c, nodeName)
	startOperator(t, c)
	stateDir := filepath.Join(tmp, "state")
	ag := startAgent(t, c, agent.Options{NodeName: nodeName, StateDir: stateDir, Kernel: kernel, Initramfs: initrd, NetNS: node, NetNSDir: testnetns.PinDir(t)})
	if err := c.Client.Create(ctx, &impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.94.0.0/24"}}); err != nil {
		t.Fatal(err)
	}
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "greeting"}, StringData: map[string]string{"value": "before"}}
	if err := c.Client.Create(ctx, secret); err != nil {
		t.Fatal(err)
	}
	w := &world{c: c, ns: ns, host: host, node: nodeName, stateDir: stateDir, agent: ag}
	newVM := func(name string) *impv1.ImpVM {
		vm := w.vm(name, "counter")
		vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
		vm.Spec.Env = []impv1.EnvVar{{Name: "GREETING", ValueFrom: &impv1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
			LocalObjectReference: corev1.LocalObjectReference{Name: "greeting"}, Key: "value"}}}}
		return vm
	}
	g := NewWithT(t)
	ready := func(name string) func() string {
		return func() string {
			v := w.get(name)
			if v == nil || v.Status.Runtime == nil {
				return "absent"
			}
			c := meta.FindStatusCondition(v.Status.Conditions, impv1.ReadyCondition)
			if c == nil || c.Status != metav1.ConditionTrue {
				return fmt.Sprintf("%s %+v", v.Status.Phase, *v.Status.Runtime)
			}
			return "ready"
		}
	}
	exec := func(name string, args ...string) string {
		t.Helper()
		out, err := w.tryExec(name, args...)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	count := func(name string) (int, string) {
		t.Helper()
		f := strings.Fields(exec(name, "tool-dial", "127.0.0.1:7000")) // count N host H
		if len(f) != 4 {
			t.Fatalf("%s's counter said %q", name, f)
		}
		n, _ := strconv.Atoi(f[1])
		return n, f[3]
	}

	if err := c.Client.Create(ctx, newVM("src")); err != nil {
		t.Fatal(err)
	}
	g.Eventually(ready("src")).WithTimeout(10 * time.Minute).WithPolling(100 * time.Millisecond).Should(Equal("ready"))
	g.Eventually(func() string { out, _ := w.tryExec("src", "tool-dial", "127.0.0.1:7000"); return out }).WithTimeout(time.Minute).Should(HavePrefix("count "))
	g.Eventually(func() int { n, _ := count("src"); return n }).WithTimeout(time.Minute).Should(BeNumerically(">=", 30))
	atSnapshot, _ := count("src")

	snap := &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "snap"}, Spec: impv1.ImpVMSnapshotSpec{VMName: "src"}}
	if err := c.Client.Create(ctx, snap); err != nil {
		t.Fatal(err)
	}
	getSnap := func() *impv1.ImpVMSnapshot {
		s := &impv1.ImpVMSnapshot{}
		if err := c.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "snap"}, s); err != nil {
			return nil
		}
		return s
	}
	g.Eventually(func() impv1.SnapshotPhase { return getSnap().Status.Phase }).WithTimeout(3*time.Minute).Should(Equal(impv1.SnapshotReady), func() string {
		return fmt.Sprintf("%+v", getSnap().Status)
	})
	snap = getSnap()
	st := snap.Status
	t.Logf("snapshot of a %s guest: paused %d ms, %s on the node", st.Source.Memory.String(), st.PauseMilliseconds, st.Size)
	if st.NodeName != nodeName || st.Source == nil || st.Source.VMM != impv1.VMMQEMU || !strings.Contains(st.Source.Image, "@sha256:") ||
		st.Size == nil || st.Size.Value() == 0 || st.PauseMilliseconds <= 0 || !st.Source.Network {
		t.Errorf("snapshot status %+v", st)
	}
	// The files are the agent's alone, outside every jail.
	dir := filepath.Join(stateDir, "snapshots", string(snap.UID))
	for _, f := range []string{snapshot.StateFile, snapshot.MemoryFile, snapshot.DiskFile, snapshot.ManifestFile} {
		fi, err := os.Stat(filepath.Join(dir, f))
		if err != nil || fi.Mode().Perm() != 0o600 || fi.Sys().(*syscall.Stat_t).Uid != 0 {
			t.Errorf("snapshot file %s: %v %v", f, fi, err)
		}
	}

	secret.StringData = map[string]string{"value": "after"}
	if err := c.Client.Update(ctx, secret); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"copy-a", "copy-b"} {
		vm := newVM(name)
		vm.Spec.SnapshotRef = &impv1.SnapshotReference{Name: "snap"}
		if err := c.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"copy-a", "copy-b"} {
		g.Eventually(ready(name)).WithTimeout(5 * time.Minute).WithPolling(50 * time.Millisecond).Should(Equal("ready"))
	}
	src, a, b := w.get("src"), w.get("copy-a"), w.get("copy-b")
	for _, v := range []*impv1.ImpVM{a, b} {
		rt := v.Status.Runtime
		if rt.RestoredFrom != "snap" || v.Status.Resources.Memory.Cmp(st.Source.Memory) != 0 {
			t.Errorf("%s: restoredFrom %q, resources %+v", v.Name, rt.RestoredFrom, v.Status.Resources)
		}
		// Restored, not booted: the count carries on, and the workload never started again.
		n, hostName := count(v.Name)
		if n < atSnapshot || hostName != v.Name {
			t.Errorf("%s: count %d (the source had %d before the snapshot), host name %q", v.Name, n, atSnapshot, hostName)
		}
		if con := w.console(v); strings.Contains(con, "hello from imp") {
			t.Errorf("%s booted its workload anew:\n%s", v.Name, con)
		}
		// Its own Secret value, address and MAC.
		if got := exec(v.Name, "tool-env", "GREETING"); got != "after" {
			t.Errorf("%s: GREETING %q, want the rotated value", v.Name, got)
		}
		ifaces := exec(v.Name, "tool-ifaces")
		if !strings.Contains(ifaces, " "+v.Status.IP+"/24") || strings.Contains(ifaces, " "+src.Status.IP+"/") || v.Status.IP == src.Status.IP {
			t.Errorf("%s (address %s; the source's %s): interfaces %q", v.Name, v.Status.IP, src.Status.IP, ifaces)
		}
		if srcIfaces := exec("src", "tool-ifaces"); strings.Fields(srcIfaces)[1] == strings.Fields(ifaces)[1] {
			t.Errorf("%s has the source's MAC: %q, %q", v.Name, ifaces, srcIfaces)
		}
	}
	if got := exec("src", "tool-env", "GREETING"); got != "before" {
		t.Errorf("the source's GREETING %q", got)
	}
	// Each copy's random stream is its own.
	uuids := func(name string) string {
		var out []string
		for range 3 {
			out = append(out, exec(name, "tool-read", "/proc/sys/kernel/random/uuid"))
		}
		return strings.Join(out, " ")
	}
	if ua, ub := uuids("copy-a"), uuids("copy-b"); ua == ub || strings.Fields(ua)[0] == strings.Fields(ub)[0] {
		t.Errorf("the copies' random streams agree: %s / %s", ua, ub)
	}
	// Their own channel tokens, neither the snapshot's.
	tokens := map[string]bool{}
	for _, v := range []*impv1.ImpVM{src, a, b} {
		data, err := os.ReadFile(filepath.Join(stateDir, "vms", string(v.UID), "meta.json"))
		if err != nil {
			t.Fatal(err)
		}
		var m vmrun.Meta
		_ = json.Unmarshal(data, &m)
		tokens[m.Token] = true
	}
	if len(tokens) != 3 {
		t.Errorf("the source and its copies share a guest channel token")
	}
	// Their own disks; and they reach each other over their network.
	exec("copy-a", "tool-touch", "/written-by-a")
	if out := exec("copy-b", "tool-absent", "/written-by-a"); out != "" {
		t.Errorf("copy-b sees copy-a's write: %q", out)
	}
	if got := exec("copy-a", "tool-dial", b.Status.IP+":7000"); !strings.HasSuffix(got, " host copy-b") {
		t.Errorf("copy-a → copy-b: %q", got)
	}
	if got := exec("copy-b", "tool-dial", a.Status.IP+":7000"); !strings.HasSuffix(got, " host copy-a") {
		t.Errorf("copy-b → copy-a: %q", got)
	}
	// A restored run runs on the snapshot's base disk (a link in its state directory), until
	// it ends.
	restoredBase := filepath.Join(w.stateDir, "vms", string(w.get("copy-a").UID), vmrun.RestoredBase)
	if fi, err := os.Stat(restoredBase); err != nil || fi.Mode().Perm() != 0o444 {
		t.Errorf("the restored run's base disk: %v %v", fi, err)
	}
	// A restart of a restored VM boots from its own disk (its writes kept), twice: it never
	// goes back to the snapshot's memory, nor holds its base disk.
	// copyEvents are copy-a's Events: what it was told, for a failure's message.
	copyEvents := func() (reasons map[string]int, text string) {
		var events corev1.EventList
		_ = c.Client.List(ctx, &events, client.InNamespace(w.ns))
		reasons = map[string]int{}
		for _, e := range events.Items {
			if e.InvolvedObject.Name == "copy-a" {
				reasons[e.Reason]++
				text += fmt.Sprintf("\n  %s %s: %s", e.Type, e.Reason, e.Message)
			}
		}
		return reasons, text
	}
	for i := int32(1); i <= 2; i++ {
		v := w.get("copy-a")
		started, want := v.Status.Runtime.StartedAt.Time, v.Status.RestartCount+1
		time.Sleep(time.Until(started.Truncate(time.Second).Add(1100 * time.Millisecond)))
		w.update(t, "copy-a", func(v *impv1.ImpVM) {
			v.Annotations = map[string]string{impv1.RestartRequestedAnnotation: time.Now().Format(time.RFC3339Nano)}
		})
		g.Eventually(func() string {
			v := w.get("copy-a")
			if v.Status.RestartCount < want {
				return fmt.Sprintf("restarts %d", v.Status.RestartCount)
			}
			return ready("copy-a")()
		}).WithTimeout(7*time.Minute).WithPolling(100*time.Millisecond).Should(Equal("ready"), func() string { // room for a boot timeout (3 min), its back-off and a boot
			_, text := copyEvents()
			return fmt.Sprintf("restart %d (count %d); copy-a's Events:%s", i, w.get("copy-a").Status.RestartCount, text)
		})
		// A run more than asked for is only a boot the agent's watchdog ended (a guest that
		// never said ready under a loaded machine), restarted by the runStrategy.
		if n := w.get("copy-a").Status.RestartCount; n != want {
			if reasons, text := copyEvents(); reasons[impv1.ReasonBootTimeout] < int(n-want) {
				t.Errorf("restart %d: the restart count is %d, not %d, and no boot timeout explains it; copy-a's Events:%s", i, n, want, text)
			} else {
				t.Logf("restart %d: %d more run(s) after a boot timeout; copy-a's Events:%s", i, n-want, text)
			}
		}
		if rt := w.get("copy-a").Status.Runtime; rt.RestoredFrom != "" {
			t.Errorf("restart %d was restored from %s, not booted", i, rt.RestoredFrom)
		}
		if _, err := w.tryExec("copy-a", "tool-read", "/written-by-a"); err != nil {
			t.Errorf("restart %d lost copy-a's write: %v", i, err)
		}
		if _, err := os.Lstat(restoredBase); !os.IsNotExist(err) {
			t.Errorf("restart %d kept the restored run's base disk: %v", i, err)
		}
	}

	// The source ran on throughout: one run, counting on.
	if n, _ := count("src"); n <= atSnapshot || w.get("src").Status.RestartCount != 0 || ready("src")() != "ready" {
		t.Errorf("the source after the copies: count %d (was %d), status %+v", n, atSnapshot, w.get("src").Status)
	}

	// Refusals, each with its reason on the VM's status.
	scheduled := func(namespace, name string) string {
		v := &impv1.ImpVM{}
		if err := c.Client.Get(ctx, types.NamespacedName{Namespace: namespace, Name: name}, v); err != nil {
			return err.Error()
		}
		if c := meta.FindStatusCondition(v.Status.Conditions, impv1.ScheduledCondition); c != nil {
			return c.Reason
		}
		return "none"
	}
	elsewhere := newVM("thief")
	elsewhere.Namespace, elsewhere.Spec.NetworkRef, elsewhere.Spec.Env = other, nil, nil
	elsewhere.Spec.SnapshotRef = &impv1.SnapshotReference{Name: "snap"}
	fc := newVM("fc")
	fc.Spec.VMM, fc.Spec.SnapshotRef = impv1.VMMFirecracker, &impv1.SnapshotReference{Name: "snap"}
	for _, v := range []*impv1.ImpVM{elsewhere, fc} {
		if err := c.Client.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	g.Eventually(func() string { return scheduled(other, "thief") }).WithTimeout(time.Minute).Should(Equal(impv1.ReasonSnapshotNotFound))
	g.Eventually(func() string { return scheduled(ns, "fc") }).WithTimeout(time.Minute).Should(Equal(impv1.ReasonSnapshotIncompatible))

	// The node refuses a snapshot taken on another host (here: its files say another kernel).
	manifest := filepath.Join(dir, snapshot.ManifestFile)
	orig, _ := os.ReadFile(manifest)
	var m snapshot.Manifest
	_ = json.Unmarshal(orig, &m)
	m.Host.Kernel = strings.Repeat("0", 64)
	tampered, _ := json.Marshal(m)
	if err := os.WriteFile(manifest, tampered, 0o600); err != nil {
		t.Fatal(err)
	}
	odd := newVM("odd")
	odd.Spec.SnapshotRef = &impv1.SnapshotReference{Name: "snap"}
	if err := c.Client.Create(ctx, odd); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string {
		if rt := w.get("odd").Status.Runtime; rt != nil {
			return rt.Reason + ": " + rt.Message
		}
		return ""
	}).WithTimeout(2 * time.Minute).Should(HavePrefix(impv1.ReasonSnapshotIncompatible + ": ImpVMSnapshot snap: the snapshot's guest kernel"))
	// Nor one without its base disk: the node's disk of the image never stands in for it.
	if err := os.WriteFile(manifest, orig, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, snapshot.BaseFile)); err != nil {
		t.Fatal(err)
	}
	baseless := newVM("baseless")
	baseless.Spec.SnapshotRef = &impv1.SnapshotReference{Name: "snap"}
	if err := c.Client.Create(ctx, baseless); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string {
		if rt := w.get("baseless").Status.Runtime; rt != nil {
			return rt.Reason + ": " + rt.Message
		}
		return ""
	}).WithTimeout(2 * time.Minute).Should(HavePrefix(impv1.ReasonSnapshotIncompatible + ": ImpVMSnapshot snap has no base disk"))
	// The refused VMs would hold the node's room while their runStrategy retries them.
	for _, name := range []string{"odd", "baseless"} {
		if err := c.Client.Delete(ctx, w.get(name)); err != nil {
			t.Fatal(err)
		}
	}

	// Deleted: its files go, and a VM naming it waits with the reason.
	if err := c.Client.Delete(ctx, snap); err != nil {
		t.Fatal(err)
	}
	g.Eventually(getSnap).WithTimeout(time.Minute).Should(BeNil())
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the deleted snapshot's files: %v", err)
	}
	late := newVM("late")
	late.Spec.SnapshotRef = &impv1.SnapshotReference{Name: "snap"}
	if err := c.Client.Create(ctx, late); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string { return scheduled(ns, "late") }).WithTimeout(time.Minute).Should(Equal(impv1.ReasonSnapshotNotFound))
	// The copies run on without it (copy-b was never restarted: it counts on).
	if n, _ := count("copy-b"); n <= atSnapshot {
		t.Errorf("copy-b after its snapshot went: count %d", n)
	}

	// A suspended VM is snapshotted from its saved state, untouched (no pause), and a copy
	// restored from that carries on from where the suspension caught it.
	susp := &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "src"}, Spec: impv1.ImpVMSuspensionSpec{Reason: impv1.SuspendReasonUser}}
	atSuspension, _ := count("src")
	if err := c.Client.Create(ctx, susp); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() impv1.VMPhase { return w.get("src").Status.Phase }).WithTimeout(3 * time.Minute).Should(Equal(impv1.VMSuspended))
	fromSuspended := &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "from-suspended"}, Spec: impv1.ImpVMSnapshotSpec{VMName: "src"}}
	if err := c.Client.Create(ctx, fromSuspended); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() impv1.SnapshotPhase {
		_ = c.Client.Get(ctx, client.ObjectKeyFromObject(fromSuspended), fromSuspended)
		return fromSuspended.Status.Phase
	}).WithTimeout(3*time.Minute).Should(Equal(impv1.SnapshotReady), func() string { return fmt.Sprintf("%+v", fromSuspended.Status) })
	if fromSuspended.Status.PauseMilliseconds != 0 || w.get("src").Status.Phase != impv1.VMSuspended {
		t.Errorf("a suspended VM's snapshot: paused %d ms; the VM %s", fromSuspended.Status.PauseMilliseconds, w.get("src").Status.Phase)
	}
	copyC := newVM("copy-c")
	copyC.Spec.SnapshotRef = &impv1.SnapshotReference{Name: "from-suspended"}
	if err := c.Client.Create(ctx, copyC); err != nil {
		t.Fatal(err)
	}
	g.Eventually(ready("copy-c")).WithTimeout(5 * time.Minute).WithPolling(50 * time.Millisecond).Should(Equal("ready"))
	if n, host := count("copy-c"); n < atSuspension || host != "copy-c" {
		t.Errorf("copy-c, from the suspended VM: count %d (%d when suspended), host %q", n, atSuspension, host)
	}
	if err := c.Client.Delete(ctx, susp); err != nil {
		t.Fatal(err)
	}
	g.Eventually(ready("src")).WithTimeout(3 * time.Minute).WithPolling(100 * time.Millisecond).Should(Equal("ready"))
}

// TestSnapshotAcrossNodes: a snapshot pushed to a registry on 127.0.0.1 (with credentials, from
// a Secret of the namespace) is restored on another node, which pulls it: its copy carries on
// the count with its own hostname, beside a copy on the snapshot's own node, and the two reach
// each other over their network across the nodes (its overlay). The key stays in
// IMP's namespace; deleting the snapshot removes its key, its node's files and (swept) the other
// node's pulled copy. (What a registry sees, and one that changes blobs on the way:
// snapshot.TestPushPull.)
func TestSnapshotAcrossNodes(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	sfx := ns[len(ns)-5:]
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	images := testregistry.Start(t, "", "")
	testguest.Image(t, images, "hello")
	snaps := testregistry.Start(t, "pusher", "s3cret")
	startOperator(t, c)
	// Two nodes, each its own network namespace, on one underlay: the network's overlay joins
	// them.
	netA, netB := testnetns.New(t, "imp-xa-"+sfx), testnetns.New(t, "imp-xb-"+sfx)
	testnetns.Link(t, netA, "under0", "192.168.78.1/24", netB, "under0", "192.168.78.2/24")
	agents := map[string]*agent.Agent{}
	for _, n := range []struct{ name, netns, vtep string }{{"a", netA, "192.168.78.1"}, {"b", netB, "192.168.78.2"}} {
		node := "imp-xn-" + n.name + "-" + sfx
		readyNode(t, c, node)
		agents[n.name] = startAgent(t, c, agent.Options{NodeName: node, StateDir: filepath.Join(tmp, n.name), Kernel: kernel, Initramfs: initrd,
			NetNS: n.netns, NetNSDir: testnetns.PinDir(t), OverlayAddress: netip.MustParseAddr(n.vtep)})
	}
	if err := c.Client.Create(ctx, &impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.95.0.0/24"}}); err != nil {
		t.Fatal(err)
	}
	nodeOf := func(n string) string { return "imp-xn-" + n + "-" + sfx }
	auth := fmt.Sprintf(`{"auths":{%q:{"username":"pusher","password":"s3cret"}}}`, snaps)
	if err := c.Client.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "push"}, Type: corev1.SecretTypeDockerConfigJson,
		Data: map[string][]byte{corev1.DockerConfigJsonKey: []byte(auth)}}); err != nil {
		t.Fatal(err)
	}
	w := &world{c: c, ns: ns, host: images, node: nodeOf("a")}
	g := NewWithT(t)
	vmOn := func(name, n, snap string) {
		v := w.vm(name, "counter")
		v.Spec.NodeSelector = map[string]string{"imp.test/node": nodeOf(n)}
		v.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
		if snap != "" {
			v.Spec.SnapshotRef = &impv1.SnapshotReference{Name: snap}
		}
		if err := c.Client.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	ready := func(name string) func() string {
		return func() string {
			v := w.get(name)
			if v == nil || v.Status.Runtime == nil {
				return "absent"
			}
			if !meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition) {
				return fmt.Sprintf("%s %+v", v.Status.Phase, *v.Status.Runtime)
			}
			return "ready on " + v.Status.NodeName
		}
	}
	// tool runs a hello tool in the VM name of node n: its output, or the error.
	tool := func(name, n string, args ...string) string {
		v := w.get(name)
		s, err := agents[n].Runs.Session(types.NamespacedName{Namespace: ns, Name: name}, v.UID)
		if err != nil {
			return err.Error()
		}
		var out bytes.Buffer
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if err := s.Exec(ctx, guestsession.ExecOptions{Command: append([]string{"/bin/hello"}, args...), Stdout: &out, Stderr: &out}); err != nil {
			fmt.Fprintf(&out, " (%v)", err)
		}
		return strings.TrimSpace(out.String())
	}
	dialTo := func(name, n, target string) string { return tool(name, n, "tool-dial", target) }
	dial := func(name, n string) string { return dialTo(name, n, "127.0.0.1:7000") }
	vmOn("src", "a", "")
	g.Eventually(ready("src")).WithTimeout(10 * time.Minute).WithPolling(100 * time.Millisecond).Should(Equal("ready on " + nodeOf("a")))
	g.Eventually(func() string { return dial("src", "a") }).WithTimeout(time.Minute).Should(MatchRegexp(`^count ([3-9]\d|\d{3,}) host src$`))
	atSnapshot, _ := strconv.Atoi(strings.Fields(dial("src", "a"))[1])

	snap := &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "snap"}, Spec: impv1.ImpVMSnapshotSpec{VMName: "src",
		Registry: &impv1.SnapshotRegistry{Repository: snaps + "/team/snaps", SecretRef: &corev1.LocalObjectReference{Name: "push"}}}}
	if err := c.Client.Create(ctx, snap); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string {
		_ = c.Client.Get(ctx, client.ObjectKeyFromObject(snap), snap)
		return snap.Status.Digest
	}).WithTimeout(3*time.Minute).Should(HavePrefix("sha256:"), func() string { return fmt.Sprintf("%+v", snap.Status) })
	t.Logf("snapshot pushed: %s (%s)", snap.Status.Message, snap.Status.Size)

	began := time.Now()
	vmOn("copy-a", "a", "snap")
	vmOn("copy-b", "b", "snap")
	for name, n := range map[string]string{"copy-a": "a", "copy-b": "b"} {
		g.Eventually(ready(name)).WithTimeout(5 * time.Minute).WithPolling(50 * time.Millisecond).Should(Equal("ready on " + nodeOf(n)))
		got := dial(name, n)
		f := strings.Fields(got)
		if len(f) != 4 || f[3] != name {
			t.Fatalf("%s: %q", name, got)
		}
		if count, _ := strconv.Atoi(f[1]); count < atSnapshot {
			t.Errorf("%s counts %d, below the snapshot's %d: booted, not restored", name, count, atSnapshot)
		}
	}
	t.Logf("two copies Ready, one from the node-local snapshot and one pulled by the other node: %v", time.Since(began).Round(time.Millisecond))
	// Side by side on two nodes, each reaches the other over their network (the overlay).
	a, b := w.get("copy-a"), w.get("copy-b")
	if a.Status.IP == b.Status.IP || a.Status.IP == w.get("src").Status.IP {
		t.Errorf("addresses: copy-a %s, copy-b %s, src %s", a.Status.IP, b.Status.IP, w.get("src").Status.IP)
	}
	g.Eventually(func() string { return dialTo("copy-a", "a", b.Status.IP+":7000") }).WithTimeout(time.Minute).Should(HaveSuffix(" host copy-b"))
	g.Eventually(func() string { return dialTo("copy-b", "b", a.Status.IP+":7000") }).WithTimeout(time.Minute).Should(HaveSuffix(" host copy-a"))
	if got := dial("src", "a"); !strings.HasSuffix(got, " host src") {
		t.Errorf("the source after the copies: %q", got)
	}
	// Node b's copy of the snapshot is the agent's alone, as node a's.
	pulled := filepath.Join(tmp, "b", "snapshots", string(snap.UID))
	for _, f := range []string{snapshot.StateFile, snapshot.MemoryFile, snapshot.DiskFile, snapshot.ManifestFile} {
		fi, err := os.Stat(filepath.Join(pulled, f))
		if err != nil || fi.Mode().Perm() != 0o600 {
			t.Errorf("node b's %s: %v %v", f, fi, err)
		}
	}
	// The key is IMP's, in its namespace, not the tenant's.
	var keys corev1.SecretList
	_ = c.Client.List(ctx, &keys, client.InNamespace(ns))
	for _, s := range keys.Items {
		if strings.HasPrefix(s.Name, "imp-snapshot-") {
			t.Errorf("a snapshot key in the tenant's namespace: %s", s.Name)
		}
	}

	checkTemplateCopies(t, w, nodeOf, ready, tool, snaps)

	// Deleted: its key goes, node a's files go, and node b's pulled copy is swept.
	if err := c.Client.Delete(ctx, snap); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() bool {
		return apierrors.IsNotFound(c.Client.Get(ctx, client.ObjectKeyFromObject(snap), &impv1.ImpVMSnapshot{}))
	}).WithTimeout(time.Minute).Should(BeTrue())
	if _, err := os.Stat(filepath.Join(tmp, "a", "snapshots", string(snap.UID))); !os.IsNotExist(err) {
		t.Errorf("node a's files of the deleted snapshot: %v", err)
	}
	if err := c.Client.Get(ctx, types.NamespacedName{Namespace: "imp-system", Name: "imp-snapshot-" + string(snap.UID)}, &corev1.Secret{}); !apierrors.IsNotFound(err) {
		t.Errorf("the deleted snapshot's key: %v", err)
	}
	if err := agents["b"].SweepSnapshots(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(pulled); !os.IsNotExist(err) {
		t.Errorf("node b's pulled copy of the deleted snapshot: %v", err)
	}
}

// checkTemplateCopies: an ImpVMTemplate pushed to the registry (snapshots) has its VM booted on
// one node, snapshotted once Ready and pushed; three copies of it, two on node a and one on node
// b (which pulls it), are restored from it, run side by side with their own addresses and
// hostnames, reach each other over their network, and neither sees another's disk writes.
func checkTemplateCopies(t *testing.T, w *world, nodeOf func(string) string, ready func(string) func() string,
	tool func(name, n string, args ...string) string, registry string) {
	ctx := context.Background()
	g := NewWithT(t)
	spec := w.vm("", "counter").Spec
	spec.NodeSelector = nil
	spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
	tmpl := &impv1.ImpVMTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "tpl"}, Spec: impv1.ImpVMTemplateSpec{VM: spec,
		Registry: &impv1.SnapshotRegistry{Repository: registry + "/team/templates", SecretRef: &corev1.LocalObjectReference{Name: "push"}}}}
	if err := w.c.Client.Create(ctx, tmpl); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	copies := map[string]string{"tpl-a1": "a", "tpl-a2": "a", "tpl-b": "b"}
	for name, n := range copies {
		v := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: name}, Spec: impv1.ImpVMSpec{
			TemplateRef:  &impv1.TemplateReference{Name: "tpl"},
			NodeSelector: map[string]string{"imp.test/node": nodeOf(n)},
			NetworkRef:   &impv1.NetworkReference{Name: "net"}}}
		if err := w.c.Client.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	for name, n := range copies {
		g.Eventually(ready(name)).WithTimeout(8*time.Minute).WithPolling(100*time.Millisecond).Should(Equal("ready on "+nodeOf(n)),
			func() string {
				return fmt.Sprintf("template %+v\n%s", w.templateStatus("tpl"), agentStacks("template-copies"))
			})
	}
	t.Logf("three copies of a template Ready (its VM booted, snapshotted, pushed; two nodes): %v", time.Since(began).Round(time.Millisecond))
	st := w.templateStatus("tpl")
	if len(st.Snapshots) != 1 || !st.Snapshots[0].Pushed || st.Snapshots[0].NodeName == "" {
		t.Fatalf("the template's snapshots: %+v", st.Snapshots)
	}
	built := st.Snapshots[0].Name
	if w.get(built) != nil {
		t.Errorf("the template's VM %s is still there", built)
	}
	ips := map[string]string{}
	for name, n := range copies {
		v := w.get(name)
		if v.Status.Runtime.RestoredFrom != built || v.Status.Template.Snapshot != built {
			t.Errorf("%s: restored from %q (template status %+v)", name, v.Status.Runtime.RestoredFrom, v.Status.Template)
		}
		if got := tool(name, n, "tool-read", "/proc/sys/kernel/hostname"); got != name {
			t.Errorf("%s's hostname %q", name, got)
		}
		ips[name] = v.Status.IP
	}
	if len(map[string]bool{ips["tpl-a1"]: true, ips["tpl-a2"]: true, ips["tpl-b"]: true}) != 3 {
		t.Errorf("addresses %v", ips)
	}
	// Each reaches the others over their network, on one node and across.
	for from, n := range copies {
		for to := range copies {
			if to != from {
				g.Eventually(func() string { return tool(from, n, "tool-dial", ips[to]+":7000") }).WithTimeout(time.Minute).Should(HaveSuffix(" host "+to), from+" to "+to)
			}
		}
	}
	// A write of one is its own: its disk is a copy of the snapshot's, not shared. A copy on
	// the node that pulled the snapshot runs on the snapshot's base disk, not on the one that
	// node built of the image (other blocks: its file system would fail, EBADMSG).
	for name, n := range copies {
		if got := tool(name, n, "tool-touch", "/written-by-"+name); got != "" {
			t.Fatalf("writing in %s (node %s): %q", name, n, got)
		}
		if got := tool(name, n, "tool-absent", "/written-by-"+name); !strings.Contains(got, "exists") {
			t.Errorf("%s does not see its own write: %q", name, got)
		}
	}
	for name, n := range copies {
		for other := range copies {
			if got := tool(name, n, "tool-absent", "/written-by-"+other); other != name && got != "" {
				t.Errorf("%s sees %s's write: %q", name, other, got)
			}
		}
	}
	for name := range copies {
		if err := w.c.Client.Delete(ctx, w.get(name)); err != nil {
			t.Fatal(err)
		}
	}
}

func (w *world) templateStatus(name string) impv1.ImpVMTemplateStatus {
	t := &impv1.ImpVMTemplate{}
	_ = w.c.Client.Get(context.Background(), types.NamespacedName{Namespace: w.ns, Name: name}, t)
	return t.Status
}

// drawLine is one line of the entropy workload: index, clock, host name, boot id, the kernel's
// draw, the user-space generator's.
var drawLine = regexp.MustCompile(`(?m)^draw (\d+) who=(\w+) at=(\d+) host=(\S+) boot=(\S+) kernel=([0-9a-f]{16}) user=([0-9a-f]{16})\r?$`)

type draw struct {
	line                                string
	index                               int
	who, host, boot, kernel, user, time string
}

func draws(console string) []draw {
	var out []draw
	for _, m := range drawLine.FindAllStringSubmatch(console, -1) {
		i, _ := strconv.Atoi(m[1])
		out = append(out, draw{line: strings.TrimSuffix(m[0], "\r"), index: i, who: m[2], time: m[3], host: m[4], boot: m[5], kernel: m[6], user: m[7]})
	}
	return out
}

// TestCopiesDrawTheirOwn (issue 45): a VM's workload draws from the kernel's generator and
// from a user-space generator seeded at its start, every 50 ms, and prints each draw with the
// clock and its host name; so do two children it moved out of its cgroup, into a cgroup beside
// it and into the root cgroup. Two copies of its snapshot each print only what they draw once
// restored (a copy's console is its own), but for the lines the source had printed before the
// pause, which the serial port still held: those are the source's own lines, word for word.
// Every other line of a copy was drawn as that copy: its host name, and a kernel draw that
// neither the other copy nor the source made. The snapshot was taken with the workload frozen,
// and a copy's guest thaws it only after taking on its identity and reseeding the kernel's
// generator; before, a copy's workload ran on as the source, drawing what the source drew.
// What stays shared, as docs/snapshots.md says: the user-space generator seeded before the
// snapshot (the copies' first draws after it agree) and the boot id read before it.
func TestCopiesDrawTheirOwn(t *testing.T) {
	w := newWorld(t)
	c, ns, ctx := w.c, w.ns, context.Background()
	g := NewWithT(t)
	ready := func(name string) func() bool {
		return func() bool {
			v := w.get(name)
			return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
		}
	}
	// printed is the fewest lines one of the VM's three drawers printed.
	printed := func(name string) func() int {
		return func() int {
			v := w.get(name)
			if v == nil {
				return 0
			}
			n := map[string]int{"main": 0, "sibling": 0, "root": 0}
			for _, d := range draws(w.console(v)) {
				n[d.who]++
			}
			return min(n["main"], n["sibling"], n["root"])
		}
	}
	if err := c.Client.Create(ctx, w.vm("src", "entropy")); err != nil {
		t.Fatal(err)
	}
	g.Eventually(ready("src")).WithTimeout(10 * time.Minute).WithPolling(100 * time.Millisecond).Should(BeTrue())
	g.Eventually(printed("src")).WithTimeout(time.Minute).Should(BeNumerically(">=", 10))
	if err := c.Client.Create(ctx, &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "snap"}, Spec: impv1.ImpVMSnapshotSpec{VMName: "src"}}); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() impv1.SnapshotPhase {
		s := &impv1.ImpVMSnapshot{}
		_ = c.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "snap"}, s)
		return s.Status.Phase
	}).WithTimeout(3 * time.Minute).Should(Equal(impv1.SnapshotReady))
	for _, name := range []string{"copy-a", "copy-b"} {
		vm := w.vm(name, "entropy")
		vm.Spec.SnapshotRef = &impv1.SnapshotReference{Name: "snap"}
		if err := c.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"copy-a", "copy-b"} {
		g.Eventually(ready(name)).WithTimeout(5 * time.Minute).WithPolling(50 * time.Millisecond).Should(BeTrue())
		g.Eventually(printed(name)).WithTimeout(time.Minute).Should(BeNumerically(">=", 10))
	}
	src, a, b := draws(w.console(w.get("src"))), draws(w.console(w.get("copy-a"))), draws(w.console(w.get("copy-b")))
	sourceLines, kernelOf := map[string]bool{}, map[string]map[string]bool{}
	for _, d := range src {
		sourceLines[d.line] = true
	}
	for name, ds := range map[string][]draw{"src": src, "copy-a": a, "copy-b": b} {
		kernelOf[name] = map[string]bool{}
		for _, d := range ds {
			if name == "src" || !sourceLines[d.line] {
				kernelOf[name][d.kernel] = true
			}
		}
	}
	own := map[string]draw{} // each copy's first draw of its own
	for name, ds := range map[string][]draw{"copy-a": a, "copy-b": b} {
		other := map[string]string{"copy-a": "copy-b", "copy-b": "copy-a"}[name]
		for _, d := range ds {
			if sourceLines[d.line] {
				continue // printed by the source before the pause, sent by the copy's serial port
			}
			if _, ok := own[name]; !ok && d.who == "main" {
				own[name] = d
			}
			switch {
			case d.host != name:
				t.Errorf("%s's workload drew as %s after the restore: %q", name, d.host, d.line)
			case kernelOf[other][d.kernel] || kernelOf["src"][d.kernel]:
				t.Errorf("%s drew what another drew from the kernel: %q", name, d.line)
			}
		}
	}
	// What stays shared: the workload's own state from before the snapshot.
	fa, fb := own["copy-a"], own["copy-b"]
	t.Logf("first own draws: %q, %q", fa.line, fb.line)
	if fa.index != fb.index || fa.user != fb.user || fa.boot != fb.boot || fa.boot != src[0].boot {
		t.Errorf("the copies' first draws of their own are not where the snapshot froze them, with the same user-space state and boot id: %q, %q (the source's boot id %s)", fa.line, fb.line, src[0].boot)
	}
}
