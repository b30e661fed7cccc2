package agent_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	. "github.com/onsi/gomega"
	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/agent/transfer"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/controller/impvm"
	"github.com/syscode-labs/imp/internal/failpoint"
	"github.com/syscode-labs/imp/internal/kubectlimp/kubectlimptest"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/pki"
	"github.com/syscode-labs/imp/internal/testcluster"
	"github.com/syscode-labs/imp/internal/testguest"
	"github.com/syscode-labs/imp/internal/testnetns"
	"github.com/syscode-labs/imp/internal/testregistry"
)

// noCgroups, as Options.CgroupRoot, starts an agent whose VMMs get no cgroups of their own:
// two agents on this one machine would otherwise give one VM's two VMMs (a migration's
// sides) the same cgroup, and its memory limit.
const noCgroups = "-"

// poolNode registers a Ready Node labelled for IMP, with imp.test/pool=pool.
func poolNode(t *testing.T, c *testcluster.Cluster, name, pool string) {
	t.Helper()
	readyNode(t, c, name, "imp.test/pool", pool)
}

// migrationIdentities are the agents' certificates of nodes, as the operator's signer issues
// them (serving and client use), under one CA; each node's is also written to dir/<node>, as
// an agent's --access-cert-dir holds it (tls.crt, tls.key, ca.crt).
func migrationIdentities(t *testing.T, dir string, nodes ...string) map[string]transfer.Identity {
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
		files := filepath.Join(dir, node)
		if err := os.MkdirAll(files, 0o700); err != nil {
			t.Fatal(err)
		}
		for name, b := range map[string][]byte{"tls.crt": leaf.Cert, "tls.key": leaf.Key, "ca.crt": ca.Cert} {
			if err := os.WriteFile(filepath.Join(files, name), b, 0o600); err != nil {
				t.Fatal(err)
			}
		}
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

// migWorld is two nodes of one pool, each its own agent taking migrations over mutually
// authenticated TLS with node certificates, the operator, and a registry with the test image.
type migWorld struct {
	c              *testcluster.Cluster
	ns, pool, tmp  string
	host           string
	nodes          []string
	kernel, initrd string
	ids            map[string]transfer.Identity
	addrs          map[string]string // each node's migration endpoint
	bin            string            // the imp-agent binary (startProcessAgent)
}

func newMigWorld(t *testing.T, prefix string, opts ...func(*agent.Options)) *migWorld {
	w := newMigNodes(t, prefix)
	for _, n := range w.nodes {
		w.startAgent(t, n, opts...)
	}
	return w
}

// newMigNodes is a migWorld with no agent started yet.
func newMigNodes(t *testing.T, prefix string) *migWorld {
	c := testcluster.Require(t, shared)
	ns := c.Namespace(t)
	sfx := ns[len(ns)-5:]
	w := &migWorld{c: c, ns: ns, pool: prefix + "-" + sfx, tmp: t.TempDir(), addrs: map[string]string{}}
	w.kernel, w.initrd = testguest.Artifacts(t, w.tmp)
	w.host = testregistry.Start(t, "", "")
	testguest.Image(t, w.host, "hello")
	w.nodes = []string{"imp-" + prefix + "-a-" + sfx, "imp-" + prefix + "-b-" + sfx}
	for _, n := range w.nodes {
		poolNode(t, c, n, w.pool)
		w.addrs[n] = freeAddr(t)
	}
	startOperator(t, c)
	w.ids = migrationIdentities(t, filepath.Join(w.tmp, "certs"), w.nodes...)
	return w
}

// startAgent starts node's agent in this process.
func (w *migWorld) startAgent(t *testing.T, node string, opts ...func(*agent.Options)) {
	o := agent.Options{NodeName: node, StateDir: filepath.Join(w.tmp, node), Kernel: w.kernel, Initramfs: w.initrd,
		MigrationAddr: w.addrs[node], MigrationIdentity: w.ids[node], CgroupRoot: noCgroups}
	for _, f := range opts {
		f(&o)
	}
	startAgent(t, w.c, o)
}

// startProcessAgent starts node's agent as a process of its own, the imp-agent binary, with env
// added to its environment (a failpoint); its identity from files, as the chart's would be.
func (w *migWorld) startProcessAgent(t *testing.T, node string, env ...string) *exec.Cmd {
	t.Helper()
	killVMMs(t, filepath.Join(w.tmp, node), node)
	return startProcess(t, env, testcluster.Binary(t, "github.com/syscode-labs/imp/cmd/imp-agent"), "--kubeconfig", w.c.KubeconfigAs(t, testcluster.Agent, node), "--node-name", node, "--state-dir", filepath.Join(w.tmp, node),
		"--netns-dir", testnetns.PinDir(t), "--local-registry", "127.0.0.1", "--kernel", w.kernel, "--initramfs", w.initrd,
		"--qemu-accel", "tcg", "--reserve-vcpus", "0", "--reserve-memory", "0", "--vcpu-overcommit", "4", "--cgroup-root", "",
		"--access-bind-address", "127.0.0.1:0", "--access-cert-dir", filepath.Join(w.tmp, "certs", node),
		"--migration-bind-address", w.addrs[node], "--heartbeat-interval", "1s",
		"--metrics-bind-address", "0", "--health-probe-bind-address", "0", "--log-level", "error")
}

// run makes a VM of mem counting a tick a second on its console and waits until its guest is
// ready; it returns the VM then. Each of set changes the VM before it is made.
func (w *migWorld) run(t *testing.T, name, mem string, set ...func(*impv1.ImpVM)) *impv1.ImpVM {
	t.Helper()
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: name}, Spec: impv1.ImpVMSpec{
		Image: w.host + "/hello:v1", Args: []string{"serve"}, NodeSelector: map[string]string{"imp.test/pool": w.pool},
		Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse(mem))}, DiskSize: ptr.To(resource.MustParse("64Mi"))}}
	for _, f := range set {
		f(vm)
	}
	if err := w.c.Client.Create(context.Background(), vm); err != nil {
		t.Fatal(err)
	}
	NewWithT(t).Eventually(func() bool {
		vm = w.get(t, vm)
		return vm.Status.Phase == impv1.VMRunning && vm.Status.Runtime != nil && vm.Status.Runtime.GuestReady
	}).WithTimeout(10*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), func() string {
		return diagnose(w.c.Client, vm, func(node string) string { return filepath.Join(w.tmp, node) })
	})
	return vm
}

func (w *migWorld) get(t *testing.T, vm *impv1.ImpVM) *impv1.ImpVM {
	t.Helper()
	v := &impv1.ImpVM{}
	if err := w.c.Client.Get(context.Background(), client.ObjectKeyFromObject(vm), v); err != nil {
		t.Fatal(err)
	}
	return v
}

