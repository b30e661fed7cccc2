// Package snapshot keeps VM snapshots on a node: each in a directory of its own under the
// agent's state, the agent's alone (0700, files 0600, outside every VMM's jail: a VMM gets a
// snapshot's files as descriptors the agent opened), with a manifest saying what it was taken of
// and with, so that a restore on a host that differs (another VMM, kernel or CPU) is refused
// before anything runs. A snapshot is written into a temporary directory and renamed into place
// whole: a crash while taking one leaves nothing that looks like a snapshot.
package snapshot

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/disk"
)

// Files of a snapshot's directory.
const (
	// ManifestFile describes the snapshot (Manifest).
	ManifestFile = "manifest.json"
	// StateFile is QEMU's memory and device state (its migration stream), or its device state
	// alone where MemoryFile is beside it.
	StateFile = "state"
	// MemoryFile is the guest's memory, page for page (sparse), of a QEMU VM whose memory was
	// a memfd (guestmem): a restore fills a new one with it instead of streaming it.
	MemoryFile = "memory"
	// DiskFile is the VM's writable disk as it was when the VM was paused.
	DiskFile = "rw.ext4"
	// BaseFile is the image's disk the VM ran on (read-only, 0444): the guest's memory holds
	// pages of it, so that a restore runs on this very disk, not on one a node built again from
	// the image (the same files, other blocks).
	BaseFile = "base.ext4"
)

// Host is what a snapshot's memory depends on of the node it was taken on: a restore needs the
// same.
type Host struct {
	// VMM is the VMM kind, VMMVersion its version, Accel its acceleration (kvm, tcg).
	VMM        impv1.VMMKind `json:"vmm"`
	VMMVersion string        `json:"vmmVersion,omitempty"`
	Accel      string        `json:"accel,omitempty"`
	// Kernel and Initramfs are the sha256 of the guest kernel and initramfs the VM booted.
	Kernel    string `json:"kernel"`
	Initramfs string `json:"initramfs"`
	// CPU is the host CPU's model and flags, hashed: the guest's CPU features are the host's.
	CPU string `json:"cpu"`
}

// Manifest is what a snapshot is of and was taken with.
type Manifest struct {
	// Namespace is the snapshot's: it is restored in no other.
	Namespace string    `json:"namespace"`
	Name      string    `json:"name"`
	UID       types.UID `json:"uid"`
	// VMUID is the VM snapshotted.
	VMUID types.UID `json:"vmUID"`
	Host  Host      `json:"host"`
	// Image is the image of the VM's base disk, by digest (repository@sha256:...).
	Image     string `json:"image"`
	VCPUs     int32  `json:"vcpus"`
	MemoryMiB int64  `json:"memoryMiB"`
	DiskBytes int64  `json:"diskBytes"`
	// Network: the VM had a network interface (a restore must have one too); its MAC was MAC.
	Network bool   `json:"network,omitempty"`
	MAC     string `json:"mac,omitempty"`
	// Session: the VM had the session channel, a device a restore must have too.
	Session bool `json:"session,omitempty"`
	// Token is the VM's guest channel token, which the restored guest holds until it is given
	// its own.
	Token string `json:"token"`
	// Taken is when the VM was paused for it; Pause how long it was paused.
	Taken time.Time     `json:"taken"`
	Pause time.Duration `json:"pause"`
}

// Store is the node's snapshots, under Dir.
type Store struct {
	Dir string
}

// Path is the directory of the snapshot with uid.
func (s *Store) Path(uid types.UID) string { return filepath.Join(s.Dir, string(uid)) }

// File is the path of file of the snapshot with uid.
func (s *Store) File(uid types.UID, file string) string { return filepath.Join(s.Path(uid), file) }

// Begin makes a fresh temporary directory for the snapshot with uid, removing what a taking
// that did not finish left.
func (s *Store) Begin(uid types.UID) (string, error) {
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return "", fmt.Errorf("creating the snapshot store: %w", err)
	}
	tmp := s.Path(uid) + ".tmp"
	if err := os.RemoveAll(tmp); err != nil {
		return "", err
	}
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return "", fmt.Errorf("creating %s: %w", tmp, err)
	}
	return tmp, nil
}

// Commit writes m into tmp (from Begin) and puts the snapshot in place, whole.
func (s *Store) Commit(tmp string, m *Manifest) error {
	data, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(tmp, ManifestFile), data, 0o600); err != nil {
		return fmt.Errorf("writing the snapshot's manifest: %w", err)
	}
	entries, err := os.ReadDir(tmp)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := syncPath(filepath.Join(tmp, e.Name())); err != nil {
			return err
		}
	}
	dst := s.Path(m.UID)
	if err := os.RemoveAll(dst); err != nil {
		return err
	}
	if err := os.Rename(tmp, dst); err != nil {
		return fmt.Errorf("putting the snapshot in place: %w", err)
	}
	return syncPath(s.Dir)
}

