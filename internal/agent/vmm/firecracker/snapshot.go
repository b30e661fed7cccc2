package firecracker

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/snapshot"
	"github.com/syscode-labs/imp/internal/agent/vmm"
)

// Files of a Firecracker VM's snapshot in the node's snapshot store, and where Firecracker
// writes and reads them in a jail: a snapshot's own names, apart from a suspension's.
const (
	SnapshotStateFile = "vm.state"
	SnapshotMemFile   = "vm.mem"
	jailTakeState     = "/snapshot/take.state"
	jailTakeMem       = "/snapshot/take.mem"
	jailLoadState     = "/snapshot/load.state"
	jailLoadMem       = "/snapshot/load.mem"
	// ifaceID is the network interface's id in Configure: a restore moves it to the VM's tap.
	ifaceID = "eth0"
)

// TakeSnapshot pauses the VM jailed for s, has Firecracker write its state and memory into the
// jail, calls whilePaused (the agent copies the writable disk, so that memory and disk are of one
// instant), resumes the VM and calls resumed, if not nil (the guest runs on: the agent thaws its
// workload); it returns how long the VM was paused. Then it moves the two files
// out of the jail into the directory into (the snapshot being made, the agent's alone): each
// opened beneath the jail with no link followed, refused unless a regular file of one link (a
// VMM that planted a link to a host file gets nothing of it read), copied into a new 0600 file
// of root, and removed from the jail. Whatever fails, the VM runs on.
func TakeSnapshot(ctx context.Context, s Spec, into string, whilePaused func() error, resumed func()) (time.Duration, error) {
	root := s.ChrootDir()
	c := NewJailClient(root)
	for _, f := range []string{jailTakeState, jailTakeMem} {
		if err := removeInJail(root, f); err != nil {
			return 0, fmt.Errorf("removing an earlier snapshot's %s from the jail: %w", f, err)
		}
	}
	defer func() {
		for _, f := range []string{jailTakeState, jailTakeMem} {
			_ = removeInJail(root, f)
		}
	}()
	paused := time.Now()
	if err := Pause(ctx, c); err != nil {
		return 0, err
	}
	err := CreateSnapshot(ctx, c, jailTakeState, jailTakeMem)
	if err == nil && whilePaused != nil {
		err = whilePaused()
	}
	if rerr := Resume(ctx, c); rerr != nil {
		return time.Since(paused), errors.Join(err, fmt.Errorf("resuming the VM: %w", rerr))
	}
	pause := time.Since(paused)
	if resumed != nil {
		resumed()
	}
	if err != nil {
		return pause, err
	}
	for _, f := range []struct {
		src, dst string
		max      int64
	}{{jailTakeState, SnapshotStateFile, maxStateBytes}, {jailTakeMem, SnapshotMemFile, s.MemoryMiB << 20}} {
		if err := moveOut(root, f.src, filepath.Join(into, f.dst), f.max); err != nil {
			return pause, err
		}
	}
	return pause, nil
}

// maxStateBytes bounds a Firecracker VM's device state file.
const maxStateBytes = 16 << 20

// moveOut copies the file rel of the jail at root to dst, a new file of the agent's, and
// removes it from the jail.
func moveOut(root, rel, dst string, max int64) error {
	if err := copyOut(root, rel, dst, max); err != nil {
		return err
	}
	return removeInJail(root, rel)
}

// copyOut copies the file rel of the jail at root, which must be a regular file of one link
// and at most max bytes, to dst, a new file of the agent's. It is opened without blocking: a
// FIFO the VMM planted holds nothing up.
func copyOut(root, rel, dst string, max int64) error {
	fd, err := openInJail(root, rel, unix.O_RDONLY|unix.O_NONBLOCK)
	if err != nil {
		return fmt.Errorf("the snapshot's %s in the jail: %w", rel, err)
	}
	in := os.NewFile(uintptr(fd), rel)
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() || fi.Sys().(*syscall.Stat_t).Nlink != 1 {
		return fmt.Errorf("%s in the jail is not a file of its own: refused", rel)
	}
	if fi.Size() > max {
		return fmt.Errorf("%s in the jail holds %d bytes, more than the %d it may: refused", rel, fi.Size(), max)
	}
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	if err := snapshot.Copy(in, out); err != nil {
		out.Close()
		return fmt.Errorf("copying %s out of the jail: %w", rel, err)
	}
	return out.Close()
}

