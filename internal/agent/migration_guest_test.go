package agent_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/agent/transfer"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/pki"
	"github.com/syscode-labs/imp/internal/testcluster"
	"github.com/syscode-labs/imp/internal/testguest"
	"github.com/syscode-labs/imp/internal/testregistry"
)

// noCgroups, as Options.CgroupRoot, starts an agent whose VMMs get no cgroups of their own:
// two agents on this one machine would otherwise give one VM's two VMMs (a migration's
// sides) the same cgroup, and its memory limit.
const noCgroups = "-"

// poolNode registers a Ready Node labelled for IMP and with imp.test/pool=pool.
func poolNode(t *testing.T, c *testcluster.Cluster, name, pool string) {
	t.Helper()
	ctx := context.Background()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{impv1.NodeEnabledLabel: "true", "imp.test/pool": pool}}}
	if err := c.Client.Create(ctx, node); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Client.Delete(context.Background(), node) })
	node.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastTransitionTime: metav1.Now()}}
	if err := c.Client.Status().Update(ctx, node); err != nil {
		t.Fatal(err)
	}
}

// migrationIdentities are the agents' certificates of nodes, as the operator's signer issues
// them (serving and client use), under one CA.
func migrationIdentities(t *testing.T, nodes ...string) map[string]transfer.Identity {
	t.Helper()
	ca, err := pki.NewCA("imp-agents", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca.Cert)
	ids := map[string]transfer.Identity{}
	for _, node := range nodes {
		leaf, err := pki.Issue(ca, pki.Request{CommonName: pki.AgentName, DNSNames: []string{pki.AgentDNSName(node)}, Server: true, Client: true,
			Lifetime: time.Hour}, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		cert, err := tls.X509KeyPair(leaf.Cert, leaf.Key)
		if err != nil {
			t.Fatal(err)
		}
		ids[node] = func() (*tls.Certificate, *x509.CertPool, error) { return &cert, pool, nil }
	}
	return ids
}

// freeAddr is a loopback address with a port nothing listens on now.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

var tick = regexp.MustCompile(`hello: tick (\d+)`)

// ticks are the ticks a console log shows, in order.
func ticks(log string) []int {
	var out []int
	for _, m := range tick.FindAllStringSubmatch(log, -1) {
		n, _ := strconv.Atoi(m[1])
		out = append(out, n)
	}
	return out
}

// TestLiveMigrationBetweenNodes: two nodes, each its own agent taking migrations over mutually
// authenticated TLS with node certificates; a VM counting a tick a second on its console boots
// on one under QEMU/TCG. An ImpVMMigration moves it to the other: the target prepares its place
// and a VMM waiting for the state, the source mirrors its disk and sends its memory while the
// guest runs, pauses it for the rest; the operator commits; the target runs it on. The VM is the
// same (UID, instance, run: not restarted), its count goes on from where it was on the target
// (no tick 0 again), the source's VMM and state are gone, and the migration says what it took.
func TestLiveMigrationBetweenNodes(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	sfx := ns[len(ns)-5:]
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	host := testregistry.Start(t, "", "")
	testguest.Image(t, host, "hello")
	pool := "mig-" + sfx
	nodes := []string{"imp-mig-a-" + sfx, "imp-mig-b-" + sfx}
	for _, n := range nodes {
		poolNode(t, c, n, pool)
	}
	startOperator(t, c)
	ids := migrationIdentities(t, nodes...)
	for _, n := range nodes {
		startAgent(t, c, agent.Options{NodeName: n, StateDir: filepath.Join(tmp, n), Kernel: kernel, Initramfs: initrd,
			MigrationAddr: freeAddr(t), MigrationIdentity: ids[n], CgroupRoot: noCgroups})
	}
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "mover"}, Spec: impv1.ImpVMSpec{
		Image: host + "/hello:v1", Args: []string{"serve"}, NodeSelector: map[string]string{"imp.test/pool": pool},
		Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("192Mi"))}, DiskSize: ptr.To(resource.MustParse("64Mi"))}}
	if err := c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	get := func() *impv1.ImpVM {
		v := &impv1.ImpVM{}
		if err := c.Client.Get(ctx, client.ObjectKeyFromObject(vm), v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	consoleOn := func(node string) string {
		b, _ := os.ReadFile(filepath.Join(tmp, node, "vms", string(vm.UID), qemu.ConsoleLog))
		return string(b)
	}
	g.Eventually(func() bool {
		vm = get()
		return vm.Status.Phase == impv1.VMRunning && vm.Status.Runtime != nil && vm.Status.Runtime.GuestReady
	}).WithTimeout(10*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), func() string {
		return diagnose(c.Client, vm, func(node string) string { return filepath.Join(tmp, node) })
	})
	source, target := vm.Status.NodeName, nodes[0]
	if source == nodes[0] {
		target = nodes[1]
	}
	g.Eventually(func() int { return len(ticks(consoleOn(source))) }).WithTimeout(5 * time.Minute).Should(BeNumerically(">=", 3))

	seen := ticks(consoleOn(source)) // the source's count when the migration begins
	mig := &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "move"}, Spec: impv1.ImpVMMigrationSpec{VMName: vm.Name}}
	began := time.Now()
	if err := c.Client.Create(ctx, mig); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() impv1.MigrationPhase {
		if err := c.Client.Get(ctx, client.ObjectKeyFromObject(mig), mig); err != nil {
			return ""
		}
		return mig.Status.Phase
	}).WithTimeout(5*time.Minute).WithPolling(100*time.Millisecond).Should(Equal(impv1.MigrationSucceeded), func() string {
		b, _ := json.MarshalIndent(mig.Status, "", " ")
		return "the migration: " + string(b) + "\nthe VM: " + diagnose(c.Client, vm, func(node string) string { return filepath.Join(tmp, node) })
	})
	took := time.Since(began)
	if mig.Status.TargetNode != target || mig.Status.SourceNode != source {
		t.Errorf("the migration went from %s to %s; want from %s to %s", mig.Status.SourceNode, mig.Status.TargetNode, source, target)
	}
	moved := get()
	if moved.UID != vm.UID || moved.Status.NodeName != target || moved.Status.Instance != vm.Status.Instance || moved.Status.RestartCount != vm.Status.RestartCount {
		t.Errorf("after the migration the VM is %s on %s, instance %d run %d; want %s on %s, instance %d run %d", moved.UID, moved.Status.NodeName,
			moved.Status.Instance, moved.Status.RestartCount, vm.UID, target, vm.Status.Instance, vm.Status.RestartCount)
	}
	if rt := moved.Status.Runtime; rt == nil || rt.State != impv1.RuntimeRunning || !rt.GuestReady {
		t.Errorf("after the migration the VM's run: %+v", rt)
	}
	if moved.Status.Migration != nil {
		t.Errorf("the VM still names a migration: %+v", moved.Status.Migration)
	}
	// The count goes on where the source left it: the same guest, not a new boot (whose count
	// would start at 0 again). The migration took about a second: a few ticks at most between.
	g.Eventually(func() int { return len(ticks(consoleOn(target))) }).WithTimeout(2*time.Minute).Should(BeNumerically(">=", 2),
		func() string { return "the target's console:\n" + consoleOn(target) })
	after := ticks(consoleOn(target))
	last := seen[len(seen)-1]
	if after[0] <= last || after[0] > last+int(took/time.Second)+5 {
		t.Errorf("the source's count when the migration began: %v; the target's first ticks %v: the count did not go on", seen, after)
	}
	// The source lets the VM go: its VMM and its state.
	g.Eventually(func() bool {
		_, err := os.Stat(filepath.Join(tmp, source, "vms", string(vm.UID)))
		return os.IsNotExist(err)
	}).WithTimeout(2*time.Minute).Should(BeTrue(), "the source kept the migrated VM's state")
	if all, here := vmm.Marked(string(vm.UID)), vmm.MarkedIn(string(vm.UID), filepath.Join(tmp, target, "vms", string(vm.UID))); len(all) != 1 || len(here) != 1 {
		t.Errorf("VMMs of the VM after the migration: %v, the target's %v; want the target's one alone", all, here)
	}
	if mig.Status.Downtime == nil || mig.Status.BytesMoved <= 0 || mig.Status.CommittedAt == nil {
		t.Errorf("the migration's figures: %+v", mig.Status)
	}
	t.Logf("moved a running VM (192 MiB, TCG) between two nodes' agents: %v from the migration's creation to Succeeded, downtime %v, %d MiB sent",
		took.Round(time.Millisecond), mig.Status.Downtime.Duration, mig.Status.BytesMoved>>20)
}

