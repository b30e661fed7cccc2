package probe_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/syscode-labs/imp/internal/guestinit/probe"
)

func port(t *testing.T, addr string) int {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	var n int
	fmt.Sscan(p, &n)
	return n
}

func check(t *testing.T, s *probe.Spec) error {
	t.Helper()
	c := &probe.Checks{Exec: func(_ context.Context, argv []string) (int, []byte, error) {
		if argv[0] == "fail" {
			return 3, []byte("not\nyet " + strings.Repeat("x", 1000)), nil
		}
		return 0, nil, nil
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return c.Check(ctx, s)
}

func TestChecks(t *testing.T) {
	web := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/ok":
			if r.Header.Get("X-Probe") != "yes" || r.Host != "svc.example" {
				w.WriteHeader(http.StatusBadRequest)
			}
		case "/redirect":
			http.Redirect(w, r, "/ok", http.StatusFound)
		case "/slow":
			time.Sleep(3 * time.Second)
		default:
			w.WriteHeader(http.StatusInternalServerError)
			fmt.Fprint(w, "broken\x00 database")
		}
	}))
	defer web.Close()
	wp := port(t, web.Listener.Addr().String())

	hs := health.NewServer()
	hs.SetServingStatus("db", healthpb.HealthCheckResponse_NOT_SERVING)
	gs := grpc.NewServer()
	healthpb.RegisterHealthServer(gs, hs)
	gl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go gs.Serve(gl)
	defer gs.Stop()
	gp := port(t, gl.Addr().String())

	closed, _ := net.Listen("tcp", "127.0.0.1:0")
	cp := port(t, closed.Addr().String())
	closed.Close()

	headers := []probe.Header{{Name: "X-Probe", Value: "yes"}, {Name: "Host", Value: "svc.example"}}
	for _, tc := range []struct {
		name string
		spec probe.Spec
		want string // "" passes; else a substring of the error
	}{
		{"http ok", probe.Spec{HTTP: &probe.HTTP{Port: wp, Path: "/ok", Headers: headers}}, ""},
		{"http redirect followed", probe.Spec{HTTP: &probe.HTTP{Port: wp, Path: "redirect", Headers: headers}}, ""},
		{"http 500", probe.Spec{HTTP: &probe.HTTP{Port: wp, Path: "/down"}}, "status 500: broken database"},
		{"http refused", probe.Spec{HTTP: &probe.HTTP{Port: cp}}, "connection refused"},
		{"http timeout", probe.Spec{HTTP: &probe.HTTP{Port: wp, Path: "/slow"}}, "deadline"},
		{"tcp open", probe.Spec{TCP: &probe.TCP{Port: wp}}, ""},
		{"tcp closed", probe.Spec{TCP: &probe.TCP{Host: "127.0.0.1", Port: cp}}, "connection refused"},
		{"grpc serving", probe.Spec{GRPC: &probe.GRPC{Port: gp}}, ""},
		{"grpc not serving", probe.Spec{GRPC: &probe.GRPC{Port: gp, Service: "db"}}, "status 2, not SERVING"},
		{"grpc unknown service", probe.Spec{GRPC: &probe.GRPC{Port: gp, Service: "nope"}}, "status 5"},
		{"grpc on http/1", probe.Spec{GRPC: &probe.GRPC{Port: wp}}, "gRPC health check"},
		{"exec ok", probe.Spec{Exec: []string{"ok"}}, ""},
		{"exec fails", probe.Spec{Exec: []string{"fail"}}, `command "fail" exited with 3: not yet xxx`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := check(t, &tc.spec)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("want a pass, got %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("want an error with %q, got %v", tc.want, err)
			case err != nil && len(err.Error()) > 512:
				t.Fatalf("an error of %d bytes", len(err.Error()))
			}
		})
	}
	// What a probe reports of a status line is bounded, whatever the body.
	if err := check(t, &probe.Spec{Exec: []string{"fail"}}); !strings.HasSuffix(err.Error(), "x") || len(err.Error()) > 300 {
		t.Fatalf("an unbounded message: %d bytes", len(err.Error()))
	}
}

// scripted answers each attempt of each probe with the next of its results (then the last one
// again) and tells the test of every attempt.
type scripted struct {
	mu       sync.Mutex
	results  map[string][]error
	attempts chan string
}

func (s *scripted) Check(_ context.Context, sp *probe.Spec) error {
	name := sp.Exec[0]
	s.mu.Lock()
	rs := s.results[name]
	err := rs[0]
	if len(rs) > 1 {
		s.results[name] = rs[1:]
	}
	s.mu.Unlock()
	s.attempts <- name
	return err
}

var errDown = errors.New("down")

type run struct {
	t        *testing.T
	clock    *clocktesting.FakeClock
	checks   *scripted
	results  chan probe.Result
	killed   chan time.Duration
	cancel   context.CancelFunc
	finished chan struct{}
}

func start(t *testing.T, set probe.Set, results map[string][]error) *run {
	r := &run{
		t: t, clock: clocktesting.NewFakeClock(time.Unix(1000, 0)),
		checks:  &scripted{results: results, attempts: make(chan string, 16)},
		results: make(chan probe.Result, 16), killed: make(chan time.Duration, 2), finished: make(chan struct{}),
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	runner := &probe.Runner{
		Probes: set, Check: r.checks, Clock: r.clock,
		Report: func(res probe.Result) { r.results <- res },
		Kill:   func(g time.Duration) { r.killed <- g },
	}
	go func() { defer close(r.finished); runner.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-r.finished })
	return r
}