// stayed checks vm after a migration to target that failed: running on source as before (the
// same instance and run), its count going on there, the migration's place on the target
// removed, and no migration named.
func (w *migWorld) stayed(t *testing.T, vm *impv1.ImpVM, source, target string) {
	t.Helper()
	g := NewWithT(t)
	got := w.get(t, vm)
	if got.Status.NodeName != source || got.Status.Instance != vm.Status.Instance || got.Status.RestartCount != vm.Status.RestartCount ||
		got.Status.Runtime == nil || got.Status.Runtime.State != impv1.RuntimeRunning {
		t.Errorf("after the failed migration the VM is on %s, instance %d run %d, run %+v; want it running on %s as before",
			got.Status.NodeName, got.Status.Instance, got.Status.RestartCount, got.Status.Runtime, source)
	}
	n := len(ticks(w.console(source, vm)))
	g.Eventually(func() int { return len(ticks(w.console(source, vm))) }).WithTimeout(2*time.Minute).Should(BeNumerically(">", n+2),
		func() string { return "the source's console:\n" + w.console(source, vm) })
	g.Eventually(func() bool {
		_, err := os.Stat(w.vmDir(target, vm))
		return os.IsNotExist(err)
	}).WithTimeout(2*time.Minute).Should(BeTrue(), "the failed migration's place on the target is still there")
	g.Eventually(func() *impv1.MigrationStatus { return w.get(t, vm).Status.Migration }).WithTimeout(time.Minute).Should(BeNil())
}

// other is the node of the two that is not node.
func (w *migWorld) other(node string) string {
	if node == w.nodes[0] {
		return w.nodes[1]
	}
	return w.nodes[0]
}

func (w *migWorld) vmDir(node string, vm *impv1.ImpVM) string {
	return filepath.Join(w.tmp, node, "vms", string(vm.UID))
}

func (w *migWorld) console(node string, vm *impv1.ImpVM) string {
	b, _ := os.ReadFile(filepath.Join(w.vmDir(node, vm), qemu.ConsoleLog))
	return string(b)
}

// migrate makes migration name of vm, and waits until it is in phase want; each look at it is
// given to seen first, when set. It returns the migration then.
func (w *migWorld) migrate(t *testing.T, name string, vm *impv1.ImpVM, want impv1.MigrationPhase, seen func(*impv1.ImpVMMigration)) *impv1.ImpVMMigration {
	t.Helper()
	ctx := context.Background()
	mig := &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: name}, Spec: impv1.ImpVMMigrationSpec{VMName: vm.Name}}
	if err := w.c.Client.Create(ctx, mig); err != nil {
		t.Fatal(err)
	}
	NewWithT(t).Eventually(func() impv1.MigrationPhase {
		if err := w.c.Client.Get(ctx, client.ObjectKeyFromObject(mig), mig); err != nil {
			return ""
		}
		if seen != nil {
			seen(mig)
		}
		return mig.Status.Phase
	}).WithTimeout(5*time.Minute).WithPolling(5*time.Millisecond).Should(Equal(want), func() string {
		b, _ := json.MarshalIndent(mig.Status, "", " ")
		return "migration " + name + ": " + string(b) + "\nthe VM: " + diagnose(w.c.Client, vm, func(node string) string { return filepath.Join(w.tmp, node) }) +
			"\nthe VMMs' logs: " + qemu.LogTail(w.vmDir(w.nodes[0], vm), 2000) + "\n---\n" + qemu.LogTail(w.vmDir(w.nodes[1], vm), 2000)
	})
	return mig
}

// TestLiveMigrationBetweenNodes: two nodes, each its own agent taking migrations over mutually
// authenticated TLS with node certificates; a VM counting a tick a second on its console boots
// on one under QEMU/TCG. An ImpVMMigration moves it to the other: the target prepares its place
// and a VMM waiting for the state, the source mirrors its disk and sends its memory while the
// guest runs, pauses it for the rest; the operator commits; the target runs it on. The VM is the
// same (UID, instance, run: not restarted), its count goes on from where it was on the target
// (no tick 0 again), the source's VMM and state are gone, and the migration says what it took.
func TestLiveMigrationBetweenNodes(t *testing.T) {
	w := newMigWorld(t, "mig")
	g := NewWithT(t)
	vm := w.run(t, "mover", "192Mi")
	source := vm.Status.NodeName
	target := w.other(source)
	g.Eventually(func() int { return len(ticks(w.console(source, vm))) }).WithTimeout(5 * time.Minute).Should(BeNumerically(">=", 3))
	seen := ticks(w.console(source, vm)) // the source's count when the migration begins
	began := time.Now()
	mig := w.migrate(t, "move", vm, impv1.MigrationSucceeded, nil)
	took := time.Since(began)
	if mig.Status.TargetNode != target || mig.Status.SourceNode != source {
		t.Errorf("the migration went from %s to %s; want from %s to %s", mig.Status.SourceNode, mig.Status.TargetNode, source, target)
	}
	moved := w.get(t, vm)
	if moved.UID != vm.UID || moved.Status.NodeName != target || moved.Status.Instance != vm.Status.Instance || moved.Status.RestartCount != vm.Status.RestartCount {
		t.Errorf("after the migration the VM is %s on %s, instance %d run %d; want %s on %s, instance %d run %d", moved.UID, moved.Status.NodeName,
			moved.Status.Instance, moved.Status.RestartCount, vm.UID, target, vm.Status.Instance, vm.Status.RestartCount)
	}
	if rt := moved.Status.Runtime; rt == nil || rt.State != impv1.RuntimeRunning || !rt.GuestReady {
		t.Errorf("after the migration the VM's run: %+v", rt)
	}
	g.Eventually(func() *impv1.MigrationStatus { return w.get(t, vm).Status.Migration }).WithTimeout(time.Minute).Should(BeNil(),
		"the VM still names its migration")
	// The count goes on where the source left it: the same guest, not a new boot (whose count
	// would start at 0 again). The migration took about a second: a few ticks at most between.
	g.Eventually(func() int { return len(ticks(w.console(target, vm))) }).WithTimeout(2*time.Minute).Should(BeNumerically(">=", 2),
		func() string { return "the target's console:\n" + w.console(target, vm) })
	after := ticks(w.console(target, vm))
	last := seen[len(seen)-1]
	if after[0] <= last || after[0] > last+int(took/time.Second)+5 {
		t.Errorf("the source's count when the migration began: %v; the target's first ticks %v: the count did not go on; the target's console:\n%s", seen, after, w.console(target, vm))
	}
	// The source lets the VM go: its VMM and its state.
	g.Eventually(func() bool {
		_, err := os.Stat(w.vmDir(source, vm))
		return os.IsNotExist(err)
	}).WithTimeout(2*time.Minute).Should(BeTrue(), "the source kept the migrated VM's state")
	// The source's VMM ended there is not the VM's run: it runs on, reported so.
	g.Consistently(func() impv1.RuntimeState { return w.get(t, vm).Status.Runtime.State }).WithTimeout(2 * time.Second).Should(Equal(impv1.RuntimeRunning))
	if all, here := vmm.Marked(string(vm.UID)), vmm.MarkedIn(string(vm.UID), w.vmDir(target, vm)); len(all) != 1 || len(here) != 1 {
		t.Errorf("VMMs of the VM after the migration: %v, the target's %v; want the target's one alone", all, here)
	}
	if mig.Status.Downtime == nil || mig.Status.BytesMoved <= 0 || mig.Status.CommittedAt == nil {
		t.Fatalf("the migration's figures: %+v", mig.Status)
	}
	t.Logf("moved a running VM (192 MiB, TCG) between two nodes' agents: %v from the migration's creation to Succeeded, downtime %v, %d MiB sent",
		took.Round(time.Millisecond), mig.Status.Downtime.Duration, mig.Status.BytesMoved>>20)
}

