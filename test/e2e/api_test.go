package e2e

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

// TestAPIWithKubectl installs the CRDs and samples the way a person would, with kubectl, and
// checks what kubectl shows.
func TestAPIWithKubectl(t *testing.T) {
	c := testcluster.Require(t, shared)
	kc := c.Kubeconfig(t)
	root, err := testcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	kubectl := func(args ...string) string {
		t.Helper()
		out, err := testcluster.Kubectl(kc, args...)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	mustContain := func(out string, wants ...string) {
		t.Helper()
		for _, w := range wants {
			if !strings.Contains(out, w) {
				t.Errorf("output lacks %q:\n%s", w, out)
			}
		}
	}

	out := kubectl("apply", "-f", filepath.Join(root, "config/crd/bases"))
	mustContain(out, "impvms.imp.dev created", "impvmclasses.imp.dev created", "impnetworks.imp.dev created")
	kubectl("wait", "--for=condition=Established", "--timeout=60s",
		"crd/impvms.imp.dev", "crd/impvmclasses.imp.dev", "crd/impnetworks.imp.dev")
	mustContain(kubectl("get", "crd"), "impvms.imp.dev", "impvmclasses.imp.dev", "impnetworks.imp.dev")

	kubectl("create", "namespace", "demo")
	out = kubectl("apply", "-n", "demo", "-f", filepath.Join(root, "config/samples"))
	mustContain(out, "impvm.imp.dev/hello created", "impvm.imp.dev/web created",
		"impvmclass.imp.dev/small created", "impnetwork.imp.dev/default created")

	out = kubectl("get", "impvm", "-A", "-o", "wide")
	header := strings.Fields(strings.SplitN(out, "\n", 2)[0])
	want := []string{"NAMESPACE", "NAME", "PHASE", "READY", "NODE", "IP", "AGE", "VCPUS", "MEMORY", "IMAGE", "START", "REASON"}
	if strings.Join(header, " ") != strings.Join(want, " ") {
		t.Errorf("kubectl get impvm -A -o wide header = %v, want %v\n%s", header, want, out)
	}
	// IMAGE is status.image, the image the VM runs (a copy's: its template's), which the
	// operator writes: there is none here (TestDay0 shows it).
	header = strings.Fields(strings.SplitN(kubectl("get", "impvm", "-A"), "\n", 2)[0])
	if strings.Join(header, " ") != "NAMESPACE NAME PHASE READY NODE IP AGE" {
		t.Errorf("kubectl get impvm -A header = %v", header)
	}

	// The short names and the imp category.
	mustContain(kubectl("get", "impnet", "-n", "demo"), "10.100.0.0/24")
	mustContain(kubectl("get", "imp", "-A"), "impvm.imp.dev/hello", "impnetwork.imp.dev/default", "impvmclass.imp.dev/small")

	// A bad object is refused with a message naming the field.
	out, err = testcluster.Kubectl(kc, "apply", "-n", "demo", "-f",
		filepath.Join(root, "api/v1alpha1/testdata/invalid/vm-memory-below-minimum.yaml"))
	if err == nil {
		t.Fatalf("an ImpVM with 64Mi of memory was accepted:\n%s", out)
	}
	mustContain(out, "spec.resources.memory", "memory must be at least 128Mi")
}