// TestAMigrationWhoseTargetDiesLeavesTheVM: the target's VMM, waiting for the state, is killed
// (kill -9) as soon as the target reports its place ready. The migration fails; the VM stays
// on its source, the same run, its count going on there; the target's place is removed; and
// the VM moves when asked again.
func TestAMigrationWhoseTargetDiesLeavesTheVM(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	sfx := ns[len(ns)-5:]
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	host := testregistry.Start(t, "", "")
	testguest.Image(t, host, "hello")
	pool := "mig-" + sfx
	nodes := []string{"imp-migf-a-" + sfx, "imp-migf-b-" + sfx}
	for _, n := range nodes {
		poolNode(t, c, n, pool)
	}
	startOperator(t, c)
	ids := migrationIdentities(t, nodes...)
	for _, n := range nodes {
		startAgent(t, c, agent.Options{NodeName: n, StateDir: filepath.Join(tmp, n), Kernel: kernel, Initramfs: initrd,
			MigrationAddr: freeAddr(t), MigrationIdentity: ids[n], CgroupRoot: noCgroups})
	}
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "stayer"}, Spec: impv1.ImpVMSpec{
		Image: host + "/hello:v1", Args: []string{"serve"}, NodeSelector: map[string]string{"imp.test/pool": pool},
		Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("192Mi"))}, DiskSize: ptr.To(resource.MustParse("64Mi"))}}
	if err := c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	get := func() *impv1.ImpVM {
		v := &impv1.ImpVM{}
		if err := c.Client.Get(ctx, client.ObjectKeyFromObject(vm), v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	g.Eventually(func() bool {
		vm = get()
		return vm.Status.Phase == impv1.VMRunning && vm.Status.Runtime != nil && vm.Status.Runtime.GuestReady
	}).WithTimeout(10*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), func() string {
		return diagnose(c.Client, vm, func(node string) string { return filepath.Join(tmp, node) })
	})
	source, target := vm.Status.NodeName, nodes[0]
	if source == nodes[0] {
		target = nodes[1]
	}
	vmDir := func(node string) string { return filepath.Join(tmp, node, "vms", string(vm.UID)) }
	consoleOn := func(node string) string {
		b, _ := os.ReadFile(filepath.Join(vmDir(node), qemu.ConsoleLog))
		return string(b)
	}
	migrate := func(name string) *impv1.ImpVMMigration {
		mig := &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: impv1.ImpVMMigrationSpec{VMName: vm.Name}}
		if err := c.Client.Create(ctx, mig); err != nil {
			t.Fatal(err)
		}
		return mig
	}
	mig := migrate("dies")
	killed := false
	g.Eventually(func() impv1.MigrationPhase {
		if err := c.Client.Get(ctx, client.ObjectKeyFromObject(mig), mig); err != nil {
			return ""
		}
		if tg := mig.Status.Target; !killed && tg != nil && tg.State == impv1.MigrationAgentReady {
			rec, err := vmm.ReadRecord(vmDir(target))
			if err != nil {
				t.Fatalf("the target reported ready with no VMM recorded: %v", err)
			}
			_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
			killed = true
		}
		return mig.Status.Phase
	}).WithTimeout(5*time.Minute).WithPolling(5*time.Millisecond).Should(Equal(impv1.MigrationFailed), func() string {
		b, _ := json.MarshalIndent(mig.Status, "", " ")
		return "the migration: " + string(b)
	})
	if !killed {
		t.Fatalf("the migration ended before the target was ready: %+v", mig.Status)
	}
	t.Logf("the migration failed: %s: %s", mig.Status.Reason, mig.Status.Message)
	stayed := get()
	if stayed.Status.NodeName != source || stayed.Status.Instance != vm.Status.Instance || stayed.Status.RestartCount != vm.Status.RestartCount ||
		stayed.Status.Runtime == nil || stayed.Status.Runtime.State != impv1.RuntimeRunning {
		t.Errorf("after the failed migration the VM is on %s, instance %d run %d, run %+v; want it running on %s as before",
			stayed.Status.NodeName, stayed.Status.Instance, stayed.Status.RestartCount, stayed.Status.Runtime, source)
	}
	// Its count goes on on the source.
	n := len(ticks(consoleOn(source)))
	g.Eventually(func() int { return len(ticks(consoleOn(source))) }).WithTimeout(2*time.Minute).Should(BeNumerically(">", n+2),
		func() string { return "the source's console:\n" + consoleOn(source) })
	g.Eventually(func() bool {
		_, err := os.Stat(vmDir(target))
		return os.IsNotExist(err)
	}).WithTimeout(2*time.Minute).Should(BeTrue(), "the failed migration's place on the target is still there")
	g.Eventually(func() *impv1.MigrationStatus { return get().Status.Migration }).WithTimeout(time.Minute).Should(BeNil())

	again := migrate("again")
	g.Eventually(func() impv1.MigrationPhase {
		if err := c.Client.Get(ctx, client.ObjectKeyFromObject(again), again); err != nil {
			return ""
		}
		return again.Status.Phase
	}).WithTimeout(5*time.Minute).WithPolling(100*time.Millisecond).Should(Equal(impv1.MigrationSucceeded), func() string {
		b, _ := json.MarshalIndent(again.Status, "", " ")
		return "the second migration: " + string(b)
	})
	if got := get(); got.Status.NodeName != target || got.Status.Instance != vm.Status.Instance || got.Status.RestartCount != vm.Status.RestartCount {
		t.Errorf("after the second migration the VM is on %s, instance %d run %d", got.Status.NodeName, got.Status.Instance, got.Status.RestartCount)
	}
}
