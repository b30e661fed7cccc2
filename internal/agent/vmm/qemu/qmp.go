package qemu

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"path/filepath"
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
	line, err := q.r.ReadBytes('\n')
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

// Close closes the connection.
func (q *QMP) Close() error { return q.conn.Close() }

// Execute runs a QMP command and returns its result, skipping asynchronous events.
func (q *QMP) Execute(command string, args any) (json.RawMessage, error) {
	req := map[string]any{"execute": command}
	if args != nil {
		req["arguments"] = args
	}
	data, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	if _, err := q.conn.Write(append(data, '\n')); err != nil {
		return nil, fmt.Errorf("QMP %s: %w", command, err)
	}
	for {
		line, err := q.r.ReadBytes('\n')
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
