package agent_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/volume"
	"github.com/syscode-labs/imp/internal/guestsession"
	"github.com/syscode-labs/imp/internal/testcluster"
)

// TestBenchVolumes is `make bench-volumes`, skipped otherwise (IMP_BENCH=volumes): a QEMU/TCG
// guest measures a raw disk volume at /dev/xvdb (64 MiB sequential write and read in 1 MiB
// requests, 4 KiB random writes, each synced, and reads, 3 s each), through its page cache and
// then with O_DIRECT, then the node measures the very file the volume is, the same two ways. A Block claim reaches the VMM the same way (an open
// descriptor of the device, virtio-blk): the figures stand for one, on this machine's disk
// rather than a claim's. It prints each guest figure beside the node's and the target ratio
// (≥ 0.5) and asserts none.
func TestBenchVolumes(t *testing.T) {
	if os.Getenv("IMP_BENCH") != "volumes" {
		t.Skip("a benchmark: make bench-volumes")
	}
	w := newWorld(t)
	ctx := context.Background()
	g := NewWithT(t)
	vm := w.vm("io", "serve")
	vm.Spec.Resources.Memory = ptr.To(resource.MustParse("256Mi"))
	vm.Spec.Volumes = []impv1.Volume{{Name: "raw", EmptyDisk: &impv1.EmptyDiskSource{Capacity: "128Mi"}}}
	vm.Spec.VolumeDevices = []impv1.VolumeDevice{{Name: "raw", DevicePath: "/dev/xvdb"}}
	if err := w.c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() bool {
		v := w.get("io")
		return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(9 * time.Minute).Should(BeTrue())
	v := w.get("io")
	s, err := w.agent.Runs.Session(types.NamespacedName{Namespace: w.ns, Name: "io"}, v.UID)
	if err != nil {
		t.Fatal(err)
	}
	ectx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	guest := map[string]map[string]float64{}
	for _, mode := range ioModes {
		var out bytes.Buffer
		if err := s.Exec(ectx, guestsession.ExecOptions{Command: []string{"/bin/hello", "tool-io", "/dev/xvdb", "64", mode}, Stdout: &out, Stderr: &out}); err != nil {
			t.Fatalf("tool-io %s in the guest: %v: %s", mode, err, out.String())
		}
		guest[mode] = parseIO(t, out.String())
	}

	// The node, on the volume's file, once the VM has stopped.
	w.update(t, "io", func(v *impv1.ImpVM) { v.Spec.RunStrategy = impv1.RunStrategyHalted })
	g.Eventually(func() impv1.VMPhase { return w.get("io").Status.Phase }).WithTimeout(3 * time.Minute).Should(Equal(impv1.VMStopped))
	root, err := testcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "hello")
	if b, err := exec.Command("go", "build", "-C", root, "-o", bin, "./internal/testguest/hello").CombinedOutput(); err != nil {
		t.Fatalf("building the tool: %v: %s", err, b)
	}
	file := filepath.Join(w.stateDir, "vms", string(v.UID), volume.DiskFile("raw"))
	for _, mode := range ioModes {
		b, err := exec.Command(bin, "tool-io", file, "64", mode).CombinedOutput()
		if err != nil {
			t.Fatalf("tool-io %s on the node: %v: %s", mode, err, b)
		}
		node := parseIO(t, string(b))
		for _, k := range []string{"seqwrite", "seqread", "randwrite", "randread"} {
			unit := "MB/s"
			if strings.HasPrefix(k, "rand") {
				unit = "IOPS (4 KiB)"
			}
			fmt.Printf("volume %-8s %-9s guest %8.1f  node %8.1f %s  ratio %.2f  (target >= 0.5 under TCG)\n", mode, k, guest[mode][k], node[k], unit, guest[mode][k]/node[k])
		}
	}
}

// ioModes are tool-io's: through the page cache (guest's and node's), and direct (O_DIRECT on
// both sides: the device as the node reads it directly, against the guest's I/O path to it).
var ioModes = []string{"buffered", "direct"}

func parseIO(t *testing.T, s string) map[string]float64 {
	t.Helper()
	f := strings.Fields(strings.TrimSpace(s))
	out := map[string]float64{}
	for i := 0; i+1 < len(f); i += 2 {
		v, err := strconv.ParseFloat(f[i+1], 64)
		if err != nil {
			t.Fatalf("tool-io said %q", s)
		}
		out[f[i]] = v
	}
	if len(out) != 4 {
		t.Fatalf("tool-io said %q", s)
	}
	return out
}
