package migration

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/transfer"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/failpoint"
	"github.com/syscode-labs/imp/internal/tracing"
)

// Downtime is how long a guest may be paused for the last of its state.
const Downtime = 300 * time.Millisecond

// EventRecorder records Events about objects (k8s.io/client-go/tools/events).
type EventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// RunReports writes a VM's run report (runreport.Reporter).
type RunReports interface {
	Report(ctx context.Context, vm *impv1.ImpVM, rt impv1.RuntimeStatus) error
}

// Source is the source side of the migrations of this node's VMs, and the arrival of VMs
// migrated to it; the agent's reconcile of a VM calls it.
type Source struct {
	Client    client.Client // the agent's: its cache holds this node's VMs
	Node      string
	VMDir     func(types.UID) string
	Identity  transfer.Identity
	Reports   Reports
	Runs      RunReports
	Endpoints Endpoints
	Recorder  EventRecorder
	// Unwatch stops following the run of a VM (its monitor): once its guest is paused for a
	// migration, its VMM's end (the run let go after the commit) is not the VM's, which runs
	// on elsewhere, and must not be reported as such.
	Unwatch func(uid types.UID)
	// Limit bounds what the node's migration streams send, together (transfer.NewLimit; nil:
	// unbounded).
	Limit *rate.Limiter
	Log   logr.Logger
	// Tracer, when set, records each sending as its migration's root span (package tracing).
	Tracer trace.Tracer

	// Clock is the source's time (nil: the real one).
	Clock clock.PassiveClock

	sending once
	mu      sync.Mutex
	sent    map[types.UID]time.Time // progress last reported, by migration
	done    map[types.UID]time.Time // migrations sent, or failed: never sent again; when
}

// doneFor is how long the source remembers a migration it sent (or failed) so as never to
// send it again: longer than any migration may last (spec.timeoutSeconds: at most 24 h),
// after which its VM names it no more. What it remembers is bounded by that window.
const doneFor = 25 * time.Hour

// markDone remembers migration uid as sent (or failed), and forgets those older than doneFor.
func (s *Source) markDone(uid types.UID) {
	now := time.Now()
	if s.Clock != nil {
		now = s.Clock.Now()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done == nil {
		s.done = map[types.UID]time.Time{}
	}
	for u, at := range s.done {
		if now.Sub(at) > doneFor {
			delete(s.done, u)
		}
	}
	s.done[uid] = now
}

// isDone says whether migration uid was sent (or failed) here.
func (s *Source) isDone(uid types.UID) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.done[uid]
	return ok
}

// Busy says whether the sending of migration uid is under way: the guest's state is QEMU's
// until it ends (paused, or running on).
func (s *Source) Busy(uid types.UID) bool { return s.sending.busy(uid) }

// Sending says whether the VM's migration (status.migration) asks this node, its source, to
// send it now.
func (s *Source) Sending(vm *impv1.ImpVM) bool {
	m := vm.Status.Migration
	return m != nil && m.SourceNode == s.Node && m.Phase == impv1.MigrationTransferring
}

// Held is the migration the guest of the VM in dir is paused for (its OutFile), "" for none:
// the agent runs the guest on once that migration ended without its commit.
func Held(dir string) types.UID { return marked(dir) }

