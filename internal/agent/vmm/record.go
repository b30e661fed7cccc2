// Package vmm holds what every VMM driver shares: the record a driver keeps of a running VMM in
// the VM's state directory, so that a restarted agent finds it again.
package vmm

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// RecordFile is the record's file in a VM's state directory.
const RecordFile = "vmm.json"

// Record is what the agent keeps of a running VMM in its state directory, so that a restarted
// agent can find it again. A pid alone is not enough: pids are reused, so the process's start
// time must match too.
type Record struct {
	Kind      string `json:"kind"`
	Pid       int    `json:"pid"`
	StartTime uint64 `json:"startTime"` // clock ticks after boot, /proc/<pid>/stat field 22
	// ConfigHash identifies the configuration the VMM was started with.
	ConfigHash string `json:"configHash"`
	// IncomingFD, when not 0, is the VMM's descriptor of the device state it waits to load on
	// its memory, filled already (qemu.ResumeIncoming starts that load).
	IncomingFD int `json:"incomingFD,omitempty"`
}

// WriteRecord writes r into dir atomically.
func WriteRecord(dir string, r *Record) error {
	data, err := json.Marshal(r)
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, RecordFile+".tmp")
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return fmt.Errorf("writing the VMM record: %w", err)
	}
	return os.Rename(tmp, filepath.Join(dir, RecordFile))
}

// ReadRecord reads the record in a VM's state directory.
func ReadRecord(dir string) (*Record, error) {
	data, err := os.ReadFile(filepath.Join(dir, RecordFile))
	if err != nil {
		return nil, err
	}
	var r Record
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("parsing the VMM record in %s: %w", dir, err)
	}
	return &r, nil
}

// Alive reports whether the recorded process still runs: same pid, same start time.
func (r *Record) Alive() bool {
	st, err := StartTime(r.Pid)
	return err == nil && st == r.StartTime
}

// WaitGone waits up to d for the recorded process to end, and says whether it did.
func (r *Record) WaitGone(d time.Duration) bool {
	for deadline := time.Now().Add(d); r.Alive(); time.Sleep(20 * time.Millisecond) {
		if !time.Now().Before(deadline) {
			return false
		}
	}
	return true
}

// StartTime returns a process's start time in clock ticks after boot.
func StartTime(pid int) (uint64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) may hold spaces and parentheses: count from its last ')'.
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("parsing /proc/%d/stat", pid)
	}
	fields := strings.Fields(s[i+1:])
	if len(fields) < 20 {
		return 0, fmt.Errorf("parsing /proc/%d/stat", pid)
	}
	// fields[0] is field 3 (state); field 22 (starttime) is fields[19].
	return strconv.ParseUint(fields[19], 10, 64)
}

// DialUnix connects to the unix socket at path (see unixAddr).
func DialUnix(path string) (net.Conn, error) {
	var c net.Conn
	err := unixAddr(path, func(addr string) (err error) { c, err = net.Dial("unix", addr); return err })
	return c, err
}

// unixAddr calls f with a socket address for path: path itself, or, when it is too long for a
// socket address (108 bytes), the path through its directory's descriptor in /proc/self/fd.
func unixAddr(path string, f func(addr string) error) error {
	if len(path) < 100 {
		return f(path)
	}
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer d.Close()
	return f(fmt.Sprintf("/proc/self/fd/%d/%s", d.Fd(), filepath.Base(path)))
}

// IntentFile marks, in a VM's state directory, a VMM being started whose record is not
// written yet: a crash between the two leaves a VMM that only its marker (Marked) can find.
const IntentFile = "vmm.intent"

// WriteIntent records, before a VMM of the VM in dir is started, that one is being started.
func WriteIntent(dir string) error {
	if err := os.WriteFile(filepath.Join(dir, IntentFile), nil, 0o600); err != nil {
		return fmt.Errorf("recording the intent to start a VMM: %w", err)
	}
	return nil
}

// ClearIntent removes the intent once the VMM is recorded (or known gone).
func ClearIntent(dir string) error {
	if err := os.Remove(filepath.Join(dir, IntentFile)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("clearing the intent to start a VMM: %w", err)
	}
	return nil
}

// HasIntent reports whether a VMM of the VM in dir was being started and not recorded.
func HasIntent(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, IntentFile))
	return err == nil
}

// DirEnv is the variable in a VMM's environment that names the directory of its run: a VMM of
// the same VM kept elsewhere (a migration's other side, on a machine that holds two nodes'
// agents, as the tests' does) is not this directory's.
const DirEnv = "IMP_VM_DIR"

// MarkedIn is Marked without the processes that say they are another directory's (DirEnv).
func MarkedIn(uid, dir string) []int {
	var out []int
	for _, pid := range Marked(uid) {
		env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
		if err == nil {
			other := false
			for _, kv := range strings.Split(string(env), "\x00") {
				if v, ok := strings.CutPrefix(kv, DirEnv+"="); ok && filepath.Clean(v) != filepath.Clean(dir) {
					other = true
				}
			}
			if other {
				continue
			}
		}
		out = append(out, pid)
	}
	return out
}

// Marked lists the processes that carry a VM's marker, its UID, on their command line, as
// every driver's VMM does: QEMU as "-name <uid>", the jailer as "--id <uid>", and the
// Firecracker it execs as "--id=<uid>" (the jailer's own form).
func Marked(uid string) []int {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	var pids []int
	for _, p := range procs {
		data, err := os.ReadFile(p)
		if err != nil || !bytes.Contains(data, []byte(uid)) {
			continue
		}
		args := strings.Split(strings.TrimRight(string(data), "\x00"), "\x00")
		for i := 1; i < len(args); i++ {
			if args[i] == uid && (args[i-1] == "-name" || args[i-1] == "--id") || args[i] == "--id="+uid {
				if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p))); err == nil && pid != os.Getpid() {
					pids = append(pids, pid)
				}
				break
			}
		}
	}
	return pids
}

// KillUnrecorded kills the VMMs of the VM in dir (marked with id) that a start left running
// without a record, when its intent says one was being started: a crash between the two. It
// returns those it killed, and clears the intent.
func KillUnrecorded(dir, id string) []int {
	if !HasIntent(dir) {
		return nil
	}
	if rec, err := ReadRecord(dir); err == nil && rec.Alive() {
		return nil // the start got as far as its record: the VMM is known
	}
	pids := KillMarkedIn(id, dir, 5*time.Second)
	_ = ClearIntent(dir)
	return pids
}

// KillMarkedIn kills every process carrying the VM's marker that is not another directory's
// (MarkedIn) and waits up to wait for them to end; it returns those it killed.
func KillMarkedIn(uid, dir string, wait time.Duration) []int {
	pids := MarkedIn(uid, dir)
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	for deadline := time.Now().Add(wait); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		alive := false
		for _, pid := range pids {
			if st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil && !zombie(st) {
				alive = true
			}
		}
		if !alive {
			break
		}
	}
	return pids
}

// zombie reports whether /proc/<pid>/stat data is of a process that ended and awaits its reaper.
func zombie(stat []byte) bool {
	i := bytes.LastIndexByte(stat, ')')
	return i >= 0 && i+2 < len(stat) && stat[i+2] == 'Z'
}
