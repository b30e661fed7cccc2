package agent

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/event"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/runsecret"
)

// fetch is a run's image being resolved and built into its base disk, off the reconcile
// workers: the registry is the tenant's choice and may be slow, and no worker waits on it
// longer than fetchWait, once per run. The reconcile that starts the run finds it done then,
// or on a later pass.
type fetch struct {
	run    string // the run it is for: "<instance>.<restartCount>"
	began  time.Time
	cancel context.CancelFunc
	done   chan struct{}

	// Set when done.
	secrets  *runsecret.Run
	digest   name.Digest
	baseDisk string
	release  func() // the base disk's lease, held until the VM's meta records the digest
	config   *v1.Config
	reason   string // why it failed, as an Event reason
	err      error
}

func runID(vm *impv1.ImpVM) string {
	return fmt.Sprintf("%d.%d", vm.Status.Instance, vm.Status.RestartCount)
}

// fetchImage returns the fetch of the VM's current run, starting it unless it runs already,
// and whether it started it; a fetch for another run of the VM is cancelled.
func (a *Agent) fetchImage(vm *impv1.ImpVM, ref name.Reference) (*fetch, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if f := a.fetches[vm.UID]; f != nil {
		if f.run == runID(vm) {
			return f, false
		}
		a.dropFetchLocked(vm.UID)
	}
	ctx, cancel := context.WithTimeout(context.Background(), a.Opts.PullTimeout)
	f := &fetch{run: runID(vm), began: time.Now(), cancel: cancel, done: make(chan struct{}), release: func() {}}
	a.fetches[vm.UID] = f
	vm = vm.DeepCopy()
	go func() {
		f.reason, f.err = a.doFetch(ctx, vm, ref, f)
		close(f.done)
		// The start goes on at once, not at its next requeue.
		select {
		case a.fetched <- event.GenericEvent{Object: vm}:
		default:
		}
	}()
	return f, true
}

func (a *Agent) doFetch(ctx context.Context, vm *impv1.ImpVM, ref name.Reference, f *fetch) (string, error) {
	ns := a.Opts.RunSecretNamespace
	var err error
	step := stepTimer()
	if f.secrets, err = runsecret.Read(ctx, a.APIReader, ns, vm); err != nil {
		return "StartFailed", err
	}
	kc, err := disk.NewPullSecretKeychain(f.secrets.PullConfigs(vm)...)
	if err != nil {
		return "StartFailed", err
	}
	step("secrets")
	// The digest keeps the reference's registry options (plain HTTP for an insecure registry).
	// A digest costs no request; a tag one, whose answer also says these credentials reach it.
	if f.digest, err = a.images.Resolve(ctx, ref, kc); err != nil {
		return "ImagePullFailed", err
	}
	if _, tag := ref.(name.Tag); tag {
		a.images.Verified(f.digest, kc)
	}
	step("image_resolve")
	// The lease keeps base-disk GC off the disk until the VM's meta records its digest.
	if f.baseDisk, f.release, err = a.images.Ensure(ctx, vm.Namespace, f.digest, kc); err != nil {
		if errors.Is(err, disk.ErrUnsafeLayer) {
			return "ImageRefused", err
		}
		return "ImagePullFailed", err
	}
	step("base_disk")
	// A disk that is there may have been pulled with another tenant's credentials: these must
	// reach the image too (asked once per credentials and digest).
	if err := a.images.Authorize(ctx, f.digest, kc); err != nil {
		return "ImagePullFailed", err
	}
	if f.config, err = a.images.Config(ctx, f.digest, kc); err != nil {
		return "ImagePullFailed", fmt.Errorf("reading the image config: %w", err)
	}
	step("image_config")
	return "", nil
}

// fetchOf is the fetch of the VM's current run, if one was started.
func (a *Agent) fetchOf(vm *impv1.ImpVM) *fetch {
	a.mu.Lock()
	defer a.mu.Unlock()
	if f := a.fetches[vm.UID]; f != nil && f.run == runID(vm) {
		return f
	}
	return nil
}

func (f *fetch) finished() bool {
	select {
	case <-f.done:
		return true
	default:
		return false
	}
}

// fetchWait is how long the pass that begins a fetch waits for it before it lets its worker
// go: a fetch that needs no registry (an image pinned by digest whose disk is on the node) is
// done within it, and its start goes on in the same pass instead of queueing again behind other
// VMs'. Later passes do not wait, so a registry that never answers costs a worker this once.
const fetchWait = 100 * time.Millisecond

// takeFetch hands a finished fetch to its run's start and forgets it, waiting up to wait for it
// to finish; nil while it runs.
func (a *Agent) takeFetch(uid types.UID, f *fetch, wait time.Duration) *fetch {
	if !f.finished() {
		if wait <= 0 {
			return nil
		}
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-f.done:
		case <-t.C:
			return nil
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.fetches[uid] == f {
		delete(a.fetches, uid)
	}
	return f
}

// dropFetch cancels the VM's fetch, if any, and lets go of what it holds.
func (a *Agent) dropFetch(uid types.UID) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.dropFetchLocked(uid)
}

func (a *Agent) dropFetchLocked(uid types.UID) {
	f := a.fetches[uid]
	if f == nil {
		return
	}
	delete(a.fetches, uid)
	f.cancel()
	go func() { <-f.done; f.release() }()
}