// Send sends the running VM in dir to its migration's target, in the background (once per
// migration): its writable disk mirrored, then its memory and devices, the guest paused only
// for the last of them (Downtime); reported Sending, then Paused with what it took. A failure
// before the guest paused leaves it running here, reported Failed.
func (s *Source) Send(vm *impv1.ImpVM, dir string, rec *vmm.Record) {
	mig := *vm.Status.Migration
	key := types.NamespacedName{Namespace: vm.Namespace, Name: mig.Name}
	log := s.Log.WithValues("migration", key, "vm", vm.Name, "to", mig.TargetNode)
	if s.isDone(mig.UID) {
		return // sent, or failed: once per migration
	}
	s.sending.start(mig.UID, log, func() {
		defer func() {
			s.markDone(mig.UID)
			s.mu.Lock()
			delete(s.sent, mig.UID)
			s.mu.Unlock()
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 2*Timeout)
		defer cancel()
		span := trace.SpanFromContext(ctx)
		if s.Tracer != nil {
			ctx, span = tracing.MigrationSpan(ctx, s.Tracer, vm, mig.UID, true)
			defer span.End()
		}
		stats, err := s.send(ctx, key, mig, dir, rec, Disks(vm))
		defer func() {
			if err != nil {
				span.SetStatus(codes.Error, "MigrationFailed")
			} else {
				span.SetAttributes(attribute.Int64("imp.migration.bytes", stats.Bytes), attribute.Int64("imp.migration.downtime_us", stats.Downtime.Microseconds()))
			}
		}()
		if err != nil && rec.Kind != string(impv1.VMMFirecracker) {
			// What the migration left goes: QEMU's migration and the disk's mirror, waited for.
			// One that completed all the same has the guest paused for good, the target all
			// of its state.
			completed, aerr := qemu.AbandonOut(dir, time.Minute)
			if aerr != nil {
				log.Error(aerr, "ending a failed migration's work in the VMM")
			}
			if completed {
				err = nil
			}
		}
		if err != nil {
			_ = os.Remove(filepath.Join(dir, OutFile)) // the guest runs on here
			log.Error(err, "sending a VM")
			s.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "MigrationFailed", "Migrate", "Sending the VM to node %s failed; it runs on here: %v", mig.TargetNode, err)
			if err := s.Reports.Report(ctx, key, "source", impv1.MigrationAgentReport{State: impv1.MigrationAgentFailed, Message: err.Error()}); err != nil {
				log.Error(err, "reporting a migration failed")
			}
			return
		}
		failpoint.Crash("migration-sent") // all sent, the guest paused, not yet said
		s.Unwatch(vm.HostUID())
		log.Info("sent a VM; its guest is paused for the commit", "total", stats.Total.String(), "downtime", stats.Downtime.String(), "bytes", stats.Bytes)
		if err := s.Reports.Report(ctx, key, "source", impv1.MigrationAgentReport{State: impv1.MigrationAgentPaused, Bytes: stats.Bytes,
			Downtime: &metav1.Duration{Duration: stats.Downtime}}); err != nil {
			log.Error(err, "reporting a VM sent") // the operator's timeout decides; the guest waits paused
		}
	})
}

func (s *Source) send(ctx context.Context, key types.NamespacedName, mig impv1.MigrationStatus, dir string, rec *vmm.Record, drives []string) (qemu.MigrationStats, error) {
	var none qemu.MigrationStats
	if rec.Kind == string(impv1.VMMFirecracker) {
		return none, errors.New("a migration of a Firecracker VM is not built yet")
	}
	if err := s.Reports.Report(ctx, key, "source", impv1.MigrationAgentReport{State: impv1.MigrationAgentSending}); err != nil {
		return none, err
	}
	addr, err := s.Endpoints.Of(ctx, mig.TargetNode)
	if err != nil {
		return none, err
	}
	cfg, err := transfer.ClientTLS(s.Identity, mig.TargetNode)
	if err != nil {
		return none, err
	}
	for _, drive := range drives {
		disk, err := openDisk(ctx, cfg, addr, mig.UID, diskStream(drive), s.Limit)
		if err != nil {
			return none, err
		}
		err = qemu.MirrorDisk(dir, disk, drive, Timeout)
		disk.Close()
		if err != nil {
			return none, fmt.Errorf("mirroring the writable disks: %w", err)
		}
	}
	// From here the guest may be paused for this migration: said on the node first, so that an
	// agent that restarts knows why (Held, Recover).
	if err := os.WriteFile(filepath.Join(dir, OutFile), []byte(mig.UID), 0o600); err != nil {
		return none, err
	}
	failpoint.Crash("migration-mirrored") // the disk mirrored, the memory not yet sent
	c, err := transfer.DialStream(ctx, cfg, addr, mig.UID, "memory")
	if err != nil {
		return none, err
	}
	memory, bridged, err := bridgeTo(c, s.Limit)
	if err != nil {
		return none, err
	}
	stats, err := qemu.MigrateOut(dir, memory, qemu.MigrateOptions{Downtime: Downtime, MirroredDisk: true, Timeout: Timeout,
		Progress: func(sent, _ int64) { s.progress(key, mig.UID, sent) }})
	memory.Close()
	if err != nil {
		return stats, err
	}
	// QEMU is done once the state is in the agent's socket: it is sent once the bridge has
	// written it all out (QEMU has closed its end), not before.
	select {
	case <-bridged:
	case <-time.After(Drain):
		return stats, errors.New("the VM's state did not leave the node within " + Drain.String() + " of QEMU's end")
	}
	return stats, nil
}

