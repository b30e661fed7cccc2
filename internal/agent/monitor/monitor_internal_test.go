package monitor

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/guestchan"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/guestinit"
)

// TestMonitorUnderAHostileGuest plays a guest that does everything wrong on its channel: a hello
// with the wrong token, then megabytes on the console, an exit without a code, 10,000 random
// messages and lines, a ready before any good hello. The monitor stays up, keeps the console
// under its cap, reports Running only after the right hello and a ready, and, when the VMM
// dies with no valid exit, reports that the VMM exited — not a code the guest never gave.
func TestMonitorUnderAHostileGuest(t *testing.T) {
	dir := t.TempDir()
	const token, capBytes = "the-token", 64 << 10
	console := filepath.Join(dir, qemu.ConsoleLog)
	if err := os.WriteFile(console, nil, 0o600); err != nil {
		t.Fatal(err)
	}

	var alive atomic.Bool
	alive.Store(true)
	var mu sync.Mutex
	var reports []impv1.RuntimeStatus
	w := watch{
		alive: alive.Load,
		report: func(_ context.Context, rt impv1.RuntimeStatus) {
			mu.Lock()
			defer mu.Unlock()
			reports = append(reports, rt)
		},
		capLogs: func() error { return qemu.CapConsole(dir, capBytes) },
	}
	guest, done := followChannel(t, w, &vmrun.Meta{Token: token, Started: time.Now()})
	send := func(lines ...string) {
		t.Helper()
		for _, line := range lines {
			if _, err := guest.Write([]byte(line + "\n")); err != nil {
				t.Fatal(err)
			}
		}
	}
	running := func() int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, r := range reports {
			if r.State == impv1.RuntimeRunning {
				n++
			}
		}
		return n
	}

	send(`{"event":"hello","token":"guessed"}`, `{"event":"ready"}`)
	// Megabytes on the console after the wrong hello: the cap still holds.
	f, err := os.OpenFile(console, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	chunk := []byte(strings.Repeat("flood ", 1000) + "\n")
	for written := 0; written < 4<<20; written += len(chunk) {
		if _, err := f.Write(chunk); err != nil {
			t.Fatal(err)
		}
		if written%(256<<10) < len(chunk) {
			time.Sleep(300 * time.Millisecond) // a tick of the cap
		}
	}
	f.Close()
	waitFor(t, "the console capped", func() bool {
		fi, err := os.Stat(console)
		return err == nil && fi.Size() <= capBytes
	})

	send(`{"event":"exit"}`)
	r := rand.New(rand.NewPCG(1, 2))
	events := []string{"hello", "ready", "exit", "error", "", "reboot"}
	for i := 0; i < 10000; i++ {
		switch i % 3 {
		case 0:
			b, _ := json.Marshal(map[string]any{"event": events[r.IntN(len(events))], "token": fmt.Sprint(r.Int()), "code": r.Int64() - r.Int64()})
			send(string(b))
		case 1:
			raw := make([]byte, r.IntN(200))
			for j := range raw {
				raw[j] = byte(r.IntN(256))
				if raw[j] == '\n' {
					raw[j] = ' '
				}
			}
			send(string(raw))
		default:
			send(`{"event":"exit","code":` + fmt.Sprint(r.IntN(1000)-500) + `}`)
		}
	}
	if running() != 0 {
		t.Fatalf("Running reported from an unauthenticated channel: %+v", reports)
	}
	send(`{"event":"hello","token":"`+token+`"}`, `{"event":"ready"}`, `{"event":"ready"}`)
	waitFor(t, "Running after the right hello", func() bool { return running() == 1 })

	alive.Store(false)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the monitor did not end with its VMM")
	}
	mu.Lock()
	defer mu.Unlock()
	last := reports[len(reports)-1]
	if len(reports) != 2 || last.State != impv1.RuntimeExited || last.Reason != "VMMExited" || last.ExitCode != nil {
		t.Errorf("reports %+v; want Running, then Exited for VMMExited without an exit code", reports)
	}
}

