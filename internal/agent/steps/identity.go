package steps

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"time"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/tracing"
)

// Identities decide who the VM's VMM is.
type Identities interface {
	// ChooseVMM is the VMM kind the VM runs under on this node.
	ChooseVMM(vm *impv1.ImpVM) (impv1.VMMKind, error)
	// Record gives m the VM's uid (either VMM runs as it) and writes m into dir, at once, so
	// that no other VM is given the same uid.
	Record(dir string, m *vmrun.Meta) error
}

// Identity records the run on the node (meta.json): its instance and run, the image digest its
// base disk came from, its VMM, the uid the VMM runs as, and the guest channel's token, kept
// across the VM's runs. From then on, base-disk collection sees the digest in use.
type Identity struct{ IDs Identities }

func (Identity) Name() string { return "identity" }

func (Identity) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) { return r.Meta == nil, nil }

func (s Identity) Do(_ context.Context, r *vmrun.Run) error {
	vm := r.VM
	chosen := vm
	if r.Incoming && r.Old != nil && r.Old.VMM != "" {
		v := *vm // a migration's run: under its source's VMM, whatever this node's best
		v.Spec.VMM = r.Old.VMM
		chosen = &v
	}
	kind, err := s.IDs.ChooseVMM(chosen)
	if err != nil {
		return plan.Fail("VMMUnavailable", err)
	}
	m := &vmrun.Meta{Namespace: vm.Namespace, Name: vm.Name, UID: vm.UID, Instance: vm.Status.Instance, Run: vm.Status.RestartCount,
		Started: time.Now(), Digest: r.Image.Digest.DigestStr(), VMM: kind, Session: true,
		Readiness: vm.Spec.ReadinessProbe != nil,
		Trace:     tracing.Trace(vm)}
	if snap := r.Snapshot; snap != nil {
		// The guest holds the snapshot's token, and its devices, until it takes on its own.
		m.Session = snap.Manifest.Session
		m.Restore = &vmrun.Restored{Snapshot: snap.Name, SnapshotUID: snap.Manifest.UID, Token: snap.Manifest.Token}
	}
	if host := vm.HostUID(); host != vm.UID {
		m.Host = host // a claim served warm, run again: its runs stay under its member's UID
	}
	if r.Old != nil && r.Old.Instance == m.Instance {
		m.Endpoint = r.Old.Endpoint // kept across the placement's runs
	}
	if r.Incoming && r.Old != nil {
		m.Migration = r.Old.Migration // the run a migration brings: its guest waits for the commit
	}
	if r.Old != nil && r.Old.Token != "" {
		m.Token = r.Old.Token
	} else {
		m.Token = randomToken()
	}
	if err := s.IDs.Record(r.Dir, m); err != nil {
		return err
	}
	r.Meta = m
	return nil
}

func randomToken() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
