// Package plan runs a VM's host work as a plan of idempotent steps, after flintlock's
// core/plans: each step measures what is there (ShouldDo) before it acts (Do), so that a plan run
// again after a crash at any point does what is left and nothing twice. The runner, not the
// steps, does what every step needs: timing, failpoints, and the reason a failure is reported
// with, and a log line for a step that runs long (a step that hangs says which it is).
package plan

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/syscode-labs/imp/internal/failpoint"
)

// Step is one idempotent piece of work on state S.
type Step[S any] interface {
	// Name is the step's word in metrics, failpoints and errors (snake_case).
	Name() string
	// ShouldDo measures: whether the node lacks what the step makes.
	ShouldDo(ctx context.Context, s S) (bool, error)
	// Do acts. An error is the plan's failure, reported with the reason plan.Fail gave it or
	// the plan's own.
	Do(ctx context.Context, s S) error
}

// ErrWait is returned by a step whose work is under way elsewhere (an image being fetched): the
// plan stops, nothing failed, and is run again later.
var ErrWait = errors.New("plan: waiting for work under way")

// WaitFor is ErrWait with the time after which the plan should run again.
func WaitFor(d time.Duration) error { return waitFor(d) }

type waitFor time.Duration

func (w waitFor) Error() string        { return fmt.Sprintf("plan: waiting %v", time.Duration(w)) }
func (w waitFor) Is(target error) bool { return target == ErrWait }

// WaitTime is the time a plan's ErrWait asked to wait before it runs again: 0 for none given
// (or no wait at all).
func WaitTime(err error) time.Duration {
	var w waitFor
	if errors.As(err, &w) {
		return time.Duration(w)
	}
	return 0
}

// Retry marks err as failing nothing (an API write that did not go through, say): the plan
// stops and returns it, its step to be run again later.
func Retry(err error) error { return retryable{err} }

type retryable struct{ err error }

func (r retryable) Error() string { return r.err.Error() }
func (r retryable) Unwrap() error { return r.err }

// Failed is a plan's failure: the step, the reason to report (a CamelCase word for
// status.runtime.reason and the Event) and the error.
type Failed struct {
	Step, Reason string
	Err          error
}

func (f *Failed) Error() string { return f.Err.Error() }
func (f *Failed) Unwrap() error { return f.Err }

// Fail gives err the reason it is reported with; a step's other errors take its plan's.
func Fail(reason string, err error) error { return &Failed{Reason: reason, Err: err} }

// Plan is steps run in order on one state.
type Plan[S any] struct {
	// Name names the plan's failpoints: "<name>/<step>" after each step that acted.
	Name string
	// Reason is what a failure is reported with when its step gave none.
	Reason string
	Steps  []Step[S]
	// Observe, when set, is given the time each step that acted took.
	Observe func(step string, took time.Duration)
	// Slow is how long a step runs before the runner logs it (ctx's logger), and again each
	// time as long: 0 for SlowStep.
	Slow time.Duration
}

// tracerName names the plan runner's spans' instrumentation scope.
const tracerName = "github.com/syscode-labs/imp/internal/agent/plan"

// SlowStep is how long a step runs before it is logged as slow.
const SlowStep = 30 * time.Second

// Run runs the steps in order: each that ShouldDo does, is timed, and may crash the process at
// its failpoint once done (tests show a crash there loses nothing). It stops at the first
// error: ErrWait and Retry's as they are, any other as a *Failed that names the step and its
// reason.
func (p Plan[S]) Run(ctx context.Context, s S) error {
	for _, st := range p.Steps {
		if err := p.step(ctx, st, s); err != nil {
			if r := (retryable{}); errors.Is(err, ErrWait) || errors.As(err, &r) {
				return err
			}
			f := &Failed{}
			if !errors.As(err, &f) {
				f = &Failed{Err: err}
			}
			if f.Reason == "" {
				f.Reason = p.Reason
			}
			f.Step = st.Name()
			return f
		}
	}
	return nil
}

func (p Plan[S]) step(ctx context.Context, st Step[S], s S) error {
	do, err := st.ShouldDo(ctx, s)
	if err != nil {
		return fmt.Errorf("measuring %s: %w", st.Name(), err)
	}
	if !do {
		return nil
	}
	began := time.Now()
	stop := p.watch(ctx, st.Name(), began)
	// A span of the step, a child of the span ctx carries (the agent's start of a run: package
	// tracing), from its tracer provider: none when ctx carries none.
	sctx, span := trace.SpanFromContext(ctx).TracerProvider().Tracer(tracerName).Start(ctx, "imp.agent."+p.Name+"."+st.Name(),
		trace.WithTimestamp(began))
	err = st.Do(sctx, s)
	stop()
	switch {
	case errors.Is(err, ErrWait):
		span.SetAttributes(attribute.Bool("imp.wait", true))
	case err != nil:
		// The reason, never the error: it may quote a tenant's registry or a guest.
		reason := p.Reason
		if f := (*Failed)(nil); errors.As(err, &f) && f.Reason != "" {
			reason = f.Reason
		}
		span.SetStatus(codes.Error, reason)
	}
	span.End()
	if err != nil {
		return err
	}
	if p.Observe != nil {
		p.Observe(st.Name(), time.Since(began))
	}
	failpoint.Crash(p.Name + "/" + st.Name())
	return nil
}

// watch logs the step name while it runs past p.Slow, each p.Slow, until the returned stop,
// which returns once nothing more is logged.
func (p Plan[S]) watch(ctx context.Context, name string, began time.Time) (stop func()) {
	every := p.Slow
	if every <= 0 {
		every = SlowStep
	}
	done, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				logr.FromContextOrDiscard(ctx).Info("a step is still running", "plan", p.Name, "step", name,
					"for", time.Since(began).Round(time.Second).String())
			}
		}
	}()
	return func() { close(done); <-exited }
}
