package agent_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	. "github.com/onsi/gomega"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/guestmem"
	"github.com/syscode-labs/imp/internal/agent/preflight"
	"github.com/syscode-labs/imp/internal/agent/snapshotter"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/controller/impvm"
	"github.com/syscode-labs/imp/internal/failpoint"
	"github.com/syscode-labs/imp/internal/guestsession"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/runsecret"
	"github.com/syscode-labs/imp/internal/testcluster"
	"github.com/syscode-labs/imp/internal/testguest"
	"github.com/syscode-labs/imp/internal/testnetns"
	"github.com/syscode-labs/imp/internal/testregistry"
)

var shared *testcluster.Cluster

// TestMain starts the control plane with a front proxy, as the access benchmark needs.
func TestMain(m *testing.M) {
	guestmem.Init() // restores fill the guest's memory in a child: this binary again
	dir, err := os.MkdirTemp("", "imp-agent-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fp, err := testcluster.WithFrontProxy(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := testcluster.Main(m, &shared, fp)
	os.RemoveAll(dir)
	os.Exit(code)
}

// killVMMs, at the end of the test, kills every VMM of a VM under stateDir, recorded or only
// marked (a failed test must not leave guests running), and removes the cgroups of node's
// agent.
func killVMMs(t *testing.T, stateDir, node string) {
	t.Cleanup(func() {
		dirs, _ := filepath.Glob(filepath.Join(stateDir, "vms", "*"))
		for _, dir := range dirs {
			if rec, err := vmm.ReadRecord(dir); err == nil && rec.Alive() {
				_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
				rec.WaitGone(5 * time.Second)
			}
			vmm.KillMarkedIn(filepath.Base(dir), dir, time.Second)
		}
		// Their cgroups, and the agent's snapshot memory's: the agent, stopped by now, leaves
		// them as it leaves its VMs running.
		for _, dir := range dirs {
			cgroup.Remove(cgroup.Root, filepath.Base(dir))
		}
		cgroup.Remove(cgroup.Root, snapshotter.MemoryCgroup(node))
	})
}

func managerOptions(c *testcluster.Cluster) ctrl.Options {
	return ctrl.Options{
		Scheme:                 c.Scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
	}
}

// nodeWithOperator registers a Ready Node standing for this machine (no kubelet here: the test
// keeps it Ready) and runs the operator in-process until the test ends.
func nodeWithOperator(t *testing.T, c *testcluster.Cluster, nodeName string) {
	readyNode(t, c, nodeName)
	startOperator(t, c)
}

// readyNode registers a Ready Node labelled for IMP and with imp.test/node=nodeName, and the
// labels given.
func readyNode(t *testing.T, c *testcluster.Cluster, nodeName string, labels ...string) {
	ctx := context.Background()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName, Labels: map[string]string{impv1.NodeEnabledLabel: "true", "imp.test/node": nodeName}}}
	for i := 0; i+1 < len(labels); i += 2 {
		node.Labels[labels[i]] = labels[i+1]
	}
	if err := c.Client.Create(ctx, node); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Client.Delete(context.Background(), node) })
	node.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastTransitionTime: metav1.Now()}}
	if err := c.Client.Status().Update(ctx, node); err != nil {
		t.Fatal(err)
	}
}

// startOperator runs the operator in-process until the test ends.
func startOperator(t *testing.T, c *testcluster.Cluster) {
	startOperatorWith(t, c, operator.Options{VM: impvm.DefaultOptions(), Concurrency: 2})
}

func startOperatorWith(t *testing.T, c *testcluster.Cluster, o operator.Options) {
	ctx := context.Background()
	mo := managerOptions(c)
	mo.Cache = operator.CacheOptions(o)
	opMgr, err := ctrl.NewManager(c.As(t, testcluster.Operator), mo)
	if err != nil {
		t.Fatal(err)
	}
	opCtx, opCancel := context.WithCancel(ctx)
	t.Cleanup(opCancel)
	if err := operator.Setup(opCtx, opMgr, o); err != nil {
		t.Fatal(err)
	}
	testcluster.RunManager(t, opMgr)
}

// world is a real control plane with the operator and an in-process agent for one Node that
// stands for this machine, and a registry on 127.0.0.1 holding the test image as hello:v1.
type world struct {
	c        *testcluster.Cluster
	ns, node string
	host     string // registry
	ref      name.Digest
	stateDir string
	agent    *agent.Agent
}

func newWorld(t *testing.T, opts ...func(*agent.Options)) *world {
	return newWorldWith(t, operator.Options{VM: impvm.DefaultOptions(), Concurrency: 2}, opts...)
}

// newWorldWith is newWorld with the operator's options op.
func newWorldWith(t *testing.T, op operator.Options, opts ...func(*agent.Options)) *world {
	c := testcluster.Require(t, shared)
	ns := c.Namespace(t)
	w := &world{c: c, ns: ns, node: "imp-e2e-" + ns[len(ns)-5:]}
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	w.host = testregistry.Start(t, "", "")
	w.ref = testguest.Image(t, w.host, "hello")

	readyNode(t, c, w.node)
	startOperatorWith(t, c, op)

	w.stateDir = filepath.Join(tmp, "state")
	o := agent.Options{NodeName: w.node, StateDir: w.stateDir, Kernel: kernel, Initramfs: initrd}
	for _, f := range opts {
		f(&o)
	}
	w.agent = startAgent(t, c, o)
	return w
}

// nodeSpaces are the network namespaces of the tests' simulated nodes, by test and node: an
// agent restarted for a node finds its networks' links where its predecessor left them.
var nodeSpaces sync.Map

// nodeNetNS is node's network namespace in this test, made at its first ask.
func nodeNetNS(t *testing.T, node string) string {
	key := t.Name() + "\x00" + node
	if p, ok := nodeSpaces.Load(key); ok {
		return p.(string)
	}
	p := testnetns.New(t, "imp-ag-"+node)
	nodeSpaces.Store(key, p)
	t.Cleanup(func() { nodeSpaces.Delete(key) })
	return p
}

// startAgent runs an in-process agent with opts (TCG, a one-second report, vCPUs overcommitted
// for this small machine) until the test ends, and kills its VMMs then.
func startAgent(t *testing.T, c *testcluster.Cluster, opts agent.Options) *agent.Agent {
	killVMMs(t, opts.StateDir, opts.NodeName)
	mo := managerOptions(c)
	mo.Cache = agent.CacheOptions(opts.NodeName)
	agMgr, err := ctrl.NewManager(c.AsNode(t, testcluster.Agent, opts.NodeName), mo)
	if err != nil {
		t.Fatal(err)
	}
	opts.Accel, opts.ReportInterval, opts.HeartbeatInterval = "tcg", time.Second, time.Second
	switch opts.CgroupRoot {
	case "":
		opts.CgroupRoot = cgroup.Root
	case noCgroups:
		opts.CgroupRoot = ""
	}
	if opts.VCPUOvercommit == 0 {
		opts.VCPUOvercommit = 4
	}
	if opts.SnapshotMemoryCache == 0 {
		opts.SnapshotMemoryCache = 1 << 30 // the chart's default
	}
	opts.LocalRegistries = append(opts.LocalRegistries, "127.0.0.1") // the tests' registries
	if opts.NetNSDir == "" {
		opts.NetNSDir = testnetns.PinDir(t) // each simulated node its own, never the machine's
	}
	if opts.NetNS == "" {
		// Each simulated node's own namespace, never the machine's: an agent prunes from its
		// node's namespace the transit links and IMP's nftables tables of networks it does
		// not know, and the machine's are a real node's (the e2e's agent, running beside
		// these tests, lost its networks' routes to them for minutes).
		opts.NetNS = nodeNetNS(t, opts.NodeName)
	}
	ag := &agent.Agent{Client: agMgr.GetClient(), APIReader: agMgr.GetAPIReader(), Recorder: agMgr.GetEventRecorder("imp-agent"), Opts: opts}
	if err := ag.SetupWithManager(agMgr); err != nil {
		t.Fatal(err)
	}
	testcluster.RunManager(t, agMgr)
	return ag
}