// followChannel follows the run of m as w says, its guest channel a unix socket whose guest end
// it returns, with a channel closed when the monitor ends. What w leaves unset does nothing.
func followChannel(t *testing.T, w watch, m *vmrun.Meta) (net.Conn, <-chan struct{}) {
	t.Helper()
	return followChannelOn(t, &monitor{token: m.Token}, w, m)
}

// followChannelOn is followChannel with the monitor mon.
func followChannelOn(t *testing.T, mon *monitor, w watch, m *vmrun.Meta) (net.Conn, <-chan struct{}) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "channel.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	w.dial = func() (net.Conn, error) { return net.Dial("unix", sock) }
	if w.capLogs == nil {
		w.capLogs = func() error { return nil }
	}
	if w.ended == nil {
		w.ended = func() {}
	}
	if w.tail == nil {
		w.tail = func() string { return "" }
	}
	if w.unhealthy == nil {
		w.unhealthy = func(guestchan.Event) {}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		mon.follow(context.Background(), w, m, logr.Discard())
	}()
	guest, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { guest.Close() })
	return guest, done
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// handedWatch is the watch of a run followed on conn, a connection handed to its monitor: it
// never connects anew, and reports to report.
func handedWatch(conn net.Conn, alive func() bool, report func(context.Context, impv1.RuntimeStatus)) watch {
	return watch{
		dial:      func() (net.Conn, error) { return nil, errors.New("no new connection in this test") },
		conn:      conn,
		alive:     alive,
		report:    report,
		capLogs:   func() error { return nil },
		ended:     func() {},
		tail:      func() string { return "" },
		unhealthy: func(guestchan.Event) {},
	}
}

// follow runs a monitor of m's run with w until ctx ends or the run does; the channel closes
// then.
func follow(ctx context.Context, w watch, m *vmrun.Meta) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		(&monitor{token: m.Token}).follow(ctx, w, m, logr.Discard())
	}()
	return done
}

