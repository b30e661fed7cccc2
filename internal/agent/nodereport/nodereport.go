// Package nodereport keeps the node's ImpNode report current (what the node offers VMs, which
// VMMs it runs, the artifacts it boots them with, its networks, its overlay address), collects
// the base disks no VM uses, and renews the agent's heartbeat Lease.
package nodereport

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
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
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/agent/volume"
)

// Reporter keeps the node's ImpNode report current: what the node offers VMs, which VMMs it
// runs, and the artifacts it boots them with. It is a manager's Runnable.
type Reporter struct {
	Client    client.Client
	APIReader client.Reader // uncached: the Node
	NodeName  string
	// StateDir is the agent's state directory: its file system holds the VMs' disks.
	StateDir string
	// What is kept for the host, and the vCPU overcommit (agent.Options).
	ReserveVCPUs   int32
	ReserveMemory  int64
	ReserveDisk    int64
	VCPUOvercommit float64
	// Held is memory the node holds for itself beyond ReserveMemory (the snapshot memory cache).
	Held int64
	// Accel is QEMU's accelerator, said in the Ready condition.
	Accel string
	// Kernel and Initramfs are reported with their hashes.
	Kernel, Initramfs string
	OverlayAddress    netip.Addr
	// MigrationEndpoint is where the node's agent takes migrations ("": none).
	MigrationEndpoint string
	VMMs              []impv1.VMMCapability
	// Interval is how often the report is refreshed and written if it changed (and unused base
	// disks collected).
	Interval time.Duration
	Images   *disk.BaseStore
	Networks Networks
	// Features are what the agent does that an older agent did not (ImpNode status.features).
	Features []string
	// JailRoot is the root of a VM's Firecracker jail; nil on a node without Firecracker.
	JailRoot func(uid types.UID) string

	once sync.Once
	now  chan struct{} // Soon's

	// written is the report last written (without its heartbeatTime), over the ImpNode of
	// resourceVersion over: a cache that still shows that version has not seen the write, and
	// is compared with it rather than written again. Only the report's loop touches them.
	written *impv1.ImpNodeStatus
	over    string
}

// Networks report the networks plumbed on the node.
type Networks interface {
	Report() []impv1.NodeNetwork
}

// Soon asks for a report now rather than at the next tick.
func (r *Reporter) Soon() {
	select {
	case r.nowChan() <- struct{}{}:
	default:
	}
}

func (r *Reporter) nowChan() chan struct{} {
	r.once.Do(func() { r.now = make(chan struct{}, 1) })
	return r.now
}

// NeedLeaderElection: every agent reports its own node.
func (*Reporter) NeedLeaderElection() bool { return false }

