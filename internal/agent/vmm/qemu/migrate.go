package qemu

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
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

// MigrateOut sends the running guest of the VM in dir, live, over conn (a connected stream
// socket whose other end reaches a VMM started with Spec.MigrationIn, MigrateIn): its memory
// while it runs, again what it dirtied meanwhile, until what is left can go within downtime;
// then, paused, that and the devices. bandwidth bounds the stream (bytes per second; 0:
// unbounded), progress (when set) is told the bytes sent and the guest's memory size as it
// goes. Post-copy is never used: the guest runs in one place at a time.
//
// Once it returns without error the guest is paused for good on this VMM ("postmigrate"): the
// caller ends it (Quit) once the other side may run it, or runs it on (Continue) if the other
// side failed before. On an error before that, QEMU runs the guest on here.
func MigrateOut(dir string, conn *os.File, downtime time.Duration, bandwidth int64, progress func(sent, total int64), timeout time.Duration) (MigrationStats, error) {
	q, err := DialQMP(dir, 10*time.Second)
	if err != nil {
		return MigrationStats{}, err
	}
	defer q.Close()
	_ = q.conn.SetDeadline(time.Now().Add(timeout))
	if bandwidth <= 0 {
		bandwidth = 1 << 40
	}
	if _, err := q.Execute("migrate-set-parameters", map[string]any{"downtime-limit": downtime.Milliseconds(), "max-bandwidth": bandwidth}); err != nil {
		return MigrationStats{}, err
	}
	if err := q.ignoreShared(false); err != nil { // the memory goes with the devices
		return MigrationStats{}, err
	}
	if err := q.SendFD("imp-migration", conn); err != nil {
		return MigrationStats{}, err
	}
	if _, err := q.Execute("migrate", map[string]any{"uri": "fd:imp-migration"}); err != nil {
		return MigrationStats{}, fmt.Errorf("starting the migration: %w", err)
	}
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
		}
		if progress != nil && st.RAM.Total > 0 {
			progress(st.RAM.Transferred, st.RAM.Total)
		}
		time.Sleep(10 * time.Millisecond)
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
// to listen (it does some 20–40 ms after its exec), unless it ended.
func dialStarted(dir string, rec *vmm.Record, deadline time.Time) (*QMP, error) {
	for began := time.Now(); ; {
		q, err := DialQMP(dir, 5*time.Second)
		if err == nil {
			return q, nil
		}
		if rec != nil && !rec.Alive() {
			return nil, errors.Join(errors.New("QEMU exited before it listened"), err)
		}
		if time.Now().After(deadline) {
			return nil, err
		}
		wait := 2 * time.Millisecond
		if time.Since(began) > 200*time.Millisecond {
			wait = 20 * time.Millisecond
		}
		time.Sleep(wait)
	}
}