// RestoreSnapshot starts a fresh VMM in the jail of s (the restored VM's own: its disks, its
// configuration) and loads the snapshot whose state and memory files are state and mem (in the
// node's store). Each is placed in the jail as the VM's uid's own file (a reflink where the file
// system shares blocks, so the memory file, which Firecracker maps rather than reads, costs no
// copy; a sparse copy otherwise); the network interface is moved to the VM's tap
// (network_overrides), and the VM resumed once loaded (launch). The placed files go then.
func RestoreSnapshot(ctx context.Context, s Spec, state, mem, configHash string) (*vmm.Record, error) {
	if err := PrepareChroot(s); err != nil {
		return nil, err
	}
	root := s.ChrootDir()
	defer func() {
		for _, f := range []string{jailLoadState, jailLoadMem} {
			_ = removeInJail(root, f)
		}
	}()
	for src, rel := range map[string]string{state: jailLoadState, mem: jailLoadMem} {
		if err := placeOwned(root, rel, src, s.UID, s.GID); err != nil {
			return nil, err
		}
	}
	load := SnapshotLoad{SnapshotPath: jailLoadState, MemBackend: &MemoryBackend{BackendType: "File", BackendPath: jailLoadMem}}
	if s.Tap != "" {
		load.NetworkOverrides = []NetworkOverride{{IfaceID: ifaceID, HostDevName: s.Tap}}
	}
	return launch(ctx, s, configHash, func(c *Client) error { return c.Do(ctx, "PUT", "/snapshot/load", load, nil) },
		func(c *Client) error { return Resume(ctx, c) })
}

// placeOwned puts a copy of src at rel in the jail at root, owned by uid and gid, replacing
// whatever is there without following it.
func placeOwned(root, rel, src string, uid, gid int) error {
	r, err := os.OpenRoot(root)
	if err != nil {
		return fmt.Errorf("opening the jail: %w", err)
	}
	defer r.Close()
	name := strings.TrimPrefix(rel, "/")
	if err := r.Remove(name); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing what is at %s in the jail: %w", rel, err)
	}
	in, err := os.OpenFile(src, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := r.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	if err := snapshot.Copy(in, out); err != nil {
		out.Close()
		return fmt.Errorf("placing the snapshot's %s in the jail: %w", rel, err)
	}
	if err := out.Chown(uid, gid); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// CopySuspension copies the snapshot a suspended VM jailed for s left in its jail into the
// directory into, as TakeSnapshot's files; the suspension stays.
func CopySuspension(s Spec, into string) error {
	root := s.ChrootDir()
	if err := copyOut(root, jailSnapshotState, filepath.Join(into, SnapshotStateFile), maxStateBytes); err != nil {
		return err
	}
	return copyOut(root, jailSnapshotMem, filepath.Join(into, SnapshotMemFile), s.MemoryMiB<<20)
}

// Continue resumes the VM jailed at root if it is paused (a snapshot's pause that an agent did
// not see through).
func Continue(ctx context.Context, root string) error {
	c := NewJailClient(root)
	info, err := Info(ctx, c)
	if err != nil {
		return err
	}
	if info.State == "Paused" {
		return Resume(ctx, c)
	}
	return nil
}

// PauseIn pauses the VM of the jail at root if it runs (a warm pool's idle member).
func PauseIn(ctx context.Context, root string) error {
	c := NewJailClient(root)
	info, err := Info(ctx, c)
	if err != nil {
		return err
	}
	if info.State == "Running" {
		return Pause(ctx, c)
	}
	return nil
}