// Start reports until ctx ends.
func (r *Reporter) Start(ctx context.Context) error {
	kernel := artifact(r.Kernel)
	initrd := artifact(r.Initramfs)
	now := r.nowChan()
	t := time.NewTicker(r.Interval)
	defer t.Stop()
	collect := true
	for {
		if err := r.report(ctx, kernel, initrd); err != nil {
			ctrl.LoggerFrom(ctx).Error(err, "reporting the node")
		}
		// Unused base disks on the interval only, not on every report a change asks for.
		if collect {
			if removed, err := r.collectImages(imageRetention); err != nil {
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
		case <-now:
			collect = false
		}
	}
}

func (r *Reporter) report(ctx context.Context, kernel, initrd *impv1.Artifact) error {
	// The report is garbage-collected with its Node: it names the Node as its owner.
	var n corev1.Node
	if err := r.APIReader.Get(ctx, types.NamespacedName{Name: r.NodeName}, &n); err != nil {
		return fmt.Errorf("reading Node %s: %w", r.NodeName, err)
	}
	owner := metav1.OwnerReference{APIVersion: "v1", Kind: "Node", Name: n.Name, UID: n.UID}
	node := &impv1.ImpNode{}
	err := r.Client.Get(ctx, types.NamespacedName{Name: r.NodeName}, node)
	switch {
	case apierrors.IsNotFound(err):
		node = &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: r.NodeName, OwnerReferences: []metav1.OwnerReference{owner}}}
		if err := r.Client.Create(ctx, node); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("creating ImpNode %s: %w", r.NodeName, err)
		}
	case err != nil:
		return fmt.Errorf("reading ImpNode %s: %w", r.NodeName, err)
	case !slices.ContainsFunc(node.OwnerReferences, func(o metav1.OwnerReference) bool { return o.UID == n.UID }):
		// Made without its owner (by an agent whose reads of Nodes were refused), or its Node
		// was made again under the same name.
		orig := node.DeepCopy()
		node.OwnerReferences = []metav1.OwnerReference{owner}
		if err := r.Client.Patch(ctx, node, client.MergeFrom(orig)); err != nil {
			return fmt.Errorf("setting the owner of ImpNode %s: %w", r.NodeName, err)
		}
	}
	orig := node.DeepCopy()
	cpus := int32(runtime.NumCPU())
	mem := memTotal()
	now := metav1.Now()
	node.Status.Capacity = &impv1.NodeResources{VCPUs: cpus, Memory: *resource.NewQuantity(mem, resource.BinarySI)}
	node.Status.Allocatable = &impv1.NodeResources{
		VCPUs:  int32(float64(max(cpus-r.ReserveVCPUs, 0)) * max(r.VCPUOvercommit, 1)),
		Memory: *resource.NewQuantity(max(mem-r.ReserveMemory-r.Held, 0), resource.BinarySI),
	}
	// Disk: the file system of the state directory, where the VMs' writable disks and
	// suspended memory live. Placement sums the VMs' diskSize (and suspended memory) against
	// allocatable: what is free plus what those files already take, less the reserve. What
	// else fills the file system (base disks, builds, logs, the node's own files) is not
	// offered, so placement never counts on space that something else took.
	var fs unix.Statfs_t
	if err := unix.Statfs(r.StateDir, &fs); err == nil {
		total := int64(fs.Blocks) * fs.Bsize
		free := int64(fs.Bavail) * fs.Bsize
		node.Status.Capacity.Disk = resource.NewQuantity(total, resource.BinarySI)
		offered := min(total, free+r.vmBytes()) - r.ReserveDisk
		node.Status.Allocatable.Disk = resource.NewQuantity(max(offered, 0)&^(reportGranule-1), resource.BinarySI)
	}
	if u, err := r.Images.Usage(); err == nil {
		node.Status.Images = &impv1.NodeImages{Disks: int32(u.Disks), Builds: int32(u.Builds),
			Bytes: *resource.NewQuantity(u.DiskBytes&^(1<<20-1), resource.BinarySI)}
	}
	node.Status.VMMs = r.VMMs
	node.Status.Features = r.Features
	node.Status.Kernel, node.Status.Initramfs = kernel, initrd
	node.Status.OverlayAddress, node.Status.MigrationEndpoint = "", r.MigrationEndpoint
	if r.OverlayAddress.IsValid() {
		node.Status.OverlayAddress = r.OverlayAddress.String()
	}
	node.Status.Networks = r.Networks.Report()
	apimeta.SetStatusCondition(&node.Status.Conditions, metav1.Condition{Type: impv1.ReadyCondition, Status: metav1.ConditionTrue,
		Reason: impv1.ReasonAgentReady, Message: fmt.Sprintf("qemu (%s) available", r.Accel)})
	// Written only when it changed: every agent watches ImpNodes, so a write reaches every
	// node. The heartbeat is the agent's Lease; heartbeatTime says when the report was written.
	seen := orig.Status
	if r.written != nil && orig.ResourceVersion == r.over {
		seen = *r.written // the cache is behind this reporter's last write
		seen.HeartbeatTime = node.Status.HeartbeatTime
	}
	if equality.Semantic.DeepEqual(seen, node.Status) {
		return nil
	}
	over := orig.ResourceVersion
	node.Status.HeartbeatTime = &now
	if err := r.Client.Status().Patch(ctx, node, client.MergeFrom(orig)); err != nil {
		return fmt.Errorf("reporting ImpNode %s: %w", r.NodeName, err)
	}
	r.written, r.over = node.Status.DeepCopy(), over
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
func (r *Reporter) vmBytes() int64 {
	var stateFS unix.Stat_t
	if unix.Stat(r.StateDir, &stateFS) != nil {
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
	dirs, _ := filepath.Glob(filepath.Join(r.StateDir, "vms", "*"))
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
		if r.JailRoot == nil {
			continue
		}
		root, err := os.OpenRoot(r.JailRoot(types.UID(filepath.Base(dir))))
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

// imageRetention is how long an unused base disk is kept, for a VM that comes back soon.
const imageRetention = 10 * time.Minute

// collectImages removes the base disks no VM of this node uses and none uses within minAge.
// A VM being started holds a lease on its disk (BaseStore.Ensure) until its meta records the
// digest; the metas are read under the lock leases take, so no start falls between the two.
func (r *Reporter) collectImages(minAge time.Duration) ([]string, error) {
	return r.Images.GC(func() map[string]bool {
		keep := map[string]bool{}
		dirs, _ := filepath.Glob(filepath.Join(r.StateDir, "vms", "*"))
		for _, d := range dirs {
			if m, err := vmrun.ReadMeta(d); err == nil && m.Digest != "" {
				keep[m.Digest] = true
			}
		}
		disks, _ := filepath.Glob(filepath.Join(r.StateDir, "images", "sha256-*.ext4"))
		for _, p := range disks {
			if fi, err := os.Stat(p); err == nil && time.Since(fi.ModTime()) < minAge {
				keep[strings.Replace(strings.TrimSuffix(filepath.Base(p), ".ext4"), "-", ":", 1)] = true
			}
		}
		return keep
	})
}
