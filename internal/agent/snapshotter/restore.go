package snapshotter

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/log"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/guestchan"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/snapshot"
	"github.com/syscode-labs/imp/internal/agent/steps"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/guestinit"
)

// Find finds a restore's snapshot: the ImpVMSnapshot as the API server has it now, and its
// files on this node (pulled first when another node's).
func (s *Snapshotter) Find(ctx context.Context, vm *impv1.ImpVM) (*vmrun.Snapshot, error) {
	name := vm.RestoreFrom()
	snap := &impv1.ImpVMSnapshot{}
	if err := s.APIReader.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: name}, snap); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, plan.Fail(impv1.ReasonSnapshotNotFound, fmt.Errorf("ImpVMSnapshot %q does not exist in namespace %s", name, vm.Namespace))
		}
		return nil, plan.Retry(err)
	}
	switch {
	case snap.Status.Source == nil && snap.Status.Phase == impv1.SnapshotReady:
		return nil, plan.Fail(impv1.ReasonSnapshotNotReady, fmt.Errorf("ImpVMSnapshot %s says nothing of what it was taken of", name))
	case !snap.DeletionTimestamp.IsZero():
		return nil, plan.Fail(impv1.ReasonSnapshotNotFound, fmt.Errorf("ImpVMSnapshot %s is being deleted", name))
	case snap.Status.Phase != impv1.SnapshotReady:
		return nil, plan.Fail(impv1.ReasonSnapshotNotReady, fmt.Errorf("ImpVMSnapshot %s is not Ready", name))
	case snap.Status.NodeName != s.NodeName && (snap.Spec.Registry == nil || snap.Status.Digest == ""):
		return nil, plan.Fail(impv1.ReasonSnapshotIncompatible, fmt.Errorf("ImpVMSnapshot %s is on node %s, not %s, and not pushed to a registry", name, snap.Status.NodeName, s.NodeName))
	case snap.Status.NodeName != s.NodeName:
		// Another node's, pushed: pulled into this node's store first.
		if err := s.pulled(vm, snap); err != nil {
			if errors.Is(err, plan.ErrWait) {
				return nil, err
			}
			return nil, plan.Fail(impv1.ReasonRestoreFailed, err)
		}
	}
	m, err := s.Store.Read(snap.UID)
	if err != nil {
		return nil, plan.Fail(impv1.ReasonSnapshotNotFound, fmt.Errorf("ImpVMSnapshot %s has no files on node %s: %w", name, s.NodeName, err))
	}
	// The files say whose they are: never another namespace's memory, whatever the API says.
	if m.Namespace != vm.Namespace || m.Name != snap.Name {
		return nil, plan.Fail(impv1.ReasonSnapshotNotFound, fmt.Errorf("the files of ImpVMSnapshot %s on node %s are of %s/%s, not of namespace %s", name, s.NodeName, m.Namespace, m.Name, vm.Namespace))
	}
	if err := s.fits(vm, m); err != nil {
		return nil, plan.Fail(impv1.ReasonSnapshotIncompatible, fmt.Errorf("ImpVMSnapshot %s: %w", name, err))
	}
	base := s.Store.File(snap.UID, snapshot.BaseFile)
	if _, err := os.Stat(base); err != nil {
		// Its memory knows a base disk it did not keep: no node's disk of the image stands in.
		return nil, plan.Fail(impv1.ReasonSnapshotIncompatible, fmt.Errorf("ImpVMSnapshot %s has no base disk on node %s (taken by an older agent: take it again): %w", name, s.NodeName, err))
	}
	return &vmrun.Snapshot{Name: name, Manifest: m, Dir: s.Store.Path(snap.UID), Disk: s.Store.File(snap.UID, snapshot.DiskFile), Base: base}, nil
}