// restored is the agent's end of a restore's channel connection (guestchan.Restore's) to a
// guest that read the request and answered with lines; the guest's end is returned too.
func restored(t *testing.T, token string, lines ...string) (*guestchan.Answered, net.Conn) {
	t.Helper()
	agentEnd, guest := net.Pipe()
	t.Cleanup(func() { guest.Close() })
	answered := make(chan struct{})
	go func() {
		defer close(answered)
		_, _ = bufio.NewReader(guest).ReadString('\n') // the restore request, all the agent sent
		_, _ = guest.Write([]byte(strings.Join(lines, "\n") + "\n"))
	}()
	a, err := guestchan.Restore(agentEnd, "the-snapshot's-token", guestinit.Restore{Token: token}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	<-answered
	_ = a.SetDeadline(time.Time{})
	return a, guest
}

// wantReady waits for the report of the guest ready.
func wantReady(t *testing.T, reports <-chan impv1.RuntimeStatus, from string) {
	t.Helper()
	select {
	case rt := <-reports:
		if rt.State != impv1.RuntimeRunning || !rt.GuestReady {
			t.Fatalf("report %+v; want Running with the guest ready", rt)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("no report of the guest ready from %s", from)
	}
}

// TestProbeVerdictsReachTheAPIBounded: a guest that flips its readiness verdict thousands of
// times a second gets at most one report per probeReportInterval, the latest verdict winning;
// a run with a readiness probe starts not ready; a liveness failure ends the run as
// LivenessProbeFailed with the workload's code, recorded once.
func TestProbeVerdictsReachTheAPIBounded(t *testing.T) {
	const token = "the-token"
	var alive atomic.Bool
	alive.Store(true)
	var mu sync.Mutex
	var reports []impv1.RuntimeStatus
	var unhealthy atomic.Int32
	w := watch{
		alive: alive.Load,
		report: func(_ context.Context, rt impv1.RuntimeStatus) {
			mu.Lock()
			defer mu.Unlock()
			reports = append(reports, rt)
		},
		unhealthy: func(guestchan.Event) { unhealthy.Add(1) },
	}
	guest, done := followChannel(t, w, &vmrun.Meta{Token: token, Started: time.Now(), Readiness: true})
	send := func(lines ...string) {
		t.Helper()
		for _, line := range lines {
			if _, err := guest.Write([]byte(line + "\n")); err != nil {
				t.Fatal(err)
			}
		}
	}
	last := func() (int, impv1.RuntimeStatus) {
		mu.Lock()
		defer mu.Unlock()
		if len(reports) == 0 {
			return 0, impv1.RuntimeStatus{}
		}
		return len(reports), reports[len(reports)-1]
	}
	send(`{"event":"hello","token":"`+token+`"}`, `{"event":"ready"}`)
	waitFor(t, "Running, not ready", func() bool {
		n, rt := last()
		return n == 1 && rt.GuestReady && rt.Ready != nil && !*rt.Ready
	})
	began := time.Now()
	for i := 0; i < 10000; i++ {
		send(fmt.Sprintf(`{"event":"probe","probe":"readiness","ok":%v,"message":"flap %d"}`, i%2 == 0, i))
	}
	send(`{"event":"probe","probe":"readiness","ok":true}`)
	waitFor(t, "the last verdict", func() bool {
		_, rt := last()
		return rt.Ready != nil && *rt.Ready
	})
	flooded := time.Since(began)
	time.Sleep(2 * probeReportInterval) // any report still pending lands
	n, _ := last()
	if bound := 2 + int(flooded/probeReportInterval) + 2; n > bound {
		t.Fatalf("%d reports for 10,001 verdicts in %v; want at most %d", n, flooded, bound)
	}
	send(`{"event":"probe","probe":"liveness","ok":false,"message":"HTTP probe failed with status 500"}`,
		`{"event":"probe","probe":"liveness","ok":false,"message":"again"}`, `{"event":"exit","code":143}`)
	waitFor(t, "the kill recorded", func() bool { return unhealthy.Load() == 1 })
	alive.Store(false)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the monitor did not end with its VMM")
	}
	_, rt := last()
	if rt.State != impv1.RuntimeExited || rt.Reason != impv1.ReasonLivenessProbeFailed || rt.ExitCode == nil || *rt.ExitCode != 143 ||
		rt.Message != "the liveness probe failed: HTTP probe failed with status 500" || unhealthy.Load() != 1 {
		t.Fatalf("last report %+v (unhealthy %d); want Exited for LivenessProbeFailed with 143, recorded once", rt, unhealthy.Load())
	}
}

// TestAFollowedRunKeepsItsReadiness: a run followed again (the agent restarted) whose status
// says its readiness probe passed is reported ready at the guest's replayed ready, not
// not-ready until the replayed verdict: its endpoints do not flap.
func TestAFollowedRunKeepsItsReadiness(t *testing.T) {
	const token = "the-token"
	var alive atomic.Bool
	alive.Store(true)
	reports := make(chan impv1.RuntimeStatus, 16)
	m := &vmrun.Meta{Token: token, Started: time.Now(), Readiness: true, Instance: 1, Run: 2}
	vm := &impv1.ImpVM{Status: impv1.ImpVMStatus{Runtime: &impv1.RuntimeStatus{Instance: 1, Run: 2, GuestReady: true, Ready: ptr.To(true)}}}
	w := watch{alive: alive.Load, report: func(_ context.Context, rt impv1.RuntimeStatus) { reports <- rt }, ready: reportedReady(vm, m)}
	guest, done := followChannel(t, w, m)
	_, _ = guest.Write([]byte(`{"event":"hello","token":"` + token + `"}` + "\n" + `{"event":"ready"}` + "\n"))
	select {
	case rt := <-reports:
		if rt.Ready == nil || !*rt.Ready {
			t.Errorf("the replayed ready reported %+v; want the run still ready", rt)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no report")
	}
	alive.Store(false)
	<-done
	if got := reportedReady(&impv1.ImpVM{Status: impv1.ImpVMStatus{Runtime: &impv1.RuntimeStatus{Instance: 1, Run: 1, GuestReady: true, Ready: ptr.To(true)}}}, m); got != nil {
		t.Errorf("another run's verdict was taken: %v", *got)
	}
}

// TestAStuckBootIsEnded: a guest that is not ready within the boot timeout (here it says hello
// and nothing more, as one whose boot stalls in imp-init would; one stalled in its kernel says
// nothing at all) has its VMM ended and its run reported Exited for BootTimeout, without an exit
// code; a guest ready in time, a run followed again whose guest was ready before (the agent
// restarted; its guest says nothing yet), and a run being stopped are never ended for it.
func TestAStuckBootIsEnded(t *testing.T) {
	const token, timeout = "the-token", 300 * time.Millisecond
	for _, tc := range []struct {
		name  string
		lines []string
		// booted: the VM's status has this run's guest ready.
		booted bool
		// stopping: the run's stop began (its guest asked to stop) before the timeout.
		stopping bool
		ended    bool
	}{
		{name: "stuck after hello", lines: []string{`{"event":"hello","token":"` + token + `"}`}, ended: true},
		{name: "silent", ended: true},
		{name: "ready in time", lines: []string{`{"event":"hello","token":"` + token + `"}`, `{"event":"ready"}`}},
		{name: "ready before the agent restarted", booted: true},
		{name: "being stopped", stopping: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var alive atomic.Bool
			alive.Store(true)
			var kills atomic.Int32
			reports := make(chan impv1.RuntimeStatus, 16)
			m := &vmrun.Meta{Token: token, Started: time.Now(), Instance: 1, Run: 1}
			vm := &impv1.ImpVM{}
			if tc.booted {
				vm.Status.Runtime = &impv1.RuntimeStatus{Instance: 1, Run: 1, GuestReady: true}
			}
			w := watch{
				alive:       alive.Load,
				report:      func(_ context.Context, rt impv1.RuntimeStatus) { reports <- rt },
				booted:      reportedBooted(vm, m),
				bootTimeout: timeout,
				kill:        func() { kills.Add(1); alive.Store(false) },
			}
			mon := &monitor{token: m.Token}
			if tc.stopping {
				mon.requestStop()
			}
			guest, done := followChannelOn(t, mon, w, m)
			for _, l := range tc.lines {
				if _, err := guest.Write([]byte(l + "\n")); err != nil {
					t.Fatal(err)
				}
			}
			if !tc.ended {
				time.Sleep(4 * timeout)
				if n := kills.Load(); n != 0 {
					t.Fatalf("the VMM was ended %d times", n)
				}
				alive.Store(false)
				<-done
				return
			}
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				t.Fatal("the monitor did not end the stuck run")
			}
			var last impv1.RuntimeStatus
			for len(reports) > 0 {
				last = <-reports
			}
			if kills.Load() != 1 || last.State != impv1.RuntimeExited || last.Reason != impv1.ReasonBootTimeout || last.ExitCode != nil ||
				!strings.Contains(last.Message, "not ready 300ms after its VMM started") {
				t.Fatalf("kills %d, last report %+v; want one kill and Exited for BootTimeout without a code", kills.Load(), last)
			}
		})
	}
}

