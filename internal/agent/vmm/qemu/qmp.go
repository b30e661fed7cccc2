package qemu

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/syscode-labs/imp/internal/agent/vmm"
)

// QMP is a connection to a VM's QEMU Machine Protocol socket.
type QMP struct {
	conn net.Conn
	r    *bufio.Reader
}

// DialQMP connects to the QMP socket of the VM in dir and negotiates capabilities.
func DialQMP(dir string, timeout time.Duration) (*QMP, error) {
	conn, err := vmm.DialUnix(filepath.Join(dir, QMPSock))
	if err != nil {
		return nil, fmt.Errorf("connecting to QMP: %w", err)
	}
	q := &QMP{conn: conn, r: bufio.NewReader(conn)}
	_ = conn.SetDeadline(time.Now().Add(timeout))
	var greeting struct {
		QMP *json.RawMessage `json:"QMP"`
	}
	line, err := q.readLine()
	if err == nil {
		err = json.Unmarshal(line, &greeting)
	}
	if err != nil || greeting.QMP == nil {
		conn.Close()
		return nil, fmt.Errorf("reading the QMP greeting %q: %v", line, err)
	}
	if _, err := q.Execute("qmp_capabilities", nil); err != nil {
		conn.Close()
		return nil, err
	}
	return q, nil
}

// MaxQMPLine bounds a line QEMU sends (a command's answer or an event; the agent's largest,
// query-migrate, is under 1 KiB): a compromised VMM that streams without end costs the agent
// this much, never its memory.
const MaxQMPLine = 1 << 20

// readLine reads one line of at most MaxQMPLine bytes.
func (q *QMP) readLine() ([]byte, error) {
	var line []byte
	for {
		part, err := q.r.ReadSlice('\n')
		if len(line)+len(part) > MaxQMPLine {
			return nil, fmt.Errorf("a QMP line longer than %d bytes", MaxQMPLine)
		}
		line = append(line, part...)
		if err != bufio.ErrBufferFull {
			return line, err
		}
	}
}

// Close closes the connection.
func (q *QMP) Close() error { return q.conn.Close() }

// Execute runs a QMP command and returns its result, skipping asynchronous events.
func (q *QMP) Execute(command string, args any) (json.RawMessage, error) {
	return q.execute(command, args, nil)
}

// SendFD passes f to QEMU under name (QMP getfd), for a command that names it next.
func (q *QMP) SendFD(name string, f *os.File) error {
	_, err := q.execute("getfd", map[string]any{"fdname": name}, f)
	return err
}

func (q *QMP) execute(command string, args any, f *os.File) (json.RawMessage, error) {
	req := map[string]any{"execute": command}
	if args != nil {
		req["arguments"] = args
	}
	data, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	if f != nil {
		uc, ok := q.conn.(*net.UnixConn)
		if !ok {
			return nil, fmt.Errorf("QMP %s: passing a file needs a unix socket", command)
		}
		if _, _, err := uc.WriteMsgUnix(append(data, '\n'), syscall.UnixRights(int(f.Fd())), nil); err != nil {
			return nil, fmt.Errorf("QMP %s: %w", command, err)
		}
	} else if _, err := q.conn.Write(append(data, '\n')); err != nil {
		return nil, fmt.Errorf("QMP %s: %w", command, err)
	}
	for {
		line, err := q.readLine()
		if err != nil {
			return nil, fmt.Errorf("QMP %s: %w", command, err)
		}
		var resp struct {
			Return json.RawMessage `json:"return"`
			Error  *struct {
				Class, Desc string
			} `json:"error"`
			Event string `json:"event"`
		}
		if err := json.Unmarshal(line, &resp); err != nil {
			return nil, fmt.Errorf("QMP %s: parsing %q: %w", command, line, err)
		}
		switch {
		case resp.Event != "":
			continue
		case resp.Error != nil:
			return nil, fmt.Errorf("QMP %s: %s: %s", command, resp.Error.Class, resp.Error.Desc)
		default:
			return resp.Return, nil
		}
	}
}

