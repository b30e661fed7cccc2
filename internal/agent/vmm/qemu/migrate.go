package qemu

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/syscode-labs/imp/internal/agent/vmm"
)

// MigrationStats is what a live migration took, as the sending QEMU measured it.
type MigrationStats struct {
	// Total is from the start of the migration to its end; Downtime how long the guest was
	// paused for its last part (the memory it dirtied meanwhile and the devices).
	Total, Downtime time.Duration
	// Bytes is the guest memory sent, pages sent again included.
	Bytes int64
}

// MigrateOptions bound a live migration.
type MigrateOptions struct {
	// Downtime is how long the guest may be paused for the migration's last part.
	Downtime time.Duration
	// Bandwidth bounds the stream, bytes per second (0: unbounded).
	Bandwidth int64
	// Progress, when set, is told the memory sent and the guest's memory size as it goes.
	Progress func(sent, total int64)
	// MirroredDisk: MirrorDisk copies the writable disk; its mirror is finished while the
	// guest is paused, before the devices go (pause-before-switchover), so that the disk the
	// receiver runs on is the one the memory knows.
	MirroredDisk bool
	Timeout      time.Duration
	// Stall ends a migration that sent nothing for that long while active (default a minute):
	// a receiver that stopped reading holds no sender until its Timeout.
	Stall time.Duration
}