// TestARestoredGuestThatSaysItsReplayFollowsThenNothing: a restored guest whose answer says
// its replay follows, and which then says nothing (lying, or stuck), is not asked again and
// not taken as ready: the boot timeout ends it, as any stuck boot.
func TestARestoredGuestThatSaysItsReplayFollowsThenNothing(t *testing.T) {
	const token, timeout = "the-token", 300 * time.Millisecond
	answered, _ := restored(t, token, `{"event":"restored","token":"`+token+`","replay":true}`)
	var alive atomic.Bool
	alive.Store(true)
	var kills atomic.Int32
	reports := make(chan impv1.RuntimeStatus, 16)
	w := handedWatch(answered, alive.Load, func(_ context.Context, rt impv1.RuntimeStatus) { reports <- rt })
	w.bootTimeout, w.kill = timeout, func() { kills.Add(1); alive.Store(false) }
	done := follow(context.Background(), w, &vmrun.Meta{Token: token, Started: time.Now(), Instance: 1, Run: 1})
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the monitor did not end the restored run whose guest said nothing after its answer")
	}
	var all []impv1.RuntimeStatus
	for len(reports) > 0 {
		all = append(all, <-reports)
	}
	if kills.Load() != 1 || len(all) != 1 || all[0].State != impv1.RuntimeExited || all[0].Reason != impv1.ReasonBootTimeout {
		t.Fatalf("kills %d, reports %+v; want one kill and one report, Exited for BootTimeout", kills.Load(), all)
	}
}

