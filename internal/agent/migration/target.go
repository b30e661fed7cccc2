package migration

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/time/rate"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/transfer"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/failpoint"
)

// DiskSocket, in the VM's directory on the target, is where its VMM serves its writable disk
// to the source's mirror (through the agent's bridge) while a migration copies it.
const DiskSocket = "nbd.sock"

// CacheByObject restricts an agent's cache of ImpVMMigrations to those moving a VM to node.
func CacheByObject(node string) (client.Object, cache.ByObject) {
	return &impv1.ImpVMMigration{}, cache.ByObject{Field: fields.OneTermEqualSelector("status.targetNode", node)}
}

// Target is the target side of the migrations to this node: a controller of ImpVMMigrations
// whose status.targetNode is this node.
type Target struct {
	Client    client.Client // the agent's: its cache holds the migrations to this node
	APIReader client.Reader
	Node      string
	// VMDir is the state directory of the VM with a UID.
	VMDir func(types.UID) string
	// Prepare runs the agent's plan that makes the VM's place (its state directory, image,
	// configuration disk, an empty writable disk, its identity, network attachment) and starts
	// its VMM waiting for the state (r.Incoming).
	Prepare func(ctx context.Context, r *vmrun.Run) error
	// Teardown removes what a migration that ended without its commit left of its VM here
	// (its VMM, directory, tap).
	Teardown  func(ctx context.Context, vm *impv1.ImpVM, dir string) error
	Identity  transfer.Identity
	Reports   Reports
	Endpoints Endpoints
	// Limit bounds what the node's migration streams send, together (shared with its Source).
	Limit *rate.Limiter
	Log   logr.Logger

	mu        sync.Mutex
	in        map[types.UID]*incoming    // by migration UID
	preparing map[types.UID]*preparation // preparations under way, by migration UID
	failed    map[types.UID]error        // preparations that ended with an error to retry
}

// preparation is a migration's place being made, in the background: an image pull may take
// minutes, and the node's other migrations, and this one's end, are not to wait for it.
type preparation struct {
	key    types.NamespacedName
	cancel context.CancelFunc
	done   chan struct{}
}

// Preparing is how often the target looks at a migration whose place it is making.
const Preparing = 2 * time.Second

// incoming is a migration this node takes: the VM's place made, its VMM waiting.
type incoming struct {
	mig    types.NamespacedName
	source string
	vm     *impv1.ImpVM
	dir    string
	rec    *vmm.Record
	taking bool            // the memory stream is being taken
	disks  map[string]bool // the disks' streams, by name: true once open (one each, the mirror's)
}

// SetupWithManager registers the target's controller with mgr (its cache from CacheByObject).
func (t *Target) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).For(&impv1.ImpVMMigration{}).Named("imp-agent-migration").Complete(t)
}

// Reconcile prepares the VM's place while the migration is Preparing, and removes it if the
// migration ends without its commit.
func (t *Target) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	mig := &impv1.ImpVMMigration{}
	if err := t.Client.Get(ctx, req.NamespacedName, mig); err != nil {
		if client.IgnoreNotFound(err) != nil {
			return ctrl.Result{}, err
		}
		return ctrl.Result{}, t.abandonNamed(ctx, req.NamespacedName)
	}
	st := &mig.Status
	if st.TargetNode != t.Node {
		return ctrl.Result{}, nil
	}
	switch {
	case st.Phase == impv1.MigrationFailed || !mig.DeletionTimestamp.IsZero() && !st.Phase.Committed():
		begun, err := t.stop(mig.UID)
		if err != nil {
			return ctrl.Result{}, err
		}
		return ctrl.Result{}, t.abandon(ctx, mig.UID, mig.Namespace, mig.Spec.VMName, st.VMUID, begun)
	case st.Phase.Committed():
		t.forget(mig.UID) // the VM is this node's: its run is the agent's (Arrive)
		return ctrl.Result{}, nil
	case st.Phase == impv1.MigrationPreparing && (st.Target == nil || st.Target.State == impv1.MigrationAgentPreparing):
		if err := t.begin(mig); err != nil {
			return ctrl.Result{}, err // the last try's error: tried again after the back-off
		}
		return ctrl.Result{RequeueAfter: Preparing}, nil
	case t.isPreparing(mig.UID):
		return ctrl.Result{RequeueAfter: Preparing}, nil
	case st.Target != nil && st.Target.State != impv1.MigrationAgentFailed && t.get(mig.UID) == nil:
		// Ready or Loaded by this node before its agent restarted: what it held in memory
		// (the disk server, the VMM waiting) is not known any more; the source runs on.
		return ctrl.Result{}, t.fail(ctx, mig, errors.New("the target's agent restarted during the migration"))
	}
	return ctrl.Result{}, nil
}

