package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	corev1 "k8s.io/api/core/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/imagefetch"
	"github.com/syscode-labs/imp/internal/agent/migration"
	"github.com/syscode-labs/imp/internal/agent/plan"
	"github.com/syscode-labs/imp/internal/agent/pullnet"
	"github.com/syscode-labs/imp/internal/agent/steps"
	"github.com/syscode-labs/imp/internal/agent/transfer"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/tracing"
)

// setupMigrations makes the node a migration's source and target (package migration): the
// sending and arriving side the VM reconcile calls, the controller of the migrations to this
// node, and the endpoint other nodes' agents reach.
func setupMigrations(a *Agent, mgr ctrl.Manager) error {
	o := &a.Opts
	log := mgr.GetLogger().WithName("migration")
	reports := migration.Reports{Client: a.Client, Node: o.NodeName}
	endpoints := migration.Endpoints{Reader: a.APIReader}
	limit := transfer.NewLimit(o.MigrationBandwidth) // what the node sends, both sides together
	a.migrations = &migration.Source{Limit: limit, Client: a.Client, Node: o.NodeName, VMDir: a.vmDir, Identity: o.MigrationIdentity, Reports: reports,
		Runs: a.reports, Endpoints: endpoints, Recorder: a.Recorder, Unwatch: a.Runs.Stop, Log: log, Tracer: a.tracer}
	target := &migration.Target{Limit: limit, Client: a.Client, APIReader: a.APIReader, Node: o.NodeName, VMDir: a.vmDir,
		Prepare: func(ctx context.Context, r *vmrun.Run) error {
			p := migrateInPlan(a, r.VM)
			if mg := r.VM.Status.Migration; mg != nil {
				var span trace.Span
				ctx, span = tracing.MigrationSpan(ctx, a.tracer, r.VM, mg.UID, false)
				defer span.End()
			}
			for {
				err := p.Run(ctx, r)
				if err != nil && !errors.Is(err, plan.ErrWait) {
					trace.SpanFromContext(ctx).SetStatus(codes.Error, "MigrationFailed")
				}
				if !errors.Is(err, plan.ErrWait) {
					return err
				}
				select { // the image is being fetched
				case <-ctx.Done():
					trace.SpanFromContext(ctx).SetStatus(codes.Error, "MigrationFailed")
					return ctx.Err()
				case <-time.After(250 * time.Millisecond):
				}
			}
		},
		Teardown: func(ctx context.Context, vm *impv1.ImpVM, dir string) error {
			if rec, err := vmm.ReadRecord(dir); err == nil && rec.Alive() {
				_ = syscall.Kill(rec.Pid, syscall.SIGKILL) // a VMM that never ran the guest
				rec.WaitGone(5 * time.Second)
			}
			a.fetches.Drop(vm.UID) // an image still being pulled for the place: not needed here
			a.endRun(vm.UID)
			return a.teardownPlan().Run(ctx, &vmrun.Teardown{UID: vm.UID, Dir: dir, Name: vm.Namespace + "/" + vm.Name})
		},
		Identity: o.MigrationIdentity, Reports: reports, Endpoints: endpoints, Log: log}
	if err := target.SetupWithManager(mgr); err != nil {
		return err
	}
	a.node.MigrationEndpoint = o.MigrationEndpoint
	if a.node.MigrationEndpoint == "" {
		a.node.MigrationEndpoint = o.MigrationAddr
	}
	return mgr.Add(&migration.Endpoint{Addr: o.MigrationAddr, Identity: o.MigrationIdentity, Files: a.migrations.Files, Streams: target.Authorize, Log: log})
}