// TestAMigrationWhoseTargetDiesLeavesTheVM: the target's VMM, waiting for the state, is killed
// (kill -9) as soon as the target reports its place ready. The migration fails; the VM stays
// on its source, the same run, its count going on there; the target's place is removed; and
// the VM moves when asked again.
func TestAMigrationWhoseTargetDiesLeavesTheVM(t *testing.T) {
	w := newMigWorld(t, "migf")
	vm := w.run(t, "stayer", "192Mi")
	source := vm.Status.NodeName
	target := w.other(source)
	killed := false
	mig := w.migrate(t, "dies", vm, impv1.MigrationFailed, func(mig *impv1.ImpVMMigration) {
		if tg := mig.Status.Target; !killed && tg != nil && tg.State == impv1.MigrationAgentReady {
			rec, err := vmm.ReadRecord(w.vmDir(target, vm))
			if err != nil {
				t.Fatalf("the target reported ready with no VMM recorded: %v", err)
			}
			_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
			killed = true
		}
	})
	if !killed {
		t.Fatalf("the migration ended before the target was ready: %+v", mig.Status)
	}
	t.Logf("the migration failed: %s: %s", mig.Status.Reason, mig.Status.Message)
	w.stayed(t, vm, source, target)

	// Asked again with kubectl imp migrate, which waits and says where it went.
	if out := kubectlimptest.Run(t, w.c.Kubeconfig(t), w.ns, "migrate", vm.Name, "--to", target, "--timeout", "5m"); !strings.Contains(out, "runs on node "+target) {
		t.Errorf("kubectl imp migrate printed:\n%s", out)
	}
	if got := w.get(t, vm); got.Status.NodeName != target || got.Status.Instance != vm.Status.Instance || got.Status.RestartCount != vm.Status.RestartCount {
		t.Errorf("after the second migration the VM is on %s, instance %d run %d", got.Status.NodeName, got.Status.Instance, got.Status.RestartCount)
	}
}

// TestDrainMovesWhatMayMove: two VMs on one node, one with evictionStrategy Migrate, one with
// None (the default). `kubectl imp drain NODE` cordons and taints the node and waits: the
// first moves to the other node with its memory (the same run), the second stays running where
// it is, and new VMs go elsewhere; `kubectl imp undrain NODE` ends it.
func TestDrainMovesWhatMayMove(t *testing.T) {
	w := newMigWorld(t, "drain")
	ctx := context.Background()
	mover := w.run(t, "mover", "192Mi", func(vm *impv1.ImpVM) { vm.Spec.EvictionStrategy = impv1.EvictionMigrate })
	node := mover.Status.NodeName
	stayer := w.run(t, "stayer", "192Mi", func(vm *impv1.ImpVM) { vm.Spec.NodeSelector["imp.test/node"] = node })
	out := kubectlimptest.Run(t, w.c.Kubeconfig(t), w.ns, "drain", node, "--timeout", "5m")
	for _, want := range []string{"cordoned and tainted", "impvm " + w.ns + "/stayer stays (evictionStrategy None)", "evacuated"} {
		if !strings.Contains(out, want) {
			t.Errorf("kubectl imp drain printed no %q:\n%s", want, out)
		}
	}
	moved := w.get(t, mover)
	if moved.Status.NodeName != w.other(node) || moved.Status.Instance != mover.Status.Instance || moved.Status.RestartCount != mover.Status.RestartCount {
		t.Errorf("after the drain the Migrate VM is on %s, instance %d run %d; want it moved to %s, the same run",
			moved.Status.NodeName, moved.Status.Instance, moved.Status.RestartCount, w.other(node))
	}
	if got := w.get(t, stayer); got.Status.NodeName != node || got.Status.Instance != stayer.Status.Instance || got.Status.Runtime == nil ||
		got.Status.Runtime.State != impv1.RuntimeRunning {
		t.Errorf("after the drain the None VM is on %s, instance %d, run %+v; want it running on %s as before", got.Status.NodeName, got.Status.Instance,
			got.Status.Runtime, node)
	}
	n := &corev1.Node{}
	if err := w.c.Client.Get(ctx, client.ObjectKey{Name: node}, n); err != nil {
		t.Fatal(err)
	}
	if !n.Spec.Unschedulable {
		t.Error("the drained node is not cordoned")
	}
	kubectlimptest.Run(t, w.c.Kubeconfig(t), w.ns, "undrain", node)
	if err := w.c.Client.Get(ctx, client.ObjectKey{Name: node}, n); err != nil {
		t.Fatal(err)
	}
	for _, taint := range n.Spec.Taints {
		if taint.Key == impv1.EvacuateTaint {
			t.Errorf("undrained, the node keeps %v", taint)
		}
	}
	if n.Spec.Unschedulable {
		t.Error("undrained, the node is still cordoned")
	}
}

