package agent

import (
	"bufio"
	"context"
	"encoding/json"
	"net"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/guestinit"
)

// monitor follows one run of a VM: the guest channel's messages and the VMM process, reported
// as status.runtime. Its lifetime is the agent's, never a request's.
type monitor struct {
	cancel context.CancelFunc
	done   chan struct{}

	mu    sync.Mutex
	conn  net.Conn
	token string
}

func (m *monitor) requestStop() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.conn != nil {
		line, _ := json.Marshal(guestinit.Request{Op: "stop", Token: m.token})
		_, _ = m.conn.Write(append(line, '\n'))
	}
}

func (a *Agent) stopMonitor(uid types.UID) {
	a.mu.Lock()
	m := a.monitors[uid]
	delete(a.monitors, uid)
	a.mu.Unlock()
	if m != nil {
		m.cancel()
		<-m.done
	}
}

// ensureMonitor starts following the VM's current run unless it is followed already.
func (a *Agent) ensureMonitor(vm *impv1.ImpVM, dir string, meta *meta, rec *vmm.Record) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.monitors[vm.UID]; ok {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &monitor{cancel: cancel, done: make(chan struct{}), token: meta.Token}
	a.monitors[vm.UID] = m
	key := types.NamespacedName{Namespace: vm.Namespace, Name: vm.Name}
	go func() {
		defer close(m.done)
		a.follow(ctx, m, key, dir, meta, rec)
	}()
}

func (a *Agent) follow(ctx context.Context, m *monitor, key types.NamespacedName, dir string, meta *meta, rec *vmm.Record) {
	log := ctrl.Log.WithName("monitor").WithValues("vm", key)
	base := impv1.RuntimeStatus{Instance: meta.Instance, Run: meta.Run}
	started := metav1.NewTime(meta.Started)
	base.StartedAt = &started
	report := func(rt impv1.RuntimeStatus) {
		vm := &impv1.ImpVM{}
		vm.Namespace, vm.Name = key.Namespace, key.Name
		if err := a.report(context.WithoutCancel(ctx), vm, rt); err != nil {
			log.Error(err, "reporting the VM's state")
		}
	}

	msgs := make(chan guestinit.Message, 8)
	go func() {
		defer close(msgs)
		for ctx.Err() == nil && rec.Alive() {
			conn, err := a.dialChannel(dir, rec)
			if err != nil {
				time.Sleep(100 * time.Millisecond)
				continue
			}
			m.mu.Lock()
			m.conn = conn
			m.mu.Unlock()
			go func() { <-ctx.Done(); conn.Close() }()
			sc := bufio.NewScanner(conn)
			for sc.Scan() {
				var msg guestinit.Message
				if json.Unmarshal(sc.Bytes(), &msg) == nil {
					msgs <- msg
				}
			}
			return
		}
	}()

	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	var exit *guestinit.Message
	for {
		select {
		case <-ctx.Done():
			return
		case msg, ok := <-msgs:
			if !ok {
				msgs = nil
				continue
			}
			switch msg.Event {
			case "hello":
				if msg.Token != meta.Token {
					log.Info("guest channel hello with the wrong token; ignoring the channel")
					return
				}
			case "ready":
				rt := base
				boot := time.Since(meta.Started).Milliseconds()
				rt.State, rt.GuestReady, rt.BootMilliseconds, rt.Message = impv1.RuntimeRunning, true, &boot, "the guest is ready"
				report(rt)
			case "exit", "error":
				exit = &msg
			}
		case <-tick.C:
			if rec.Alive() {
				if err := qemu.CapConsole(dir, a.Opts.ConsoleLogBytes); err != nil {
					log.Error(err, "capping the console log")
				}
				continue
			}
			// The guest's last words may still be in the channel: read it to its end.
			drain := time.After(2 * time.Second)
		drained:
			for msgs != nil {
				select {
				case msg, ok := <-msgs:
					if !ok {
						break drained
					}
					if msg.Event == "exit" || msg.Event == "error" {
						exit = &msg
					}
				case <-drain:
					break drained
				}
			}
			a.endRun(meta.UID)
			rt := base
			now := metav1.Now()
			rt.State, rt.FinishedAt = impv1.RuntimeExited, &now
			switch {
			case exit != nil && exit.Event == "exit":
				code := int32(*exit.Code)
				rt.ExitCode, rt.Reason, rt.Message = &code, "WorkloadExited", "the workload exited"
			case exit != nil:
				rt.Reason, rt.Message = "GuestError", exit.Message
			default:
				rt.Reason, rt.Message = "VMMExited", "the VMM exited without the guest reporting an exit"
				if tail := a.logTail(dir, rec); tail != "" {
					rt.Message += ": " + tail
				}
			}
			report(rt)
			return
		}
	}
}
