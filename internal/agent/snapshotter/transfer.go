package snapshotter

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/guestchan"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/pullnet"
	"github.com/syscode-labs/imp/internal/agent/snapshot"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
	"github.com/syscode-labs/imp/internal/snapshotsecret"
)

// registryOptions are the options a snapshot's registry is reached with: the credentials of its
// key Secret, and the node's registry transport (pullnet), as an image's registry is.
func (s *Snapshotter) registryOptions(dockerConfig []byte) ([]remote.Option, error) {
	var configs [][]byte
	if len(dockerConfig) > 0 {
		configs = append(configs, dockerConfig)
	}
	kc, err := disk.NewPullSecretKeychain(configs...)
	if err != nil {
		return nil, err
	}
	return append(append([]remote.Option{}, s.Images.RemoteOptions...), remote.WithAuthFromKeychain(kc)), nil
}

// push pushes a snapshot taken on this node to its registry, sealed with its key, and reports
// its digest; a failure is reported (PushFailed) and tried again.
func (s *Snapshotter) push(ctx context.Context, snap *impv1.ImpVMSnapshot) error {
	repo := snap.Spec.Registry.Repository
	key, cfg, err := snapshotsecret.Read(ctx, s.APIReader, s.SecretNamespace, snap.UID)
	if err != nil {
		return err // the operator writes it before it gives the snapshot to a node
	}
	opts, err := s.registryOptions(cfg)
	if err != nil {
		return s.pushFailed(ctx, snap, err)
	}
	ref, err := name.ParseReference(repo+":"+string(snap.UID), pullnet.NameOptions(repo, s.InsecureRegistries)...)
	if err != nil {
		return s.pushFailed(ctx, snap, err)
	}
	ctx, cancel := context.WithTimeout(ctx, s.PullTimeout)
	defer cancel()
	began := time.Now()
	digest, err := s.Store.Push(ctx, snap.UID, ref, key, opts...)
	if err != nil {
		return s.pushFailed(ctx, snap, err)
	}
	msg := fmt.Sprintf("pushed to %s@%s in %v", ref.Context(), digest, time.Since(began).Round(time.Millisecond))
	if err := s.patch(ctx, snap, func(st *impv1.ImpVMSnapshotStatus) { st.Digest, st.Reason, st.Message = digest, "", msg }); err != nil {
		return err
	}
	s.Recorder.Eventf(snap, nil, corev1.EventTypeNormal, "Pushed", "Push", "ImpVMSnapshot %s %s (sealed with its own key)", snap.Name, msg)
	return nil
}

func (s *Snapshotter) pushFailed(ctx context.Context, snap *impv1.ImpVMSnapshot, err error) error {
	msg := guestchan.Sanitize(err.Error())
	s.Recorder.Eventf(snap, nil, corev1.EventTypeWarning, impv1.ReasonPushFailed, "Push", "Pushing ImpVMSnapshot %s: %s", snap.Name, msg)
	if perr := s.patch(ctx, snap, func(st *impv1.ImpVMSnapshotStatus) { st.Reason, st.Message = impv1.ReasonPushFailed, msg }); perr != nil {
		return perr
	}
	return fmt.Errorf("pushing ImpVMSnapshot %s: %w", snap.Name, err)
}

// snapshotPulls are the snapshots being pulled into this node's store for restores, off the
// reconcile workers; each VM waiting for one is enqueued again when it is done.
type snapshotPulls struct {
	mu      sync.Mutex
	running map[types.UID]*snapshotPull
}

type snapshotPull struct {
	done    bool
	err     error
	waiters map[types.NamespacedName]*impv1.ImpVM
}

// pulled returns nil once the snapshot is in the store; plan.WaitFor while it is pulled (begun
// here if it is not under way); the pull's failure, once, when it failed.
func (s *Snapshotter) pulled(vm *impv1.ImpVM, snap *impv1.ImpVMSnapshot) error {
	p := &s.pulls
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.running == nil {
		p.running = map[types.UID]*snapshotPull{}
	}
	key := types.NamespacedName{Namespace: vm.Namespace, Name: vm.Name}
	if cur := p.running[snap.UID]; cur != nil {
		if !cur.done {
			cur.waiters[key] = vm
			return plan.WaitFor(time.Second)
		}
		delete(p.running, snap.UID) // a failure is told once: the next start pulls anew
		return cur.err
	}
	if _, err := s.Store.Read(snap.UID); err == nil {
		return nil
	}
	cur := &snapshotPull{waiters: map[types.NamespacedName]*impv1.ImpVM{key: vm}}
	p.running[snap.UID] = cur
	go func() {
		err := s.pullSnapshot(snap)
		p.mu.Lock()
		cur.done, cur.err = true, err
		if err == nil {
			delete(p.running, snap.UID)
		}
		waiters := cur.waiters
		p.mu.Unlock()
		for _, w := range waiters {
			s.Wake(w)
		}
	}()
	return plan.WaitFor(time.Second)
}

// pullSnapshot pulls snap (pushed by the node that took it) into the store, within the pull
// timeout: only the files its VMM kind has, each at most what the snapshot's resources allow.
func (s *Snapshotter) pullSnapshot(snap *impv1.ImpVMSnapshot) error {
	ctx, cancel := context.WithTimeout(context.Background(), s.PullTimeout)
	defer cancel()
	key, cfg, err := snapshotsecret.Read(ctx, s.APIReader, s.SecretNamespace, snap.UID)
	if err != nil {
		return err
	}
	opts, err := s.registryOptions(cfg)
	if err != nil {
		return err
	}
	repo := snap.Spec.Registry.Repository
	ref, err := name.NewDigest(repo+"@"+snap.Status.Digest, pullnet.NameOptions(repo, s.InsecureRegistries)...)
	if err != nil {
		return err
	}
	src := snap.Status.Source
	mem, dsk := src.Memory.Value(), src.DiskSize.Value()
	// The base disk holds the image's files (at most MaxImageBytes) and its file system's own.
	limits := map[string]int64{snapshot.ManifestFile: 1 << 20, snapshot.DiskFile: dsk, snapshot.BaseFile: 2*s.MaxImageBytes + 64<<20}
	if src.VMM == impv1.VMMFirecracker {
		limits[firecracker.SnapshotStateFile], limits[firecracker.SnapshotMemFile] = 16<<20, mem
	} else {
		limits[snapshot.StateFile] = mem + 64<<20 // the devices' state beside the memory
		limits[snapshot.MemoryFile] = mem
	}
	if err := s.Store.Pull(ctx, snap.UID, snap.Namespace, snap.Name, ref, key, limits, opts...); err != nil {
		return fmt.Errorf("pulling ImpVMSnapshot %s from %s: %w", snap.Name, ref, err)
	}
	return nil
}

// Sweep removes from the store the files of snapshots that are no more: one pulled
// here for a restore (its own node removes the original when it is deleted), or one whose
// deletion this node missed. A snapshot being taken or pulled is in the cluster, and stays.
func (s *Snapshotter) Sweep(ctx context.Context) error {
	uids, err := s.Store.List()
	if err != nil || len(uids) == 0 {
		return err
	}
	var all impv1.ImpVMSnapshotList
	if err := s.APIReader.List(ctx, &all); err != nil {
		return fmt.Errorf("listing snapshots: %w", err)
	}
	exists := map[types.UID]bool{}
	for _, it := range all.Items {
		exists[it.UID] = true
	}
	for _, uid := range uids {
		if !exists[uid] {
			if err := s.remove(uid); err != nil {
				return err
			}
		}
	}
	return nil
}