// TestReportsAreRetried: a run's report that the API server refuses is tried again, spaced,
// until it is written; one never written ends with its last error once the attempts are spent;
// a refusal is not tried again.
func TestReportsAreRetried(t *testing.T) {
	b := wait.Backoff{Duration: time.Millisecond, Factor: 2, Cap: 10 * time.Millisecond, Steps: 5}
	calls := 0
	err := retryReport(context.Background(), b, func(context.Context) error {
		calls++
		if calls < 3 {
			return errors.New("the API server did not answer")
		}
		return nil
	})
	if err != nil || calls != 3 {
		t.Fatalf("%d attempts, %v; want written at the third", calls, err)
	}
	calls = 0
	err = retryReport(context.Background(), b, func(context.Context) error {
		calls++
		return errors.New("refused")
	})
	if err == nil || err.Error() != "refused" || calls < 3 || calls > 5 {
		t.Fatalf("%d attempts, %v; want the last error after the backoff's steps", calls, err)
	}
	// A refusal (the agent policy: the VM is another node's now) is final.
	calls = 0
	forbidden := apierrors.NewForbidden(schema.GroupResource{Group: "imp.dev", Resource: "impvms"}, "vm", errors.New("not this node's"))
	if err := retryReport(context.Background(), b, func(context.Context) error { calls++; return forbidden }); !apierrors.IsForbidden(err) || calls != 1 {
		t.Fatalf("%d attempts, %v; want one, forbidden", calls, err)
	}
}

// TestAStoppedMonitorTriesNoMore: a monitor stopped while its report is tried against an API
// server that does not answer ends at once, not after the retries' minute: the stop's caller
// (a halt, a suspension, a teardown, the next run) writes what follows, and waits on it.
func TestAStoppedMonitorTriesNoMore(t *testing.T) {
	const token = "the-token"
	agentEnd, guest := net.Pipe()
	defer guest.Close()
	tried := make(chan struct{}, 64)
	unavailable := apierrors.NewServiceUnavailable("the API server is down")
	w := handedWatch(agentEnd, func() bool { return true }, func(ctx context.Context, _ impv1.RuntimeStatus) {
		_ = retryReport(ctx, reportBackoff, func(context.Context) error { tried <- struct{}{}; return unavailable })
	})
	ctx, stop := context.WithCancel(context.Background())
	done := follow(ctx, w, &vmrun.Meta{Token: token, Started: time.Now(), Instance: 1, Run: 1})
	_ = guest.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := bufio.NewReader(guest).ReadString('\n'); err != nil { // its request for the replay
		t.Fatal(err)
	}
	if _, err := guest.Write([]byte(`{"event":"hello","token":"` + token + `"}` + "\n" + `{"event":"ready"}` + "\n")); err != nil {
		t.Fatal(err)
	}
	for range 2 { // tried, and tried again
		select {
		case <-tried:
		case <-time.After(30 * time.Second):
			t.Fatal("the guest's ready was not reported")
		}
	}
	stop()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("a monitor stopped while its report was tried still runs 5 s later")
	}
}