// begin makes the migration's place in the background, unless that is under way; it returns
// the error of a try that ended with one (once), for the caller to try again later.
func (t *Target) begin(mig *impv1.ImpVMMigration) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err, ok := t.failed[mig.UID]; ok {
		delete(t.failed, mig.UID)
		return err
	}
	if _, ok := t.preparing[mig.UID]; ok {
		return nil
	}
	if t.preparing == nil {
		t.preparing, t.failed = map[types.UID]*preparation{}, map[types.UID]error{}
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &preparation{key: client.ObjectKeyFromObject(mig), cancel: cancel, done: make(chan struct{})}
	t.preparing[mig.UID] = p
	mig = mig.DeepCopy()
	go func() {
		defer close(p.done)
		defer cancel()
		err := t.prepare(ctx, mig)
		t.mu.Lock()
		defer t.mu.Unlock()
		delete(t.preparing, mig.UID)
		if err != nil && ctx.Err() == nil {
			t.failed[mig.UID] = err
		}
	}()
	return nil
}

func (t *Target) isPreparing(uid types.UID) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.preparing[uid]
	return ok
}

// stop ends the preparation of migration uid, if under way, and waits for it, saying whether
// there was one: what it made is then abandon's to remove.
func (t *Target) stop(uid types.UID) (bool, error) {
	t.mu.Lock()
	p := t.preparing[uid]
	delete(t.failed, uid)
	t.mu.Unlock()
	if p == nil {
		return false, nil
	}
	p.cancel()
	select {
	case <-p.done:
		return true, nil
	case <-time.After(30 * time.Second):
		return true, fmt.Errorf("the preparation of migration %s did not end within 30s of its cancel", p.key)
	}
}

func (t *Target) get(uid types.UID) *incoming {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.in[uid]
}

func (t *Target) forget(uid types.UID) {
	t.mu.Lock()
	delete(t.in, uid)
	t.mu.Unlock()
}

func (t *Target) fail(ctx context.Context, mig *impv1.ImpVMMigration, err error) error {
	t.Log.Error(err, "a migration to this node failed", "migration", client.ObjectKeyFromObject(mig))
	return t.Reports.Report(ctx, client.ObjectKeyFromObject(mig), "target", impv1.MigrationAgentReport{State: impv1.MigrationAgentFailed, Message: err.Error()})
}

// prepare makes the VM's place and starts its VMM waiting for the state, then reports Ready.
func (t *Target) prepare(ctx context.Context, mig *impv1.ImpVMMigration) error {
	key := client.ObjectKeyFromObject(mig)
	if in := t.get(mig.UID); in != nil {
		return t.Reports.Report(ctx, key, "target", impv1.MigrationAgentReport{State: impv1.MigrationAgentReady})
	}
	vm := &impv1.ImpVM{}
	if err := t.APIReader.Get(ctx, types.NamespacedName{Namespace: mig.Namespace, Name: mig.Spec.VMName}, vm); err != nil {
		return client.IgnoreNotFound(err)
	}
	if m := vm.Status.Migration; vm.UID != mig.Status.VMUID || m == nil || m.UID != mig.UID || m.TargetNode != t.Node {
		return nil // not (or no longer) this migration's VM: the operator fails it
	}
	if vm.Status.Resources == nil || vm.Status.Resources.VMM == impv1.VMMFirecracker {
		return t.fail(ctx, mig, errors.New("a migration to a Firecracker VM is not built yet"))
	}
	if err := t.Reports.Report(ctx, key, "target", impv1.MigrationAgentReport{State: impv1.MigrationAgentPreparing}); err != nil {
		return err
	}
	in, err := t.make(ctx, mig, vm)
	if err != nil {
		return t.fail(ctx, mig, err)
	}
	t.mu.Lock()
	if t.in == nil {
		t.in = map[types.UID]*incoming{}
	}
	t.in[mig.UID] = in
	t.mu.Unlock()
	t.Log.Info("ready for a migration", "migration", key, "vm", vm.Name, "from", mig.Status.SourceNode)
	return t.Reports.Report(ctx, key, "target", impv1.MigrationAgentReport{State: impv1.MigrationAgentReady})
}

