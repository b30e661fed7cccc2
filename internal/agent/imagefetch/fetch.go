// Package imagefetch fetches the runs' images, off the reconcile workers: each run's image
// resolved (its tag's digest), pulled and built into a base disk of the node's store, with its
// run Secret's pull credentials, within a timeout; the start that waits for it is woken when it
// is done.
package imagefetch

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/steps"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/runsecret"
)

// Fetches are the runs' images being resolved and built into base disks, off the reconcile
// workers: the registry is the tenant's choice and may be slow, and no worker waits on it
// longer than FetchWait, once per run. The reconcile that starts the run finds its fetch done
// then, or on a later pass (a done fetch sends its VM to done, which requeues it at once).
// One fetch per VM, of its current run; its own lock, taken for the map alone.
type Fetches struct {
	images    *disk.BaseStore
	apiReader client.Reader
	secretNS  string // the run Secrets' namespace
	timeout   time.Duration
	done      chan<- event.GenericEvent

	mu   sync.Mutex
	byVM map[types.UID]*fetch
}

var _ steps.Fetches = (*Fetches)(nil)
var _ steps.FetchState = (*Fetches)(nil)

// fetch is one run's image being fetched.
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
	return fmt.Sprintf("%s.%d.%d", vm.UID, vm.Status.Instance, vm.Status.RestartCount) // a member's and its claim's differ
}

// Begin starts the fetch of the VM's current run unless it runs already, and says whether it
// started it; a fetch for another run of the VM is cancelled.
func (fs *Fetches) Begin(vm *impv1.ImpVM, ref name.Reference) bool {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if f := fs.byVM[vm.HostUID()]; f != nil {
		if f.run == runID(vm) {
			return false
		}
		fs.dropLocked(vm.HostUID())
	}
	ctx, cancel := context.WithTimeout(context.Background(), fs.timeout)
	f := &fetch{run: runID(vm), began: time.Now(), cancel: cancel, done: make(chan struct{}), release: func() {}}
	fs.byVM[vm.HostUID()] = f
	vm = vm.DeepCopy()
	go func() {
		f.reason, f.err = fs.do(ctx, vm, ref, f)
		close(f.done)
		// The start goes on at once, not at its next requeue.
		select {
		case fs.done <- event.GenericEvent{Object: vm}:
		default:
		}
	}()
	return true
}

func (fs *Fetches) do(ctx context.Context, vm *impv1.ImpVM, ref name.Reference, f *fetch) (string, error) {
	var err error
	step := steps.Timer()
	if f.secrets, err = runsecret.Read(ctx, fs.apiReader, fs.secretNS, vm); err != nil {
		return "StartFailed", err
	}
	kc, err := disk.NewPullSecretKeychain(f.secrets.PullConfigs(vm)...)
	if err != nil {
		return "StartFailed", err
	}
	step("secrets")
	// The digest keeps the reference's registry options (plain HTTP for an insecure registry).
	// A digest costs no request; a tag one, whose answer also says these credentials reach it.
	if f.digest, err = fs.images.Resolve(ctx, ref, kc); err != nil {
		return "ImagePullFailed", err
	}
	if _, tag := ref.(name.Tag); tag {
		fs.images.Verified(f.digest, kc)
	}
	step("image_resolve")
	// The lease keeps base-disk GC off the disk until the VM's meta records its digest.
	if f.baseDisk, f.release, err = fs.images.Ensure(ctx, vm.Namespace, f.digest, kc); err != nil {
		if errors.Is(err, disk.ErrUnsafeLayer) {
			return "ImageRefused", err
		}
		return "ImagePullFailed", err
	}
	step("base_disk")
	// A disk that is there may have been pulled with another tenant's credentials: these must
	// reach the image too (asked once per credentials and digest).
	if err := fs.images.Authorize(ctx, f.digest, kc); err != nil {
		return "ImagePullFailed", err
	}
	if f.config, err = fs.images.Config(ctx, f.digest, kc); err != nil {
		return "ImagePullFailed", fmt.Errorf("reading the image config: %w", err)
	}
	step("image_config")
	return "", nil
}

// Fetching says whether the fetch of the VM's current run began and has not finished.
func (fs *Fetches) Fetching(vm *impv1.ImpVM) bool {
	fs.mu.Lock()
	f := fs.byVM[vm.HostUID()]
	fs.mu.Unlock()
	return f != nil && f.run == runID(vm) && !f.finished()
}

func (f *fetch) finished() bool {
	select {
	case <-f.done:
		return true
	default:
		return false
	}
}

// FetchWait is how long the pass that begins a fetch waits for it before it lets its worker
// go: a fetch that needs no registry (an image pinned by digest whose disk is on the node) is
// done within it, and its start goes on in the same pass instead of queueing again behind other
// VMs'. Later passes do not wait, so a registry that never answers costs a worker this once.
const FetchWait = 100 * time.Millisecond

// Take hands the finished fetch of the VM's current run to its start and forgets it, waiting
// up to wait for it to finish: plan.ErrWait while it runs (or none began), a plan failure with
// its reason when it failed.
func (fs *Fetches) Take(vm *impv1.ImpVM, wait time.Duration) (*vmrun.Image, error) {
	fs.mu.Lock()
	f := fs.byVM[vm.HostUID()]
	fs.mu.Unlock()
	if f == nil || f.run != runID(vm) || fs.take(vm.HostUID(), f, wait) == nil {
		return nil, plan.ErrWait
	}
	if f.err != nil {
		f.release()
		return nil, plan.Fail(f.reason, f.err)
	}
	return &vmrun.Image{Digest: f.digest, BaseDisk: f.baseDisk, Config: f.config, Secrets: f.secrets, Began: f.began, Release: f.release}, nil
}

// take forgets f, once finished, waiting up to wait for it; nil while it runs.
func (fs *Fetches) take(uid types.UID, f *fetch, wait time.Duration) *fetch {
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
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fs.byVM[uid] == f {
		delete(fs.byVM, uid)
	}
	return f
}

// Drop cancels the VM's fetch, if any, and lets go of what it holds.
func (fs *Fetches) Drop(uid types.UID) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	fs.dropLocked(uid)
}

func (fs *Fetches) dropLocked(uid types.UID) {
	f := fs.byVM[uid]
	if f == nil {
		return
	}
	delete(fs.byVM, uid)
	f.cancel()
	go func() { <-f.done; f.release() }()
}

// New is the fetches of images into images, with the run Secrets of namespace secretNS read by
// apiReader, each within timeout; a VM whose fetch is done is sent to done.
func New(images *disk.BaseStore, apiReader client.Reader, secretNS string, timeout time.Duration, done chan<- event.GenericEvent) *Fetches {
	return &Fetches{images: images, apiReader: apiReader, secretNS: secretNS, timeout: timeout, done: done, byVM: map[types.UID]*fetch{}}
}
