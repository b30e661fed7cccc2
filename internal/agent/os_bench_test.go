package agent_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/guestsession"
)

// TestBenchOS is `make bench-os`, skipped otherwise (IMP_BENCH=os): create → Ready of the
// Debian VM of hack/os-image.sh (boot OS) without and with cloud-init, five runs each, beside
// the test workload's VM, P50 and the spread, one VM at a time under QEMU/TCG; and where the
// OS's boot went (systemd-analyze of the last run of each). Restored from a snapshot is not
// built for an OS (its snapshots are refused): printed as such. It asserts nothing.
func TestBenchOS(t *testing.T) {
	if os.Getenv("IMP_BENCH") != "os" {
		t.Skip("a benchmark: make bench-os")
	}
	w := newWorld(t)
	ref := osImage(t, w.host)
	ctx := context.Background()
	g := NewWithT(t)
	const runs = 5
	kinds := []struct {
		name string
		vm   func(name string) *impv1.ImpVM
	}{
		{"workload (the test image's VM)", func(name string) *impv1.ImpVM { return w.vm(name, "web") }},
		{"os (Debian, cloud-init off)", func(name string) *impv1.ImpVM { return osVM(w, name, ref, nil) }},
		{"os (Debian, cloud-init user data)", func(name string) *impv1.ImpVM {
			return osVM(w, name, ref, &impv1.CloudInit{UserData: "#cloud-config\nwrite_files:\n  - path: /etc/imp-bench\n    content: ok\n"})
		}},
	}
	for k, kind := range kinds {
		var took []time.Duration
		analyze := ""
		for i := range runs {
			name := fmt.Sprintf("bench-%d-%d", k, i)
			vm := kind.vm(name)
			began := time.Now()
			if err := w.c.Client.Create(ctx, vm); err != nil {
				t.Fatal(err)
			}
			g.Eventually(func() bool {
				v := w.get(name)
				return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
			}).WithTimeout(9*time.Minute).WithPolling(50*time.Millisecond).Should(BeTrue(), name)
			took = append(took, time.Since(began))
			v := w.get(name)
			if vm.Spec.Boot == impv1.BootOS && i == runs-1 {
				s, err := w.agent.Runs.Session(types.NamespacedName{Namespace: w.ns, Name: name}, v.UID)
				if err != nil {
					t.Fatal(err)
				}
				var out bytes.Buffer
				ectx, cancel := context.WithTimeout(ctx, time.Minute)
				_ = s.Exec(ectx, guestsession.ExecOptions{Command: []string{"sh", "-c", "systemd-analyze; systemd-analyze blame | head -6"}, Stdout: &out, Stderr: &out})
				cancel()
				analyze = out.String()
			}
			if err := w.c.Client.Delete(ctx, v); err != nil {
				t.Fatal(err)
			}
			g.Eventually(func() bool { return w.get(name) == nil }).WithTimeout(5 * time.Minute).Should(BeTrue())
		}
		slices.Sort(took)
		fmt.Printf("os create→Ready %-34s P50 %6.2f s (min %.2f, max %.2f, %d runs)\n", kind.name, took[len(took)/2].Seconds(), took[0].Seconds(), took[len(took)-1].Seconds(), runs)
		for _, l := range strings.Split(strings.TrimSpace(analyze), "\n") {
			if l != "" {
				fmt.Printf("  %s\n", strings.TrimSpace(l))
			}
		}
	}
	fmt.Printf("os create→Ready %-34s not built: an OS's snapshots are refused (docs/os.md)\n", "os restored from a snapshot")
}

// osVM is a VM of the Debian image ref, booting its OS, with cloud-init data ci (none: off).
func osVM(w *world, name, ref string, ci *impv1.CloudInit) *impv1.ImpVM {
	vm := w.vm(name)
	vm.Spec.Image, vm.Spec.Args, vm.Spec.Boot, vm.Spec.CloudInit = ref, nil, impv1.BootOS, ci
	vm.Spec.Resources.Memory = ptr.To(resource.MustParse("512Mi"))
	vm.Spec.DiskSize = ptr.To(resource.MustParse("256Mi"))
	return vm
}
