package plan

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

type state struct{ did []string }

type fake struct {
	name string
	do   bool
	err  error
}

func (f fake) Name() string                                   { return f.name }
func (f fake) ShouldDo(context.Context, *state) (bool, error) { return f.do, nil }
func (f fake) Do(_ context.Context, s *state) error {
	s.did = append(s.did, f.name)
	return f.err
}

// TestRun: steps run in order, only those that should; the first error stops the plan, a
// failure names its step and the reason its step gave or the plan's; ErrWait is no failure;
// only the steps that acted are timed.
func TestRun(t *testing.T) {
	boom := errors.New("boom")
	for _, tc := range []struct {
		name     string
		steps    []Step[*state]
		did      []string
		observed []string
		reason   string // "" for no failure
		wait     bool
	}{
		{"all", []Step[*state]{fake{"a", true, nil}, fake{"b", true, nil}}, []string{"a", "b"}, []string{"a", "b"}, "", false},
		{"measured done", []Step[*state]{fake{"a", false, nil}, fake{"b", true, nil}}, []string{"b"}, []string{"b"}, "", false},
		{"plan's reason", []Step[*state]{fake{"a", true, boom}, fake{"b", true, nil}}, []string{"a"}, nil, "Default", false},
		{"step's reason", []Step[*state]{fake{"a", true, nil}, fake{"b", true, Fail("Own", boom)}}, []string{"a", "b"}, []string{"a"}, "Own", false},
		{"waits", []Step[*state]{fake{"a", true, ErrWait}, fake{"b", true, nil}}, []string{"a"}, nil, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var observed []string
			p := Plan[*state]{Name: "test", Reason: "Default", Steps: tc.steps, Observe: func(s string, _ time.Duration) { observed = append(observed, s) }}
			s := &state{}
			err := p.Run(context.Background(), s)
			if !slices.Equal(s.did, tc.did) || !slices.Equal(observed, tc.observed) {
				t.Errorf("did %v, observed %v; want %v, %v", s.did, observed, tc.did, tc.observed)
			}
			var f *Failed
			switch {
			case tc.wait:
				if !errors.Is(err, ErrWait) || errors.As(err, &f) {
					t.Errorf("err %v; want ErrWait", err)
				}
			case tc.reason == "":
				if err != nil {
					t.Errorf("err %v", err)
				}
			default:
				if !errors.As(err, &f) || f.Reason != tc.reason || f.Step != tc.did[len(tc.did)-1] || !errors.Is(err, boom) || err.Error() != "boom" {
					t.Errorf("err %#v; want a failure of %s with reason %s", err, tc.did[len(tc.did)-1], tc.reason)
				}
			}
		})
	}
}

func TestWaitFor(t *testing.T) {
	err := Plan[*state]{Steps: []Step[*state]{fake{"a", true, WaitFor(time.Second)}}}.Run(context.Background(), &state{})
	if !errors.Is(err, ErrWait) || WaitTime(err) != time.Second {
		t.Errorf("err %v, wait %v", err, WaitTime(err))
	}
	boom := errors.New("the API server is away")
	err = Plan[*state]{Steps: []Step[*state]{fake{"a", true, Retry(boom)}}}.Run(context.Background(), &state{})
	var f *Failed
	if !errors.Is(err, boom) || errors.As(err, &f) || err.Error() != boom.Error() {
		t.Errorf("a retry: %#v", err)
	}
	if WaitTime(ErrWait) != 0 || WaitTime(nil) != 0 {
		t.Error("a wait without a time has one")
	}
}

// slow is a step that runs for d.
type slow struct{ d time.Duration }

func (slow) Name() string                                   { return "slow" }
func (slow) ShouldDo(context.Context, *state) (bool, error) { return true, nil }
func (s slow) Do(context.Context, *state) error {
	time.Sleep(s.d)
	return nil
}