// attempt waits for the next attempt, of the probe named.
func (r *run) attempt(name string) {
	r.t.Helper()
	select {
	case got := <-r.checks.attempts:
		if got != name {
			r.t.Fatalf("attempt of %s, want %s", got, name)
		}
	case <-time.After(5 * time.Second):
		r.t.Fatalf("no attempt of %s", name)
	}
}

// step moves the clock d once every probe goroutine waits on it.
func (r *run) step(d time.Duration, waiters int) {
	r.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for r.clock.Waiters() < waiters {
		if time.Now().After(deadline) {
			r.t.Fatalf("%d waiters, want %d", r.clock.Waiters(), waiters)
		}
		time.Sleep(time.Millisecond)
	}
	r.clock.Step(d)
}

func (r *run) want(res probe.Result) {
	r.t.Helper()
	select {
	case got := <-r.results:
		if got != res {
			r.t.Fatalf("result %+v, want %+v", got, res)
		}
	case <-time.After(5 * time.Second):
		r.t.Fatalf("no result, want %+v", res)
	}
}

func (r *run) none() {
	r.t.Helper()
	select {
	case got := <-r.results:
		r.t.Fatalf("unexpected result %+v", got)
	default:
	}
}

func spec(name string, period, success, failure int32) *probe.Spec {
	return &probe.Spec{Exec: []string{name}, PeriodSeconds: period, TimeoutSeconds: 1, SuccessThreshold: success, FailureThreshold: failure, GraceSeconds: 7}
}

func TestReadinessFollowsThresholds(t *testing.T) {
	r := start(t, probe.Set{Readiness: spec("ready", 2, 2, 3)},
		map[string][]error{"ready": {nil, nil, nil, errDown, errDown, errDown, nil, errDown, nil, nil}})
	r.attempt("ready") // first success: not yet successThreshold
	r.none()
	r.step(2*time.Second, 1)
	r.attempt("ready")
	r.want(probe.Result{Probe: probe.Readiness, OK: true})
	r.step(2*time.Second, 1)
	r.attempt("ready")
	for i := 0; i < 3; i++ { // three failures in a row
		r.step(2*time.Second, 1)
		r.attempt("ready")
		if i < 2 {
			r.none()
		}
	}
	r.want(probe.Result{Probe: probe.Readiness, OK: false, Message: "down"})
	r.step(2*time.Second, 1)
	r.attempt("ready") // one success, one failure: still failed
	r.step(2*time.Second, 1)
	r.attempt("ready")
	r.step(2*time.Second, 1)
	r.attempt("ready")
	r.none()
	r.step(2*time.Second, 1)
	r.attempt("ready")
	r.want(probe.Result{Probe: probe.Readiness, OK: true})
}

func TestStartupGatesTheOthersAndKills(t *testing.T) {
	t.Run("passes", func(t *testing.T) {
		r := start(t, probe.Set{Startup: spec("startup", 1, 1, 5), Readiness: spec("ready", 10, 1, 1)},
			map[string][]error{"startup": {errDown, errDown, nil}, "ready": {nil}})
		r.attempt("startup")
		r.step(time.Second, 1)
		r.attempt("startup")
		r.step(time.Second, 1)
		r.attempt("startup")
		r.want(probe.Result{Probe: probe.Startup, OK: true})
		r.attempt("ready")
		r.want(probe.Result{Probe: probe.Readiness, OK: true})
	})
	t.Run("fails", func(t *testing.T) {
		r := start(t, probe.Set{Startup: spec("startup", 1, 1, 2), Liveness: spec("live", 1, 1, 1)},
			map[string][]error{"startup": {errDown}, "live": {nil}})
		r.attempt("startup")
		r.step(time.Second, 1)
		r.attempt("startup")
		r.want(probe.Result{Probe: probe.Startup, OK: false, Message: "down"})
		if g := <-r.killed; g != 7*time.Second {
			t.Fatalf("grace %v", g)
		}
		<-r.finished // no liveness attempt ever
		if len(r.checks.attempts) != 0 {
			t.Fatal("a probe ran after the startup probe failed")
		}
	})
}

func TestLivenessKillsOnce(t *testing.T) {
	set := probe.Set{Readiness: spec("ready", 1, 1, 1), Liveness: spec("live", 1, 1, 2)}
	set.Liveness.InitialDelaySeconds = 5
	r := start(t, set, map[string][]error{"ready": {nil}, "live": {nil, errDown, errDown}})
	r.attempt("ready")
	r.want(probe.Result{Probe: probe.Readiness, OK: true})
	r.step(5*time.Second, 2) // the readiness ticker and the liveness delay
	got := map[string]int{}
	for len(got) < 2 {
		select {
		case n := <-r.checks.attempts:
			got[n]++
		case <-time.After(5 * time.Second):
			t.Fatalf("attempts %v", got)
		}
	}
	for i := 0; i < 2; i++ {
		r.step(time.Second, 2)
		r.attempt2()
	}
	r.want(probe.Result{Probe: probe.Liveness, OK: false, Message: "down"})
	select {
	case <-r.killed:
	case <-time.After(5 * time.Second):
		t.Fatal("not killed")
	}
	<-r.finished
	if len(r.killed) != 0 {
		t.Fatal("killed twice")
	}
}

// attempt2 waits for one attempt of each of two probes.
func (r *run) attempt2() {
	r.t.Helper()
	for i := 0; i < 2; i++ {
		select {
		case <-r.checks.attempts:
		case <-time.After(5 * time.Second):
			r.t.Fatal("an attempt missing")
		}
	}
}
