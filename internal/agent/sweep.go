package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/handover"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
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
		if err := s.a.snapshots.Sweep(ctx); err != nil {
			ctrl.LoggerFrom(ctx).Error(err, "sweeping snapshots no longer in the cluster")
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// keeps says whether the run recorded in dir (meta m) is vm's, on node: the VM the meta
// names, the same UID, placed here, and keeping its run under that directory (a claim served
// warm keeps it under its member's UID; re-placed, it keeps it there no more).
func keeps(vm *impv1.ImpVM, node, dir string, m *vmrun.Meta) bool {
	if mg := vm.Status.Migration; mg != nil && m.Migration != "" && mg.UID == m.Migration && mg.TargetNode == node && vm.UID == m.UID {
		return true // the place of a migration to this node, under way: the VM is still its source's
	}
	return vm.UID == m.UID && vm.Status.NodeName == node && string(vm.HostUID()) == filepath.Base(dir)
}

// removeLeftovers removes the local VM that a request named when the API server says it is
// gone (vm empty) or placed elsewhere.
func (a *Agent) removeLeftovers(ctx context.Context, key types.NamespacedName, vm *impv1.ImpVM) error {
	dirs, _ := filepath.Glob(filepath.Join(a.Opts.StateDir, "vms", "*"))
	for _, dir := range dirs {
		m, err := vmrun.ReadMeta(dir)
		if err != nil || m.Namespace != key.Namespace || m.Name != key.Name {
			continue
		}
		if handover.Owner(dir, m) != m.UID {
			continue // a member's run being handed to its claim: the claim's
		}
		if keeps(vm, a.Opts.NodeName, dir, m) {
			continue
		}
		if err := a.removeLocal(ctx, dir, m); err != nil {
			return err
		}
	}
	return nil
}

// sweep checks every VM recorded on this node against the API server and removes those it says
// are gone (by UID) or placed on another node. Watches cannot report a VM that disappeared
// while the agent was down; this does, at start and then periodically.
func (a *Agent) sweep(ctx context.Context) error {
	dirs, _ := filepath.Glob(filepath.Join(a.Opts.StateDir, "vms", "*"))
	var hosts map[types.UID]types.UID // the node's VMs' host UIDs, by UID, listed when needed
	for _, dir := range dirs {
		if claim, ok := handover.Claimant(dir); ok {
			// A run handed (or being handed) to a claim is the claim's while the claim keeps
			// it there, whatever its record still says.
			if hosts == nil {
				var list impv1.ImpVMList
				if err := a.APIReader.List(ctx, &list, client.MatchingFields{"status.nodeName": a.Opts.NodeName}); err != nil {
					return fmt.Errorf("listing the node's VMs: %w", err)
				}
				hosts = make(map[types.UID]types.UID, len(list.Items))
				for i := range list.Items {
					hosts[list.Items[i].UID] = list.Items[i].HostUID()
				}
			}
			if hosts[claim] == types.UID(filepath.Base(dir)) {
				continue
			}
			m, _ := vmrun.ReadMeta(dir)
			if m == nil {
				m = &vmrun.Meta{}
			}
			if err := a.removeLocal(ctx, dir, m); err != nil {
				return err
			}
			continue
		}
		m, err := vmrun.ReadMeta(dir)
		if err != nil {
			if err := a.recoverState(ctx, dir, err); err != nil {
				return err
			}
			continue
		}
		vm := &impv1.ImpVM{}
		err = a.APIReader.Get(ctx, types.NamespacedName{Namespace: m.Namespace, Name: m.Name}, vm)
		switch {
		case err != nil && !apierrors.IsNotFound(err):
			return fmt.Errorf("looking up VM %s/%s: %w", m.Namespace, m.Name, err)
		case err == nil && keeps(vm, a.Opts.NodeName, dir, m):
			continue
		}
		if err := a.removeLocal(ctx, dir, m); err != nil {
			return err
		}
	}
	// Taps of VMs without a state directory, and networks left without taps.
	return a.net.Prune(func(uid string) bool {
		_, err := os.Stat(a.vmDir(types.UID(uid)))
		return err == nil
	})
}

// recoverState deals with a VM directory whose meta cannot be read (a crash while it was first
// written, a damaged disk): the directory is named by the VM's UID, which the API server is
// asked about. A VM of this node with that UID keeps its writable disk and console; its VMM is
// stopped and what described it removed, so that the VM's runStrategy starts it afresh, and an
// Event says so. Anything else is removed whole.
func (a *Agent) recoverState(ctx context.Context, dir string, cause error) error {
	uid := types.UID(filepath.Base(dir))
	var list impv1.ImpVMList
	if err := a.APIReader.List(ctx, &list, client.MatchingFields{"status.nodeName": a.Opts.NodeName}); err != nil {
		return fmt.Errorf("looking up the VM of %s: %w", dir, err)
	}
	var vm *impv1.ImpVM
	for i := range list.Items {
		if list.Items[i].HostUID() == uid {
			vm = &list.Items[i]
		}
	}
	log := ctrl.LoggerFrom(ctx).WithValues("dir", dir, "cause", cause.Error())
	if vm == nil {
		if err := a.teardownPlan().Run(ctx, &vmrun.Teardown{UID: uid, Dir: dir, Name: dir}); err != nil {
			return err
		}
		log.Info("removed the unreadable state of a VM that is not on this node")
		return nil
	}
	if rec, err := vmm.ReadRecord(dir); err == nil && rec.Alive() {
		_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
		rec.WaitGone(5 * time.Second)
	}
	vmm.KillMarkedIn(string(uid), dir, 5*time.Second)
	a.Runs.Stop(uid)
	for _, f := range []string{"meta.json", vmm.RecordFile, vmm.IntentFile, vmrun.ConfigDisk, qemu.StateFile} {
		if err := os.Remove(filepath.Join(dir, f)); err != nil && !os.IsNotExist(err) {
			return fmt.Errorf("removing %s of %s: %w", f, dir, err)
		}
	}
	a.endRun(uid)
	a.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "StateRecovered", "Recover",
		"The node's record of the VM was unreadable (%v); its VMM was stopped and it starts again with its writable disk", cause)
	log.Info("recovered a VM whose state was unreadable", "vm", vm.Namespace+"/"+vm.Name)
	// Its current run ended here: the operator's runStrategy decides about the next.
	st := vm.Status
	if rt := st.Runtime; rt != nil && rt.Instance == st.Instance && rt.Run == st.RestartCount {
		switch rt.State {
		case impv1.RuntimeExited, impv1.RuntimeStopped, impv1.RuntimeGone:
			return nil
		}
		ended := *rt
		now := metav1.Now()
		ended.State, ended.FinishedAt, ended.GuestReady, ended.ExitCode = impv1.RuntimeExited, &now, false, nil
		ended.Reason, ended.Message = "StateRecovered", "the node's record of the VM was unreadable; its VMM was stopped"
		return a.reports.Report(ctx, vm, ended)
	}
	return nil
}

// removeLocal kills a local VM's VMM and removes its monitor, cgroups and state.
func (a *Agent) removeLocal(ctx context.Context, dir string, m *vmrun.Meta) error {
	// The directory's name is the UID its run is kept under, whatever its record says.
	t := &vmrun.Teardown{UID: types.UID(filepath.Base(dir)), Dir: dir, Name: m.Namespace + "/" + m.Name}
	// The VM is not this node's: the end of its VMM here is not its run's (it may run on
	// elsewhere, moved by a migration), and its monitor does not report it.
	a.Runs.Stop(t.UID)
	if err := a.teardownPlan().Run(ctx, t); err != nil {
		return err
	}
	ctrl.LoggerFrom(ctx).Info("removed a VM that is no longer on this node", "vm", t.Name, "uid", m.UID)
	return nil
}
