package guestinit

import (
	"context"
	"errors"
	"io"
	"os"
	"syscall"
	"time"

	"k8s.io/utils/clock"

	"github.com/syscode-labs/imp/internal/guestinit/probe"
)

// runProbes runs cfg's probes against the workload pid for the rest of its life, reporting
// each verdict over the guest channel; a failed startup or liveness probe kills the workload
// (SIGTERM, SIGKILL after the grace period), which ends the VM's run with its exit.
func runProbes(ctx context.Context, cfg Config, pid int) {
	r := &probe.Runner{
		Probes: cfg.Probes,
		Check:  &probe.Checks{Exec: func(ctx context.Context, argv []string) (int, []byte, error) { return execProbe(ctx, cfg, argv) }},
		Clock:  clock.RealClock{},
		Report: func(res probe.Result) {
			ok := res.OK
			ch.send(Message{Event: "probe", Probe: string(res.Probe), OK: &ok, Message: res.Message})
		},
		Kill: func(grace time.Duration) {
			if cfg.OS {
				powerOff() // the OS stops within its own timeouts
				return
			}
			_ = syscall.Kill(pid, syscall.SIGTERM)
			time.AfterFunc(grace, func() { _ = syscall.Kill(-pid, syscall.SIGKILL); _ = syscall.Kill(pid, syscall.SIGKILL) })
		},
	}
	r.Run(ctx)
}

// execProbe runs argv as the workload runs, in a session of its own that is killed whole when
// ctx ends, and returns its exit code and the start of its output.
func execProbe(ctx context.Context, cfg Config, argv []string) (int, []byte, error) {
	cmd, err := command(cfg, argv)
	if err != nil {
		return 0, nil, err
	}
	r, w, err := os.Pipe()
	if err != nil {
		return 0, nil, err
	}
	defer r.Close()
	null, err := os.Open(os.DevNull)
	if err != nil {
		w.Close()
		return 0, nil, err
	}
	defer null.Close()
	cmd.Stdin, cmd.Stdout, cmd.Stderr = null, w, w
	wait, err := procs.start(cmd)
	w.Close()
	if err != nil {
		return 0, nil, err
	}
	stop := context.AfterFunc(ctx, func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) })
	out := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(io.LimitReader(r, 1024))
		_, _ = io.Copy(io.Discard, r) // never block the command on a full pipe
		out <- b
	}()
	code := wait()
	stop()
	var b []byte
	select {
	case b = <-out:
	case <-time.After(100 * time.Millisecond): // a background child holds the pipe: enough
	}
	if ctx.Err() != nil {
		return code, b, errors.New("killed at its timeout")
	}
	return code, b, nil
}