// migrateInPlan is the plan of a migration's target: the VM's place made as a start makes it
// (its state directory, image, configuration disk, identity — with the guest's token, which the
// source's record gave as r.Old — and network attachment with its address and MAC), its
// writable disk and disk volumes empty for the source's mirrors, its ports exposed at an endpoint of this node's,
// and its VMM started waiting for the state (r.Incoming). Its failpoints are
// "migrate-in/<step>".
func migrateInPlan(a *Agent, vm *impv1.ImpVM) plan.Plan[*vmrun.Run] {
	insecure := a.Opts.InsecureRegistries
	ss := []steps.Step{steps.StateDir{},
		// The VM is still the source's: nothing of this run is reported until it arrives.
		steps.Image{Fetches: a.fetches, Reports: unreported{}, FetchWait: imagefetch.FetchWait,
			NameOptions: func(image string) []name.Option { return pullnet.NameOptions(image, insecure) }},
	}
	if len(vm.Spec.Volumes) > 0 {
		// Its disk volumes empty for the source's mirrors, its volumes of files made anew.
		ss = append(ss, steps.Volumes{Maker: a.volumes})
	}
	ss = append(ss, steps.ConfigDisk{}, migration.EmptyDisk{}, steps.Identity{IDs: a.drivers}, steps.Intent{})
	if vm.Spec.NetworkRef != nil {
		// Its ports at an endpoint of this node's block: the Services follow once the run is
		// reported here (its endpoint in the report), after the commit.
		ss = append(ss, steps.Network{Attacher: a.networks}, steps.Expose{Exposer: a.exposer})
	}
	ss = append(ss, steps.Exec{Launcher: launcher{a.drivers}})
	return plan.Plan[*vmrun.Run]{Name: "migrate-in", Reason: "MigrationFailed", Steps: ss}
}

// unreported reports nothing: a migration's target prepares a run that is not its node's yet.
type unreported struct{}

func (unreported) ReportLater(context.Context, *impv1.ImpVM, impv1.RuntimeStatus) error { return nil }

// migrating is the VM reconcile's part in migrations, for a VM whose VMM runs this run: a run
// that came by a migration waits paused until the commit, then runs on (Arrive); a guest a
// migration paused waits for the commit, and runs on if the migration ended without it (as the
// API server says: a cache never decides that); a VM its migration asks this node to send is
// sent, in the background (Send). done: the reconcile has nothing more to do.
func migrating(ctx context.Context, a *Agent, vm *impv1.ImpVM, dir string, m *vmrun.Meta, rec *vmm.Record) (done bool, err error) {
	if m.Migration != "" {
		if a.migrations == nil {
			return true, nil // a node that takes no migrations any more: its guest waits, the migration's end removes it
		}
		if err := a.migrations.Arrive(ctx, vm, dir, m, rec); err != nil {
			return true, err
		}
		if m.Migration == "" {
			a.Runs.Ensure(vm, dir, m, rec, nil)
		}
		return true, nil
	}
	if held := migration.Held(dir); held != "" {
		fresh := &impv1.ImpVM{}
		if err := a.APIReader.Get(ctx, client.ObjectKeyFromObject(vm), fresh); err != nil {
			return true, client.IgnoreNotFound(err)
		}
		mg := fresh.Status.Migration
		if fresh.UID != vm.UID || fresh.Status.NodeName != a.Opts.NodeName || a.migrations != nil && a.migrations.Busy(held) {
			return true, nil // moved, or still sending: its end decides
		}
		if mg != nil && mg.UID == held {
			if a.migrations != nil && mg.Phase == impv1.MigrationTransferring && (fresh.Status.Migration.SourceNode == a.Opts.NodeName) {
				// Paused for a migration this agent no longer sends (it restarted): say where
				// it stands.
				return true, a.migrations.Recover(ctx, fresh, dir, held)
			}
			return true, nil // paused for a migration still under way: its commit or its end decides
		}
		if err := a.drivers.Continue(ctx, vm.HostUID(), rec); err != nil {
			return true, fmt.Errorf("running on the guest of %s that a migration paused: %w", vm.Name, err)
		}
		if err := os.Remove(filepath.Join(dir, migration.OutFile)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return true, err
		}
		a.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "MigrationAbandoned", "Migrate", "The migration ended without its commit: the VM runs on on node %s", a.Opts.NodeName)
		return false, nil
	}
	if a.migrations != nil && a.migrations.Sending(vm) {
		a.migrations.Send(vm, dir, rec)
	}
	return false, nil
}
