package agent_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
)

// TestBenchIdle is `make bench-idle`, skipped otherwise (IMP_BENCH=idle): what a warm pool's
// idle member costs its node, running idle against paused (QEMU `stop`), and what pausing
// costs a claim. Four copies restored from a snapshot of a guest serving HTTP and otherwise
// idle (256 MiB, TCG), as a pool's members are; for each state, over 10 s: the VMMs' CPU (in
// cores, from /proc/<pid>/stat) and their memory (PSS, from smaps_rollup). Then `cont` and an
// exec through the session channel right after it, against an exec in a guest that ran. It
// prints the figures and asserts none.
func TestBenchIdle(t *testing.T) {
	if os.Getenv("IMP_BENCH") != "idle" {
		t.Skip("a benchmark: make bench-idle")
	}
	w := newWorld(t, func(o *agent.Options) { o.VCPUOvercommit = 8 })
	ctx := context.Background()
	g := NewWithT(t)
	vm := func(name, snap string) *impv1.ImpVM {
		v := w.vm(name, "web")
		v.Spec.Resources.Memory = ptr.To(resource.MustParse("256Mi"))
		if snap != "" {
			v.Spec.SnapshotRef = &impv1.SnapshotReference{Name: snap}
		}
		return v
	}
	ready := func(name string) {
		g.Eventually(func() bool {
			v := w.get(name)
			return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
		}).WithTimeout(10 * time.Minute).WithPolling(100 * time.Millisecond).Should(BeTrue())
	}
	g.Expect(w.c.Client.Create(ctx, vm("src", ""))).To(Succeed())
	ready("src")
	g.Expect(w.c.Client.Create(ctx, &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "snap"},
		Spec: impv1.ImpVMSnapshotSpec{VMName: "src"}})).To(Succeed())
	g.Eventually(func() impv1.SnapshotPhase {
		s := &impv1.ImpVMSnapshot{}
		_ = w.c.Client.Get(ctx, types.NamespacedName{Namespace: w.ns, Name: "snap"}, s)
		return s.Status.Phase
	}).WithTimeout(5 * time.Minute).Should(Equal(impv1.SnapshotReady))
	g.Expect(w.c.Client.Delete(ctx, w.get("src"))).To(Succeed())
	const n = 4
	var names []string
	for i := range n {
		names = append(names, fmt.Sprintf("member-%d", i))
		g.Expect(w.c.Client.Create(ctx, vm(names[i], "snap"))).To(Succeed())
	}
	for _, name := range names {
		ready(name)
	}
	g.Eventually(func() *impv1.ImpVM { return w.get("src") }).WithTimeout(3 * time.Minute).Should(BeNil())
	dirs := map[string]string{}
	pids := map[string]int{}
	for _, name := range names {
		dir := filepath.Join(w.stateDir, "vms", string(w.get(name).UID))
		rec, err := vmm.ReadRecord(dir)
		g.Expect(err).NotTo(HaveOccurred())
		dirs[name], pids[name] = dir, rec.Pid
	}
	// measure is the VMMs' CPU (cores, each) and PSS (MiB, each) over d.
	measure := func(d time.Duration) (cpu []float64, pss []float64) {
		before := map[string]float64{}
		for name, pid := range pids {
			before[name] = cpuSeconds(t, pid)
		}
		time.Sleep(d)
		for _, name := range names {
			cpu = append(cpu, (cpuSeconds(t, pids[name])-before[name])/d.Seconds())
			pss = append(pss, pssMiB(t, pids[name]))
		}
		return cpu, pss
	}
	time.Sleep(5 * time.Second) // the restores' own work done
	runCPU, runPSS := measure(10 * time.Second)
	execRunning := timeExec(t, w, names[0])

	for _, name := range names {
		q, err := qemu.DialQMP(dirs[name], 5*time.Second)
		g.Expect(err).NotTo(HaveOccurred())
		_, err = q.Execute("stop", nil)
		q.Close()
		g.Expect(err).NotTo(HaveOccurred())
	}
	pauseCPU, pausePSS := measure(10 * time.Second)

	var conts, execs []time.Duration
	for _, name := range names[1:] {
		began := time.Now()
		g.Expect(qemu.Continue(dirs[name])).To(Succeed())
		conts = append(conts, time.Since(began))
		execs = append(execs, timeExec(t, w, name))
	}
	g.Expect(qemu.Continue(dirs[names[0]])).To(Succeed())

	mean := func(xs []float64) float64 {
		s := 0.0
		for _, x := range xs {
			s += x
		}
		return s / float64(len(xs))
	}
	fmt.Printf("idle member (256 MiB, TCG, a guest serving HTTP), %d restored copies, 10 s each, mean per member:\n", n)
	fmt.Printf("  running idle: VMM CPU %.3f cores, PSS %.1f MiB\n", mean(runCPU), mean(runPSS))
	fmt.Printf("  paused:       VMM CPU %.3f cores, PSS %.1f MiB\n", mean(pauseCPU), mean(pausePSS))
	slices.Sort(execs)
	fmt.Printf("  a claim of a paused member: cont %v; the first exec after it %v (P50 of %d), against %v in a member that ran\n",
		slices.Max(conts).Round(100*time.Microsecond), execs[len(execs)/2].Round(time.Millisecond), len(execs), execRunning.Round(time.Millisecond))
}

// timeExec is how long an exec of /bin/hello tool-true takes in the VM's guest, through its
// session channel.
func timeExec(t *testing.T, w *world, name string) time.Duration {
	t.Helper()
	began := time.Now()
	if _, err := w.tryExec(name, "tool-true"); err != nil {
		t.Fatalf("exec in %s: %v", name, err)
	}
	return time.Since(began)
}

// cpuSeconds is the user and system time of process pid.
func cpuSeconds(t *testing.T, pid int) float64 {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	s := string(data)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:]) // after the command's name
	utime, _ := strconv.ParseFloat(fields[11], 64)
	stime, _ := strconv.ParseFloat(fields[12], 64)
	return (utime + stime) / 100 // USER_HZ
}

// pssMiB is process pid's proportional set size.
func pssMiB(t *testing.T, pid int) float64 {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "Pss:"); ok {
			kb, _ := strconv.ParseFloat(strings.Fields(rest)[0], 64)
			return kb / 1024
		}
	}
	t.Fatalf("no Pss in /proc/%d/smaps_rollup", pid)
	return 0
}