// TestAMigratedVMKeepsItsAddressAndService: two nodes, each a network namespace with its own
// agent taking migrations, joined by an underlay (the overlay between them) and each with an
// endpoint block; a "pod" namespace routed through node B. A web VM on an ImpNetwork with
// port 8080 (a readiness probe) behind a Service boots on node A and moves to node B: it keeps
// its address (and so its MAC) and its run; its Service endpoint moves into B's block, ready,
// and answers from the pod with the VM's greeting.
func TestAMigratedVMKeepsItsAddressAndService(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	sfx := ns[len(ns)-5:]
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	host := testregistry.Start(t, "", "")
	testguest.Image(t, host, "hello")
	nsA, nsB, pod := testnetns.New(t, "imp-ma-"+sfx), testnetns.New(t, "imp-mb-"+sfx), testnetns.New(t, "imp-mp-"+sfx)
	testnetns.Link(t, nsA, "under0", "192.168.76.1/24", nsB, "under0", "192.168.76.2/24")
	testnetns.Link(t, nsB, "eth1", "192.168.75.1/24", pod, "eth0", "192.168.75.2/24")
	ph := testnetns.Handle(t, pod)
	pl, _ := ph.LinkByName("eth0")
	if err := ph.RouteAdd(&netlink.Route{LinkIndex: pl.Attrs().Index, Gw: net.ParseIP("192.168.75.1")}); err != nil {
		t.Fatal(err)
	}
	pool := "mignet-" + sfx
	nodeA, nodeB := "imp-mna-"+sfx, "imp-mnb-"+sfx
	poolNode(t, c, nodeA, pool)
	poolNode(t, c, nodeB, pool)
	startOperatorWith(t, c, operator.Options{VM: impvm.DefaultOptions(), Concurrency: 2,
		EndpointRange: netip.MustParsePrefix("100.73.0.0/16"), EndpointBlockBits: 24})
	ids := migrationIdentities(t, filepath.Join(tmp, "certs"), nodeA, nodeB)
	for _, n := range []struct{ node, netns, vtep string }{{nodeA, nsA, "192.168.76.1"}, {nodeB, nsB, "192.168.76.2"}} {
		startAgent(t, c, agent.Options{NodeName: n.node, StateDir: filepath.Join(tmp, n.node), Kernel: kernel, Initramfs: initrd,
			NetNS: n.netns, NetNSDir: testnetns.PinDir(t), OverlayAddress: netip.MustParseAddr(n.vtep), EndpointBlocks: true,
			MigrationAddr: freeAddr(t), MigrationIdentity: ids[n.node], CgroupRoot: noCgroups})
	}
	if err := c.Client.Create(ctx, &impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.95.0.0/24"}}); err != nil {
		t.Fatal(err)
	}
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "web", Labels: map[string]string{"app": "web"}}, Spec: impv1.ImpVMSpec{
		Image: host + "/hello:v1", Args: []string{"web"}, NodeSelector: map[string]string{"imp.test/pool": pool},
		NetworkRef: &impv1.NetworkReference{Name: "net"}, Ports: []impv1.VMPort{{Name: "http", Port: 8080, Protocol: corev1.ProtocolTCP}},
		ReadinessProbe: &impv1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: intstr.FromString("http")}},
			PeriodSeconds: 1, FailureThreshold: 1, SuccessThreshold: 1, TimeoutSeconds: 1},
		Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("192Mi"))}, DiskSize: ptr.To(resource.MustParse("64Mi"))}}
	if err := c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	if err := c.Client.Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "web"}, Spec: corev1.ServiceSpec{
		Selector: map[string]string{"app": "web"}, Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}}}}); err != nil {
		t.Fatal(err)
	}
	sw := &svcWorld{c: c}
	g := NewWithT(t)
	g.Eventually(func() []string { return sw.endpoints(ns) }).WithTimeout(10*time.Minute).WithPolling(200*time.Millisecond).Should(
		ConsistOf(MatchRegexp(`^100\.73\.\d+\.\d+:8080 web true$`)), func() string {
			return diagnose(c.Client, vm, func(node string) string { return filepath.Join(tmp, node) })
		})
	if err := c.Client.Get(ctx, client.ObjectKeyFromObject(vm), vm); err != nil {
		t.Fatal(err)
	}
	if vm.Status.NodeName != nodeA { // of two nodes with as much free, the first by name
		t.Fatalf("the VM went to %s", vm.Status.NodeName)
	}
	before := sw.endpoints(ns)[0]
	// A connection through the Service's endpoint before the move (HTTP, kept alive): node B
	// routes node A's block to A (the agents' routes), forwards the pod's packets, and node A
	// routes the pod's network back through B, as a cluster's routes would.
	ha := testnetns.Handle(t, nsA)
	ua, _ := ha.LinkByName("under0")
	if err := ha.RouteAdd(&netlink.Route{LinkIndex: ua.Attrs().Index, Dst: &net.IPNet{IP: net.ParseIP("192.168.75.0"), Mask: net.CIDRMask(24, 32)},
		Gw: net.ParseIP("192.168.76.2")}); err != nil {
		t.Fatal(err)
	}
	if err := testnetns.Do(nsB, func() error { return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644) }); err != nil {
		t.Fatal(err)
	}
	var through net.Conn
	if err := testnetns.Do(pod, func() (err error) {
		through, err = net.DialTimeout("tcp", strings.Fields(before)[0], 10*time.Second)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer through.Close()
	ask := func() (string, error) {
		_ = through.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := through.Write([]byte("GET / HTTP/1.1\r\nHost: web\r\n\r\n")); err != nil {
			return "", err
		}
		resp, err := http.ReadResponse(bufio.NewReader(through), nil)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return strings.TrimSpace(string(b)), err
	}
	if got, err := ask(); got != "hello from web" {
		t.Fatalf("through the endpoint before the move: %q, %v", got, err)
	}
	mig := &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "move"}, Spec: impv1.ImpVMMigrationSpec{VMName: "web", TargetNode: nodeB}}
	if err := c.Client.Create(ctx, mig); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() impv1.MigrationPhase {
		_ = c.Client.Get(ctx, client.ObjectKeyFromObject(mig), mig)
		return mig.Status.Phase
	}).WithTimeout(5*time.Minute).WithPolling(100*time.Millisecond).Should(Equal(impv1.MigrationSucceeded), func() string {
		b, _ := json.MarshalIndent(mig.Status, "", " ")
		return string(b)
	})
	moved := &impv1.ImpVM{}
	if err := c.Client.Get(ctx, client.ObjectKeyFromObject(vm), moved); err != nil {
		t.Fatal(err)
	}
	if moved.Status.NodeName != nodeB || moved.Status.IP != vm.Status.IP || moved.Status.Instance != vm.Status.Instance || moved.Status.RestartCount != vm.Status.RestartCount {
		t.Errorf("after the migration: on %s, address %s, instance %d run %d; want on %s with address %s, the same run", moved.Status.NodeName, moved.Status.IP,
			moved.Status.Instance, moved.Status.RestartCount, nodeB, vm.Status.IP)
	}
	var after string
	g.Eventually(func() []string { return sw.endpoints(ns) }).WithTimeout(2 * time.Minute).WithPolling(100 * time.Millisecond).Should(
		ConsistOf(MatchRegexp(`^100\.73\.\d+\.\d+:8080 web true$`)))
	after = sw.endpoints(ns)[0]
	if after == before {
		t.Errorf("the Service endpoint stayed %s: node B's block is not node A's", before)
	}
	ep := strings.Fields(after)[0]
	g.Eventually(func() string { return get(pod, ep) }).WithTimeout(time.Minute).Should(Equal("hello from web"),
		"the moved VM's endpoint "+ep+" from the pod")
	// The connection made through the source's endpoint went with the source's run: it breaks
	// (docs/migration.md), where the client's next connection reached the VM on its new node.
	if got, err := ask(); err == nil {
		t.Errorf("a connection through the source's endpoint still answers after the move: %q", got)
	} else {
		t.Logf("the connection through the source's endpoint after the move: %v", err)
	}
	t.Logf("moved a web VM with its address %s; its Service endpoint %s → %s; paused %v", vm.Status.IP, strings.Fields(before)[0], ep, mig.Status.Downtime.Duration)
}