// fits says why the snapshot m cannot run as vm on this node, or nil: its host (VMM, version,
// acceleration, kernel, initramfs, CPU), its resources and its devices must be the VM's.
func (s *Snapshotter) fits(vm *impv1.ImpVM, m *snapshot.Manifest) error {
	kind, err := s.Drivers.ChooseVMM(vm)
	if err != nil {
		return err
	}
	host, err := s.host(kind)
	if err != nil {
		return err
	}
	if err := m.Compatible(host); err != nil {
		return err
	}
	res := vm.Status.Resources
	switch {
	case res == nil:
		return fmt.Errorf("the VM has no resources recorded by its placement")
	case res.VCPUs != m.VCPUs || res.Memory.Value()>>20 != m.MemoryMiB:
		return fmt.Errorf("it was taken of a VM with %d vCPUs and %d MiB; this VM has %d and %d MiB", m.VCPUs, m.MemoryMiB, res.VCPUs, res.Memory.Value()>>20)
	case m.DiskBytes != 0 && res.DiskSize.Value() != m.DiskBytes:
		return fmt.Errorf("it was taken of a VM with a disk of %d bytes; this VM's is %d", m.DiskBytes, res.DiskSize.Value())
	case (vm.Spec.NetworkRef != nil) != m.Network:
		return fmt.Errorf("the network interface of its VM and this VM's differ (one has none)")
	}
	return nil
}

// host is what a snapshot taken under kind on this node depends on.
func (s *Snapshotter) host(kind impv1.VMMKind) (snapshot.Host, error) {
	h := snapshot.Host{VMM: kind}
	for _, c := range s.Drivers.Capabilities() {
		if c.Kind == kind {
			h.VMMVersion, h.Accel = c.Version, c.Acceleration
		}
	}
	var err error
	if h.Kernel, err = s.hashes.Of(s.Kernel); err != nil {
		return h, fmt.Errorf("hashing the guest kernel: %w", err)
	}
	if h.Initramfs, err = s.hashes.Of(s.Initramfs); err != nil {
		return h, fmt.Errorf("hashing the initramfs: %w", err)
	}
	cpuinfo, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return h, err
	}
	h.CPU = snapshot.CPU(string(cpuinfo))
	return h, nil
}

// restoreTimeout bounds a restored guest's taking on its identity; each connection to its
// channel is given restoreAttempt of it. A guest that has not answered on one connection is
// asked again on a new one: a new connection is told the guest's history (its hello with the
// new token, once it took the identity on), and a request that never reached the guest (a
// connection that was not the channel's current one) is sent again. Observed: a warm member
// handed to a claim, one handover in three on a loaded machine, never answered on the first
// connection, while the fallback's restore answered within a second.
const (
	restoreTimeout = 30 * time.Second
	restoreAttempt = 10 * time.Second
)

// Reidentify gives a restored guest its identity over its guest channel.
func (s *Snapshotter) Reidentify(ctx context.Context, r *vmrun.Run) error {
	req := guestinit.Restore{Token: r.Meta.Token, Entropy: make([]byte, 64)}
	if _, err := rand.Read(req.Entropy); err != nil {
		return err
	}
	if r.Net != nil {
		req.Net = r.Net.Params()
	}
	// The run's configuration as the config_disk step made it: the guest need not read its
	// disk (block I/O of cold code under TCG). A restore finished after an agent restart has
	// none, and the guest reads the disk: the agent never reads back that file, which a
	// Firecracker VMM, whose jail holds it, may write.
	req.Config = r.Config
	deadline := time.Now().Add(restoreTimeout)
	for attempt := 1; ; attempt++ {
		err := s.reidentifyOnce(ctx, r, req, min(restoreAttempt, time.Until(deadline)))
		if err == nil || !errors.Is(err, guestchan.ErrRestoreTimeout) || time.Until(deadline) <= 0 || ctx.Err() != nil {
			return err
		}
		log.FromContext(ctx).Info("the restored guest did not answer on its channel: asking again on a new connection", "attempt", attempt)
	}
}

// reidentifyOnce asks the guest on one new connection to its channel, waiting up to timeout.
func (s *Snapshotter) reidentifyOnce(ctx context.Context, r *vmrun.Run, req guestinit.Restore, timeout time.Duration) error {
	conn, err := s.Drivers.For(string(r.Meta.VMM)).Dial(r.Dir)
	if err != nil {
		return fmt.Errorf("connecting to the restored guest's channel: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	// Kept open, once the guest answered on it, for the run's monitor (vmrun.Run.Channel).
	kept := false
	defer func() {
		if !kept {
			conn.Close()
		}
	}()
	req.UnixNano = time.Now().UnixNano() // the clock as it is at this ask
	answered, err := guestchan.Restore(conn, r.Meta.Restore.Token, req, timeout)
	if err != nil {
		return err
	}
	if stop() && conn.SetDeadline(time.Time{}) == nil {
		r.Channel, kept = answered, true
	}
	return nil
}

var (
	_ steps.Snapshots = (*Snapshotter)(nil)
	_ steps.Guests    = (*Snapshotter)(nil)
)
