package vmm

import (
	"context"
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// Exited returns a channel closed once the recorded process has ended, known from the kernel
// (a pidfd, readable when its process ends) rather than by reading /proc over and over; nil
// where the kernel cannot say (Linux before 5.3), for the caller to poll Alive instead. The
// watch ends with ctx; the channel is then never closed.
func (r *Record) Exited(ctx context.Context) <-chan struct{} {
	done := make(chan struct{})
	fd, err := unix.PidfdOpen(r.Pid, unix.PIDFD_NONBLOCK)
	if errors.Is(err, unix.ESRCH) {
		close(done) // no such process
		return done
	}
	if err != nil {
		return nil
	}
	// The descriptor is the recorded process's only if the process still has the recorded
	// start: a pid reused since is another's.
	if !r.Alive() {
		_ = unix.Close(fd)
		close(done)
		return done
	}
	f := os.NewFile(uintptr(fd), "pidfd")
	rc, err := f.SyscallConn()
	if err != nil {
		_ = f.Close()
		return nil
	}
	go func() {
		defer f.Close()
		stop := context.AfterFunc(ctx, func() { _ = f.Close() }) // ends the wait below
		defer stop()
		// The runtime's poller waits for the descriptor to be readable: the process ended.
		waited := false
		err := rc.Read(func(uintptr) bool {
			if waited {
				return true
			}
			waited = true
			return false
		})
		if err == nil && ctx.Err() == nil {
			close(done)
		}
	}()
	return done
}
