package guestinit

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/guestsession"
)

// procs hands the ends of the commands the session server started to their waiters: imp-init
// reaps every process itself, so os/exec's Wait cannot.
var procs = &reaper{waiting: map[int]chan int{}}

type reaper struct {
	mu      sync.Mutex
	waiting map[int]chan int
}

// start starts cmd and registers it before the reaping loop can see it end.
func (r *reaper) start(cmd *exec.Cmd) (func() int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	done := make(chan int, 1)
	r.waiting[cmd.Process.Pid] = done
	return func() int {
		code := <-done
		_ = cmd.Process.Release()
		return code
	}, nil
}

// reaped delivers the end of pid, if the session server started it.
func (r *reaper) reaped(pid int, ws unix.WaitStatus) {
	r.mu.Lock()
	done := r.waiting[pid]
	delete(r.waiting, pid)
	r.mu.Unlock()
	if done != nil {
		done <- guestsession.ExitCode(syscall.WaitStatus(ws))
	}
}

// sessionKeys writes the OS's users' SSH keys: set by the guest side of an OS, nil in a
// workload's guest (which refuses them).
var sessionKeys func(guestsession.AuthorizedKeys) ([]string, error)

// serveSessions answers the agent's exec and port-forward requests, as the workload runs (the
// run's configuration as it stands: live), for the rest of the VM's life.
func serveSessions() {
	if ch == nil || ch.token == "" {
		return
	}
	srv := &guestsession.Server{
		Token:    ch.token,
		TokenNow: ch.currentToken,
		Command:  func(argv []string) (*exec.Cmd, error) { return command(live.config(), argv) },
		Start:    procs.start,
		Keys:     sessionKeys,
	}
	if ch.vsock {
		go serveVsockSessions(srv, ch.port+guestsession.VsockPortOffset)
		return
	}
	go serveVirtioSessions(srv)
}

// serveVirtioSessions serves the virtio-serial port of the session channel: one host
// connection at a time, each a fresh HTTP/2 connection. It starts one only once the host is
// connected and has spoken (HTTP/2's client speaks first), so that nothing the guest writes
// waits in the port for a host that is not there.
func serveVirtioSessions(srv *guestsession.Server) {
	dev, err := virtioPort(guestsession.PortName)
	if err != nil {
		fmt.Fprintln(os.Stderr, "imp-init: no session channel:", err)
		return
	}
	for {
		f, err := os.OpenFile(dev, os.O_RDWR, 0)
		if err != nil {
			fmt.Fprintln(os.Stderr, "imp-init: opening the session channel:", err)
			return
		}
		if err := waitForHost(f); err == nil {
			_ = srv.Serve(guestsession.FileConn(f))
		}
		f.Close()
		time.Sleep(50 * time.Millisecond)
	}
}

// waitForHost waits until the port's host end is connected and has sent something.
func waitForHost(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	for {
		var ready bool
		var perr error
		if err := rc.Control(func(fd uintptr) {
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			_, perr = unix.Poll(pfd, 1000)
			// A virtio-serial port polls HUP while its host end is not connected.
			ready = pfd[0].Revents&unix.POLLIN != 0 && pfd[0].Revents&unix.POLLHUP == 0
			if pfd[0].Revents&unix.POLLHUP != 0 {
				time.Sleep(100 * time.Millisecond)
			}
		}); err != nil {
			return err
		}
		if perr != nil && !errors.Is(perr, unix.EINTR) {
			return perr
		}
		if ready {
			return nil
		}
	}
}

// serveVsockSessions accepts the host's vsock connections to port (Firecracker forwards
// "CONNECT <port>" on its vsock socket here), each an HTTP/2 connection of its own.
func serveVsockSessions(srv *guestsession.Server, port uint32) {
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err == nil {
		if err = unix.Bind(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: port}); err == nil {
			err = unix.Listen(fd, 4)
		}
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "imp-init: listening on vsock port %d for sessions: %v\n", port, err)
		return
	}
	for {
		nfd, _, err := unix.Accept4(fd, unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK) // non-blocking: the runtime polls it
		if err != nil {
			if errors.Is(err, unix.EINTR) || errors.Is(err, unix.ECONNABORTED) {
				continue
			}
			fmt.Fprintln(os.Stderr, "imp-init: accepting a session:", err)
			return
		}
		go func() {
			f := os.NewFile(uintptr(nfd), "vsock-session")
			_ = srv.Serve(guestsession.FileConn(f))
			f.Close()
		}()
	}
}