// Quit asks the VMM in dir to exit at once (QMP quit): the step after a graceful shutdown that
// did not end in time, before a signal.
func Quit(dir string) error {
	q, err := DialQMP(dir, 2*time.Second)
	if err != nil {
		return err
	}
	defer q.Close()
	_, err = q.Execute("quit", nil)
	return err
}

// StateFile is where a suspended VM's memory and device state live in its state directory.
const StateFile = "suspend.state"

// Suspend stops the guest's vCPUs, writes its memory and device state to StateFile in dir
// (QEMU's migration to a file the agent opens and passes over QMP: QEMU's sandbox lets it spawn
// nothing) and quits QEMU. When saving fails the guest is resumed and QEMU keeps running: a
// failed suspend never leaves the VM half-dead.
func Suspend(dir string, timeout time.Duration) error {
	q, err := DialQMP(dir, 10*time.Second)
	if err != nil {
		return err
	}
	defer q.Close()
	_ = q.conn.SetDeadline(time.Now().Add(timeout))
	if _, err := q.Execute("stop", nil); err != nil {
		return err
	}
	state := filepath.Join(dir, StateFile)
	_ = os.Remove(state)
	out, err := os.OpenFile(state, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return q.resumeAfter(fmt.Errorf("creating the state file: %w", err))
	}
	defer out.Close()
	if err := q.ignoreShared(false); err != nil { // the memory is saved with the devices
		return q.resumeAfter(err)
	}
	if err := q.save(out); err != nil {
		return q.resumeAfter(err)
	}
	_, _ = q.Execute("quit", nil)
	return nil
}

// Snapshot pauses the guest, writes its memory and device state to state (a file the agent
// opened; QEMU gets its descriptor), calls whilePaused (which copies the writable disk, so that
// memory and disk are of one instant) and runs the guest on. It returns how long the guest was
// paused. Whatever fails, the guest runs on.
func Snapshot(dir string, state *os.File, whilePaused func() error, timeout time.Duration) (time.Duration, error) {
	q, err := DialQMP(dir, 10*time.Second)
	if err != nil {
		return 0, err
	}
	defer q.Close()
	_ = q.conn.SetDeadline(time.Now().Add(timeout))
	// Unbounded bandwidth: the guest is paused, every second of the copy is a second of pause.
	if _, err := q.Execute("migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40}); err != nil {
		return 0, err
	}
	if err := q.ignoreShared(false); err != nil { // the memory is saved with the devices
		return 0, err
	}
	paused := time.Now()
	if _, err := q.Execute("stop", nil); err != nil {
		return 0, err
	}
	err = q.save(state)
	if err == nil && whilePaused != nil {
		err = whilePaused()
	}
	// The guest runs on whatever the save and the copy took: a deadline of its own, and a new
	// connection if this one is done for.
	_ = q.conn.SetDeadline(time.Now().Add(30 * time.Second))
	if _, cerr := q.Execute("cont", nil); cerr != nil {
		if cerr = Continue(dir); cerr != nil {
			return time.Since(paused), errors.Join(err, fmt.Errorf("resuming the guest: %w", cerr))
		}
	}
	return time.Since(paused), err
}

// ignoreShared sets QEMU's x-ignore-shared: migrations leave out the guest's memory where it is
// a shared memfd (a restore's, guestmem). A restore sets it to load the devices alone, and
// unsets it; a suspend or snapshot unsets it again, in case an agent stopped in between.
func (q *QMP) ignoreShared(on bool) error {
	_, err := q.Execute("migrate-set-capabilities", map[string]any{
		"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": on}}})
	if err != nil {
		return fmt.Errorf("setting x-ignore-shared: %w", err)
	}
	return nil
}