// vm returns (does not create) a VM of the test image on the world's node.
func (w *world) vm(name string, args ...string) *impv1.ImpVM {
	return &impv1.ImpVM{
		ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: name},
		Spec: impv1.ImpVMSpec{
			Image:        w.host + "/hello:v1",
			Args:         args,
			Resources:    &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("192Mi"))},
			NodeSelector: map[string]string{"imp.test/node": w.node},
			DiskSize:     ptr.To(resource.MustParse("64Mi")),
		},
	}
}

// tryExec runs /bin/hello with args in the guest of the world's VM name, through its agent's
// session channel, and returns what it printed (stdout and stderr, trimmed).
func (w *world) tryExec(name string, args ...string) (string, error) {
	v := w.get(name)
	if v == nil {
		return "", fmt.Errorf("no ImpVM %s", name)
	}
	s, err := w.agent.Runs.Session(types.NamespacedName{Namespace: w.ns, Name: name}, v.HostUID())
	if err != nil {
		return "", err
	}
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := s.Exec(ctx, guestsession.ExecOptions{Command: append([]string{"/bin/hello"}, args...), Stdout: &out, Stderr: &out}); err != nil {
		return "", fmt.Errorf("exec %v in %s: %w: %s", args, name, err, out.String())
	}
	return strings.TrimSpace(out.String()), nil
}

func (w *world) get(name string) *impv1.ImpVM {
	v := &impv1.ImpVM{}
	if err := w.c.Client.Get(context.Background(), types.NamespacedName{Namespace: w.ns, Name: name}, v); err != nil {
		return nil
	}
	return v
}

// update changes the world's VM name with change and writes it, read afresh and changed again
// when the write conflicts: the operator and the agent write the VM's status meanwhile.
func (w *world) update(t *testing.T, name string, change func(*impv1.ImpVM)) {
	t.Helper()
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		v := w.get(name)
		if v == nil {
			return fmt.Errorf("ImpVM %s is gone", name)
		}
		change(v)
		return w.c.Client.Update(context.Background(), v)
	}); err != nil {
		t.Fatal(err)
	}
}

