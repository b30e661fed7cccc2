package impvm_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// kubectlImp builds the plugin once per test and runs it against the test's control plane.
func (e *env) kubectlImp() func(args ...string) (string, error) {
	e.t.Helper()
	bin := filepath.Join(e.t.TempDir(), "kubectl-imp")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/syscode-labs/imp/cmd/kubectl-imp").CombinedOutput(); err != nil {
		e.t.Fatalf("building kubectl-imp: %v\n%s", err, out)
	}
	kc := e.cl.Kubeconfig(e.t)
	return func(args ...string) (string, error) {
		out, err := exec.Command(bin, append([]string{"--kubeconfig", kc, "-n", e.ns}, args...)...).CombinedOutput()
		return string(out), err
	}
}

func (e *env) setPressure(node string, on bool) {
	e.t.Helper()
	ctx := context.Background()
	var n corev1.Node
	if err := e.c.Get(ctx, client.ObjectKey{Name: e.ns + "-" + node}, &n); err != nil {
		e.t.Fatal(err)
	}
	status := corev1.ConditionFalse
	if on {
		status = corev1.ConditionTrue
	}
	found := false
	for i := range n.Status.Conditions {
		if c := &n.Status.Conditions[i]; c.Type == corev1.NodeMemoryPressure {
			c.Status, c.LastHeartbeatTime, found = status, metav1.Now(), true
		}
	}
	if !found {
		n.Status.Conditions = append(n.Status.Conditions, corev1.NodeCondition{Type: corev1.NodeMemoryPressure, Status: status, LastTransitionTime: metav1.Now()})
	}
	if err := e.c.Status().Update(ctx, &n); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) phases(names ...string) string {
	var out []string
	for _, n := range names {
		out = append(out, n+"="+string(e.get(n).Status.Phase))
	}
	return strings.Join(out, " ")
}

// TestPressureLifecycle: under MemoryPressure the largest VM is suspended first, then the next
// while the pressure holds; clearing it stops the suspensions; nothing resumes by itself;
// kubectl imp resume --node N --all resumes what the pressure suspended.
func TestPressureLifecycle(t *testing.T) {
	e := newEnv(t)
	e.opts.PressureLifecycle, e.opts.PressureSettle = true, 2*time.Second
	e.node("n", 8, 8)
	e.startAgent(nil)
	e.startOperator()
	for _, v := range []struct{ name, mem string }{{"half", "512Mi"}, {"two", "2Gi"}, {"one", "1Gi"}} {
		e.create(e.vm(v.name, 1, v.mem))
	}
	eventually(t, func() string { return e.phases("half", "two", "one") }).Should(Equal("half=Running two=Running one=Running"))

	e.setPressure("n", true)
	eventually(t, func() string { return e.phases("half", "two", "one") }).Should(Equal("half=Running two=Suspended one=Running"))
	eventually(t, func() string { return e.phases("half", "two", "one") }).WithTimeout(30 * time.Second).Should(Equal("half=Running two=Suspended one=Suspended"))
	e.setPressure("n", false)
	// The 512Mi VM is never suspended, and nothing resumes by itself.
	NewWithT(t).Consistently(func() string { return e.phases("half", "two", "one") }).WithTimeout(6 * time.Second).Should(Equal("half=Running two=Suspended one=Suspended"))
	two := e.get("two")
	if c := two.Status.Suspension; c == nil || c.Reason != impv1.SuspendReasonPressure || c.MemoryReleased == nil || c.MemoryReleased.String() != "2Gi" {
		t.Errorf("suspension of two: %+v", c)
	}
	ev := e.events()
	for _, r := range []string{"Suspending", "Suspended"} {
		if ev[r] == 0 {
			t.Errorf("no %s Event; events: %v", r, ev)
		}
	}
	// PressureDetected is about the Node, a cluster-scoped object: its Events are in default.
	var nodeEvents corev1.EventList
	if err := e.c.List(context.Background(), &nodeEvents, client.InNamespace("default")); err != nil {
		t.Fatal(err)
	}
	detected := 0
	for _, ev := range nodeEvents.Items {
		if ev.Reason == "PressureDetected" && ev.InvolvedObject.Name == e.ns+"-n" {
			detected++
		}
	}
	if detected != 2 {
		t.Errorf("%d PressureDetected Events about the node, want 2 (one per VM suspended)", detected)
	}

	imp := e.kubectlImp()
	out, err := imp("resume", "--node", e.ns+"-n", "--all")
	if err != nil || !strings.Contains(out, "impvm/two resuming") || !strings.Contains(out, "impvm/one resuming") {
		t.Fatalf("kubectl imp resume --node --all: %v\n%s", err, out)
	}
	eventually(t, func() string { return e.phases("half", "two", "one") }).Should(Equal("half=Running two=Running one=Running"))
}

