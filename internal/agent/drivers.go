package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/kvm"
	"github.com/syscode-labs/imp/internal/agent/preflight"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/guestinit"
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

// firecrackerSpec is the VM as the Firecracker driver runs it.
func (a *Agent) firecrackerSpec(vm *impv1.ImpVM, dir string, m *meta, base string, at hostnet.Attachment, gnet *guestinit.Net) firecracker.Spec {
	res := vm.Status.Resources
	s := firecracker.Spec{ID: string(vm.UID), Dir: dir, Firecracker: a.Opts.Firecracker, Jailer: a.Opts.Jailer,
		UID: m.JailUID, GID: m.JailUID, ChrootBase: a.jailBase(), NetNS: a.Opts.NetNS, CgroupVersion: cgroup.Version(a.Opts.CgroupRoot),
		Kernel: a.Opts.Kernel, Initramfs: a.Opts.Initramfs, BaseDisk: base, WritableDisk: filepath.Join(dir, "rw.ext4"), ConfigDisk: filepath.Join(dir, configDisk),
		VCPUs: int(res.VCPUs), MemoryMiB: res.Memory.Value() >> 20, Token: m.Token}
	if gnet != nil {
		// The jailer joins the network's namespace, where Firecracker opens the tap by name.
		s.Tap, s.Net, s.NetNS = hostnet.TapName(string(vm.UID)), gnet, at.NetNS
	}
	return s
}

// startFirecracker runs the VM under Firecracker's jailer: booted, or resumed from its
// snapshot.
func (a *Agent) startFirecracker(ctx context.Context, vm *impv1.ImpVM, dir string, m *meta, base string,
	at hostnet.Attachment, gnet *guestinit.Net, resume bool) (*vmm.Record, error) {
	s := a.firecrackerSpec(vm, dir, m, base, at, gnet)
	if at.Tap != nil {
		// The jailed Firecracker, an unprivileged uid, opens the persistent tap by name.
		if err := hostnet.SetOwner(at.Tap, m.JailUID); err != nil {
			return nil, err
		}
	}
	// The console where every driver's is, for kubectl imp logs and the console cap.
	console := filepath.Join(dir, qemu.ConsoleLog)
	if err := os.Remove(console); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	if err := os.Symlink(s.ConsoleLog(), console); err != nil {
		return nil, err
	}
	if resume {
		return firecracker.ResumeSnapshot(ctx, s, m.Digest)
	}
	return firecracker.Start(ctx, s, m.Digest)
}

// quitVMM ends a VMM that outlived the grace period: QMP quit for QEMU, Ctrl-Alt-Del for
// Firecracker (which exits on the guest's reset); the caller kills what is still alive.
func (a *Agent) quitVMM(ctx context.Context, uid types.UID, rec *vmm.Record) error {
	if rec.Kind == string(impv1.VMMFirecracker) {
		c := firecracker.NewClient(filepath.Join(a.jailRoot(uid), "run/firecracker.socket"))
		return c.Do(ctx, "PUT", "/actions", firecracker.Action{ActionType: "SendCtrlAltDel"}, nil)
	}
	return qemu.Quit(a.vmDir(uid))
}

// dialChannel connects to the guest channel of the VM in dir.
func (a *Agent) dialChannel(dir string, rec *vmm.Record) (net.Conn, error) {
	if rec.Kind == string(impv1.VMMFirecracker) {
		return firecracker.DialChannel(a.jailRoot(types.UID(filepath.Base(dir))))
	}
	return qemu.DialChannel(dir)
}

// removeJail removes a VM's Firecracker jail, if it has one.
func (a *Agent) removeJail(uid types.UID) error {
	if a.Opts.Firecracker == "" {
		return nil
	}
	return os.RemoveAll(firecracker.JailDir(a.jailBase(), a.Opts.Firecracker, string(uid)))
}

// waitGone waits up to d for rec's process to end.
func waitGone(rec *vmm.Record, d time.Duration) {
	for deadline := time.Now().Add(d); rec.Alive() && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
}

// logTail is the end of the VMM's own log, on one line.
// capLogs keeps every file a VM's VMM and guest write to under the one cap
// (Options.ConsoleLogBytes): the console, the VMM's own log (and Firecracker's metrics and its
// jailer's output). Those in a Firecracker jail, where the VMM could have replaced them, are
// opened through vmm.OpenIn like the others.
func (a *Agent) capLogs(dir string, rec *vmm.Record) error {
	max := a.Opts.ConsoleLogBytes
	if rec != nil && rec.Kind == string(impv1.VMMFirecracker) {
		jail := a.jailRoot(types.UID(filepath.Base(dir)))
		return errors.Join(vmm.CapFile(jail, firecracker.ConsoleFile, max), vmm.CapFile(jail, firecracker.LogFile, max),
			vmm.CapFile(jail, firecracker.MetricsFile, max), vmm.CapFile(dir, firecracker.JailerLog, max))
	}
	return errors.Join(qemu.CapConsole(dir, max), vmm.CapFile(dir, qemu.LogFile, max))
}

func (a *Agent) logTail(dir string, rec *vmm.Record) string {
	if rec != nil && rec.Kind == string(impv1.VMMFirecracker) {
		return vmm.Tail(a.jailRoot(types.UID(filepath.Base(dir))), firecracker.LogFile, 300)
	}
	return qemu.LogTail(dir, 300)
}