// TestSlowStepsAreLogged: a step that runs past the plan's Slow is logged with its plan and
// name while it runs, so that a step that hangs says which it is; a quick one is not.
func TestSlowStepsAreLogged(t *testing.T) {
	var mu sync.Mutex
	var lines []string
	log := funcr.New(func(prefix, args string) {
		mu.Lock()
		defer mu.Unlock()
		lines = append(lines, args)
	}, funcr.Options{})
	ctx := logr.NewContext(context.Background(), log)
	p := Plan[*state]{Name: "start", Slow: 20 * time.Millisecond, Steps: []Step[*state]{fake{name: "quick", do: true}, slow{d: 70 * time.Millisecond}}}
	began := time.Now()
	if err := p.Run(ctx, &state{}); err != nil {
		t.Fatal(err)
	}
	took := time.Since(began)
	mu.Lock()
	atEnd := len(lines)
	mu.Unlock()
	time.Sleep(50 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	if len(lines) != atEnd {
		t.Errorf("%d log lines after the step was done", len(lines)-atEnd)
	}
	if max := int(took/(20*time.Millisecond)) + 1; len(lines) < 2 || len(lines) > max {
		t.Fatalf("%d log lines for a step of %v logged each 20 ms: %q", len(lines), took, lines)
	}
	for _, l := range lines {
		if !strings.Contains(l, `"plan"="start"`) || !strings.Contains(l, `"step"="slow"`) {
			t.Errorf("log line %s: not of the slow step", l)
		}
	}
}

// TestStepsAreSpans (docs/security.md): each step that acts is a span beneath the span the
// plan's context carries, from its provider; a step that waits says so; a failed step's span
// carries its reason, never its error's text (a registry's answer, a guest's words); a step
// that does nothing is no span; a context with no span records nothing.
func TestStepsAreSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	ctx, parent := tp.Tracer("t").Start(context.Background(), "pass")
	p := Plan[*state]{Name: "start", Reason: "StartFailed", Steps: []Step[*state]{
		fake{name: "done", do: true},
		fake{name: "skipped"},
		fake{name: "image", do: true, err: Fail("ImagePullFailed", errors.New("registry.evil said: token=s3cret"))},
	}}
	if err := p.Run(ctx, &state{}); err == nil {
		t.Fatal("the plan did not fail")
	}
	if err := (Plan[*state]{Name: "start", Steps: []Step[*state]{fake{name: "wait", do: true, err: WaitFor(time.Second)}}}).Run(ctx, &state{}); !errors.Is(err, ErrWait) {
		t.Fatal(err)
	}
	parent.End()
	got := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		got[s.Name()] = s
	}
	if len(got) != 4 || got["imp.agent.start.done"] == nil || got["imp.agent.start.image"] == nil || got["imp.agent.start.wait"] == nil {
		t.Fatalf("spans %v; want the pass, done, image and wait", slices.Collect(maps.Keys(got)))
	}
	for name, s := range got {
		if name != "pass" && s.Parent().SpanID() != parent.SpanContext().SpanID() {
			t.Errorf("%s is not the pass's child", name)
		}
		text := s.Status().Description + fmt.Sprint(s.Attributes(), s.Events())
		if strings.Contains(text, "s3cret") || strings.Contains(text, "registry.evil") {
			t.Errorf("%s carries the error's text: %s", name, text)
		}
	}
	if st := got["imp.agent.start.image"].Status(); st.Code != codes.Error || st.Description != "ImagePullFailed" {
		t.Errorf("the failed step's status %+v, want Error ImagePullFailed", st)
	}
	if a := got["imp.agent.start.wait"].Attributes(); len(a) != 1 || a[0].Key != "imp.wait" || !a[0].Value.AsBool() {
		t.Errorf("the waiting step's attributes %v", a)
	}
	before := len(rec.Ended())
	_ = p.Run(context.Background(), &state{})
	if len(rec.Ended()) != before {
		t.Error("a plan run with no span in its context recorded spans")
	}
}