// TestAHandedConnectionIsFollowedFirst: a monitor given a connection to the guest channel (a
// restore's, left open once the guest took on its identity) asks the guest for its history on
// it and reports the guest ready from it, without connecting anew; once the guest closes it,
// the monitor connects as usual. A connection handed to a monitor that never follows (its VMM
// gone) is closed.
func TestAHandedConnectionIsFollowedFirst(t *testing.T) {
	const token = "the-new-token"
	var alive atomic.Bool
	alive.Store(true)
	var dials atomic.Int32
	reports := make(chan impv1.RuntimeStatus, 16)
	agentEnd, guest := net.Pipe()
	defer guest.Close()
	w := handedWatch(agentEnd, alive.Load, func(_ context.Context, rt impv1.RuntimeStatus) { reports <- rt })
	w.dial = func() (net.Conn, error) { dials.Add(1); return nil, errors.New("no new connection in this test") }
	m := &vmrun.Meta{Token: token, Started: time.Now(), Instance: 1, Run: 1}
	done := follow(context.Background(), w, m)
	// The guest reads the monitor's request for its history, then tells it.
	_ = guest.SetDeadline(time.Now().Add(30 * time.Second))
	line, err := bufio.NewReader(guest).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	var req guestinit.Request
	if err := json.Unmarshal([]byte(line), &req); err != nil || req.Op != "replay" || req.Token != token {
		t.Fatalf("the monitor's first words on the handed connection: %q (%v); want a replay request with the run's token", line, err)
	}
	if _, err := guest.Write([]byte(`{"event":"hello","token":"` + token + `"}` + "\n" + `{"event":"ready"}` + "\n")); err != nil {
		t.Fatal(err)
	}
	wantReady(t, reports, "the handed connection")
	if n := dials.Load(); n != 0 {
		t.Fatalf("the monitor connected anew %d times while the handed connection was open", n)
	}
	guest.Close()
	waitFor(t, "the monitor to connect anew once the handed connection closed", func() bool { return dials.Load() > 0 })
	alive.Store(false)
	<-done

	// Never followed: closed.
	agentEnd, guest = net.Pipe()
	defer guest.Close()
	w.conn = agentEnd
	done = follow(context.Background(), w, m)
	_ = guest.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := guest.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("the handed connection of a monitor whose VMM is gone: read %v; want it closed", err)
	}
	<-done

	// A restore's connection whose guest sent its replay after its answer: the monitor reports
	// from what followed the answer, without asking for the replay.
	for len(reports) > 0 {
		<-reports // the run's end, as the monitor before saw it
	}
	answered, guest := restored(t, token, `{"event":"restored","token":"`+token+`","replay":true}`,
		`{"event":"hello","token":"`+token+`"}`, `{"event":"ready"}`)
	asked := make(chan string, 1)
	go func() {
		// A thaw is no question (every connection of a monitor holding no freeze says it).
		_ = guest.SetReadDeadline(time.Now().Add(2 * time.Second))
		r := bufio.NewReader(guest)
		line, _ := r.ReadString('\n')
		if strings.Contains(line, `"op":"thaw"`) {
			line, _ = r.ReadString('\n')
		}
		asked <- line
	}()
	alive.Store(true)
	w.conn = answered
	done = follow(context.Background(), w, m)
	wantReady(t, reports, "the replay that followed the restore's answer")
	if line := <-asked; line != "" {
		t.Errorf("the monitor asked a guest that sent its replay after its answer: %q", line)
	}
	alive.Store(false)
	guest.Close()
	<-done
}

