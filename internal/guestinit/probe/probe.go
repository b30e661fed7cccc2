// Package probe runs an ImpVM's startup, readiness and liveness probes inside its guest, as the
// kubelet runs a container's: exec, HTTP GET, TCP connect or gRPC health check, with the same
// timings, thresholds and order (nothing but the startup probe runs until it passed). imp-init
// runs them for the life of the workload, so they need no network between node and guest; what
// they find reaches the agent as messages of the guest channel.
package probe

import (
	"context"
	"fmt"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// Kind names a probe.
type Kind string

// The probes, as their names appear on the guest channel.
const (
	Startup   Kind = "startup"
	Readiness Kind = "readiness"
	Liveness  Kind = "liveness"
)

// Spec is one probe as the agent resolved it from the ImpVM: exactly one handler, named ports
// already numbers, defaults applied.
type Spec struct {
	Exec []string `json:"exec,omitempty"`
	HTTP *HTTP    `json:"http,omitempty"`
	TCP  *TCP     `json:"tcp,omitempty"`
	GRPC *GRPC    `json:"grpc,omitempty"`

	InitialDelaySeconds int32 `json:"initialDelaySeconds,omitempty"`
	TimeoutSeconds      int32 `json:"timeoutSeconds"`
	PeriodSeconds       int32 `json:"periodSeconds"`
	SuccessThreshold    int32 `json:"successThreshold"`
	FailureThreshold    int32 `json:"failureThreshold"`
	// GraceSeconds is how long the workload has between SIGTERM and SIGKILL when this
	// (startup or liveness) probe kills it.
	GraceSeconds int64 `json:"graceSeconds"`
}

// HTTP is an HTTP GET; success is a status from 200 to 399.
type HTTP struct {
	Scheme  string   `json:"scheme,omitempty"` // HTTP (default) or HTTPS, unverified as the kubelet's
	Host    string   `json:"host,omitempty"`   // default 127.0.0.1
	Port    int      `json:"port"`
	Path    string   `json:"path,omitempty"`
	Headers []Header `json:"headers,omitempty"`
}

// Header is one HTTP header of a probe.
type Header struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

// TCP connects; success is an accepted connection.
type TCP struct {
	Host string `json:"host,omitempty"` // default 127.0.0.1
	Port int    `json:"port"`
}

// GRPC calls grpc.health.v1.Health/Check; success is SERVING.
type GRPC struct {
	Port    int    `json:"port"`
	Service string `json:"service,omitempty"`
}

// Set is a workload's probes; any may be nil.
type Set struct {
	Startup   *Spec `json:"startup,omitempty"`
	Readiness *Spec `json:"readiness,omitempty"`
	Liveness  *Spec `json:"liveness,omitempty"`
}

// Empty says whether s holds no probe.
func (s Set) Empty() bool { return s.Startup == nil && s.Readiness == nil && s.Liveness == nil }

// Result is a probe's verdict changing: readiness passing or failing, startup passing, or a
// startup or liveness probe failing for good (the workload is then killed).
type Result struct {
	Probe   Kind
	OK      bool
	Message string
}

// Checker runs one attempt of a probe; a nil error is a success. ctx ends at the probe's
// timeout.
type Checker interface {
	Check(ctx context.Context, s *Spec) error
}

// Runner runs a workload's probes.
type Runner struct {
	Probes Set
	// Check runs one attempt.
	Check Checker
	// Report receives each change of a verdict, in order, from one goroutine.
	Report func(Result)
	// Kill is called once, when a startup or liveness probe failed for good, with the grace
	// period the workload has before SIGKILL.
	Kill  func(grace time.Duration)
	Clock clock.WithTicker
}

// Run probes until ctx ends or a probe killed the workload.
func (r *Runner) Run(ctx context.Context) {
	if r.Probes.Empty() {
		return
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := r.Clock.Now()
	var mu sync.Mutex // Report and Kill, one at a time
	report := func(res Result) {
		mu.Lock()
		defer mu.Unlock()
		if ctx.Err() == nil {
			r.Report(res)
		}
	}
	killed := false
	kill := func(res Result, s *Spec) {
		mu.Lock()
		defer mu.Unlock()
		if killed || ctx.Err() != nil {
			return
		}
		killed = true
		r.Report(res)
		r.Kill(time.Duration(s.GraceSeconds) * time.Second)
		cancel()
	}

	if s := r.Probes.Startup; s != nil {
		ok := r.loop(ctx, start, s, func(passed bool, msg string) bool {
			if passed {
				report(Result{Probe: Startup, OK: true})
				return false
			}
			kill(Result{Probe: Startup, Message: msg}, s)
			return false
		})
		if !ok {
			return
		}
	}
	var wg sync.WaitGroup
	if s := r.Probes.Readiness; s != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.loop(ctx, start, s, func(passed bool, msg string) bool {
				report(Result{Probe: Readiness, OK: passed, Message: msg})
				return true
			})
		}()
	}
	if s := r.Probes.Liveness; s != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.loop(ctx, start, s, func(passed bool, msg string) bool {
				if !passed {
					kill(Result{Probe: Liveness, Message: msg}, s)
					return false
				}
				return true
			})
		}()
	}
	wg.Wait()
}

// loop runs s every period from start plus its initial delay and calls verdict each time its
// verdict changes (the first verdict counts as a change): passed after successThreshold
// successes in a row, failed after failureThreshold failures in a row. It stops when verdict
// returns false and then says whether the last verdict passed; at ctx's end it returns false.
func (r *Runner) loop(ctx context.Context, start time.Time, s *Spec, verdict func(passed bool, msg string) bool) bool {
	if !r.sleep(ctx, start.Add(time.Duration(s.InitialDelaySeconds)*time.Second).Sub(r.Clock.Now())) {
		return false
	}
	tick := r.Clock.NewTicker(time.Duration(max(s.PeriodSeconds, 1)) * time.Second)
	defer tick.Stop()
	var successes, failures int32
	decided, passed := false, false
	for {
		err := r.attempt(ctx, s)
		if ctx.Err() != nil {
			return false
		}
		if err == nil {
			successes, failures = successes+1, 0
		} else {
			successes, failures = 0, failures+1
		}
		switch {
		case err == nil && successes >= max(s.SuccessThreshold, 1) && (!decided || !passed):
			decided, passed = true, true
			if !verdict(true, "") {
				return true
			}
		case err != nil && failures >= max(s.FailureThreshold, 1) && (!decided || passed):
			decided, passed = true, false
			if !verdict(false, err.Error()) {
				return false
			}
		}
		select {
		case <-ctx.Done():
			return false
		case <-tick.C():
		}
	}
}

// attempt runs s once under its timeout.
func (r *Runner) attempt(ctx context.Context, s *Spec) error {
	ctx, cancel := context.WithTimeout(ctx, time.Duration(max(s.TimeoutSeconds, 1))*time.Second)
	defer cancel()
	if err := r.Check.Check(ctx, s); err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("timed out after %ds: %w", max(s.TimeoutSeconds, 1), err)
		}
		return err
	}
	return nil
}

// sleep waits d (or returns false when ctx ends first).
func (r *Runner) sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := r.Clock.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C():
		return true
	}
}
