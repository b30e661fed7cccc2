// Package vmrun holds what the agent keeps of a VM on its node (Meta, beside the VMM's record)
// and what a plan's steps share while they start or resume one run of a VM (Run).
package vmrun

import (
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/snapshot"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/guestinit"
	"github.com/syscode-labs/imp/internal/runsecret"
)

// Meta is what the agent keeps beside a VM's VMM record, in meta.json of its state directory.
type Meta struct {
	Namespace string    `json:"namespace"`
	Name      string    `json:"name"`
	UID       types.UID `json:"uid"`
	// Host is the UID the run is kept under on the node, when not the VM's own: a warm pool
	// member's, whose running guest was handed to this VM (ImpVM.HostUID).
	Host     types.UID `json:"host,omitempty"`
	Token    string    `json:"token"`
	Instance int64     `json:"instance"`
	Run      int32     `json:"run"`
	Started  time.Time `json:"started"`
	// Trace is the traceparent of the run's start (package tracing), which its guest's boot
	// joins, whichever agent follows it.
	Trace string `json:"trace,omitempty"`
	// Digest is the image the VM's base disk was built from.
	Digest string `json:"digest"`
	// VMM runs the VM; JailUID is the uid it runs as (Firecracker in its jail, QEMU by
	// descriptors).
	VMM     impv1.VMMKind `json:"vmm,omitempty"`
	JailUID int           `json:"jailUID,omitempty"`
	// Session: the run has the session channel (exec, port-forward). Runs booted by agents
	// before it have none, and keep none through a suspension.
	Session bool `json:"session,omitempty"`
	// Readiness: the run has a readiness probe, so it starts not ready.
	Readiness bool `json:"readiness,omitempty"`
	// Endpoint is the VM's endpoint address (a VM with ports on a network), kept across its
	// runs on the node.
	Endpoint string `json:"endpoint,omitempty"`
	// Ports are the ports the run forwards at its endpoint (spec.ports at its start).
	Ports []impv1.VMPort `json:"ports,omitempty"`
	// Restore, for a run restored from a snapshot, is where its guest stands in taking on its
	// own identity.
	Restore *Restored `json:"restore,omitempty"`
	// Migration, for a run that came to this node by a migration, is the migration's UID
	// until its guest runs here (package migration: its VMM waits for the state, then its
	// guest waits paused for the commit).
	Migration types.UID `json:"migration,omitempty"`
}

// Restored is a run restored from a snapshot.
type Restored struct {
	// Snapshot is the ImpVMSnapshot's name, SnapshotUID its uid.
	Snapshot    string    `json:"snapshot"`
	SnapshotUID types.UID `json:"snapshotUID"`
	// Token is the snapshot's guest channel token, which the guest holds until it took on
	// the run's own (Done).
	Token string `json:"token"`
	// Done: the guest took on the run's identity (Meta.Token, its MAC, address, hostname and
	// configuration).
	Done bool `json:"done,omitempty"`
}

// HostUID is the UID the run is kept under on the node: its state directory's name.
func (m *Meta) HostUID() types.UID {
	if m.Host != "" {
		return m.Host
	}
	return m.UID
}

// Status is what every report of the run says: its instance and run, its endpoint and ports,
// and the snapshot it was restored from.
func (m *Meta) Status() impv1.RuntimeStatus {
	rt := impv1.RuntimeStatus{Instance: m.Instance, Run: m.Run, Endpoint: m.Endpoint, Ports: m.Ports}
	if m.Restore != nil {
		rt.RestoredFrom = m.Restore.Snapshot
	}
	return rt
}

// ReadMeta reads the meta of the VM whose state directory is dir.
func ReadMeta(dir string) (*Meta, error) { return ReadMetaFile(filepath.Join(dir, "meta.json")) }

// ReadMetaFile reads a meta from the file path.
func ReadMetaFile(path string) (*Meta, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var m Meta
	return &m, json.Unmarshal(data, &m)
}

// WriteMeta writes m into dir, whole or not at all (a rename).
func WriteMeta(dir string, m *Meta) error {
	data, err := json.Marshal(m)
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, "meta.json.tmp")
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, "meta.json"))
}

// File names in a VM's state directory.
const (
	// WritableDisk is the VM's own disk, kept across its runs.
	WritableDisk = "rw.ext4"
	// RestoredBase is, in a run restored from a snapshot, a link to the snapshot's base disk
	// (snapshot.BaseFile), which the run runs on instead of the node's disk of its image.
	RestoredBase = "base.ext4"
	// ConfigDisk is the current run's configuration disk (its workload, secrets and all): it
	// goes when the run ends.
	ConfigDisk = "config.img"
)