// TestASourceAgentKilledMidMigration: the source's agent runs as a process of its own and is
// killed (at a failpoint: it exits at once, as kill -9 would leave it) twice in a migration's
// course, and started again each time. Killed with the disk mirrored and the memory not yet
// sent: the agent that returns finds the guest held for the migration, says the migration
// failed, and the VM runs on where it is, the same run, its count going on. Killed with
// everything sent and the guest paused, before it said so: the agent that returns finds QEMU's
// migration completed and says so; the operator commits, and the VM runs on on the target, the
// same run, counting on from where it stood; the source keeps nothing of it.
func TestASourceAgentKilledMidMigration(t *testing.T) {
	w := newMigNodes(t, "migk")
	ctx := context.Background()
	g := NewWithT(t)
	source, target := w.nodes[0], w.nodes[1]
	proc := w.startProcessAgent(t, source, failpoint.EnvVar+"=migration-mirrored")
	vm := w.run(t, "held", "192Mi") // the only node with an agent yet
	if vm.Status.NodeName != source {
		t.Fatalf("the VM went to %s; want %s", vm.Status.NodeName, source)
	}
	w.startAgent(t, target)
	g.Eventually(func() int { return len(ticks(w.console(source, vm))) }).WithTimeout(5 * time.Minute).Should(BeNumerically(">=", 3))
	rec, err := vmm.ReadRecord(w.vmDir(source, vm))
	if err != nil {
		t.Fatal(err)
	}
	migrate := func(name string) *impv1.ImpVMMigration {
		t.Helper()
		mig := &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: name}, Spec: impv1.ImpVMMigrationSpec{VMName: vm.Name, TargetNode: target}}
		if err := w.c.Client.Create(ctx, mig); err != nil {
			t.Fatal(err)
		}
		return mig
	}
	ended := func(mig *impv1.ImpVMMigration, want impv1.MigrationPhase) {
		t.Helper()
		g.Eventually(func() impv1.MigrationPhase {
			_ = w.c.Client.Get(ctx, client.ObjectKeyFromObject(mig), mig)
			return mig.Status.Phase
		}).WithTimeout(5*time.Minute).WithPolling(100*time.Millisecond).Should(Equal(want), func() string {
			b, _ := json.MarshalIndent(mig.Status, "", " ")
			return "migration " + mig.Name + ": " + string(b)
		})
	}

	// Killed with the disk mirrored, the memory not yet sent.
	first := migrate("first")
	waitCrashed(t, proc, 5*time.Minute)
	if !rec.Alive() {
		t.Fatal("the VM's VMM ended with its agent")
	}
	proc = w.startProcessAgent(t, source, failpoint.EnvVar+"=migration-sent")
	ended(first, impv1.MigrationFailed)
	if s := first.Status.Source; s == nil || s.State != impv1.MigrationAgentFailed || !strings.Contains(s.Message, "restarted") {
		t.Errorf("the source's report of the first migration: %+v; want Failed, its agent having restarted", s)
	}
	w.stayed(t, vm, source, target)

	// Killed with everything sent and the guest paused, before it said so.
	second := migrate("second")
	waitCrashed(t, proc, 5*time.Minute)
	seen := ticks(w.console(source, vm))
	began := time.Now()
	w.startProcessAgent(t, source)
	ended(second, impv1.MigrationSucceeded)
	moved := w.get(t, vm)
	if moved.UID != vm.UID || moved.Status.NodeName != target || moved.Status.Instance != vm.Status.Instance || moved.Status.RestartCount != vm.Status.RestartCount {
		t.Errorf("after the second migration the VM is %s on %s, instance %d run %d; want %s on %s, instance %d run %d", moved.UID, moved.Status.NodeName,
			moved.Status.Instance, moved.Status.RestartCount, vm.UID, target, vm.Status.Instance, vm.Status.RestartCount)
	}
	if s := second.Status.Source; s == nil || s.State != impv1.MigrationAgentPaused || second.Status.BytesMoved <= 0 {
		t.Errorf("the second migration: source %+v, %d bytes moved; want Paused with what QEMU sent", s, second.Status.BytesMoved)
	}
	g.Eventually(func() int { return len(ticks(w.console(target, vm))) }).WithTimeout(2*time.Minute).Should(BeNumerically(">=", 2),
		func() string { return "the target's console:\n" + w.console(target, vm) })
	after, last := ticks(w.console(target, vm)), seen[len(seen)-1]
	if after[0] <= last || after[0] > last+int(time.Since(began)/time.Second)+5 {
		t.Errorf("the source's count when its agent was killed: %v; the target's first ticks %v: the count did not go on", seen, after)
	}
	g.Eventually(func() bool {
		_, err := os.Stat(w.vmDir(source, vm))
		return os.IsNotExist(err)
	}).WithTimeout(2*time.Minute).Should(BeTrue(), "the source kept the migrated VM's state")
	if all, here := vmm.Marked(string(vm.UID)), vmm.MarkedIn(string(vm.UID), w.vmDir(target, vm)); len(all) != 1 || len(here) != 1 {
		t.Errorf("VMMs of the VM after the migration: %v, the target's %v; want the target's one alone", all, here)
	}
}