// watchReports returns the runtime reports of the world's VMs, in order, from a watch that
// sees every write: "State" or "State/ready".
func (w *world) watchReports(t *testing.T) func() []string {
	wc, err := client.NewWithWatch(w.c.Config, client.Options{Scheme: w.c.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	watch, err := wc.Watch(context.Background(), &impv1.ImpVMList{}, client.InNamespace(w.ns))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(watch.Stop)
	var mu sync.Mutex
	var seen []string
	go func() {
		for ev := range watch.ResultChan() {
			vm, ok := ev.Object.(*impv1.ImpVM)
			if !ok || vm.Status.Runtime == nil {
				continue
			}
			r := string(vm.Status.Runtime.State)
			if vm.Status.Runtime.GuestReady {
				r += "/ready"
			}
			mu.Lock()
			if len(seen) == 0 || seen[len(seen)-1] != r {
				seen = append(seen, r)
			}
			mu.Unlock()
		}
	}()
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(seen)
	}
}

// diagnose says where a VM stands, for a test that waited for it in vain: its status as the API
// server has it, and the end of its console (stateDirOf gives its node's agent's state
// directory).
func diagnose(c client.Client, vm *impv1.ImpVM, stateDirOf func(node string) string) string {
	v := &impv1.ImpVM{}
	if err := c.Get(context.Background(), client.ObjectKeyFromObject(vm), v); err != nil {
		return err.Error()
	}
	st, _ := json.Marshal(v.Status)
	b, _ := os.ReadFile(filepath.Join(stateDirOf(v.Status.NodeName), "vms", string(v.UID), qemu.ConsoleLog))
	if len(b) > 3000 {
		b = b[len(b)-3000:]
	}
	return fmt.Sprintf("status %s\nconsole (end):\n%s", st, b)
}

func (w *world) console(vm *impv1.ImpVM) string {
	b, _ := os.ReadFile(filepath.Join(w.stateDir, "vms", string(vm.HostUID()), qemu.ConsoleLog))
	return string(b)
}

// TestVMLifecycle: an ImpVM becomes a guest booted under QEMU/TCG on this machine, reaches
// Running with Ready=True from the guest channel, shows its workload's output on its console,
// and on deletion its VMM, disks and state go and its finalizer is released. With a starting
// report delay longer than the boot, the guest's readiness is the run's first report: the
// Starting and booting reports it overtook were never written.
func TestVMLifecycle(t *testing.T) {
	w := newWorld(t, func(o *agent.Options) { o.StartingReportDelay = 10 * time.Minute })
	c, ns, ctx, stateDir, ref := w.c, w.ns, context.Background(), w.stateDir, w.ref
	reports := w.watchReports(t)
	vm := w.vm("hello", "serve")
	vm.Spec.Env = []impv1.EnvVar{{Name: "GREETING", Value: "from-the-api"}}
	vm.Spec.Stdin, vm.Spec.TTY = true, true // the console is the workload's terminal
	created := time.Now()
	if err := c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	get := func() *impv1.ImpVM { return w.get("hello") }
	g.Eventually(func() bool {
		v := get()
		return v != nil && v.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(9*time.Minute).WithPolling(100*time.Millisecond).Should(BeTrue(), func() string {
		st := get().Status
		return fmt.Sprintf("VM status: %+v; runtime: %+v", st, ptr.Deref(st.Runtime, impv1.RuntimeStatus{}))
	})
	// The agent, with the chart's identity, reported its node and named the Node its owner.
	var report impv1.ImpNode
	if err := c.Client.Get(ctx, types.NamespacedName{Name: w.node}, &report); err != nil || len(report.OwnerReferences) != 1 ||
		report.OwnerReferences[0].Kind != "Node" || report.OwnerReferences[0].Name != w.node {
		t.Errorf("ImpNode %s: owners %+v, %v; want its Node", w.node, report.OwnerReferences, err)
	}
	// Its disk, for placement to count the VMs' diskSize against.
	if st := report.Status; st.Capacity == nil || st.Capacity.Disk == nil || st.Capacity.Disk.Value() <= 0 ||
		st.Allocatable == nil || st.Allocatable.Disk == nil || st.Allocatable.Disk.Cmp(*st.Capacity.Disk) > 0 {
		t.Errorf("ImpNode %s reports no usable disk: capacity %+v, allocatable %+v", w.node, st.Capacity, st.Allocatable)
	}
	v := get()
	t.Logf("create→Running+Ready %v (boot %dms under TCG); runtime %+v", time.Since(created).Round(time.Millisecond), ptr.Deref(v.Status.Runtime.BootMilliseconds, -1), *v.Status.Runtime)
	if got := reports(); !slices.Equal(got, []string{"Running/ready"}) {
		t.Errorf("the run's reports were %v, want only Running/ready", got)
	}

	dir := filepath.Join(stateDir, "vms", string(v.UID))
	g.Eventually(func() string {
		b, _ := os.ReadFile(filepath.Join(dir, qemu.ConsoleLog))
		return string(b)
	}).WithTimeout(30 * time.Second).Should(ContainSubstring("hello from imp: GREETING=from-the-api host=hello"))
	rec, err := vmm.ReadRecord(dir)
	if err != nil || !rec.Alive() {
		t.Fatalf("VMM record %+v, %v", rec, err)
	}
	checkAccess(t, w, v)
	images, _ := filepath.Glob(filepath.Join(stateDir, "images", "sha256-*.ext4"))
	if len(images) != 1 || !strings.Contains(images[0], strings.TrimPrefix(ref.DigestStr(), "sha256:")) {
		t.Errorf("base disks %v, want the image's digest %s", images, ref.DigestStr())
	}

	// Delete: the guest is asked to stop, the VMM goes, the state goes, the VM goes.
	if err := c.Client.Delete(ctx, v); err != nil {
		t.Fatal(err)
	}
	g.Eventually(get).WithTimeout(6 * time.Minute).WithPolling(100 * time.Millisecond).Should(BeNil())
	if rec.Alive() {
		t.Error("the VMM still runs after the VM was deleted")
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the VM's state directory remains: %v", err)
	}
	var events corev1.EventList
	_ = c.Client.List(ctx, &events)
	reasons := map[string]bool{}
	for _, e := range events.Items {
		if e.InvolvedObject.Name == "hello" && e.Namespace == ns {
			reasons[e.Reason] = true
		}
	}
	for _, r := range []string{"Scheduled", "Started"} {
		if !reasons[r] {
			t.Errorf("no %s Event (have %v)", r, reasons)
		}
	}
}

// TestAgentRestart runs the imp-agent binary with three VMs, kills it with SIGKILL, deletes one
// VM while it is down and starts it again: the other VMMs never stopped (same pids and start
// times), their status stays Running, and the deleted VM is cleaned up by the returning agent.
// The agent's heartbeat is its Lease, which no agent watches: its ImpNode, which every agent
// watches, is written when the report changes, not at every beat.
func TestHeartbeatIsALease(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	var lease coordinationv1.Lease
	var report impv1.ImpNode
	key := types.NamespacedName{Namespace: testcluster.ChartNamespace, Name: impv1.AgentLeasePrefix + w.node}
	NewWithT(t).Eventually(func() error {
		if err := w.c.Client.Get(ctx, key, &lease); err != nil {
			return err
		}
		return w.c.Client.Get(ctx, types.NamespacedName{Name: w.node}, &report)
	}).WithTimeout(time.Minute).Should(Succeed())
	time.Sleep(2 * time.Second) // the first reports, which fill the report in
	if err := errors.Join(w.c.Client.Get(ctx, key, &lease), w.c.Client.Get(ctx, types.NamespacedName{Name: w.node}, &report)); err != nil {
		t.Fatal(err)
	}
	if lease.Spec.HolderIdentity == nil || *lease.Spec.HolderIdentity != w.node || lease.Labels[impv1.AgentLeaseLabel] != "true" {
		t.Errorf("the heartbeat Lease: %+v", lease)
	}
	// Three heartbeat and report intervals.
	time.Sleep(3500 * time.Millisecond)
	var later coordinationv1.Lease
	var again impv1.ImpNode
	if err := errors.Join(w.c.Client.Get(ctx, key, &later), w.c.Client.Get(ctx, types.NamespacedName{Name: w.node}, &again)); err != nil {
		t.Fatal(err)
	}
	if !later.Spec.RenewTime.After(lease.Spec.RenewTime.Time) {
		t.Errorf("the Lease was not renewed: %v, then %v", lease.Spec.RenewTime, later.Spec.RenewTime)
	}
	// Written again only for a change of the report (its disk follows the machine's free space,
	// which other work on it moves): never for the heartbeat alone.
	was, now := report.Status.DeepCopy(), again.Status.DeepCopy()
	was.HeartbeatTime, now.HeartbeatTime = nil, nil
	if again.ResourceVersion != report.ResourceVersion && equality.Semantic.DeepEqual(was, now) && equality.Semantic.DeepEqual(report.Spec, again.Spec) {
		t.Errorf("the ImpNode was written with nothing changed: heartbeat %v, then %v", report.Status.HeartbeatTime, again.Status.HeartbeatTime)
	}
	// A Lease that lost its label, which the operator's cache selects on, gets it back.
	delete(later.Labels, impv1.AgentLeaseLabel)
	if err := w.c.Client.Update(ctx, &later); err != nil {
		t.Fatal(err)
	}
	NewWithT(t).Eventually(func() string {
		_ = w.c.Client.Get(ctx, key, &later)
		return later.Labels[impv1.AgentLeaseLabel]
	}).WithTimeout(30 * time.Second).Should(Equal("true"))
}

// An agent that cannot write its Lease (here, IMP's namespace is missing) beats in its ImpNode,
// as agents before the Lease did: its node does not look dead for that.
func TestHeartbeatWithoutItsLease(t *testing.T) {
	w := newWorld(t, func(o *agent.Options) { o.RunSecretNamespace = "imp-no-such-namespace" })
	ctx := context.Background()
	beat := func() time.Time {
		var report impv1.ImpNode
		if err := w.c.Client.Get(ctx, types.NamespacedName{Name: w.node}, &report); err != nil || report.Status.HeartbeatTime == nil {
			return time.Time{}
		}
		return report.Status.HeartbeatTime.Time
	}
	g := NewWithT(t)
	g.Eventually(beat).WithTimeout(time.Minute).ShouldNot(BeZero())
	first := beat()
	g.Eventually(beat).WithTimeout(time.Minute).WithPolling(200 * time.Millisecond).Should(BeTemporally(">", first))
}

func TestAgentRestart(t *testing.T) {
	pw := newProcessWorld(t, "imp-restart-")
	c, ctx, stateDir, startAgent := pw.c, context.Background(), pw.stateDir, pw.startAgent
	agentProc := startAgent()

	names := []string{"a", "b", "c"}
	for _, n := range names {
		if err := c.Client.Create(ctx, pw.vm(n)); err != nil {
			t.Fatal(err)
		}
	}
	get := pw.get
	g := NewWithT(t)
	records := map[string]*vmm.Record{}
	for _, n := range names {
		g.Eventually(func() bool {
			v := get(n)
			return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
		}).WithTimeout(12*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), func() string {
			v := get(n)
			if v == nil {
				return "VM " + n + " is gone"
			}
			return fmt.Sprintf("VM %s: %+v; runtime: %+v", n, v.Status, ptr.Deref(v.Status.Runtime, impv1.RuntimeStatus{}))
		})
		rec, err := vmm.ReadRecord(filepath.Join(stateDir, "vms", string(get(n).UID)))
		if err != nil {
			t.Fatal(err)
		}
		records[n] = rec
	}

	// kill -9 the agent; delete c while it is down, and b's VMM dies while nobody watches.
	if err := agentProc.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = agentProc.Wait()
	if err := syscall.Kill(records["b"].Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for records["b"].Alive() {
		time.Sleep(50 * time.Millisecond)
	}
	// c goes from the API entirely (its finalizer stripped by hand): no watch event will ever
	// name it to the returning agent; its start-up sweep must find it.
	cUID := get("c").UID
	if err := c.Client.Delete(ctx, get("c")); err != nil {
		t.Fatal(err)
	}
	if err := c.Client.Patch(ctx, get("c"), client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`))); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() *impv1.ImpVM { return get("c") }).WithTimeout(30 * time.Second).Should(BeNil())
	if !records["a"].Alive() || !records["c"].Alive() {
		t.Error("a VMM died with the agent")
	}

	startAgent()
	g.Eventually(records["c"].Alive).WithTimeout(3*time.Minute).Should(BeFalse(), "the deleted VM's VMM still runs")
	g.Eventually(func() error {
		_, err := os.Stat(filepath.Join(stateDir, "vms", string(cUID)))
		return err
	}).WithTimeout(3*time.Minute).Should(MatchError(os.ErrNotExist), "the deleted VM's state remains")
	// a: the same process, still Running and Ready, after the agent came back.
	g.Consistently(func() bool {
		v := get("a")
		return v != nil && v.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(5 * time.Second).Should(BeTrue())
	if now, err := vmm.ReadRecord(filepath.Join(stateDir, "vms", string(get("a").UID))); err != nil || *now != *records["a"] || !now.Alive() {
		t.Errorf("VM a's VMM changed across the agent restart: %+v → %+v (%v)", records["a"], now, err)
	}
	// b: its VMM died unwatched; the returning agent reports it and runStrategy Always restarts it.
	g.Eventually(func() bool {
		v := get("b")
		return v != nil && v.Status.RestartCount >= 1 && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(9*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), "VM b restarted after its VMM died unwatched")
	for _, n := range []string{"a", "b"} {
		if err := c.Client.Delete(ctx, get(n)); err != nil {
			t.Fatal(err)
		}
		g.Eventually(func() *impv1.ImpVM { return get(n) }).WithTimeout(6 * time.Minute).Should(BeNil())
	}
}

// processWorld is a real control plane with the operator in-process, a Node standing for this
// machine, the test image in a registry on 127.0.0.1, and the imp-agent binary to run as a
// process for that node with the chart's agent identity.
type processWorld struct {
	c        *testcluster.Cluster
	ns, node string
	host     string // registry
	stateDir string
	// startAgent runs the agent with env added to its environment until the test ends.
	startAgent func(env ...string) *exec.Cmd
}

func newProcessWorld(t *testing.T, nodePrefix string) *processWorld {
	c := testcluster.Require(t, shared)
	ns := c.Namespace(t)
	pw := &processWorld{c: c, ns: ns, node: nodePrefix + ns[len(ns)-5:]}
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	pw.host = testregistry.Start(t, "", "")
	testguest.Image(t, pw.host, "hello")
	nodeWithOperator(t, c, pw.node)
	pw.stateDir = filepath.Join(tmp, "state")
	bin := testcluster.Binary(t, "github.com/syscode-labs/imp/cmd/imp-agent")
	kubeconfig := c.KubeconfigAs(t, testcluster.Agent, pw.node)
	killVMMs(t, pw.stateDir, pw.node)
	nsDir, nodeNS := testnetns.PinDir(t), nodeNetNS(t, pw.node) // never the machine's (startAgent)
	pw.startAgent = func(env ...string) *exec.Cmd {
		return startProcess(t, env, bin, "--kubeconfig", kubeconfig, "--node-name", pw.node, "--state-dir", pw.stateDir, "--netns-dir", nsDir, "--netns", nodeNS, "--local-registry", "127.0.0.1",
			"--kernel", kernel, "--initramfs", initrd, "--qemu-accel", "tcg", "--reserve-vcpus", "0", "--reserve-memory", "0", "--vcpu-overcommit", "4",
			"--metrics-bind-address", "0", "--health-probe-bind-address", "0", "--log-level", "error")
	}
	return pw
}

// startProcess starts bin with args, env added to its environment and its stderr the test's;
// the test's end kills it.
func startProcess(t *testing.T, env []string, bin string, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd
}

// vm returns (does not create) a VM of the test image, serving, on the world's node.
func (pw *processWorld) vm(name string) *impv1.ImpVM {
	return &impv1.ImpVM{
		ObjectMeta: metav1.ObjectMeta{Namespace: pw.ns, Name: name},
		Spec: impv1.ImpVMSpec{
			Image: pw.host + "/hello:v1", Args: []string{"serve"},
			Resources:    &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))},
			NodeSelector: map[string]string{"imp.test/node": pw.node},
			DiskSize:     ptr.To(resource.MustParse("64Mi")),
		},
	}
}

func (pw *processWorld) get(name string) *impv1.ImpVM {
	v := &impv1.ImpVM{}
	if err := pw.c.Client.Get(context.Background(), types.NamespacedName{Namespace: pw.ns, Name: name}, v); err != nil {
		return nil
	}
	return v
}

// waitCrashed waits up to d for the agent process to end at its failpoint.
func waitCrashed(t *testing.T, agent *exec.Cmd, d time.Duration) {
	t.Helper()
	exited := make(chan error, 1)
	go func() { exited <- agent.Wait() }()
	select {
	case err := <-exited:
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != failpoint.ExitCode {
			t.Fatalf("the agent ended with %v, not at its failpoint", err)
		}
	case <-time.After(d):
		t.Fatal("the agent never reached its failpoint")
	}
}

// TestAgentCrashAtEachStartStep crashes the imp-agent process after each step of a VM's start
// plan (the runner's failpoints, "start/<step>") and inside the last one (the VMM started, not
// yet recorded), and starts it again: whatever the step, the VM ends up Running with exactly one
// VMM, the recorded one; a VMM started but not yet recorded is found by its marker and killed.
func TestAgentCrashAtEachStartStep(t *testing.T) {
	pw := newProcessWorld(t, "imp-crash-")
	c, ctx, stateDir, startAgent, get := pw.c, context.Background(), pw.stateDir, pw.startAgent, pw.get
	g := NewWithT(t)

	// The plan of a VM on no network, on a node with no pins: every step of it.
	var points []string
	for _, st := range []string{"state_dir", "image", "config_disk", "writable_disk", "identity", "intent", "exec"} {
		points = append(points, "start/"+st)
	}
	for _, point := range append(points, "vmm-started") {
		name := strings.NewReplacer("/", "-", "_", "-").Replace(point)
		t.Run(name, func(t *testing.T) {
			step := name
			crashing := startAgent(failpoint.EnvVar + "=" + point)
			if err := c.Client.Create(ctx, pw.vm(step)); err != nil {
				t.Fatal(err)
			}
			waitCrashed(t, crashing, 3*time.Minute)
			uid := string(get(step).UID)
			left := 0 // a VMM exists once the exec step began
			if point == "vmm-started" || point == "start/exec" {
				left = 1
			}
			if n := len(vmm.Marked(uid)); n != left {
				t.Fatalf("after the crash, VMMs of the VM: %v; want %d", vmm.Marked(uid), left)
			}

			again := startAgent()
			defer func() { _ = again.Process.Kill(); _ = again.Wait() }()
			g.Eventually(func() bool {
				v := get(step)
				return v != nil && v.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
			}).WithTimeout(12*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), func() string {
				return fmt.Sprintf("VM %s: %+v", step, get(step).Status)
			})
			rec, err := vmm.ReadRecord(filepath.Join(stateDir, "vms", uid))
			if err != nil || !rec.Alive() {
				t.Fatalf("record %+v, %v", rec, err)
			}
			if pids := vmm.Marked(uid); len(pids) != 1 || pids[0] != rec.Pid {
				t.Errorf("VMMs of the VM: %v; want only the recorded %d", pids, rec.Pid)
			}
		})
	}
}

// TestAgentCrashAtEachSuspendAndResumeStep crashes the imp-agent process after each step of the
// suspend plan ("suspend/<step>") and of the resume plan ("resume/<step>"), one VM suspended and
// resumed again and again, and starts it again each time: whatever the step, a suspension ends
// Suspended with no VMM left, and a resume Running and Ready with exactly one VMM, the recorded
// one, in the same run (the guest went on, it was not started again).
func TestAgentCrashAtEachSuspendAndResumeStep(t *testing.T) {
	pw := newProcessWorld(t, "imp-crash-sr-")
	c, ctx, get := pw.c, context.Background(), pw.get
	g := NewWithT(t)
	ready := func() bool {
		v := get("sr")
		return v != nil && v.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}
	stop := func(p *exec.Cmd) { _ = p.Process.Kill(); _ = p.Wait() }
	running := pw.startAgent()
	if err := c.Client.Create(ctx, pw.vm("sr")); err != nil {
		t.Fatal(err)
	}
	g.Eventually(ready).WithTimeout(12*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), "sr Ready")
	v := get("sr")
	uid, instance, restarts := string(v.UID), v.Status.Instance, v.Status.RestartCount
	sameRun := func(when string) {
		t.Helper()
		if v := get("sr"); v.Status.Instance != instance || v.Status.RestartCount != restarts || v.Status.Runtime.Instance != instance || v.Status.Runtime.Run != restarts {
			t.Fatalf("%s: instance %d, restarts %d, runtime %+v; want the run of instance %d, restart %d", when, v.Status.Instance, v.Status.RestartCount, v.Status.Runtime, instance, restarts)
		}
	}
	// crashAt starts an agent that crashes at point (none: "") while change is made, and then
	// one that does not.
	crashAt := func(point string, change func()) {
		t.Helper()
		stop(running)
		if point == "" {
			running = pw.startAgent()
			change()
			return
		}
		crashing := pw.startAgent(failpoint.EnvVar + "=" + point)
		change()
		waitCrashed(t, crashing, 5*time.Minute)
		running = pw.startAgent()
	}
	suspendSteps := []string{"suspending", "freeze", "save", "suspended"}
	resumeSteps := []string{"intent", "exec", "resumed"}
	for i := range max(len(suspendSteps), len(resumeSteps)) {
		point := ""
		if i < len(suspendSteps) {
			point = "suspend/" + suspendSteps[i]
		}
		crashAt(point, func() {
			if err := c.Client.Create(ctx, &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: pw.ns, Name: "sr"},
				Spec: impv1.ImpVMSuspensionSpec{Reason: impv1.SuspendReasonUser, Message: "by the test"}}); err != nil {
				t.Fatal(err)
			}
		})
		g.Eventually(func() impv1.VMPhase { return get("sr").Status.Phase }).WithTimeout(5*time.Minute).Should(Equal(impv1.VMSuspended), func() string {
			return fmt.Sprintf("after a crash at %q: %+v", point, get("sr").Status)
		})
		if pids := vmm.Marked(uid); len(pids) != 0 {
			t.Fatalf("after a crash at %q, the suspended VM has VMMs %v", point, pids)
		}
		sameRun("suspended after a crash at " + point)

		point = ""
		if i < len(resumeSteps) {
			point = "resume/" + resumeSteps[i]
		}
		crashAt(point, func() {
			if err := c.Client.Delete(ctx, &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: pw.ns, Name: "sr"}}); err != nil {
				t.Fatal(err)
			}
		})
		g.Eventually(ready).WithTimeout(5*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), func() string {
			return fmt.Sprintf("after a crash at %q: %+v", point, get("sr").Status)
		})
		rec, err := vmm.ReadRecord(filepath.Join(pw.stateDir, "vms", uid))
		if err != nil || !rec.Alive() {
			t.Fatalf("after a crash at %q: record %+v, %v", point, rec, err)
		}
		if pids := vmm.Marked(uid); len(pids) != 1 || pids[0] != rec.Pid {
			t.Fatalf("after a crash at %q: VMMs of the VM %v; want only the recorded %d", point, pids, rec.Pid)
		}
		sameRun("resumed after a crash at " + point)
	}
	stop(running)
}

// TestAgentCrashMidRestore crashes the imp-agent process once a restore's VMM runs the
// snapshot's guest (the resumed step), before the guest took on its own identity; the agent
// started again finishes the restore: the guest takes on the copy's identity (its monitor
// accepts only the copy's token) and the copy is Ready, restored from the snapshot, with exactly
// one VMM.
func TestAgentCrashMidRestore(t *testing.T) {
	pw := newProcessWorld(t, "imp-crash-restore-")
	c, ctx, get := pw.c, context.Background(), pw.get
	g := NewWithT(t)
	ready := func(name string) func() bool {
		return func() bool {
			v := get(name)
			return v != nil && v.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
		}
	}
	first := pw.startAgent()
	if err := c.Client.Create(ctx, pw.vm("src")); err != nil {
		t.Fatal(err)
	}
	g.Eventually(ready("src")).WithTimeout(12*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), "src Ready")
	snap := &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: pw.ns, Name: "snap"}, Spec: impv1.ImpVMSnapshotSpec{VMName: "src"}}
	if err := c.Client.Create(ctx, snap); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() impv1.SnapshotPhase {
		_ = c.Client.Get(ctx, client.ObjectKeyFromObject(snap), snap)
		return snap.Status.Phase
	}).WithTimeout(5 * time.Minute).Should(Equal(impv1.SnapshotReady))
	_ = first.Process.Kill()
	_ = first.Wait()

	crashing := pw.startAgent(failpoint.EnvVar + "=start/resumed")
	cp := pw.vm("copy")
	cp.Spec.SnapshotRef = &impv1.SnapshotReference{Name: "snap"}
	if err := c.Client.Create(ctx, cp); err != nil {
		t.Fatal(err)
	}
	waitCrashed(t, crashing, 5*time.Minute)
	uid := string(get("copy").UID)
	if n := len(vmm.Marked(uid)); n != 1 {
		t.Fatalf("after the crash, VMMs of the copy: %v; want its one", vmm.Marked(uid))
	}
	again := pw.startAgent()
	defer func() { _ = again.Process.Kill(); _ = again.Wait() }()
	g.Eventually(ready("copy")).WithTimeout(5*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), func() string {
		return fmt.Sprintf("copy: %+v", get("copy").Status)
	})
	if rt := get("copy").Status.Runtime; rt == nil || rt.RestoredFrom != "snap" {
		t.Errorf("the copy's run: %+v; want restored from snap", rt)
	}
	rec, err := vmm.ReadRecord(filepath.Join(pw.stateDir, "vms", uid))
	if err != nil || !rec.Alive() {
		t.Fatalf("record %+v, %v", rec, err)
	}
	if pids := vmm.Marked(uid); len(pids) != 1 || pids[0] != rec.Pid {
		t.Errorf("VMMs of the copy: %v; want only the recorded %d", pids, rec.Pid)
	}
}

// TestUnreadableStateIsRecovered: state directories whose meta cannot be read are decided by
// their UID against the API when the agent starts: a VM of the node is recovered (its VMM
// stopped, an Event, a new run that finds its writable disk), an unknown one is removed.
func TestUnreadableStateIsRecovered(t *testing.T) {
	pw := newProcessWorld(t, "imp-corrupt-")
	c, ctx, stateDir, startAgent := pw.c, context.Background(), pw.stateDir, pw.startAgent
	proc := startAgent()
	vm := pw.vm("damaged")
	if err := c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	get := func() *impv1.ImpVM {
		v := &impv1.ImpVM{}
		if err := c.Client.Get(ctx, client.ObjectKeyFromObject(vm), v); err != nil {
			return nil
		}
		return v
	}
	g.Eventually(func() bool {
		v := get()
		return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(12 * time.Minute).WithPolling(200 * time.Millisecond).Should(BeTrue())
	dir := filepath.Join(stateDir, "vms", string(get().UID))
	g.Eventually(func() string { b, _ := os.ReadFile(filepath.Join(dir, qemu.ConsoleLog)); return string(b) }).
		WithTimeout(3 * time.Minute).Should(ContainSubstring("hello: no earlier write"))
	rec, err := vmm.ReadRecord(dir)
	if err != nil {
		t.Fatal(err)
	}
	rwBefore, err := os.Stat(filepath.Join(dir, "rw.ext4"))
	if err != nil {
		t.Fatal(err)
	}

	_ = proc.Process.Signal(syscall.SIGKILL)
	_ = proc.Wait()
	if err := os.WriteFile(filepath.Join(dir, "meta.json"), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	unknown := filepath.Join(stateDir, "vms", "0badc0de-0000-4000-8000-000000000000")
	if err := os.MkdirAll(unknown, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(unknown, "meta.json"), nil, 0o600); err != nil {
		t.Fatal(err)
	}

	startAgent()
	g.Eventually(rec.Alive).WithTimeout(3*time.Minute).Should(BeFalse(), "the VMM of the unreadable state still runs")
	g.Eventually(func() error { _, err := os.Stat(unknown); return err }).WithTimeout(3 * time.Minute).Should(MatchError(os.ErrNotExist))
	g.Eventually(func() bool {
		var events corev1.EventList
		_ = c.Client.List(ctx, &events, client.InNamespace(pw.ns))
		for _, e := range events.Items {
			if e.Reason == "StateRecovered" && e.InvolvedObject.Name == "damaged" {
				return true
			}
		}
		return false
	}).WithTimeout(3*time.Minute).Should(BeTrue(), "no StateRecovered Event")
	// The next run (runStrategy Always) starts on the same writable disk: the same file, not
	// a new one (what the killed guest had not flushed is lost, as after a power cut).
	g.Eventually(func() bool {
		v := get()
		return v.Status.RestartCount >= 1 && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(9 * time.Minute).WithPolling(200 * time.Millisecond).Should(BeTrue())
	if rwAfter, err := os.Stat(filepath.Join(dir, "rw.ext4")); err != nil || !os.SameFile(rwBefore, rwAfter) {
		t.Errorf("the recovered VM's writable disk was replaced (%v)", err)
	}
}

// TestSharedBaseDiskAndRefusedImage: two VMs of one image share one base disk and do not see
// each other's writes; an image with a layer writing through a symlink out of its root is
// refused with a clear Event and nothing runs.
func TestSharedBaseDiskAndRefusedImage(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	g := NewWithT(t)
	for _, n := range []string{"one", "two"} {
		if err := w.c.Client.Create(ctx, w.vm(n, "serve")); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range []string{"one", "two"} {
		g.Eventually(func() string {
			v := w.get(n)
			rt := v.Status.Runtime
			if rt == nil {
				rt = &impv1.RuntimeStatus{}
			}
			return fmt.Sprintf("phase=%s node=%s runtime=%s/%s/%s console=%s", v.Status.Phase, v.Status.NodeName, rt.State, rt.Reason, rt.Message, w.console(v))
		}).WithTimeout(12*time.Minute).WithPolling(200*time.Millisecond).Should(ContainSubstring("hello: no earlier write"), "VM %s", n)
	}
	images, _ := filepath.Glob(filepath.Join(w.stateDir, "images", "*.ext4"))
	if len(images) != 1 {
		t.Errorf("base disks %v, want one shared by both VMs", images)
	}
	for _, n := range []string{"one", "two"} {
		if c := w.console(w.get(n)); strings.Contains(c, "found an earlier write") {
			t.Errorf("VM %s saw another VM's write:\n%s", n, c)
		}
	}

	// The unsafe image.
	outside := t.TempDir()
	testregistry.Push(t, w.host, "evil", disk.PullSecretKeychain{},
		testguest.Layer(t, testguest.Symlink("escape", outside)),
		testguest.Layer(t, testguest.RegularFile("escape/pwned", "x")))
	evil := w.vm("evil")
	evil.Spec.Image = w.host + "/evil:v1"
	evil.Spec.RunStrategy = impv1.RunStrategyOnce
	if err := w.c.Client.Create(ctx, evil); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() impv1.VMPhase { return w.get("evil").Status.Phase }).WithTimeout(3 * time.Minute).Should(Equal(impv1.VMFailed))
	rt := w.get("evil").Status.Runtime
	if rt == nil || rt.Reason != "ImageRefused" || !strings.Contains(rt.Message, "unsafe layer entry") {
		t.Errorf("runtime %+v, want reason ImageRefused naming the unsafe entry", rt)
	}
	var events corev1.EventList
	_ = w.c.Client.List(ctx, &events)
	found := ""
	for _, e := range events.Items {
		if e.Namespace == w.ns && e.InvolvedObject.Name == "evil" && e.Reason == "ImageRefused" {
			found = e.Message
		}
	}
	if !strings.Contains(found, "escapes") && !strings.Contains(found, "unsafe layer entry") {
		t.Errorf("no clear ImageRefused Event (got %q)", found)
	}
	t.Logf("ImageRefused: %s", found)
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Errorf("the image wrote outside its root: %v", entries)
	}
}

// TestPinMismatchBlocksTheVM: a pinned artifact that differs stops the VM before anything of it
// is made, with the reason in its status and an Event.
func TestPinMismatchBlocksTheVM(t *testing.T) {
	const pinned = "0000000000000000000000000000000000000000000000000000000000000000"
	var kernel string
	w := newWorld(t, func(o *agent.Options) {
		kernel = o.Kernel
		o.Pins = []preflight.Pin{{Name: "kernel", Path: o.Kernel, SHA256: pinned}}
	})
	ctx := context.Background()
	vm := w.vm("pinned", "exit")
	if err := w.c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	g.Eventually(func() string {
		v := w.get("pinned")
		if v == nil || v.Status.Runtime == nil {
			return ""
		}
		return v.Status.Runtime.Reason + ": " + v.Status.Runtime.Message
	}).WithTimeout(3 * time.Minute).Should(And(HavePrefix("PinMismatch: pinned kernel: "+kernel+" has sha256 "), HaveSuffix(", pinned "+pinned)))
	v := w.get("pinned")
	if _, err := os.Stat(filepath.Join(w.stateDir, "vms", string(v.UID), "rw.ext4")); !os.IsNotExist(err) {
		t.Errorf("the VM's disk was made despite the mismatch: %v", err)
	}
	if recs, _ := filepath.Glob(filepath.Join(w.stateDir, "vms", "*", vmm.RecordFile)); len(recs) > 0 {
		t.Errorf("a VMM was started: %v", recs)
	}
	g.Eventually(func() bool {
		var events corev1.EventList
		_ = w.c.Client.List(ctx, &events, client.InNamespace(w.ns))
		for _, e := range events.Items {
			if e.Reason == "PinMismatch" && e.InvolvedObject.Name == "pinned" {
				return true
			}
		}
		return false
	}).WithTimeout(30 * time.Second).Should(BeTrue())
}

// TestWorkloadChangesReachTheGuest: each run of a VM gets the workload as it is at its start
// (a rotated Secret, new arguments), and the values stay on the node no longer than the run:
// once the VM is stopped no file of its state holds them.
func TestWorkloadChangesReachTheGuest(t *testing.T) {
	w := newWorld(t)
	c, ctx := w.c, context.Background()
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "greeting"}, StringData: map[string]string{"value": "first-s3cret"}}
	if err := c.Client.Create(ctx, secret); err != nil {
		t.Fatal(err)
	}
	vm := w.vm("rotates", "serve")
	vm.Spec.Env = []impv1.EnvVar{{Name: "GREETING", ValueFrom: &impv1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
		LocalObjectReference: corev1.LocalObjectReference{Name: "greeting"}, Key: "value"}}}}
	if err := c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	console := func() string { v := w.get("rotates"); return w.console(v) }
	g.Eventually(console).WithTimeout(9 * time.Minute).Should(ContainSubstring("GREETING=first-s3cret"))
	uid := w.get("rotates").UID
	dir := filepath.Join(w.stateDir, "vms", string(uid))
	if _, err := os.Stat(filepath.Join(dir, "config.img")); err != nil {
		t.Errorf("the running VM has no configuration disk: %v", err)
	}
	// The agent got the value from the run Secret the operator wrote in IMP's namespace; with
	// the chart's identity it can read that, and no Secret of the tenant's namespace.
	asAgent, err := client.New(c.AsNode(t, testcluster.Agent, w.node), client.Options{Scheme: c.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	if err := asAgent.Get(ctx, client.ObjectKeyFromObject(secret), &corev1.Secret{}); !apierrors.IsForbidden(err) {
		t.Errorf("the agent read the tenant's Secret: %v", err)
	}
	runKey := types.NamespacedName{Namespace: testcluster.ChartNamespace, Name: runsecret.Name(uid)}
	if err := asAgent.Get(ctx, runKey, &corev1.Secret{}); err != nil {
		t.Errorf("the agent cannot read the VM's run Secret: %v", err)
	}

	// Rotate the Secret, change the arguments, restart: the next run sees both.
	secret.StringData = map[string]string{"value": "second-s3cret"}
	if err := c.Client.Update(ctx, secret); err != nil {
		t.Fatal(err)
	}
	w.update(t, "rotates", func(v *impv1.ImpVM) {
		v.Spec.Env = append(v.Spec.Env, impv1.EnvVar{Name: "EXTRA", Value: "x"})
		v.Spec.Args = []string{"serve", "again"}
		if v.Annotations == nil {
			v.Annotations = map[string]string{}
		}
		v.Annotations[impv1.RestartRequestedAnnotation] = time.Now().Format(time.RFC3339Nano)
	})
	g.Eventually(console).WithTimeout(9 * time.Minute).Should(ContainSubstring("GREETING=second-s3cret"))
	g.Eventually(func() int32 { return w.get("rotates").Status.RestartCount }).Should(BeNumerically(">=", 1))

	// Stopped: the run's configuration is gone from the node; nothing of the VM keeps the values.
	w.update(t, "rotates", func(v *impv1.ImpVM) { v.Spec.RunStrategy = impv1.RunStrategyHalted })
	g.Eventually(func() impv1.VMPhase { return w.get("rotates").Status.Phase }).WithTimeout(6 * time.Minute).Should(Equal(impv1.VMStopped))
	if _, err := os.Stat(filepath.Join(dir, "config.img")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the stopped VM's configuration disk remains: %v", err)
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*"))
	for _, f := range files {
		if filepath.Base(f) == qemu.ConsoleLog {
			continue // the workload printed it
		}
		b, _ := os.ReadFile(f)
		for _, s := range []string{"first-s3cret", "second-s3cret"} {
			if strings.Contains(string(b), s) {
				t.Errorf("%s holds the secret value %s after the VM stopped", filepath.Base(f), s)
			}
		}
	}
	// Deleted: its run Secret goes with it.
	if err := c.Client.Delete(ctx, w.get("rotates")); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() bool { return apierrors.IsNotFound(c.Client.Get(ctx, runKey, &corev1.Secret{})) }).WithTimeout(3 * time.Minute).Should(BeTrue())
}

// TestStopsDoNotHoldWorkers deletes four VMs whose workloads ignore SIGTERM, with a grace
// period of an hour: as many as the agent has workers. A fifth VM created meanwhile still
// starts and runs; the four keep their VMMs, and their ImpVMs (with the address and capacity
// they hold) stay, Stopping, while the VMMs run.
func TestStopsDoNotHoldWorkers(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	g := NewWithT(t)
	var stubborn []*impv1.ImpVM
	for i := range 4 {
		vm := w.vm(fmt.Sprintf("stubborn-%d", i), "stubborn")
		vm.Spec.Resources.Memory = ptr.To(resource.MustParse("128Mi"))
		vm.Spec.TerminationGracePeriodSeconds = ptr.To[int64](3600)
		if err := w.c.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
		stubborn = append(stubborn, vm)
	}
	running := func(name string) func() bool {
		return func() bool {
			v := w.get(name)
			return v != nil && v.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
		}
	}
	for _, vm := range stubborn {
		g.Eventually(running(vm.Name)).WithTimeout(15*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), func() string {
			return vm.Name + ": " + diagnose(w.c.Client, vm, func(string) string { return w.stateDir })
		})
		// Ready comes as the workload starts; it ignores SIGTERM once it ticks.
		g.Eventually(func() string { return w.console(w.get(vm.Name)) }).WithTimeout(6*time.Minute).Should(ContainSubstring("hello: tick 0"), vm.Name)
	}
	for i, vm := range stubborn {
		stubborn[i] = w.get(vm.Name)
		if err := w.c.Client.Delete(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	g.Eventually(func() int {
		n := 0
		for _, vm := range stubborn {
			if v := w.get(vm.Name); v != nil && v.Status.Phase == impv1.VMStopping {
				n++
			}
		}
		return n
	}).WithTimeout(time.Minute).Should(Equal(4), "the four VMs being deleted are Stopping")

	// What the stopping guests last said, for a failure's report.
	last := map[string]string{}
	stopWatch := make(chan struct{})
	defer close(stopWatch)
	var lastMu sync.Mutex
	go func() {
		for {
			select {
			case <-stopWatch:
				return
			case <-time.After(200 * time.Millisecond):
			}
			for _, vm := range stubborn {
				dir := filepath.Join(w.stateDir, "vms", string(vm.UID))
				c, err1 := os.ReadFile(filepath.Join(dir, qemu.ConsoleLog))
				q, err2 := os.ReadFile(filepath.Join(dir, "qemu.log"))
				if err1 == nil || err2 == nil {
					lastMu.Lock()
					last[vm.Name] = string(c) + "\n--- qemu.log:\n" + string(q)
					lastMu.Unlock()
				}
			}
		}
	}()
	defer func() {
		if t.Failed() {
			lastMu.Lock()
			defer lastMu.Unlock()
			for name, l := range last {
				t.Logf("%s last said:\n%s", name, l)
			}
		}
	}()

	fifth := w.vm("fifth", "serve")
	fifth.Spec.Resources.Memory = ptr.To(resource.MustParse("128Mi"))
	if err := w.c.Client.Create(ctx, fifth); err != nil {
		t.Fatal(err)
	}
	g.Eventually(running("fifth")).WithTimeout(10*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), "a VM created while four stops wait out their grace period")
	for _, vm := range stubborn {
		rec, err := vmm.ReadRecord(filepath.Join(w.stateDir, "vms", string(vm.UID)))
		if err != nil || !rec.Alive() {
			t.Errorf("%s: the VMM of a VM within its grace period is gone (%v)", vm.Name, err)
		}
		v := w.get(vm.Name)
		if v == nil || v.Status.Phase != impv1.VMStopping || v.Status.NodeName != w.node {
			t.Errorf("%s was released while its VMM runs: %+v", vm.Name, v)
		}
	}
}

// TestSlowRegistryHoldsNoWorker: four VMs of an image whose registry sends its blobs at one
// byte a second — as many VMs as the agent has workers — keep pulling, Starting, while a fifth
// VM of another registry starts and runs.
func TestSlowRegistryHoldsNoWorker(t *testing.T) {
	// No timeout ends the pulls meanwhile: a worker that waited on one would wait the test out.
	w := newWorld(t, func(o *agent.Options) { o.PullTimeout = time.Hour })
	ctx := context.Background()
	slowHost, slow := testregistry.StartSlow(t)
	testregistry.Push(t, slowHost, "slow", authn.DefaultKeychain, testregistry.FilesLayer(t, testregistry.File{Name: "slow", Mode: 0o644, Data: []byte("a tenant's image")}))
	slow()
	for i := range 4 {
		vm := w.vm(fmt.Sprintf("slow-%d", i))
		vm.Spec.Image = slowHost + "/slow:v1"
		if err := w.c.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	g := NewWithT(t)
	g.Eventually(func() int {
		n := 0
		for i := range 4 {
			if v := w.get(fmt.Sprintf("slow-%d", i)); v != nil && v.Status.Runtime != nil && v.Status.Runtime.State == impv1.RuntimeStarting {
				n++
			}
		}
		return n
	}).WithTimeout(3*time.Minute).Should(Equal(4), "the four VMs of the slow registry are Starting")
	fifth := w.vm("fifth", "serve")
	if err := w.c.Client.Create(ctx, fifth); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() bool {
		v := w.get("fifth")
		return v != nil && v.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(10*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), "a VM created while four pulls crawl")
	for i := range 4 {
		if v := w.get(fmt.Sprintf("slow-%d", i)); v == nil || v.Status.Runtime == nil || v.Status.Runtime.State != impv1.RuntimeStarting {
			t.Errorf("slow-%d: %+v, want still Starting", i, v)
		}
	}
	// Deleted while pulling: the pulls end with them.
	for i := range 4 {
		if err := w.c.Client.Delete(ctx, w.get(fmt.Sprintf("slow-%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	g.Eventually(func() int {
		n := 0
		for i := range 4 {
			if w.get(fmt.Sprintf("slow-%d", i)) != nil {
				n++
			}
		}
		return n
	}).WithTimeout(time.Minute).Should(BeZero())
}

// TestFinishedVMsLoseTheirDisks: a VM that finished keeps its disks on the node for the
// retention only; its console stays, and so does the ImpVM.
func TestFinishedVMsLoseTheirDisks(t *testing.T) {
	w := newWorld(t, func(o *agent.Options) { o.FinishedDiskRetention = 3 * time.Second })
	ctx := context.Background()
	vm := w.vm("done", "exit")
	vm.Spec.RunStrategy = impv1.RunStrategyOnce
	if err := w.c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	g.Eventually(func() impv1.VMPhase {
		if v := w.get("done"); v != nil {
			return v.Status.Phase
		}
		return ""
	}).WithTimeout(9 * time.Minute).WithPolling(200 * time.Millisecond).Should(Equal(impv1.VMFailed))
	dir := filepath.Join(w.stateDir, "vms", string(w.get("done").UID))
	g.Eventually(func() error { _, err := os.Stat(filepath.Join(dir, "rw.ext4")); return err }).WithTimeout(time.Minute).Should(MatchError(os.ErrNotExist))
	if b, err := os.ReadFile(filepath.Join(dir, qemu.ConsoleLog)); err != nil || !strings.Contains(string(b), "hello from imp") {
		t.Errorf("the finished VM's console went with its disks: %v", err)
	}
	if w.get("done") == nil {
		t.Error("the finished ImpVM is gone")
	}
	// The operator counts the disks until the agent says they are gone (issue 27, item 6).
	g.Eventually(func() bool {
		v := w.get("done")
		return v != nil && v.Status.Runtime != nil && v.Status.Runtime.DisksRemoved && v.Status.Runtime.FinishedAt != nil
	}).WithTimeout(time.Minute).Should(BeTrue(), "the removal of the disks is not reported")
}

// agentStacks writes every goroutine of the test process (the in-process agents' among them)
// to a file named for what stalled, and returns that file's name and the stacks that stand in
// the agent's start (image fetches, base disks, snapshots, plan steps), at most 16 KiB of them:
// where a start that never ends stands, for a failure message.
func agentStacks(what string) string {
	var all strings.Builder
	_ = pprof.Lookup("goroutine").WriteTo(&all, 2)
	path := filepath.Join(os.TempDir(), "imp-"+what+"-goroutines.txt")
	_ = os.WriteFile(path, []byte(all.String()), 0o644)
	var b strings.Builder
	fmt.Fprintf(&b, "(every goroutine in %s)", path)
	for _, g := range strings.Split(all.String(), "\n\n") {
		for _, pkg := range []string{"/agent/imagefetch.", "/agent/disk.", "/agent/snapshotter.", "/agent/steps.", "/agent/snapshot."} {
			if strings.Contains(g, pkg) {
				b.WriteString("\n\n" + g)
				break
			}
		}
		if b.Len() > 16<<10 {
			b.WriteString("\n(cut)")
			break
		}
	}
	return b.String()
}