// MigrateOut sends the running guest of the VM in dir, live, over conn (a connected stream
// socket whose other end reaches a VMM started with Spec.MigrationIn, MigrateIn): its memory
// while it runs, again what it dirtied meanwhile, until what is left can go within
// o.Downtime; then, paused, that and the devices. Post-copy is never used: the guest runs in
// one place at a time.
//
// Once it returns without error the guest is paused for good on this VMM ("postmigrate"): the
// caller ends it (Quit) once the other side may run it, or runs it on (Continue) if the other
// side failed before. On an error before that, the guest runs on here.
func MigrateOut(dir string, conn *os.File, o MigrateOptions) (MigrationStats, error) {
	q, err := DialQMP(dir, 10*time.Second)
	if err != nil {
		return MigrationStats{}, err
	}
	defer q.Close()
	_ = q.conn.SetDeadline(time.Now().Add(o.Timeout))
	bandwidth := o.Bandwidth
	if bandwidth <= 0 {
		bandwidth = 1 << 40
	}
	if _, err := q.Execute("migrate-set-parameters", map[string]any{"downtime-limit": o.Downtime.Milliseconds(), "max-bandwidth": bandwidth}); err != nil {
		return MigrationStats{}, err
	}
	if err := q.ignoreShared(false); err != nil { // the memory goes with the devices
		return MigrationStats{}, err
	}
	if _, err := q.Execute("migrate-set-capabilities", map[string]any{"capabilities": []map[string]any{
		{"capability": "pause-before-switchover", "state": o.MirroredDisk}}}); err != nil {
		return MigrationStats{}, err
	}
	if err := q.SendFD("imp-migration", conn); err != nil {
		return MigrationStats{}, err
	}
	if _, err := q.Execute("migrate", map[string]any{"uri": "fd:imp-migration"}); err != nil {
		return MigrationStats{}, fmt.Errorf("starting the migration: %w", err)
	}
	stall := o.Stall
	if stall <= 0 {
		stall = time.Minute
	}
	sent, moved := int64(-1), time.Now()
	for {
		raw, err := q.Execute("query-migrate", nil)
		if err != nil {
			return MigrationStats{}, err
		}
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
			TotalTime int64  `json:"total-time"`
			Downtime  int64  `json:"downtime"`
			RAM       struct {
				Transferred int64 `json:"transferred"`
				Total       int64 `json:"total"`
			} `json:"ram"`
		}
		_ = json.Unmarshal(raw, &st)
		switch st.Status {
		case "completed":
			return MigrationStats{Total: time.Duration(st.TotalTime) * time.Millisecond, Downtime: time.Duration(st.Downtime) * time.Millisecond,
				Bytes: st.RAM.Transferred}, nil
		case "failed", "cancelled":
			return MigrationStats{}, fmt.Errorf("migrating the VM: %s %s", st.Status, st.ErrorDesc)
		case "pre-switchover":
			// Paused, before the devices go: the disk's copy is made whole first.
			if err := q.finishMirror(); err != nil {
				_, _ = q.Execute("migrate_cancel", nil)
				return MigrationStats{}, err
			}
			if _, err := q.Execute("migrate-continue", map[string]any{"state": "pre-switchover"}); err != nil {
				_, _ = q.Execute("migrate_cancel", nil)
				return MigrationStats{}, err
			}
		}
		if st.RAM.Transferred != sent {
			sent, moved = st.RAM.Transferred, time.Now()
		} else if st.Status == "active" && time.Since(moved) > stall {
			_, _ = q.Execute("migrate_cancel", nil)
			return MigrationStats{}, fmt.Errorf("migrating the VM: nothing sent for %v (the receiver stopped reading)", stall)
		}
		if o.Progress != nil && st.RAM.Total > 0 {
			o.Progress(st.RAM.Transferred, st.RAM.Total)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// MigrateIn has the VMM of the VM in dir, started with Spec.MigrationIn, take a live
// migration's stream from conn (MigrateOut's other end), and returns once it has the whole of
// it: the guest is paused (-S) until ResumeIncoming runs it, which only the migration's commit
// may do. If the stream breaks, QEMU exits and MigrateIn fails.
func MigrateIn(dir string, rec *vmm.Record, conn *os.File, timeout time.Duration) error {
	q, err := dialStarted(dir, rec, time.Now().Add(timeout))
	if err != nil {
		return err
	}
	defer q.Close()
	_ = q.conn.SetDeadline(time.Now().Add(timeout))
	if err := q.SendFD("imp-migration", conn); err != nil {
		return err
	}
	if _, err := q.Execute("migrate-incoming", map[string]any{"uri": "fd:imp-migration"}); err != nil {
		return fmt.Errorf("receiving the migration: %w", err)
	}
	for {
		status, err := q.status()
		if err != nil {
			if rec != nil && !rec.Alive() {
				return fmt.Errorf("the VMM ended while receiving the migration: %s", LogTail(dir, 300))
			}
			return err
		}
		switch status {
		case "inmigrate":
			time.Sleep(10 * time.Millisecond)
			continue
		case "paused", "prelaunch":
			return nil
		}
		return fmt.Errorf("the VM is %s after receiving the migration; want paused", status)
	}
}

// dialStarted connects to the QMP socket of a VMM just started, waiting until deadline for it
// to listen, unless it ended.
func dialStarted(dir string, rec *vmm.Record, deadline time.Time) (*QMP, error) {
	for began := time.Now(); ; {
		q, err := DialQMP(dir, 5*time.Second)
		if err == nil {
			return q, nil
		}
		if rec != nil && !rec.Alive() {
			return nil, fmt.Errorf("QEMU exited before it listened: %w", err)
		}
		if time.Now().After(deadline) {
			return nil, err
		}
		// Tried often at first: QEMU listens some 20–40 ms after its exec, and the guest of a
		// restore or a migration waits for this; then less.
		wait := 2 * time.Millisecond
		if time.Since(began) > 200*time.Millisecond {
			wait = 20 * time.Millisecond
		}
		time.Sleep(wait)
	}
}

// mirrorJob begins the names of the block jobs (and their target nodes) that copy a VM's
// writable disks to a migration's receiver: one a disk, mirrorJob-<drive>.
const mirrorJob = "imp-mirror"

// WritableDrive is the drive id of a VM's writable disk; a disk volume's is VolumeDrive's.
const WritableDrive = "rw"

// VolumeDrive is the drive id of the VM's disk volume id (vmm.Drive.ID).
func VolumeDrive(id string) string { return "vol-" + id }

// ServeDisk has the VMM of the VM in dir, started with Spec.MigrationIn, serve its writable
// disks named drives (WritableDrive, VolumeDrive) over NBD on ln (a listening stream socket
// the agent passes it), each an export of its drive's name, for the sender's MirrorDisk to
// write, until StopDiskServer. Nothing else is exported, and only on ln.
func ServeDisk(dir string, rec *vmm.Record, ln *os.File, drives []string, timeout time.Duration) error {
	q, err := dialStarted(dir, rec, time.Now().Add(timeout))
	if err != nil {
		return err
	}
	defer q.Close()
	_ = q.conn.SetDeadline(time.Now().Add(timeout))
	if err := q.SendFD("imp-nbd", ln); err != nil {
		return err
	}
	if _, err := q.Execute("nbd-server-start", map[string]any{"addr": map[string]any{"type": "fd", "data": map[string]any{"str": "imp-nbd"}}}); err != nil {
		return fmt.Errorf("serving the disk for the migration: %w", err)
	}
	for _, d := range drives {
		if _, err := q.Execute("nbd-server-add", map[string]any{"device": d, "writable": true}); err != nil {
			return fmt.Errorf("exporting disk %s for the migration: %w", d, err)
		}
	}
	return nil
}

// StopDiskServer ends ServeDisk's server, once the migration has all of the disk.
func StopDiskServer(dir string) error {
	q, err := DialQMP(dir, 10*time.Second)
	if err != nil {
		return err
	}
	defer q.Close()
	_, err = q.Execute("nbd-server-stop", nil)
	return err
}

// MirrorDisk has the sending VMM of the VM in dir copy its writable disk drive, while the
// guest runs, to the receiver's export of that name (ServeDisk) over conn (connected to it),
// and returns once the copy has caught up. From then on every write of the guest reaches both
// before it completes (copy-mode write-blocking), until MigrateOut finishes every mirror
// (MigrateOptions.MirroredDisk). On an error that mirror is gone and the guest runs on as
// before.
func MirrorDisk(dir string, conn *os.File, drive string, timeout time.Duration) error {
	q, err := DialQMP(dir, 10*time.Second)
	if err != nil {
		return err
	}
	defer q.Close()
	_ = q.conn.SetDeadline(time.Now().Add(timeout))
	if err := q.SendFD("imp-nbd", conn); err != nil {
		return err
	}
	job := mirrorJob + "-" + drive
	if _, err := q.Execute("blockdev-add", map[string]any{"driver": "nbd", "node-name": job, "export": drive,
		"server": map[string]any{"type": "fd", "str": "imp-nbd"}}); err != nil {
		return fmt.Errorf("connecting to the receiver's disk %s: %w", drive, err)
	}
	if _, err := q.Execute("blockdev-mirror", map[string]any{"job-id": job, "device": drive, "target": job,
		"sync": "full", "copy-mode": "write-blocking"}); err != nil {
		_, _ = q.Execute("blockdev-del", map[string]any{"node-name": job})
		return fmt.Errorf("mirroring disk %s: %w", drive, err)
	}
	for {
		jobs, err := q.mirrors()
		if err != nil {
			return err
		}
		j, ok := jobs[job]
		switch {
		case !ok:
			_, _ = q.Execute("blockdev-del", map[string]any{"node-name": job})
			return fmt.Errorf("the mirror of disk %s ended before it caught up", drive)
		case j.Ready:
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// finishMirror ends MirrorDisk's copies while the guest is paused (MigrateOut, before the
// switchover): each copy is made whole, the sender keeps its own disks, the connections go.
func (q *QMP) finishMirror() error {
	jobs, err := q.mirrors()
	if err != nil {
		return err
	}
	// A ready mirror's cancel completes it without switching the guest to the copy.
	for job := range jobs {
		if _, err := q.Execute("block-job-cancel", map[string]any{"device": job}); err != nil {
			return fmt.Errorf("finishing the disk's mirror %s: %w", job, err)
		}
	}
	for len(jobs) > 0 {
		time.Sleep(5 * time.Millisecond)
		if jobs, err = q.mirrors(); err != nil {
			return err
		}
	}
	return q.dropMirrorTargets()
}

// dropMirrorTargets removes the connections to the receiver's disks (the mirrors' targets),
// those there are.
func (q *QMP) dropMirrorTargets() error {
	raw, err := q.Execute("query-named-block-nodes", map[string]any{"flat": true})
	if err != nil {
		return err
	}
	var nodes []struct {
		NodeName string `json:"node-name"`
	}
	if err := json.Unmarshal(raw, &nodes); err != nil {
		return err
	}
	for _, n := range nodes {
		if strings.HasPrefix(n.NodeName, mirrorJob) {
			if _, err := q.Execute("blockdev-del", map[string]any{"node-name": n.NodeName}); err != nil {
				return fmt.Errorf("disconnecting from the receiver's disk %s: %w", n.NodeName, err)
			}
		}
	}
	return nil
}

// blockJob is a block job as query-block-jobs describes it.
type blockJob struct {
	Device string `json:"device"`
	Ready  bool   `json:"ready"`
	Len    int64  `json:"len"`
	Offset int64  `json:"offset"`
}

// mirrors are the disks' mirror jobs there are, by job id.
func (q *QMP) mirrors() (map[string]blockJob, error) {
	raw, err := q.Execute("query-block-jobs", nil)
	if err != nil {
		return nil, err
	}
	var jobs []blockJob
	if err := json.Unmarshal(raw, &jobs); err != nil {
		return nil, err
	}
	out := map[string]blockJob{}
	for _, j := range jobs {
		if strings.HasPrefix(j.Device, mirrorJob) {
			out[j.Device] = j
		}
	}
	return out, nil
}

// AbandonOut ends what an outgoing migration of the VM in dir left behind when MigrateOut or
// MirrorDisk returned an error (a deadline, a QMP error, a receiver gone): the migration
// cancelled and waited for until QEMU says it ended, the disk's mirror cancelled without being
// completed and its connection removed. It reports whether the migration had completed all
// the same: then the guest is paused for good ("postmigrate") and the receiver has the whole
// state; else QEMU runs the guest on here.
func AbandonOut(dir string, timeout time.Duration) (completed bool, err error) {
	q, err := DialQMP(dir, 10*time.Second)
	if err != nil {
		return false, err
	}
	defer q.Close()
	_ = q.conn.SetDeadline(time.Now().Add(timeout))
	_, _ = q.Execute("migrate_cancel", nil)
	for ended := false; !ended; {
		raw, err := q.Execute("query-migrate", nil)
		if err != nil {
			return false, err
		}
		var st struct {
			Status string `json:"status"`
		}
		_ = json.Unmarshal(raw, &st)
		switch st.Status {
		case "completed":
			completed, ended = true, true
		case "", "none", "failed", "cancelled":
			ended = true
		default:
			time.Sleep(10 * time.Millisecond)
		}
	}
	jobs, err := q.mirrors()
	if err != nil {
		return completed, err
	}
	for job := range jobs {
		if _, err := q.Execute("block-job-cancel", map[string]any{"device": job, "force": true}); err != nil {
			return completed, fmt.Errorf("cancelling the disk's mirror %s: %w", job, err)
		}
	}
	for len(jobs) > 0 {
		time.Sleep(10 * time.Millisecond)
		if jobs, err = q.mirrors(); err != nil {
			return completed, err
		}
	}
	return completed, q.dropMirrorTargets() // none when no mirror began, or all were finished
}

// OutgoingState is where the outgoing migration of the VM in dir stands, as its QEMU says:
// "completed" (the guest paused for good, the figures its stats), "active" and the like while
// it runs, "failed" or "cancelled" after it ended without completing, "none" for none.
func OutgoingState(dir string) (string, MigrationStats, error) {
	q, err := DialQMP(dir, 10*time.Second)
	if err != nil {
		return "", MigrationStats{}, err
	}
	defer q.Close()
	raw, err := q.Execute("query-migrate", nil)
	if err != nil {
		return "", MigrationStats{}, err
	}
	var st struct {
		Status    string `json:"status"`
		TotalTime int64  `json:"total-time"`
		Downtime  int64  `json:"downtime"`
		RAM       struct {
			Transferred int64 `json:"transferred"`
		} `json:"ram"`
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		return "", MigrationStats{}, err
	}
	if st.Status == "" {
		st.Status = "none"
	}
	return st.Status, MigrationStats{Total: time.Duration(st.TotalTime) * time.Millisecond, Downtime: time.Duration(st.Downtime) * time.Millisecond,
		Bytes: st.RAM.Transferred}, nil
}
