package agent

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/agent/volume"
)

// sweeper runs Agent.sweep when the agent starts and every five minutes.
type sweeper struct{ a *Agent }

// NeedLeaderElection: every agent sweeps its own node.
func (sweeper) NeedLeaderElection() bool { return false }

func (s sweeper) Start(ctx context.Context) error {
	t := time.NewTicker(5 * time.Minute)
	defer t.Stop()
	for {
		if err := s.a.sweep(ctx); err != nil {
			ctrl.LoggerFrom(ctx).Error(err, "sweeping VMs no longer on this node")
		}
		if err := s.a.sweepSnapshots(ctx); err != nil {
			ctrl.LoggerFrom(ctx).Error(err, "sweeping snapshots no longer in the cluster")
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// reporter keeps the node's ImpNode report current: what the node offers VMs, which VMMs it
// runs, and the artifacts it boots them with.
type reporter struct{ a *Agent }

// NeedLeaderElection: every agent reports its own node.
func (reporter) NeedLeaderElection() bool { return false }

func (r reporter) Start(ctx context.Context) error {
	kernel := artifact(r.a.Opts.Kernel)
	initrd := artifact(r.a.Opts.Initramfs)
	vmms := r.a.vmms
	t := time.NewTicker(r.a.Opts.ReportInterval)
	defer t.Stop()
	collect := true
	for {
		if err := r.a.reportNode(ctx, vmms, kernel, initrd); err != nil {
			ctrl.LoggerFrom(ctx).Error(err, "reporting the node")
		}
		// Unused base disks on the interval only, not on every report a change asks for.
		if collect {
			if removed, err := r.a.collectImages(imageRetention); err != nil {
				ctrl.LoggerFrom(ctx).Error(err, "collecting unused base disks")
			} else if len(removed) > 0 {
				ctrl.LoggerFrom(ctx).Info("removed unused base disks", "disks", removed)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			collect = true
		case <-r.a.reportNow:
			collect = false
		}
	}
}

func (a *Agent) reportNode(ctx context.Context, vmms []impv1.VMMCapability, kernel, initrd *impv1.Artifact) error {
	// The report is garbage-collected with its Node: it names the Node as its owner.
	var n corev1.Node
	if err := a.APIReader.Get(ctx, types.NamespacedName{Name: a.Opts.NodeName}, &n); err != nil {
		return fmt.Errorf("reading Node %s: %w", a.Opts.NodeName, err)
	}
	owner := metav1.OwnerReference{APIVersion: "v1", Kind: "Node", Name: n.Name, UID: n.UID}
	node := &impv1.ImpNode{}
	err := a.Client.Get(ctx, types.NamespacedName{Name: a.Opts.NodeName}, node)
	switch {
	case apierrors.IsNotFound(err):
		node = &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: a.Opts.NodeName, OwnerReferences: []metav1.OwnerReference{owner}}}
		if err := a.Client.Create(ctx, node); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("creating ImpNode %s: %w", a.Opts.NodeName, err)
		}
	case err != nil:
		return fmt.Errorf("reading ImpNode %s: %w", a.Opts.NodeName, err)
	case !slices.ContainsFunc(node.OwnerReferences, func(o metav1.OwnerReference) bool { return o.UID == n.UID }):
		// Made without its owner (by an agent whose reads of Nodes were refused), or its Node
		// was made again under the same name.
		orig := node.DeepCopy()
		node.OwnerReferences = []metav1.OwnerReference{owner}
		if err := a.Client.Patch(ctx, node, client.MergeFrom(orig)); err != nil {
			return fmt.Errorf("setting the owner of ImpNode %s: %w", a.Opts.NodeName, err)
		}
	}
	orig := node.DeepCopy()
	cpus := int32(runtime.NumCPU())
	mem := memTotal()
	now := metav1.Now()
	node.Status.Capacity = &impv1.NodeResources{VCPUs: cpus, Memory: *resource.NewQuantity(mem, resource.BinarySI)}
	node.Status.Allocatable = &impv1.NodeResources{
		VCPUs:  int32(float64(max(cpus-a.Opts.ReserveVCPUs, 0)) * max(a.Opts.VCPUOvercommit, 1)),
		Memory: *resource.NewQuantity(max(mem-a.Opts.ReserveMemory-a.memoryCacheBytes(), 0), resource.BinarySI),
	}
	// Disk: the file system of the state directory, where the VMs' writable disks and
	// suspended memory live. Placement sums the VMs' diskSize (and suspended memory) against
	// allocatable: what is free plus what those files already take, less the reserve. What
	// else fills the file system (base disks, builds, logs, the node's own files) is not
	// offered, so placement never counts on space that something else took.
	var fs unix.Statfs_t
	if err := unix.Statfs(a.Opts.StateDir, &fs); err == nil {
		total := int64(fs.Blocks) * fs.Bsize
		free := int64(fs.Bavail) * fs.Bsize
		node.Status.Capacity.Disk = resource.NewQuantity(total, resource.BinarySI)
		offered := min(total, free+a.vmBytes()) - a.Opts.ReserveDisk
		node.Status.Allocatable.Disk = resource.NewQuantity(max(offered, 0)&^(reportGranule-1), resource.BinarySI)
	}
	if u, err := a.images.Usage(); err == nil {
		node.Status.Images = &impv1.NodeImages{Disks: int32(u.Disks), Builds: int32(u.Builds),
			Bytes: *resource.NewQuantity(u.DiskBytes&^(1<<20-1), resource.BinarySI)}
	}
	node.Status.VMMs = vmms
	node.Status.Kernel, node.Status.Initramfs = kernel, initrd
	node.Status.OverlayAddress = ""
	if a.Opts.OverlayAddress.IsValid() {
		node.Status.OverlayAddress = a.Opts.OverlayAddress.String()
	}
	node.Status.Networks = a.networks.report()
	apimeta.SetStatusCondition(&node.Status.Conditions, metav1.Condition{Type: impv1.ReadyCondition, Status: metav1.ConditionTrue,
		Reason: impv1.ReasonAgentReady, Message: fmt.Sprintf("qemu (%s) available", a.Opts.Accel)})
	// Written only when it changed: every agent watches ImpNodes, so a write reaches every
	// node. The heartbeat is the agent's Lease; heartbeatTime says when the report was written.
	if equality.Semantic.DeepEqual(orig.Status, node.Status) {
		return nil
	}
	node.Status.HeartbeatTime = &now
	if err := a.Client.Status().Patch(ctx, node, client.MergeFrom(orig)); err != nil {
		return fmt.Errorf("reporting ImpNode %s: %w", a.Opts.NodeName, err)
	}
	return nil
}

// reportGranule rounds the allocatable disk down: free space moves with every write, and a
// report is written (and reaches every agent's watch) only when it changes.
const reportGranule = 256 << 20

// vmBytes is what the files that placement counts take on the state file system: each VM's
// writable disk and saved memory (QEMU's state file, Firecracker's snapshot in its jail). Only
// those are looked at, without following a link (a jail belongs to its VMM, which may have
// planted any), on the state file system alone, a file linked twice counted once: nothing a VMM
// makes can add the base disks it shares, or the host's files, to what the node offers.
func (a *Agent) vmBytes() int64 {
	var stateFS unix.Stat_t
	if unix.Stat(a.Opts.StateDir, &stateFS) != nil {
		return 0
	}
	type fileID struct{ dev, ino uint64 }
	seen := map[fileID]bool{}
	var n int64
	count := func(fi os.FileInfo) {
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok || !fi.Mode().IsRegular() || st.Dev != stateFS.Dev || seen[fileID{st.Dev, st.Ino}] {
			return
		}
		seen[fileID{st.Dev, st.Ino}] = true
		n += st.Blocks * 512
	}
	dirs, _ := filepath.Glob(filepath.Join(a.Opts.StateDir, "vms", "*"))
	for _, dir := range dirs {
		files := []string{vmrun.WritableDisk, qemu.StateFile}
		vols, _ := filepath.Glob(filepath.Join(dir, volume.DiskFile("*"))) // disk volumes, counted as placement counts them
		for _, v := range vols {
			files = append(files, filepath.Base(v))
		}
		for _, f := range files {
			if fi, err := os.Lstat(filepath.Join(dir, f)); err == nil {
				count(fi)
			}
		}
		if a.Opts.Firecracker == "" {
			continue
		}
		root, err := os.OpenRoot(a.jailRoot(types.UID(filepath.Base(dir))))
		if err != nil {
			continue
		}
		for _, f := range firecracker.SnapshotFiles {
			if fi, err := root.Lstat(f); err == nil {
				count(fi)
			}
		}
		root.Close()
	}
	return n
}

func artifact(path string) *impv1.Artifact {
	f, err := os.Open(path)
	if err != nil {
		return &impv1.Artifact{Path: path}
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return &impv1.Artifact{Path: path}
	}
	return &impv1.Artifact{Path: path, SHA256: hex.EncodeToString(h.Sum(nil))}
}

func memTotal() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}