// TestABusyGuestThatCannotMoveStays: a guest that dirties its memory faster than this machine
// sends it (256 MiB of pages at 1 GiB/s) is not moved: pre-copy never catches up, the migration
// times out, and the guest runs on on its source, the same run, counting on. (QEMU's
// auto-converge would slow it until it fits; under TCG here it left guests with corrupt
// memory: docs/migration.md.)
func TestABusyGuestThatCannotMoveStays(t *testing.T) {
	// The nodes' streams bounded at 64 MiB/s (the chart's bound is 1 GiB/s): the guest dirties
	// faster than that however loaded this machine is. Unbounded, a loaded machine's guest
	// (its vCPU starved beside QEMU's migration thread) was once outrun: CI, 866 MiB sent.
	w := newMigWorld(t, "migb", func(o *agent.Options) { o.MigrationBandwidth = 64 << 20 })
	vm := w.run(t, "busy", "512Mi", func(vm *impv1.ImpVM) { vm.Spec.Args = []string{"dirty", "256", "1024"} })
	source := vm.Status.NodeName
	NewWithT(t).Eventually(func() int { return len(ticks(w.console(source, vm))) }).WithTimeout(5 * time.Minute).Should(BeNumerically(">=", 3))
	mig := &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "busy"},
		Spec: impv1.ImpVMMigrationSpec{VMName: vm.Name, TimeoutSeconds: ptr.To[int32](30)}}
	if err := w.c.Client.Create(context.Background(), mig); err != nil {
		t.Fatal(err)
	}
	NewWithT(t).Eventually(func() impv1.MigrationPhase {
		_ = w.c.Client.Get(context.Background(), client.ObjectKeyFromObject(mig), mig)
		return mig.Status.Phase
	}).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Or(Equal(impv1.MigrationSucceeded), Equal(impv1.MigrationFailed)))
	t.Logf("a busy guest (512 MiB, dirtying 256 MiB at 1 GiB/s): %s %s, %d MiB sent", mig.Status.Phase, mig.Status.Reason, mig.Status.BytesMoved>>20)
	if mig.Status.Phase != impv1.MigrationFailed {
		t.Fatalf("the busy guest's migration %s: pre-copy caught up with a guest dirtying faster than it sends", mig.Status.Phase)
	}
	w.stayed(t, vm, source, w.other(source))
}

var held = regexp.MustCompile(`hold: (\S+) count (\d+) host (\S+)`)

// answers are the answers a hold workload's console shows, in order: its connection's local
// address and the count each said.
func answers(log string) (local []string, counts []int) {
	for _, m := range held.FindAllStringSubmatch(log, -1) {
		n, _ := strconv.Atoi(m[2])
		local, counts = append(local, m[1]), append(counts, n)
	}
	return local, counts
}

// TestAConnectionFromAThirdNodeSurvivesTheMove: three nodes, each a network namespace with its
// own agent, on one underlay segment (the overlay between them). A VM counting in memory and
// answering on one TCP connection for as long as it is open runs on node A; a VM of the same
// network on node C holds one connection to it, asking twice a second. The counting VM moves to
// node B: the same connection (its client's end unchanged) goes on answering across the move,
// with counts that go on from where they were (the memory moved, not a new boot); the VM keeps
// its name, UID, address (and so its MAC) and run; node A keeps nothing of it.
func TestAConnectionFromAThirdNodeSurvivesTheMove(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	sfx := ns[len(ns)-5:]
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	host := testregistry.Start(t, "", "")
	testguest.Image(t, host, "hello")
	spaces := []string{testnetns.New(t, "imp-m3a-"+sfx), testnetns.New(t, "imp-m3b-"+sfx), testnetns.New(t, "imp-m3c-"+sfx)}
	vteps := []string{"192.168.74.1", "192.168.74.2", "192.168.74.3"}
	testnetns.Switch(t, "imp-m3u-"+sfx, "under0", spaces, []string{vteps[0] + "/24", vteps[1] + "/24", vteps[2] + "/24"})
	nodes := []string{"imp-m3a-" + sfx, "imp-m3b-" + sfx, "imp-m3c-" + sfx}
	pool := "mig3-" + sfx
	poolNode(t, c, nodes[0], pool)
	poolNode(t, c, nodes[1], pool)
	readyNode(t, c, nodes[2])
	startOperator(t, c)
	ids := migrationIdentities(t, filepath.Join(tmp, "certs"), nodes[:2]...)
	for i, node := range nodes {
		o := agent.Options{NodeName: node, StateDir: filepath.Join(tmp, node), Kernel: kernel, Initramfs: initrd,
			NetNS: spaces[i], NetNSDir: testnetns.PinDir(t), OverlayAddress: netip.MustParseAddr(vteps[i]), CgroupRoot: noCgroups}
		if i < 2 {
			o.MigrationAddr, o.MigrationIdentity = freeAddr(t), ids[node]
		}
		startAgent(t, c, o)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, n := range spaces {
				dump, _ := exec.Command("sh", "-c", "ip -n $0 -d link; ip netns exec $0 bridge fdb", filepath.Base(n)).CombinedOutput()
				t.Logf("%s:\n%s", n, dump)
			}
		}
	})
	if err := c.Client.Create(ctx, &impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.96.0.0/24"}}); err != nil {
		t.Fatal(err)
	}
	stateDir := func(node string) string { return filepath.Join(tmp, node) }
	console := func(node string, vm *impv1.ImpVM) string {
		b, _ := os.ReadFile(filepath.Join(stateDir(node), "vms", string(vm.UID), qemu.ConsoleLog))
		return string(b)
	}
	running := func(name string, selector map[string]string, args ...string) *impv1.ImpVM {
		t.Helper()
		vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: impv1.ImpVMSpec{
			Image: host + "/hello:v1", Args: args, NodeSelector: selector, NetworkRef: &impv1.NetworkReference{Name: "net"},
			Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("192Mi"))}, DiskSize: ptr.To(resource.MustParse("64Mi"))}}
		if err := c.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
		NewWithT(t).Eventually(func() bool {
			_ = c.Client.Get(ctx, client.ObjectKeyFromObject(vm), vm)
			return vm.Status.Phase == impv1.VMRunning && vm.Status.Runtime != nil && vm.Status.Runtime.GuestReady
		}).WithTimeout(10*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), func() string { return diagnose(c.Client, vm, stateDir) })
		return vm
	}
	counter := running("counter", map[string]string{"imp.test/pool": pool}, "counter")
	source := counter.Status.NodeName
	if source != nodes[0] { // of two nodes with as much free, the first by name
		t.Fatalf("the counting VM went to %s", source)
	}
	client3 := running("client", map[string]string{"imp.test/node": nodes[2]}, "hold", counter.Status.IP+":7002")
	g := NewWithT(t)
	asked := func() int { local, _ := answers(console(nodes[2], client3)); return len(local) }
	g.Eventually(asked).WithTimeout(5*time.Minute).Should(BeNumerically(">=", 3), func() string { return "the client's console:\n" + console(nodes[2], client3) })

	began := time.Now()
	mig := &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "move"}, Spec: impv1.ImpVMMigrationSpec{VMName: counter.Name, TargetNode: nodes[1]}}
	if err := c.Client.Create(ctx, mig); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() impv1.MigrationPhase {
		_ = c.Client.Get(ctx, client.ObjectKeyFromObject(mig), mig)
		return mig.Status.Phase
	}).WithTimeout(5*time.Minute).WithPolling(100*time.Millisecond).Should(Equal(impv1.MigrationSucceeded), func() string {
		b, _ := json.MarshalIndent(mig.Status, "", " ")
		return string(b)
	})
	ended := time.Now()
	atEnd := asked()
	// Answers after the move, on the same connection.
	g.Eventually(asked).WithTimeout(2*time.Minute).Should(BeNumerically(">=", atEnd+4), func() string { return "the client's console:\n" + console(nodes[2], client3) })
	log := console(nodes[2], client3)
	if strings.Contains(log, "hold: broken") || strings.Count(log, "hold: connected") != 1 {
		t.Fatalf("the client's connection did not survive the move:\n%s", log)
	}
	local, counts := answers(log)
	for i := range local {
		if local[i] != local[0] {
			t.Fatalf("answer %d came on a connection from %s, the first from %s:\n%s", i, local[i], local[0], log)
		}
		if i > 0 && counts[i] < counts[i-1] {
			t.Fatalf("the count went back from %d to %d: not the same guest's memory:\n%s", counts[i-1], counts[i], log)
		}
	}
	// The largest gap between two answers is the connection's stall across the move.
	var stall time.Duration
	for i := 1; i < len(counts); i++ {
		stall = max(stall, time.Duration(counts[i]-counts[i-1])*100*time.Millisecond)
	}
	moved := &impv1.ImpVM{}
	if err := c.Client.Get(ctx, client.ObjectKeyFromObject(counter), moved); err != nil {
		t.Fatal(err)
	}
	if moved.UID != counter.UID || moved.Status.NodeName != nodes[1] || moved.Status.IP != counter.Status.IP ||
		moved.Status.Instance != counter.Status.Instance || moved.Status.RestartCount != counter.Status.RestartCount {
		t.Errorf("after the migration the VM is %s on %s at %s, instance %d run %d; want %s on %s at %s, the same run", moved.UID, moved.Status.NodeName,
			moved.Status.IP, moved.Status.Instance, moved.Status.RestartCount, counter.UID, nodes[1], counter.Status.IP)
	}
	// Node A keeps nothing of it: its state, its VMM.
	g.Eventually(func() bool {
		_, err := os.Stat(filepath.Join(stateDir(source), "vms", string(counter.UID)))
		return os.IsNotExist(err)
	}).WithTimeout(2*time.Minute).Should(BeTrue(), "node A kept the migrated VM's state")
	if all := vmm.Marked(string(counter.UID)); len(all) != 1 {
		t.Errorf("VMMs of the VM after the migration: %v; want the target's one alone", all)
	}
	t.Logf("a connection from a VM on a third node held across the move (%v from the migration's creation to Succeeded, paused %v): "+
		"%d answers on one connection from %s, counts %d..%d; its longest silence %v",
		ended.Sub(began).Round(time.Millisecond), mig.Status.Downtime.Duration, len(counts), local[0], counts[0], counts[len(counts)-1], stall)
}