// make fetches the run's record from the source, makes the VM's place with the agent's plan, and
// has its VMM serve its (empty) writable disk for the source's mirror.
func (t *Target) make(ctx context.Context, mig *impv1.ImpVMMigration, vm *impv1.ImpVM) (*incoming, error) {
	source := mig.Status.SourceNode
	addr, err := t.Endpoints.Of(ctx, source)
	if err != nil {
		return nil, err
	}
	cfg, err := transfer.ClientTLS(t.Identity, source)
	if err != nil {
		return nil, err
	}
	dir := t.VMDir(vm.UID)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("making the VM's directory: %w", err)
	}
	// The source's record of the run: the guest holds its channel's token.
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}}
	defer hc.CloseIdleConnections()
	const fetched = "source-meta.json"
	if _, err := transfer.Fetch(ctx, hc, "https://"+addr, mig.UID, MetaFile, dir, fetched, 64<<10); err != nil {
		return nil, err
	}
	old, err := vmrun.ReadMetaFile(filepath.Join(dir, fetched))
	if err != nil {
		return nil, fmt.Errorf("the source's record of the run: %w", err)
	}
	_ = os.Remove(filepath.Join(dir, fetched))
	if old.UID != vm.UID || old.Instance != vm.Status.Instance || old.Run != vm.Status.RestartCount || old.Token == "" {
		return nil, fmt.Errorf("the source's record is of run %s %d.%d, not the VM's %d.%d", old.UID, old.Instance, old.Run, vm.Status.Instance, vm.Status.RestartCount)
	}
	// What this node keeps of the source's: the guest's token alone. The run's meta says whose
	// migration it is from the first write on (the sweep keeps it while the migration is under way).
	if old.VMM != "" && old.VMM != impv1.VMMQEMU {
		return nil, fmt.Errorf("the VM runs under %s on its source: a migration of a %s VM is not built yet", old.VMM, old.VMM)
	}
	kept := &vmrun.Meta{Token: old.Token, Migration: mig.UID, VMM: old.VMM}
	// The image the source's base disk came from, by digest, whatever its tag says now.
	r := &vmrun.Run{VM: vm, Dir: dir, Old: kept, Incoming: true, Pinned: old.Digest}
	defer r.Done()
	pctx, cancel := context.WithTimeout(ctx, Timeout) // an image pull, an endpoint block waited for: bounded
	defer cancel()
	if err := t.Prepare(pctx, r); err != nil {
		return nil, err
	}
	f, err := vmm.ListenUnix(filepath.Join(dir, DiskSocket))
	if err != nil {
		return nil, fmt.Errorf("listening for the disk's mirror: %w", err)
	}
	defer f.Close()
	drives := Disks(vm)
	if err := qemu.ServeDisk(dir, r.Record, f, drives, Timeout); err != nil {
		return nil, err
	}
	in := &incoming{mig: client.ObjectKeyFromObject(mig), source: source, vm: vm, dir: dir, rec: r.Record, disks: map[string]bool{}}
	for _, d := range drives {
		in.disks[diskStream(d)] = false
	}
	return in, nil
}

