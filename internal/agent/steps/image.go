package steps

import (
	"context"
	"fmt"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"go.opentelemetry.io/otel/trace"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/tracing"
)

// Fetches is how Image gets the run's image: fetched off the reconcile workers, within the
// pull timeout, so that a registry the tenant chose holds no worker however slow.
type Fetches interface {
	// Begin begins the run's fetch unless it is under way, and says whether it began it.
	Begin(vm *impv1.ImpVM, ref name.Reference) bool
	// Take returns the run's image once fetched, waiting up to wait; plan.ErrWait while it
	// is fetched, a failure with its reason (ImagePullFailed, ImageRefused, ...) when it failed.
	Take(vm *impv1.ImpVM, wait time.Duration) (*vmrun.Image, error)
}

// Reports reports a run's state.
type Reports interface {
	// ReportLater reports rt after the starting-report delay, unless a later report overtakes
	// it.
	ReportLater(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error
}

// Image resolves the VM's image and has its base disk on the node: it begins the fetch, reports
// that the run is starting, and takes the fetch when done; the pass that begins it waits up to
// FetchWait for it, so that an image whose disk is on the node goes on in the same pass, and
// later passes do not wait. The base disk's lease is let go when the plan ends (the VM's meta
// records the digest by then).
type Image struct {
	Fetches Fetches
	Reports Reports
	// NameOptions are the options an image reference is parsed with (plain HTTP registries).
	NameOptions func(image string) []name.Option
	FetchWait   time.Duration
}

func (Image) Name() string { return "image" }

func (Image) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) { return r.Image == nil, nil }

func (s Image) Do(ctx context.Context, r *vmrun.Run) error {
	vm := r.VM
	image := vm.Workload().Image
	if r.Snapshot != nil {
		image = r.Snapshot.Manifest.Image // a restore's base disk is the snapshot's, by digest
	}
	ref, err := name.ParseReference(image, s.NameOptions(image)...)
	if err != nil {
		return plan.Fail("InvalidImage", fmt.Errorf("image %q: %w", image, err))
	}
	if r.Pinned != "" {
		ref = ref.Context().Digest(r.Pinned) // the running guest's, by digest
	}
	began := s.Fetches.Begin(vm, ref)
	starting := impv1.RuntimeStatus{Instance: vm.Status.Instance, Run: vm.Status.RestartCount, State: impv1.RuntimeStarting, Message: "preparing disks"}
	if err := s.Reports.ReportLater(ctx, vm, starting); err != nil {
		return plan.Retry(err) // the run has not failed: the report goes again
	}
	wait := time.Duration(0)
	if began {
		wait = s.FetchWait
	}
	img, err := s.Fetches.Take(vm, wait)
	if err != nil {
		return err
	}
	if !began {
		// Fetched off the workers since an earlier pass began it: a span of the start's,
		// from then to now.
		t := trace.SpanFromContext(ctx).TracerProvider().Tracer(tracing.AgentScope)
		_, sp := tracing.RunSpan(ctx, t, vm, tracing.SpanFetch, trace.WithTimestamp(img.Began))
		sp.End()
	}
	r.Image = img
	r.Defer(img.Release)
	return nil
}