// TestATargetAgentKilledMidTransfer: the target's agent runs as a process of its own and is
// killed (at a failpoint: it exits at once, as kill -9 would leave it) once the source has
// mirrored the disk and opened the memory's stream, nothing loaded yet; its VMM, waiting for
// the state, outlives it. The migration fails; the VM runs on on its source, the same run, its
// count going on; the target's agent, started again, removes what the migration left there
// (its VMM, its state): the VM is never on both. Asked again, the VM moves.
func TestATargetAgentKilledMidTransfer(t *testing.T) {
	w := newMigNodes(t, "migt")
	source, target := w.nodes[0], w.nodes[1]
	w.startAgent(t, source)
	vm := w.run(t, "held", "192Mi") // the only node with an agent yet
	if vm.Status.NodeName != source {
		t.Fatalf("the VM went to %s; want %s", vm.Status.NodeName, source)
	}
	proc := w.startProcessAgent(t, target, failpoint.EnvVar+"=migration-receiving")
	g := NewWithT(t)
	g.Eventually(func() int { return len(ticks(w.console(source, vm))) }).WithTimeout(5 * time.Minute).Should(BeNumerically(">=", 3))
	ctx := context.Background()
	mig := &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "first"}, Spec: impv1.ImpVMMigrationSpec{VMName: vm.Name, TargetNode: target}}
	if err := w.c.Client.Create(ctx, mig); err != nil {
		t.Fatal(err)
	}
	waitCrashed(t, proc, 5*time.Minute)
	rec, err := vmm.ReadRecord(w.vmDir(target, vm))
	if err != nil || !rec.Alive() {
		t.Fatalf("the target's VMM did not outlive its agent (%v): the kill left nothing to clean", err)
	}
	g.Eventually(func() impv1.MigrationPhase {
		_ = w.c.Client.Get(ctx, client.ObjectKeyFromObject(mig), mig)
		return mig.Status.Phase
	}).WithTimeout(5*time.Minute).WithPolling(100*time.Millisecond).Should(Equal(impv1.MigrationFailed), func() string {
		b, _ := json.MarshalIndent(mig.Status, "", " ")
		return string(b)
	})
	t.Logf("the target's agent killed mid-transfer: the migration %s (%s): %s", mig.Status.Phase, mig.Status.Reason, mig.Status.Message)
	w.startProcessAgent(t, target)
	w.stayed(t, vm, source, target)
	if !rec.WaitGone(time.Minute) {
		t.Error("the target's VMM, waiting for the state, outlived the failed migration")
	}
	if all, here := vmm.Marked(string(vm.UID)), vmm.MarkedIn(string(vm.UID), w.vmDir(source, vm)); len(all) != 1 || len(here) != 1 {
		t.Errorf("VMMs of the VM after the failed migration: %v, the source's %v; want the source's one alone", all, here)
	}
	w.migrate(t, "second", vm, impv1.MigrationSucceeded, nil)
	if got := w.get(t, vm); got.Status.NodeName != target || got.Status.RestartCount != vm.Status.RestartCount {
		t.Errorf("asked again, the VM is on %s run %d; want it on %s, the same run", got.Status.NodeName, got.Status.RestartCount, target)
	}
}

