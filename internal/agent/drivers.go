package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/kvm"
	"github.com/syscode-labs/imp/internal/agent/preflight"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
)

// Jail uids: each Firecracker VM of a node runs as its own uid (and gid) from this range.
const (
	defaultJailUIDBase = 300000
	jailUIDCount       = 65536
)

// probeVMMs lists the VMMs this node can run, best first: firecracker when KVM works and
// firecracker and its jailer run at a supported version; qemu always (KVM or TCG). Options.VMMs,
// when set, is taken as it is. Each says what one of its VMM processes holds beyond its guest.
func (a *Agent) probeVMMs(ctx context.Context) []impv1.VMMCapability {
	caps := a.findVMMs(ctx)
	for i := range caps {
		caps[i].MemoryOverhead = resource.NewQuantity(vmm.MemoryOverhead(string(caps[i].Kind), caps[i].Acceleration), resource.BinarySI)
	}
	return caps
}

func (a *Agent) findVMMs(ctx context.Context) []impv1.VMMCapability {
	qemuCap := impv1.VMMCapability{Kind: impv1.VMMQEMU, Acceleration: a.Opts.Accel, Version: qemuVersion()}
	if len(a.Opts.VMMs) > 0 {
		var caps []impv1.VMMCapability
		for _, k := range a.Opts.VMMs {
			if k == impv1.VMMFirecracker {
				caps = append(caps, impv1.VMMCapability{Kind: k, Acceleration: "kvm"})
			} else {
				caps = append(caps, qemuCap)
			}
		}
		return caps
	}
	caps := []impv1.VMMCapability{qemuCap}
	if kvm.Check(a.Opts.KVMDevice) != nil {
		return caps
	}
	v, err := preflight.FirecrackerVersion(ctx, a.Opts.Firecracker)
	if err != nil || !preflight.Supported(v) {
		return caps
	}
	if jv, err := preflight.FirecrackerVersion(ctx, a.Opts.Jailer); err != nil || jv != v {
		return caps
	}
	return append([]impv1.VMMCapability{{Kind: impv1.VMMFirecracker, Acceleration: "kvm", Version: v}}, caps...)
}

// chooseVMM picks the VMM of a VM: the one it asks for, else the node's best.
func (a *Agent) chooseVMM(vm *impv1.ImpVM) (impv1.VMMKind, error) {
	want := vm.Spec.VMM
	for _, c := range a.vmms {
		if want == "" || c.Kind == want {
			return c.Kind, nil
		}
	}
	return "", fmt.Errorf("the VM asks for VMM %s, which node %s does not offer", want, a.Opts.NodeName)
}

func (a *Agent) jailBase() string { return filepath.Join(a.Opts.StateDir, "jail") }

func (a *Agent) jailRoot(uid types.UID) string {
	return filepath.Join(firecracker.JailDir(a.jailBase(), a.Opts.Firecracker, string(uid)), "root")
}

// allocJailUID returns the jail uid recorded for the VM, or the lowest one no other VM of the
// node holds. Callers hold a.mu.
func (a *Agent) allocJailUID(uid types.UID) (int, error) {
	held := map[int]bool{}
	dirs, _ := filepath.Glob(filepath.Join(a.Opts.StateDir, "vms", "*"))
	for _, d := range dirs {
		if m, err := readMeta(d); err == nil && m.JailUID != 0 {
			if m.UID == uid {
				return m.JailUID, nil
			}
			held[m.JailUID] = true
		}
	}
	base := a.Opts.JailUIDBase
	if base == 0 {
		base = defaultJailUIDBase
	}
	for u := base; u < base+jailUIDCount; u++ {
		if !held[u] {
			return u, nil
		}
	}
	return 0, fmt.Errorf("all %d jail uids from %d are in use", jailUIDCount, base)
}

// removeJail removes a VM's Firecracker jail, if it has one.
func (a *Agent) removeJail(uid types.UID) error {
	if a.Opts.Firecracker == "" {
		return nil
	}
	return os.RemoveAll(firecracker.JailDir(a.jailBase(), a.Opts.Firecracker, string(uid)))
}
