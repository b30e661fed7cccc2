package agent_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/controller/impvm"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/testcluster"
	"github.com/syscode-labs/imp/internal/testguest"
	"github.com/syscode-labs/imp/internal/testregistry"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// run starts a manager until the test ends; it returns a function that stops it earlier.
func run(t *testing.T, mgr ctrl.Manager) func() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := mgr.Start(ctx); err != nil {
			t.Errorf("manager: %v", err)
		}
	}()
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

func managerOptions(c *testcluster.Cluster) ctrl.Options {
	return ctrl.Options{
		Scheme:                 c.Scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
	}
}

// TestVMLifecycle: an ImpVM becomes a guest booted under QEMU/TCG on this machine, reaches
// Running with Ready=True from the guest channel, shows its workload's output on its console,
// and on deletion its VMM, disks and state go and its finalizer is released.
func TestVMLifecycle(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	nodeName := "imp-e2e-" + ns[len(ns)-5:]
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	host := testregistry.Start(t, "", "")
	ref := testguest.Image(t, host, "hello")

	// This machine as a Node (no kubelet here: the test keeps it Ready).
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName, Labels: map[string]string{impv1.NodeEnabledLabel: "true", "imp.test/node": nodeName}}}
	if err := c.Client.Create(ctx, node); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Client.Delete(context.Background(), node) })
	node.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastTransitionTime: metav1.Now()}}
	if err := c.Client.Status().Update(ctx, node); err != nil {
		t.Fatal(err)
	}

	opMgr, err := ctrl.NewManager(c.Config, managerOptions(c))
	if err != nil {
		t.Fatal(err)
	}
	opCtx, opCancel := context.WithCancel(ctx)
	t.Cleanup(opCancel)
	if err := operator.Setup(opCtx, opMgr, operator.Options{VM: impvm.DefaultOptions(), Concurrency: 2}); err != nil {
		t.Fatal(err)
	}
	run(t, opMgr)

	stateDir := filepath.Join(tmp, "state")
	opts := managerOptions(c)
	opts.Cache = agent.CacheOptions(nodeName)
	agMgr, err := ctrl.NewManager(c.Config, opts)
	if err != nil {
		t.Fatal(err)
	}
	ag := &agent.Agent{
		Client: agMgr.GetClient(), APIReader: agMgr.GetAPIReader(), Recorder: agMgr.GetEventRecorder("imp-agent"),
		Opts: agent.Options{NodeName: nodeName, StateDir: stateDir, Kernel: kernel, Initramfs: initrd, Accel: "tcg", ReportInterval: time.Second},
	}
	if err := ag.SetupWithManager(agMgr); err != nil {
		t.Fatal(err)
	}
	run(t, agMgr)

	vm := &impv1.ImpVM{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "hello"},
		Spec: impv1.ImpVMSpec{
			Image:        host + "/hello:v1",
			Args:         []string{"serve"},
			Env:          []impv1.EnvVar{{Name: "GREETING", Value: "from-the-api"}},
			Resources:    &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("256Mi"))},
			NodeSelector: map[string]string{"imp.test/node": nodeName},
			DiskSize:     ptr.To(resource.MustParse("64Mi")),
		},
	}
	created := time.Now()
	if err := c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	get := func() *impv1.ImpVM {
		v := &impv1.ImpVM{}
		if err := c.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "hello"}, v); err != nil {
			return nil
		}
		return v
	}
	g.Eventually(func() bool {
		v := get()
		return v != nil && v.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(3*time.Minute).WithPolling(100*time.Millisecond).Should(BeTrue(), "VM status: %+v", func() any { return get().Status })
	v := get()
	t.Logf("create→Running+Ready %v (boot %dms under TCG); runtime %+v", time.Since(created).Round(time.Millisecond), ptr.Deref(v.Status.Runtime.BootMilliseconds, -1), *v.Status.Runtime)

	dir := filepath.Join(stateDir, "vms", string(v.UID))
	g.Eventually(func() string {
		b, _ := os.ReadFile(filepath.Join(dir, qemu.ConsoleLog))
		return string(b)
	}).WithTimeout(30 * time.Second).Should(ContainSubstring("hello from imp: GREETING=from-the-api host=hello"))
	rec, err := qemu.ReadRecord(dir)
	if err != nil || !rec.Alive() {
		t.Fatalf("VMM record %+v, %v", rec, err)
	}
	images, _ := filepath.Glob(filepath.Join(stateDir, "images", "sha256-*.ext4"))
	if len(images) != 1 || !strings.Contains(images[0], strings.TrimPrefix(ref.DigestStr(), "sha256:")) {
		t.Errorf("base disks %v, want the image's digest %s", images, ref.DigestStr())
	}

	// Delete: the guest is asked to stop, the VMM goes, the state goes, the VM goes.
	if err := c.Client.Delete(ctx, v); err != nil {
		t.Fatal(err)
	}
	g.Eventually(get).WithTimeout(2 * time.Minute).WithPolling(100 * time.Millisecond).Should(BeNil())
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
func TestAgentRestart(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns := c.Namespace(t)
	nodeName := "imp-restart-" + ns[len(ns)-5:]
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	host := testregistry.Start(t, "", "")
	testguest.Image(t, host, "hello")
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName, Labels: map[string]string{impv1.NodeEnabledLabel: "true", "imp.test/node": nodeName}}}
	if err := c.Client.Create(ctx, node); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Client.Delete(context.Background(), node) })
	node.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastTransitionTime: metav1.Now()}}
	if err := c.Client.Status().Update(ctx, node); err != nil {
		t.Fatal(err)
	}
	opMgr, err := ctrl.NewManager(c.Config, managerOptions(c))
	if err != nil {
		t.Fatal(err)
	}
	opCtx, opCancel := context.WithCancel(ctx)
	t.Cleanup(opCancel)
	if err := operator.Setup(opCtx, opMgr, operator.Options{VM: impvm.DefaultOptions(), Concurrency: 2}); err != nil {
		t.Fatal(err)
	}
	run(t, opMgr)

	// The agent as a process.
	bin := filepath.Join(tmp, "imp-agent")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/syscode-labs/imp/cmd/imp-agent").CombinedOutput(); err != nil {
		t.Fatalf("building imp-agent: %v\n%s", err, out)
	}
	kubeconfig := c.Kubeconfig(t)
	stateDir := filepath.Join(tmp, "state")
	startAgent := func() *exec.Cmd {
		cmd := exec.Command(bin, "--kubeconfig", kubeconfig, "--node-name", nodeName, "--state-dir", stateDir,
			"--kernel", kernel, "--initramfs", initrd, "--qemu-accel", "tcg", "--reserve-vcpus", "0", "--reserve-memory", "0", "--vcpu-overcommit", "2",
			"--metrics-bind-address", "0", "--health-probe-bind-address", "0", "--log-level", "error")
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return cmd
	}
	agentProc := startAgent()

	names := []string{"a", "b", "c"}
	for _, n := range names {
		vm := &impv1.ImpVM{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: n},
			Spec: impv1.ImpVMSpec{
				Image: host + "/hello:v1", Args: []string{"serve"},
				Resources:    &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("128Mi"))},
				NodeSelector: map[string]string{"imp.test/node": nodeName},
				DiskSize:     ptr.To(resource.MustParse("64Mi")),
			},
		}
		if err := c.Client.Create(ctx, vm); err != nil {
			t.Fatal(err)
		}
	}
	get := func(n string) *impv1.ImpVM {
		v := &impv1.ImpVM{}
		if err := c.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: n}, v); err != nil {
			return nil
		}
		return v
	}
	g := NewWithT(t)
	records := map[string]*qemu.Record{}
	for _, n := range names {
		g.Eventually(func() bool {
			v := get(n)
			return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
		}).WithTimeout(4*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), "VM %s", n)
		rec, err := qemu.ReadRecord(filepath.Join(stateDir, "vms", string(get(n).UID)))
		if err != nil {
			t.Fatal(err)
		}
		records[n] = rec
	}

	// kill -9 the agent; delete c while it is down.
	if err := agentProc.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = agentProc.Wait()
	cUID := get("c").UID
	if err := c.Client.Delete(ctx, get("c")); err != nil {
		t.Fatal(err)
	}
	for n, rec := range records {
		if !rec.Alive() {
			t.Errorf("VM %s's VMM (pid %d) died with the agent", n, rec.Pid)
		}
	}

	startAgent()
	g.Eventually(func() *impv1.ImpVM { return get("c") }).WithTimeout(2 * time.Minute).Should(BeNil())
	if records["c"].Alive() {
		t.Error("the deleted VM's VMM still runs")
	}
	if _, err := os.Stat(filepath.Join(stateDir, "vms", string(cUID))); !os.IsNotExist(err) {
		t.Errorf("the deleted VM's state remains: %v", err)
	}
	// a and b: the same processes, still Running and Ready, after the agent came back.
	g.Consistently(func() bool {
		for _, n := range []string{"a", "b"} {
			v := get(n)
			if v == nil || v.Status.Phase != impv1.VMRunning || !meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition) {
				return false
			}
		}
		return true
	}).WithTimeout(5 * time.Second).Should(BeTrue())
	for _, n := range []string{"a", "b"} {
		now, err := qemu.ReadRecord(filepath.Join(stateDir, "vms", string(get(n).UID)))
		if err != nil || *now != *records[n] || !now.Alive() {
			t.Errorf("VM %s's VMM changed across the agent restart: %+v → %+v (%v)", n, records[n], now, err)
		}
	}
	for _, n := range []string{"a", "b"} {
		if err := c.Client.Delete(ctx, get(n)); err != nil {
			t.Fatal(err)
		}
		g.Eventually(func() *impv1.ImpVM { return get(n) }).WithTimeout(2 * time.Minute).Should(BeNil())
	}
}