// Image is a run's image on the node: its digest and base disk (leased until Release), its
// config, and the run's secrets read with it.
type Image struct {
	Digest   name.Digest
	BaseDisk string
	Config   *v1.Config
	Secrets  *runsecret.Run
	// Began is when the run's start first saw it (its fetch began).
	Began time.Time
	// Release lets go of the base disk's lease, once the VM's meta records its digest.
	Release func()
}

// Run is one run of a VM being started (booted or resumed) on the node: what its plan's steps
// read, and what each makes for the ones after it. A step measures what is there before it
// acts, so the fields a step sets are also how a later pass (after a crash, say) finds its work
// done.
type Run struct {
	VM  *impv1.ImpVM
	Dir string
	// Old is what the node recorded of the VM before this run (nil: nothing).
	Old *Meta
	// Resume: the run comes back from its saved state instead of booting.
	Resume bool
	// BaseDisk is the image's base disk, for a resume (a boot's comes with Image).
	BaseDisk string
	// Snapshot is the snapshot a restore starts the run from (nil: a boot or resume).
	Snapshot *Snapshot
	// Incoming: the run is a migration's on its target: its VMM waits for the state the
	// source sends, its guest paused until the migration is committed.
	Incoming bool
	// Pinned is, for a run handed over (a warm pool member's running guest, handed to its
	// claim), the digest of the image the member's base disk came from: the run's image is
	// that one, whatever the image's tag says now.
	Pinned string

	// Made by the steps, in order.
	Image   *Image
	Volumes *Volumes
	// Config is the workload configuration the config_disk step wrote on the run's
	// configuration disk (nil when this plan did not write it: a restore finished after an
	// agent restart).
	Config     *guestinit.Config
	Meta       *Meta
	Attachment hostnet.Attachment
	Net        *guestinit.Net
	Record     *vmm.Record
	// Channel is a connection to the guest's channel a step left open (a restore's, once the
	// guest took on its identity on it), for the run's monitor to follow the guest on rather
	// than connect anew (under TCG, the guest's noticing a new connection is cold code); Done
	// closes it unless it was taken.
	Channel net.Conn

	cleanups []func()
}

// Path is the path of file in the run's state directory.
func (r *Run) Path(file string) string { return filepath.Join(r.Dir, file) }

// Defer runs f when the run's plan is done, whatever its outcome (last deferred first).
func (r *Run) Defer(f func()) { r.cleanups = append(r.cleanups, f) }

// Done runs what was deferred, once.
func (r *Run) Done() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
	r.cleanups = nil
	if r.Channel != nil {
		_ = r.Channel.Close()
		r.Channel = nil
	}
}

// TakeChannel returns the run's open channel connection (nil: none), which is then the
// caller's to close.
func (r *Run) TakeChannel() net.Conn {
	c := r.Channel
	r.Channel = nil
	return c
}

// Teardown is a VM being removed from the node: deleted, placed elsewhere, or its state
// unreadable and its VM not of the node.
type Teardown struct {
	// UID is the UID the VM's run is kept under on the node (ImpVM.HostUID).
	UID types.UID
	Dir string
	// Name is the VM's "namespace/name", for messages ("" when unknown).
	Name string
}

// Stop is a run's VMM being stopped, over as many passes as its grace period takes: the guest
// asked to stop, its grace period, the VMM made to quit, then killed.
type Stop struct {
	VM     *impv1.ImpVM
	Record *vmm.Record
	// Deadline ends the grace period; Asked says the guest was asked to stop.
	Deadline time.Time
	Asked    bool
	// DrainUntil is when the guest of a VM with an endpoint is asked to stop: its endpoint is
	// terminating from the stop's start, and the proxies have this long to stop using it.
	DrainUntil time.Time
}

// Suspend is a suspension of a VM's current run under way: its memory and device state saved
// on the node, its VMM ended; its disks, tap and address stay.
type Suspend struct {
	VM     *impv1.ImpVM
	Dir    string
	Meta   *Meta
	Record *vmm.Record
	// Runtime is the run's report when the suspension began.
	Runtime impv1.RuntimeStatus
	// Took is how long the save took, once the save step did it.
	Took time.Duration
}

// Alive says whether the run's VMM runs.
func (s *Suspend) Alive() bool { return s.Record != nil && s.Record.Alive() }

// Snapshot is a node-local snapshot a run is restored from.
type Snapshot struct {
	// Name is the ImpVMSnapshot's.
	Name     string
	Manifest *snapshot.Manifest
	// Dir is its directory in the node's store (its VMM's files), Disk its writable disk, Base
	// its base disk.
	Dir, Disk, Base string
}

// Volumes are a run's volumes: the disks its VMM attaches, and what imp-init makes of them and
// of its volumes of files (guestinit.Config's Volumes, Mounts and Devices).
type Volumes struct {
	Drives []vmm.Drive
	Guest  struct {
		Volumes []guestinit.Volume
		Mounts  []guestinit.Mount
		Devices []guestinit.Device
	}
}