// progress reports the bytes sent, at most every second.
func (s *Source) progress(key types.NamespacedName, uid types.UID, sent int64) {
	s.mu.Lock()
	if s.sent == nil {
		s.sent = map[types.UID]time.Time{}
	}
	if time.Since(s.sent[uid]) < time.Second {
		s.mu.Unlock()
		return
	}
	s.sent[uid] = time.Now()
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = s.Reports.Report(ctx, key, "source", impv1.MigrationAgentReport{State: impv1.MigrationAgentSending, Bytes: sent})
}

// Recover finishes, after the agent restarted, the sending of migration mig (which the VM's
// status.migration still names) that the guest in dir is held for (OutFile), when no sending of
// this agent runs it: a migration QEMU completed is reported Paused with its figures; one that
// ended without completing is reported Failed, its guest running on; one still running is
// ended (the agent's end of its streams went with the agent that stopped).
func (s *Source) Recover(ctx context.Context, vm *impv1.ImpVM, dir string, mig types.UID) error {
	if s.Busy(mig) {
		return nil
	}
	m := vm.Status.Migration
	if m == nil || m.UID != mig {
		return nil
	}
	key := types.NamespacedName{Namespace: vm.Namespace, Name: m.Name}
	s.markDone(mig) // never sent again by this agent, whatever comes of it
	state, stats, err := qemu.OutgoingState(dir)
	if err != nil {
		return fmt.Errorf("reading where a migration stands: %w", err)
	}
	if state != "completed" {
		completed, err := qemu.AbandonOut(dir, time.Minute)
		if err != nil {
			return err
		}
		if !completed {
			if err := os.Remove(filepath.Join(dir, OutFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
				return err
			}
			return s.Reports.Report(ctx, key, "source", impv1.MigrationAgentReport{State: impv1.MigrationAgentFailed,
				Message: "the source's agent restarted while sending; the VM runs on here"})
		}
		if _, stats, err = qemu.OutgoingState(dir); err != nil {
			return err
		}
	}
	s.Unwatch(vm.HostUID())
	return s.Reports.Report(ctx, key, "source", impv1.MigrationAgentReport{State: impv1.MigrationAgentPaused, Bytes: stats.Bytes,
		Downtime: &metav1.Duration{Duration: stats.Downtime}})
}

// Files is the source's answer to the target's fetch of a migration's files: the run's record
// (its guest's token), to the migration's target only, while it moves.
func (s *Source) Files(ctx context.Context, node string, uid types.UID) (map[string]transfer.File, error) {
	var vms impv1.ImpVMList
	if err := s.Client.List(ctx, &vms); err != nil {
		return nil, err
	}
	for i := range vms.Items {
		vm := &vms.Items[i]
		if m := vm.Status.Migration; m != nil && m.UID == uid && m.SourceNode == s.Node && m.TargetNode == node && vm.Status.NodeName == s.Node &&
			(m.Phase == impv1.MigrationPreparing || m.Phase == impv1.MigrationTransferring) {
			return map[string]transfer.File{MetaFile: {Dir: s.VMDir(vm.HostUID()), Name: MetaFile}}, nil
		}
	}
	return nil, transfer.ErrNotAllowed
}

// Arrive runs on the guest of a VM migrated to this node, once committed: the VM is this node's
// (only the commit moves a VM's nodeName to its migration's target) and this run is its current
// one. Its status.migration may be gone by then (a migration deleted just after its commit):
// the VM's node is what says. The disk server ended, the guest continued where the source
// paused it, the run reported running here, and the target's side Running.
func (s *Source) Arrive(ctx context.Context, vm *impv1.ImpVM, dir string, m *vmrun.Meta, rec *vmm.Record) error {
	mig := vm.Status.Migration
	if vm.Status.NodeName != s.Node || m.Instance != vm.Status.Instance || m.Run != vm.Status.RestartCount || mig != nil && mig.UID != m.Migration {
		return nil // not committed: the guest waits paused
	}
	source := "another node"
	if mig != nil {
		source = "node " + mig.SourceNode
	}
	_ = qemu.StopDiskServer(dir) // gone with an agent that restarted since: nothing to end
	if err := qemu.ResumeIncoming(dir, rec, time.Minute); err != nil {
		return fmt.Errorf("running on the guest of a migrated VM: %w", err)
	}
	m.Migration = ""
	if err := vmrun.WriteMeta(dir, m); err != nil {
		return err
	}
	rt := m.Status()
	now := metav1.Now()
	rt.State, rt.StartedAt, rt.GuestReady, rt.Message = impv1.RuntimeRunning, &now, true, "migrated from "+source
	if r := vm.Status.Runtime; r != nil && r.Instance == rt.Instance && r.Run == rt.Run {
		rt.StartedAt, rt.Ready = r.StartedAt, r.Ready // the same run, on
	}
	if err := s.Runs.Report(ctx, vm, rt); err != nil {
		return err
	}
	s.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Arrived", "Migrate", "The VM runs on node %s, moved from %s", s.Node, source)
	if mig == nil {
		return nil
	}
	return s.Reports.Report(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: mig.Name}, "target", impv1.MigrationAgentReport{State: impv1.MigrationAgentRunning})
}

