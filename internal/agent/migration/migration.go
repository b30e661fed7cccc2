// Package migration is an agent's side of moving a running VM between nodes
// (docs/migration.md). On the target: the VM's place prepared and its VMM started waiting for
// the state (Target, a controller of the ImpVMMigrations to this node), the state taken from the
// streams the source opens, and the guest run on once the operator committed (Arrive). On the
// source: the disk mirrored and the memory sent while the guest runs, then the guest paused
// for the rest (Send), and run on again if the migration ends without its commit. The
// node's transfer endpoint (Endpoint) serves both sides over mutually authenticated TLS. The
// agents only report their side (status.source, status.target): the operator alone commits,
// so no agent can make two copies of a VM run.
package migration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/sys/unix"
	"golang.org/x/time/rate"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/transfer"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
)

// MetaFile is the run's record on its node (vmrun's meta.json), which the target fetches from
// the source: the guest channel's token and what the run was started with.
const MetaFile = "meta.json"

// OutFile, in a VM's directory on the source, names the migration that paused the guest: while
// it is there the guest is paused for that migration, to run on if the migration ends without
// its commit, or to be let go once the VM is the target's.
const OutFile = "migrating-out"

// Timeout bounds each VMM operation of a migration (the disk's mirror, the memory's transfer).
const Timeout = 10 * time.Minute

// Disks are the drives a migration of vm mirrors to its target while it runs: its writable
// disk and each of its emptyDisk volumes (files of its own on the node). Both sides read them
// off the VM.
func Disks(vm *impv1.ImpVM) []string {
	out := []string{qemu.WritableDrive}
	for _, v := range vm.Spec.Volumes {
		if v.EmptyDisk != nil {
			out = append(out, qemu.VolumeDrive(v.Name))
		}
	}
	return out
}

// diskStream is the name of the stream that carries the mirror of drive.
func diskStream(drive string) string { return "disk-" + drive }

// Reports writes this node's side of a migration.
type Reports struct {
	Client client.Client
	Node   string
}

// Report merge-patches side ("source" or "target") of migration mig.
func (r Reports) Report(ctx context.Context, mig types.NamespacedName, side string, rep impv1.MigrationAgentReport) error {
	if len(rep.Message) > 1024 {
		rep.Message = rep.Message[:1024]
	}
	p, err := json.Marshal(map[string]any{"status": map[string]any{side: rep}})
	if err != nil {
		return err
	}
	obj := &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: mig.Namespace, Name: mig.Name}}
	if err := r.Client.Status().Patch(ctx, obj, client.RawPatch(types.MergePatchType, p)); client.IgnoreNotFound(err) != nil {
		return fmt.Errorf("reporting the %s of migration %s as %s: %w", side, mig.Name, rep.State, err)
	}
	return nil
}

// Endpoints finds the transfer endpoint of a node's agent (its ImpNode's migrationEndpoint).
type Endpoints struct{ Reader client.Reader }

// Of is node's endpoint, host:port.
func (e Endpoints) Of(ctx context.Context, node string) (string, error) {
	n := &impv1.ImpNode{}
	if err := e.Reader.Get(ctx, types.NamespacedName{Name: node}, n); err != nil {
		return "", fmt.Errorf("getting the ImpNode of %s: %w", node, err)
	}
	if n.Status.MigrationEndpoint == "" {
		return "", fmt.Errorf("the agent of node %s takes no migrations (its ImpNode reports no migrationEndpoint)", node)
	}
	return n.Status.MigrationEndpoint, nil
}

// socketPair is a connected pair of stream sockets: one end for the agent's bridge, the other
// passed to a VMM.
func socketPair() (mine, vmms *os.File, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("making a socket pair for a VMM: %w", err)
	}
	return os.NewFile(uintptr(fds[0]), "migration-agent"), os.NewFile(uintptr(fds[1]), "migration-vmm"), nil
}

// bridgeTo bridges c to a new socket pair and returns the end for the VMM, and a channel closed
// once the bridge has ended: every byte the VMM wrote gone out on c, which stays within lim
// (the node's bound, shared by its streams; nil: none).
func bridgeTo(c io.ReadWriteCloser, lim *rate.Limiter) (*os.File, <-chan struct{}, error) {
	mine, vmms, err := socketPair()
	if err != nil {
		c.Close()
		return nil, nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		transfer.Bridge(transfer.Throttled(c, lim), mine)
	}()
	return vmms, done, nil
}

// marked reads the migration OutFile in dir names, "" for none.
func marked(dir string) types.UID {
	b, err := os.ReadFile(filepath.Join(dir, OutFile))
	if err != nil || len(b) > 64 {
		return ""
	}
	return types.UID(b)
}

// once runs each key's function once at a time.
type once struct {
	mu      sync.Mutex
	running map[types.UID]bool
}

// busy says whether key's function runs.
func (o *once) busy(key types.UID) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.running[key]
}

// start runs f in the background unless f of key runs already.
func (o *once) start(key types.UID, log logr.Logger, f func()) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.running[key] {
		return
	}
	if o.running == nil {
		o.running = map[types.UID]bool{}
	}
	o.running[key] = true
	go func() {
		defer func() {
			o.mu.Lock()
			delete(o.running, key)
			o.mu.Unlock()
		}()
		defer func() {
			if p := recover(); p != nil {
				log.Error(errors.New(fmt.Sprint(p)), "a migration's work panicked")
			}
		}()
		f()
	}()
}