// TestPressureLifecycleDisabled: without the feature nothing is suspended under pressure.
func TestPressureLifecycleDisabled(t *testing.T) {
	e := newEnv(t)
	e.node("n", 8, 8)
	e.startAgent(nil)
	e.startOperator()
	e.create(e.vm("big", 1, "2Gi"))
	eventually(t, func() string { return e.phases("big") }).Should(Equal("big=Running"))
	e.setPressure("n", true)
	NewWithT(t).Consistently(func() string { return e.phases("big") }).WithTimeout(5 * time.Second).Should(Equal("big=Running"))
}

// TestSuspendedVMKeepsItsHold: a suspended VM keeps what it holds on its node (its state is
// there, and resuming must find room), so a new VM that only fits in its memory waits.
func TestSuspendedVMKeepsItsHold(t *testing.T) {
	e := newEnv(t)
	e.node("n", 8, 3)
	e.startAgent(nil)
	e.startOperator()
	e.create(e.vm("a", 1, "2Gi"))
	eventually(t, func() string { return e.phases("a") }).Should(Equal("a=Running"))
	imp := e.kubectlImp()
	if out, err := imp("suspend", "a", "--message", "for the test"); err != nil || !strings.Contains(out, "impvm/a suspending") {
		t.Fatalf("kubectl imp suspend: %v\n%s", err, out)
	}
	eventually(t, func() string { return e.phases("a") }).Should(Equal("a=Suspended"))
	e.create(e.vm("b", 1, "2Gi"))
	eventually(t, func() string { return e.phases("b") }).Should(Equal("b=Pending"))
	NewWithT(t).Consistently(func() string { return e.phases("b") }).WithTimeout(3 * time.Second).Should(Equal("b=Pending"))
	if out, err := imp("resume", "a"); err != nil {
		t.Fatalf("kubectl imp resume: %v\n%s", err, out)
	}
	eventually(t, func() string { return e.phases("a") }).Should(Equal("a=Running"))
}

// TestKubectlImpVerbs: list, status, stop, start and restart act on the API as they say.
func TestKubectlImpVerbs(t *testing.T) {
	e := newEnv(t)
	e.node("n", 8, 8)
	e.startAgent(nil)
	e.startOperator()
	vm := e.vm("web", 1, "256Mi")
	vm.Spec.RunStrategy = impv1.RunStrategyRerunOnFailure
	e.create(vm)
	eventually(t, func() string { return e.phases("web") }).Should(Equal("web=Running"))
	imp := e.kubectlImp()
	run := func(args ...string) string {
		t.Helper()
		out, err := imp(args...)
		if err != nil {
			t.Fatalf("kubectl imp %v: %v\n%s", args, err, out)
		}
		return out
	}
	if out := run("list"); !strings.Contains(out, "NAMESPACE") || !strings.Contains(out, "web") || !strings.Contains(out, "Running") {
		t.Errorf("list:\n%s", out)
	}
	if out := run("status", "web"); !strings.Contains(out, "Phase:") || !strings.Contains(out, "Condition Ready:") {
		t.Errorf("status:\n%s", out)
	}
	if out := run("status", "web", "-o", "json"); !strings.Contains(out, `"kind": "ImpVM"`) || !strings.Contains(out, `"name": "web"`) {
		t.Errorf("status -o json:\n%s", out)
	}
	if out, err := imp("status", "nope"); err == nil || !strings.Contains(out, "ImpVM nope not found") {
		t.Errorf("status of a missing VM: %v\n%s", err, out)
	}
	// logs from an agent state directory on this machine (the exec path needs a kubelet).
	state := t.TempDir()
	consoleDir := filepath.Join(state, "vms", string(e.get("web").UID))
	if err := os.MkdirAll(consoleDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(consoleDir, "console.log"), []byte("boot\nhello from the console\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if out := run("logs", "web", "--state-dir", state); out != "boot\nhello from the console\n" {
		t.Errorf("logs = %q", out)
	}
	if out := run("logs", "web", "--state-dir", state, "--limit-bytes", "8"); out != "console\n" {
		t.Errorf("logs --limit-bytes 8 = %q", out)
	}
	// Through the API server, which serves no subresources here: a refusal that says so.
	if out, err := imp("logs", "web"); err == nil || !strings.Contains(out, "does not serve subresources.imp.dev") {
		t.Errorf("logs without IMP's subresources: %v\n%s", err, out)
	}
	run("stop", "web")
	eventually(t, func() string { return e.phases("web") }).Should(Equal("web=Stopped"))
	run("start", "web")
	eventually(t, func() string { return e.phases("web") }).Should(Equal("web=Running"))
	if rs := e.get("web").Spec.RunStrategy; rs != impv1.RunStrategyRerunOnFailure {
		t.Errorf("start restored runStrategy %s, want RerunOnFailure", rs)
	}
	before := e.get("web").Status.RestartCount
	time.Sleep(1100 * time.Millisecond) // a restart is asked for after the run began
	run("restart", "web")
	eventually(t, func() int32 { return e.get("web").Status.RestartCount }).Should(Equal(before + 1))
	eventually(t, func() string { return e.phases("web") }).Should(Equal("web=Running"))
	NewWithT(t).Consistently(func() int32 { return e.get("web").Status.RestartCount }).WithTimeout(3 * time.Second).Should(Equal(before + 1))
}