// nbdMagic opens what an NBD server sends first.
var nbdMagic = []byte("NBDMAGIC")

// Drain bounds the wait, once QEMU has sent a VM's state, for the agent to have written it out.
const Drain = 30 * time.Second

// Greeting bounds the wait for the target's disk server to greet the source's mirror.
const Greeting = 30 * time.Second

// openDisk opens a disk's stream to the target and waits, within Greeting, for its disk
// server's greeting before it hands the stream to the VMM: QEMU connects to an NBD server in its
// main loop, and a peer that never speaks would hold it there, the guest with it. The greeting
// read goes to the VMM with the rest.
func openDisk(ctx context.Context, cfg *tls.Config, addr string, uid types.UID, stream string, lim *rate.Limiter) (*os.File, error) {
	c, err := transfer.DialStream(ctx, cfg, addr, uid, stream)
	if err != nil {
		return nil, err
	}
	_ = c.SetReadDeadline(time.Now().Add(Greeting))
	first := make([]byte, len(nbdMagic))
	if _, err := io.ReadFull(c, first); err != nil {
		c.Close()
		return nil, fmt.Errorf("the target's disk server did not greet the mirror: %w", err)
	}
	_ = c.SetReadDeadline(time.Time{})
	if !bytes.Equal(first, nbdMagic) {
		c.Close()
		return nil, errors.New("the target's disk stream is not an NBD server's")
	}
	f, _, err := bridgeTo(greeted{Reader: io.MultiReader(bytes.NewReader(first), c), Conn: c}, lim)
	return f, err
}

// greeted is a connection whose first bytes were read already: Read gives them again first.
type greeted struct {
	io.Reader
	net.Conn
}

func (g greeted) Read(p []byte) (int, error) { return g.Reader.Read(p) }