// TestAMigratedVMKeepsItsDiskVolume: a VM with a disk volume of its own (emptyDisk, ext4,
// mounted at its working directory, where its workload writes a file at start, synced) moves
// to the other node: the volume is mirrored with its writable disk while the guest runs. On
// the target the VMM is then killed: the VM boots again there, the same placement, and its new
// boot finds the file the first one wrote on the source.
func TestAMigratedVMKeepsItsDiskVolume(t *testing.T) {
	w := newMigWorld(t, "migv")
	vm := w.run(t, "keeper", "192Mi", func(vm *impv1.ImpVM) {
		vm.Spec.Volumes = []impv1.Volume{{Name: "data", EmptyDisk: &impv1.EmptyDiskSource{Capacity: "64Mi"}}}
		vm.Spec.VolumeMounts = []impv1.VolumeMount{{Name: "data", MountPath: "/data"}}
		vm.Spec.WorkingDir = "/data"
	})
	source := vm.Status.NodeName
	target := w.other(source)
	g := NewWithT(t)
	g.Eventually(func() int { return len(ticks(w.console(source, vm))) }).WithTimeout(5 * time.Minute).Should(BeNumerically(">=", 2))
	if log := w.console(source, vm); !strings.Contains(log, "hello: no earlier write") {
		t.Fatalf("the first boot found a volume written before it:\n%s", log)
	}
	mig := w.migrate(t, "move", vm, impv1.MigrationSucceeded, nil)
	g.Eventually(func() int { return len(ticks(w.console(target, vm))) }).WithTimeout(2*time.Minute).Should(BeNumerically(">=", 2),
		func() string { return "the target's console:\n" + w.console(target, vm) })
	if _, err := os.Stat(filepath.Join(w.vmDir(source, vm), "vol-data.img")); !os.IsNotExist(err) {
		g.Eventually(func() bool {
			_, err := os.Stat(w.vmDir(source, vm))
			return os.IsNotExist(err)
		}).WithTimeout(2*time.Minute).Should(BeTrue(), "the source kept the migrated VM's volume")
	}
	rec, err := vmm.ReadRecord(w.vmDir(target, vm))
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(rec.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() bool {
		got := w.get(t, vm)
		rt := got.Status.Runtime
		return got.Status.RestartCount > vm.Status.RestartCount && got.Status.NodeName == target && rt != nil && rt.GuestReady &&
			rt.Run == got.Status.RestartCount
	}).WithTimeout(5*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), func() string {
		return diagnose(w.c.Client, vm, func(node string) string { return filepath.Join(w.tmp, node) })
	})
	g.Eventually(func() string { return w.console(target, vm) }).WithTimeout(2*time.Minute).Should(
		ContainSubstring("hello: found an earlier write: upper layer of keeper"), "the volume's file, written on the source, read on the target")
	t.Logf("moved a VM with a 64 MiB disk volume: paused %v, %d MiB sent; a new boot on the target read what the first wrote on the source",
		mig.Status.Downtime.Duration, mig.Status.BytesMoved>>20)
}

// TestATargetPreparesMigrationsSideBySide: two VMs of one node move to the other at once; the
// first's image is on a registry that, by then, trickles its blobs at a byte a second, so that
// the target's pull of it for the migration's place never ends. The target makes each place in
// the background: the second VM moves meanwhile, while the first's migration still prepares.
// The first's migration then times out: the target ends its preparation and removes its place,
// and the VM runs on at its source.
func TestATargetPreparesMigrationsSideBySide(t *testing.T) {
	w := newMigNodes(t, "migp")
	slowHost, slow := testregistry.StartSlow(t)
	testguest.ImageWith(t, slowHost, "hello", authn.DefaultKeychain, testregistry.File{Name: "etc/slow", Mode: 0o644, Data: []byte("another digest")})
	source, target := w.nodes[0], w.nodes[1]
	w.startAgent(t, source)
	stuck := w.run(t, "stuck", "192Mi", func(vm *impv1.ImpVM) { vm.Spec.Image = slowHost + "/hello:v1" }) // the only node with an agent yet
	mover := w.run(t, "mover", "192Mi")
	if stuck.Status.NodeName != source || mover.Status.NodeName != source {
		t.Fatalf("the VMs went to %s and %s; want both on %s", stuck.Status.NodeName, mover.Status.NodeName, source)
	}
	w.startAgent(t, target)
	g := NewWithT(t)
	g.Eventually(func() int { return len(ticks(w.console(source, stuck))) }).WithTimeout(5 * time.Minute).Should(BeNumerically(">=", 2))
	slow() // from now on the target pulls the stuck VM's image a byte a second
	ctx := context.Background()
	first := &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "first"},
		Spec: impv1.ImpVMMigrationSpec{VMName: stuck.Name, TargetNode: target, TimeoutSeconds: ptr.To[int32](30)}}
	if err := w.c.Client.Create(ctx, first); err != nil {
		t.Fatal(err)
	}
	// The target has begun making the first's place (it says so) before the second comes.
	g.Eventually(func() impv1.MigrationAgentState {
		_ = w.c.Client.Get(ctx, client.ObjectKeyFromObject(first), first)
		if first.Status.Target == nil {
			return ""
		}
		return first.Status.Target.State
	}).WithTimeout(time.Minute).Should(Equal(impv1.MigrationAgentPreparing))
	began := time.Now()
	second := w.migrate(t, "second", mover, impv1.MigrationSucceeded, nil)
	took := time.Since(began)
	if err := w.c.Client.Get(ctx, client.ObjectKeyFromObject(first), first); err != nil {
		t.Fatal(err)
	}
	if first.Status.Phase != impv1.MigrationPreparing {
		t.Fatalf("the first migration is %s once the second moved its VM; want it still preparing (its image trickling)", first.Status.Phase)
	}
	g.Eventually(func() impv1.MigrationPhase {
		_ = w.c.Client.Get(ctx, client.ObjectKeyFromObject(first), first)
		return first.Status.Phase
	}).WithTimeout(3 * time.Minute).Should(Equal(impv1.MigrationFailed))
	w.stayed(t, stuck, source, target)
	t.Logf("a migration moved its VM in %v (paused %v) while another to the same node prepared; that one then %s: %s",
		took.Round(time.Millisecond), second.Status.Downtime.Duration, first.Status.Reason, first.Status.Message)
}