func qemuVersion() string {
	out, err := exec.Command("qemu-system-x86_64", "--version").Output()
	if err != nil {
		return ""
	}
	first, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimPrefix(first, "QEMU emulator version ")
}

// imageRetention is how long an unused base disk is kept, for a VM that comes back soon.
const imageRetention = 10 * time.Minute

// collectImages removes the base disks no VM of this node uses and none uses within minAge.
// A VM being started holds a lease on its disk (BaseStore.Ensure) until its meta records the
// digest; the metas are read under the lock leases take, so no start falls between the two.
func (a *Agent) collectImages(minAge time.Duration) ([]string, error) {
	return a.images.GC(func() map[string]bool {
		keep := map[string]bool{}
		dirs, _ := filepath.Glob(filepath.Join(a.Opts.StateDir, "vms", "*"))
		for _, d := range dirs {
			if m, err := readMeta(d); err == nil && m.Digest != "" {
				keep[m.Digest] = true
			}
		}
		disks, _ := filepath.Glob(filepath.Join(a.Opts.StateDir, "images", "sha256-*.ext4"))
		for _, p := range disks {
			if fi, err := os.Stat(p); err == nil && time.Since(fi.ModTime()) < minAge {
				keep[strings.Replace(strings.TrimSuffix(filepath.Base(p), ".ext4"), "-", ":", 1)] = true
			}
		}
		return keep
	})
}