// save writes the stopped guest's memory and device state to out.
func (q *QMP) save(out *os.File) error {
	if err := q.SendFD("imp-state", out); err != nil {
		return err
	}
	if _, err := q.Execute("migrate", map[string]any{"uri": "fd:imp-state"}); err != nil {
		return err
	}
	for {
		raw, err := q.Execute("query-migrate", nil)
		if err != nil {
			return err
		}
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		_ = json.Unmarshal(raw, &st)
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			_, _ = q.Execute("migrate_cancel", nil)
			return fmt.Errorf("saving the VM's state: %s %s", st.Status, st.ErrorDesc)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// resumeAfter runs the stopped guest again after err.
func (q *QMP) resumeAfter(err error) error {
	_, _ = q.Execute("migrate_cancel", nil)
	if _, cerr := q.Execute("cont", nil); cerr != nil {
		return fmt.Errorf("%w; and resuming the guest failed: %v", err, cerr)
	}
	return err
}

// ResumeIncoming waits for a VMM started with Spec.Incoming to load its state, then runs the
// guest again. A VMM whose record has an IncomingFD (Spec.MemoryImage) waits for the agent:
// ResumeIncoming has it load the devices from that descriptor on the memory it has.
func ResumeIncoming(dir string, rec *vmm.Record, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	q, err := dialStarted(dir, rec, deadline)
	if err != nil {
		return err
	}
	defer q.Close()
	_ = q.conn.SetDeadline(deadline)
	poll := 20 * time.Millisecond
	if rec != nil && rec.IncomingFD != 0 {
		if err := q.loadDevices(rec.IncomingFD); err != nil {
			return err
		}
		poll = 2 * time.Millisecond // a few hundred kilobytes
	}
	for {
		status, err := q.status()
		if err != nil {
			return err
		}
		switch status {
		case "inmigrate":
			time.Sleep(poll)
			continue
		}
		if rec != nil && rec.IncomingFD != 0 {
			// Its suspends and snapshots save the memory unless they say otherwise.
			if err := q.ignoreShared(false); err != nil {
				return err
			}
		}
		if status == "running" {
			return nil
		}
		_, err = q.Execute("cont", nil)
		return err
	}
}

// loadDevices has a VMM started with -incoming defer load the device state at its descriptor
// fd, leaving the memory as it is (x-ignore-shared), unless a load has begun already (an agent
// before this one's restart began it).
func (q *QMP) loadDevices(fd int) error {
	raw, err := q.Execute("query-migrate", nil)
	if err != nil {
		return err
	}
	var st struct {
		Status string `json:"status"`
	}
	_ = json.Unmarshal(raw, &st)
	if st.Status != "" && st.Status != "none" {
		return nil
	}
	if err := q.ignoreShared(true); err != nil {
		return err
	}
	if _, err := q.Execute("migrate-incoming", map[string]any{"uri": fmt.Sprintf("fd:%d", fd)}); err != nil {
		return fmt.Errorf("loading the snapshot's devices: %w", err)
	}
	return nil
}

// Pause pauses the guest of the VM in dir if it runs (a warm pool's idle member: it takes no
// CPU until it is handed to a claim); a guest in any other state is left as it is.
func Pause(dir string) error {
	q, err := DialQMP(dir, 5*time.Second)
	if err != nil {
		return err
	}
	defer q.Close()
	status, err := q.status()
	if err != nil || status != "running" {
		return err
	}
	_, err = q.Execute("stop", nil)
	return err
}

// Continue runs the guest of the VM in dir on if it is paused (a snapshot's pause that an agent
// did not see through); a guest that runs, or is being loaded, is left as it is.
func Continue(dir string) error {
	q, err := DialQMP(dir, 5*time.Second)
	if err != nil {
		return err
	}
	defer q.Close()
	status, err := q.status()
	if err != nil {
		return err
	}
	switch status {
	case "running", "inmigrate", "shutdown", "internal-error", "guest-panicked":
		return nil
	}
	_, _ = q.Execute("migrate_cancel", nil)
	_, err = q.Execute("cont", nil)
	return err
}

// status is the VM's run state (query-status): running, paused, inmigrate, postmigrate, ...
// Status is the run state of the guest of the VM in dir ("running", "paused", ...).
func Status(dir string) (string, error) {
	q, err := DialQMP(dir, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer q.Close()
	return q.status()
}

func (q *QMP) status() (string, error) {
	raw, err := q.Execute("query-status", nil)
	if err != nil {
		return "", err
	}
	var st struct {
		Status string `json:"status"`
	}
	_ = json.Unmarshal(raw, &st)
	return st.Status, nil
}