// TestFreezeTakesTheGuestsWordOnly: a snapshot asks the guest to freeze its workload only
// when its hello offered to, and waits for its word: a guest that never answers holds the
// snapshot up for the timeout, not longer; a "frozen" it says unasked (or before its hello)
// answers no later request. A frozen workload is thawed by thaw, and by every connection of
// a monitor that holds no freeze (an agent's restart, the next run after a suspension), not
// by a reconnection meanwhile.
func TestFreezeTakesTheGuestsWordOnly(t *testing.T) {
	const token = "the-token"
	sock := filepath.Join(t.TempDir(), "channel.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var alive atomic.Bool
	alive.Store(true)
	t.Cleanup(func() { alive.Store(false) })
	mon := &monitor{token: token}
	reported := make(chan impv1.RuntimeStatus, 16)
	w := watch{alive: alive.Load, report: func(_ context.Context, rt impv1.RuntimeStatus) { reported <- rt },
		dial:    func() (net.Conn, error) { return net.Dial("unix", sock) },
		capLogs: func() error { return nil }, ended: func() {}, tail: func() string { return "" }, unhealthy: func(guestchan.Event) {}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		mon.follow(ctx, w, &vmrun.Meta{Token: token, Started: time.Now()}, logr.Discard())
	}()
	t.Cleanup(func() { cancel(); <-done })

	// connect accepts the monitor's next connection and returns it with the ops it asks.
	connect := func() (net.Conn, <-chan string) {
		t.Helper()
		c, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		ops := make(chan string, 16)
		go func() {
			sc := bufio.NewScanner(c)
			for sc.Scan() {
				var r guestinit.Request
				if json.Unmarshal(sc.Bytes(), &r) == nil && r.Token == token {
					ops <- r.Op
				}
			}
		}()
		return c, ops
	}
	next := func(ops <-chan string) string {
		select {
		case op := <-ops:
			return op
		case <-time.After(10 * time.Second):
			return "(nothing)"
		}
	}
	say := func(c net.Conn, line string) {
		t.Helper()
		if _, err := c.Write([]byte(line + "\n")); err != nil {
			t.Fatal(err)
		}
	}
	guest, ops := connect()
	if got := next(ops) + " " + next(ops); got != "replay thaw" {
		t.Fatalf("a first connection asked %q, want the replay and a thaw", got)
	}
	say(guest, `{"event":"frozen"}`) // before any hello: nothing
	say(guest, `{"event":"hello","token":"`+token+`"}`)
	if err := mon.freeze(time.Second); !errors.Is(err, errCannotFreeze) {
		t.Fatalf("a guest that did not offer to freeze: %v", err)
	}
	say(guest, `{"event":"hello","token":"`+token+`","freezes":true}`)
	say(guest, `{"event":"frozen"}`) // unasked
	// A marker: the monitor reads the lines in order, so once it reports the guest ready it has
	// taken the unasked frozen before the freeze below asks.
	say(guest, `{"event":"ready"}`)
	select {
	case <-reported:
	case <-time.After(10 * time.Second):
		t.Fatal("the guest's ready was never reported")
	}
	waitFor(t, "the offer", mon.freezes.Load)
	start := time.Now()
	if err := mon.freeze(300 * time.Millisecond); err == nil {
		t.Fatal("a guest that said frozen before it was asked froze nothing")
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("a silent guest held the freeze %v", took)
	}
	if op := next(ops); op != "freeze" {
		t.Fatalf("asked %q, want freeze", op)
	}
	mon.thaw()
	if op := next(ops); op != "thaw" {
		t.Fatalf("asked %q, want thaw", op)
	}

	// Frozen on its word; a reconnection meanwhile does not thaw it, thaw does.
	answered := make(chan error, 1)
	go func() { answered <- mon.freeze(10 * time.Second) }()
	if op := next(ops); op != "freeze" {
		t.Fatalf("asked %q, want freeze", op)
	}
	say(guest, `{"event":"frozen"}`)
	if err := <-answered; err != nil {
		t.Fatalf("a guest that froze when asked: %v", err)
	}
	guest.Close()
	guest, ops = connect()
	if op := next(ops); op != "replay" {
		t.Fatalf("a reconnection asked %q, want the replay", op)
	}
	say(guest, `{"event":"hello","token":"`+token+`","freezes":true}`)
	waitFor(t, "the reconnection", mon.requestStop) // a marker: what the reconnection asked comes before it
	if op := next(ops); op != "stop" {
		t.Fatalf("a reconnection while the workload is frozen for a snapshot asked %q", op)
	}
	mon.thaw()
	if op := next(ops); op != "thaw" {
		t.Fatalf("after thaw, asked %q", op)
	}
	guest.Close()
}

// TestTheKernelTellsTheEnd: a run whose VMM's end the kernel tells (watch.exited) is reported
// ended when it says so, the guest's exit code kept, though its record still reads alive (a
// process not yet reaped) and the backstop's tick is seconds away.
func TestTheKernelTellsTheEnd(t *testing.T) {
	exited := make(chan struct{})
	reports := make(chan impv1.RuntimeStatus, 8)
	w := watch{
		alive:  func() bool { return true },
		exited: func(context.Context) <-chan struct{} { return exited },
		report: func(_ context.Context, rt impv1.RuntimeStatus) { reports <- rt },
	}
	const token = "the-token"
	guest, done := followChannel(t, w, &vmrun.Meta{Token: token, Started: time.Now()})
	for _, line := range []string{`{"event":"hello","token":"` + token + `"}`, `{"event":"ready"}`, `{"event":"exit","code":3}`} {
		if _, err := guest.Write([]byte(line + "\n")); err != nil {
			t.Fatal(err)
		}
	}
	wantReady(t, reports, "the guest")
	guest.Close()
	close(exited)
	select {
	case rt := <-reports:
		if rt.State != impv1.RuntimeExited || rt.ExitCode == nil || *rt.ExitCode != 3 {
			t.Errorf("reported %s (exit code %v, %q); want Exited with the guest's code 3", rt.State, rt.ExitCode, rt.Message)
		}
	case <-time.After(aliveBackstop - time.Second):
		t.Fatal("the end the kernel told was not reported before the backstop's tick")
	}
	<-done
}

// TestGuestStatsAreTheGuestsWordBounded (docs/security.md): a guest's figures count after ready
// only, at most one a second however fast it sends them, and not when it claims more memory
// than its VM has; they are its own run's (the monitor's), whatever it names.
func TestGuestStatsAreTheGuestsWordBounded(t *testing.T) {
	const token = "the-token"
	var alive atomic.Bool
	alive.Store(true)
	reports := make(chan impv1.RuntimeStatus, 16)
	m := &vmrun.Meta{Token: token, Started: time.Now(), Instance: 1, Run: 0}
	w := watch{alive: alive.Load, report: func(_ context.Context, rt impv1.RuntimeStatus) { reports <- rt }, memory: 256 << 20}
	mon := &monitor{token: token}
	guest, done := followChannelOn(t, mon, w, m)
	stats := func(total, avail uint64) string {
		return fmt.Sprintf(`{"event":"stats","stats":{"memTotal":%d,"memAvailable":%d,"cpuMillis":5}}`, total, avail)
	}
	lines := []string{`{"event":"hello","token":"` + token + `"}`, stats(200<<20, 1), `{"event":"ready"}`, stats(200<<20, 100<<20)}
	for i := range 2000 { // a flood, all within the second after the first
		lines = append(lines, stats(200<<20, uint64(i)))
	}
	lines = append(lines, stats(8<<30, 1)) // more than the VM has
	began := time.Now()
	_, _ = guest.Write([]byte(strings.Join(lines, "\n") + "\n"))
	wantReady(t, reports, "the guest")
	waitFor(t, "the guest's figures taken", func() bool { return mon.guest.Load() != nil })
	g := mon.guest.Load()
	switch took := time.Since(began); {
	case g.MemoryTotal != 200<<20:
		t.Errorf("the guest's figures %+v: a lie about its memory was taken", g.Stats)
	case took < 900*time.Millisecond && (g.MemoryAvailable != 100<<20 || g.CPUMillis != 5):
		t.Errorf("the guest's figures %+v; want the first after ready, the flood of the next %v dropped", g.Stats, took)
	}
	// A second after the one taken, the next counts; a lie still does not.
	for time.Since(g.At) <= time.Second {
		time.Sleep(50 * time.Millisecond)
	}
	_, _ = guest.Write([]byte(stats(9<<30, 1) + "\n" + stats(200<<20, 50<<20) + "\n"))
	waitFor(t, "the next second's figures taken", func() bool { return mon.guest.Load().MemoryAvailable == 50<<20 })
	alive.Store(false)
	guest.Close()
	<-done
}
