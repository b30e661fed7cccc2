package logging

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/go-logr/logr"
	uberzap "go.uber.org/zap"
	crzap "sigs.k8s.io/controller-runtime/pkg/log/zap"
)

func TestLogger(t *testing.T) {
	tests := []struct {
		name    string
		opts    Options
		wantErr bool
		debugOn bool
	}{
		{name: "defaults", opts: Options{Level: "info", Format: "json"}},
		{name: "debug text", opts: Options{Level: "debug", Format: "text"}, debugOn: true},
		{name: "verbosity number", opts: Options{Level: "4", Format: "json"}, debugOn: true},
		{name: "bad level", opts: Options{Level: "loud", Format: "json"}, wantErr: true},
		{name: "negative level", opts: Options{Level: "-1", Format: "json"}, wantErr: true},
		{name: "bad format", opts: Options{Level: "info", Format: "xml"}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l, err := tt.opts.Logger()
			if (err != nil) != tt.wantErr {
				t.Fatalf("error = %v, wantErr %v", err, tt.wantErr)
			}
			if err == nil && l.V(1).Enabled() != tt.debugOn {
				t.Errorf("V(1).Enabled() = %v, want %v", l.V(1).Enabled(), tt.debugOn)
			}
		})
	}
}

// TestValuesReachTheLine: values given to WithValues, before and after a name, and to the
// line itself, are written with it, in order; a logger's values are its own (one derived from
// it does not add to it); the caller is the line's, not the logging package's.
func TestValuesReachTheLine(t *testing.T) {
	var out bytes.Buffer
	l, err := (&Options{Level: "info", Format: "json"}).logger(&out)
	if err != nil {
		t.Fatal(err)
	}
	base := l.WithValues("controller", "impvm")
	a := base.WithName("place").WithValues("vm", "ns/a")
	_ = base.WithValues("vm", "ns/b") // shares base's values, never a's
	a.Info("placed", "node", "n1")
	a.V(1).Info("not written")
	base.Error(errors.New("boom"), "failed")
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("%d lines, want 2:\n%s", len(lines), out.String())
	}
	var first, second map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &first); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(lines[1]), &second); err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]any{"msg": "placed", "logger": "place", "controller": "impvm", "vm": "ns/a", "node": "n1"} {
		if first[k] != v {
			t.Errorf("line %s: %s is %v, want %v", lines[0], k, first[k], v)
		}
	}
	if second["vm"] != nil || second["controller"] != "impvm" || second["error"] != "boom" {
		t.Errorf("second line %s", lines[1])
	}
}

// TestCallerIsTheLines: with callers on, a line's caller is where it was logged, not the
// logging package.
func TestCallerIsTheLines(t *testing.T) {
	var out bytes.Buffer
	l := logr.New(deferred{sink: crzap.New(crzap.WriteTo(&out), crzap.RawZapOpts(uberzap.AddCaller())).GetSink()})
	l.WithValues("a", 1).Info("hello")
	var line map[string]any
	if err := json.Unmarshal(out.Bytes(), &line); err != nil {
		t.Fatal(err)
	}
	if c, _ := line["caller"].(string); !strings.HasPrefix(c, "logging/logging_test.go:") {
		t.Errorf("caller %q, want this test's line", line["caller"])
	}
}

// BenchmarkReconcileLogger: the values controller-runtime gives each reconcile's logger, no
// line written (what most reconciles do).
func BenchmarkReconcileLogger(b *testing.B) {
	l, err := (&Options{Level: "info", Format: "json"}).logger(io.Discard)
	if err != nil {
		b.Fatal(err)
	}
	ctrl := l.WithValues("controller", "impvm", "controllerGroup", "imp.dev", "controllerKind", "ImpVM")
	for b.Loop() {
		r := ctrl.WithValues("ImpVM", "run/vm-0001", "namespace", "run", "name", "vm-0001").WithValues("reconcileID", "0a1b2c3d-4e5f-6789-abcd-ef0123456789")
		r.V(1).Info("reconciling")
	}
}