// Authorize is the target's answer to a stream the source opens: the disk's mirror to the
// VMM's disk server, the memory to its migration socket; only the migration's source, only
// while this node waits for it.
func (t *Target) Authorize(_ context.Context, node string, uid types.UID, name string) (func(net.Conn), error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	in := t.in[uid]
	if in == nil || in.source != node {
		return nil, transfer.ErrNotAllowed
	}
	if open, ok := in.disks[name]; ok {
		if open {
			return nil, transfer.ErrNotAllowed // one stream a disk
		}
		in.disks[name] = true
		return func(c net.Conn) {
			d, err := vmm.DialUnix(filepath.Join(in.dir, DiskSocket))
			if err != nil {
				c.Close()
				return
			}
			transfer.Bridge(transfer.Throttled(c, t.Limit), d)
		}, nil
	}
	if name != "memory" || in.taking {
		return nil, transfer.ErrNotAllowed // one memory stream per migration
	}
	in.taking = true
	return func(c net.Conn) { t.take(in, c) }, nil
}

// take has the VMM take the state from c, then reports it Loaded (or Failed).
func (t *Target) take(in *incoming, c net.Conn) {
	failpoint.Crash("migration-receiving") // the disk mirrored, the memory's stream open, nothing loaded
	vmms, _, err := bridgeTo(c, t.Limit)
	ctx := context.Background()
	if err == nil {
		err = qemu.MigrateIn(in.dir, in.rec, vmms, Timeout)
		vmms.Close()
	}
	rep := impv1.MigrationAgentReport{State: impv1.MigrationAgentLoaded}
	if err != nil {
		t.Log.Error(err, "taking a migration's state", "migration", in.mig)
		rep = impv1.MigrationAgentReport{State: impv1.MigrationAgentFailed, Message: "taking the state: " + err.Error()}
	}
	if err := t.Reports.Report(ctx, in.mig, "target", rep); err != nil {
		t.Log.Error(err, "reporting a migration's state taken", "migration", in.mig)
	}
}

// abandonNamed abandons what this node holds for the migration key, gone.
func (t *Target) abandonNamed(ctx context.Context, key types.NamespacedName) error {
	t.mu.Lock()
	var uid types.UID
	var in *incoming
	for u, i := range t.in {
		if i.mig == key {
			uid, in = u, i
		}
	}
	var under []types.UID
	for u, p := range t.preparing {
		if p.key == key {
			under = append(under, u)
		}
	}
	t.mu.Unlock()
	for _, u := range under {
		if _, err := t.stop(u); err != nil {
			return err
		}
	}
	if in == nil && len(under) > 0 {
		uid = under[0]
		in = t.get(uid) // made before its cancel
	}
	if in == nil {
		return nil // a place begun and not made: the sweep removes it (the VM names no migration to here)
	}
	return t.abandon(ctx, uid, key.Namespace, in.vm.Name, in.vm.UID, false)
}

// abandon removes the place made for a migration that ended without its commit, unless the VM
// is this node's (placed here since, by a later migration or placement). begun: this agent
// began making it (stopped), which its record may not say yet.
func (t *Target) abandon(ctx context.Context, uid types.UID, ns, name string, vmUID types.UID, begun bool) error {
	in := t.get(uid)
	vm := &impv1.ImpVM{}
	err := t.APIReader.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, vm)
	switch {
	case err == nil && vm.UID == vmUID && vm.Status.NodeName == t.Node:
		t.forget(uid)
		return nil
	case err != nil && client.IgnoreNotFound(err) != nil:
		return err
	case err != nil:
		vm = &impv1.ImpVM{}
		vm.Namespace, vm.Name, vm.UID = ns, name, vmUID
	}
	dir := t.VMDir(vmUID)
	if in == nil && !begun {
		if m, err := vmrun.ReadMeta(dir); err != nil || m.Migration != uid {
			return nil // nothing of this migration's here
		}
	}
	if err := t.Teardown(ctx, vm, dir); err != nil {
		return fmt.Errorf("removing what a migration that ended left: %w", err)
	}
	t.forget(uid)
	t.Log.Info("removed the place of a migration that ended without its commit", "migration", types.NamespacedName{Namespace: ns, Name: name})
	return nil
}