// Read reads the manifest of the snapshot with uid.
func (s *Store) Read(uid types.UID) (*Manifest, error) {
	m, err := readManifest(s.File(uid, ManifestFile))
	if err != nil {
		return nil, err
	}
	if m.UID != uid {
		return nil, fmt.Errorf("the manifest in snapshot %s's directory is of snapshot %s", uid, m.UID)
	}
	return m, nil
}

// readManifest reads the manifest at path (at most 1 MiB of it).
func readManifest(path string) (*Manifest, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, 1<<20))
	if err != nil {
		return nil, err
	}
	var m Manifest
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("reading the snapshot manifest %s: %w", path, err)
	}
	return &m, nil
}

// Remove removes the snapshot with uid, and what a taking of it left.
func (s *Store) Remove(uid types.UID) error {
	return errors.Join(os.RemoveAll(s.Path(uid)), os.RemoveAll(s.Path(uid)+".tmp"), os.RemoveAll(s.Path(uid)+".push"))
}

// List is the uids of the snapshots in the store, finished or not.
func (s *Store) List() ([]types.UID, error) {
	entries, err := os.ReadDir(s.Dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []types.UID
	seen := map[types.UID]bool{}
	for _, e := range entries {
		uid := types.UID(strings.TrimSuffix(strings.TrimSuffix(e.Name(), ".tmp"), ".push"))
		if !seen[uid] {
			seen[uid] = true
			out = append(out, uid)
		}
	}
	return out, nil
}

// Size is the space the snapshot with uid takes on the node: the allocated bytes of its files.
func (s *Store) Size(uid types.UID) (int64, error) {
	entries, err := os.ReadDir(s.Path(uid))
	if err != nil {
		return 0, err
	}
	var total int64
	for _, e := range entries {
		if !e.Type().IsRegular() {
			continue
		}
		n, err := disk.Allocated(s.File(uid, e.Name()))
		if err != nil {
			return 0, err
		}
		total += n
	}
	return total, nil
}

// Compatible says why a snapshot taken on m.Host cannot run on h, or nil.
func (m *Manifest) Compatible(h Host) error {
	switch {
	case m.Host.VMM != h.VMM:
		return fmt.Errorf("the snapshot was taken under %s; this node runs the VM under %s", m.Host.VMM, h.VMM)
	case m.Host.VMMVersion != h.VMMVersion:
		return fmt.Errorf("the snapshot was taken under %s %s; this node has %s", m.Host.VMM, m.Host.VMMVersion, h.VMMVersion)
	case m.Host.Accel != h.Accel:
		return fmt.Errorf("the snapshot was taken with %s acceleration; this node has %s", m.Host.Accel, h.Accel)
	case m.Host.Kernel != h.Kernel:
		return fmt.Errorf("the snapshot's guest kernel (sha256 %.12s) is not this node's (%.12s)", m.Host.Kernel, h.Kernel)
	case m.Host.Initramfs != h.Initramfs:
		return fmt.Errorf("the snapshot's initramfs (sha256 %.12s) is not this node's (%.12s)", m.Host.Initramfs, h.Initramfs)
	case m.Host.CPU != h.CPU:
		return errors.New("the snapshot was taken on another CPU model or feature set than this node's")
	}
	return nil
}

// Hashes is the sha256 of files, each computed once per path, size and modification time.
type Hashes struct {
	mu   sync.Mutex
	seen map[string]string
}

// Of returns the hex sha256 of the file at path.
func (h *Hashes) Of(path string) (string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	key := fmt.Sprintf("%s\x00%d\x00%d", path, fi.Size(), fi.ModTime().UnixNano())
	h.mu.Lock()
	if v, ok := h.seen[key]; ok {
		h.mu.Unlock()
		return v, nil
	}
	h.mu.Unlock()
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	sum := sha256.New()
	if _, err := io.Copy(sum, f); err != nil {
		return "", fmt.Errorf("hashing %s: %w", path, err)
	}
	v := hex.EncodeToString(sum.Sum(nil))
	h.mu.Lock()
	if h.seen == nil {
		h.seen = map[string]string{}
	}
	h.seen[key] = v
	h.mu.Unlock()
	return v, nil
}

// CPU is this host's CPU model and flags from cpuinfo, hashed.
func CPU(cpuinfo string) string {
	var model, flags string
	for _, line := range strings.Split(cpuinfo, "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch strings.TrimSpace(k) {
		case "model name":
			if model == "" {
				model = strings.TrimSpace(v)
			}
		case "flags":
			if flags == "" {
				flags = strings.TrimSpace(v)
			}
		}
	}
	sum := sha256.Sum256([]byte(model + "\x00" + flags))
	return hex.EncodeToString(sum[:])
}

func syncPath(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}
