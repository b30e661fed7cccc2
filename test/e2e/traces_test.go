package e2e

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/testotlp"
	"github.com/syscode-labs/imp/internal/tracing"
)

// podGateway is the node's address on the pods' bridge (hack/real-node.sh: the first of
// POD_CIDR, 10.88.0.0/16): the operator's pod and the agent (hostNetwork) both reach the
// collector there.
const podGateway = "10.88.0.1"

// collector is a real OpenTelemetry Collector on the node (hack/otelcol: the OTLP receiver and
// the contrib file exporter, built by hack/setup-control-plane.sh), where the chart's
// observability.tracing sends the operator's and the agent's spans.
type collector struct {
	Endpoint string // host:port of its OTLP/gRPC receiver
	file     string
}

// startCollector runs the collector of bin on the pods' gateway (the bridge must exist: after
// the node joined) until the test ends.
func startCollector(t *testing.T, bin, dir string) *collector {
	t.Helper()
	c := &collector{Endpoint: podGateway + ":" + freePort(t), file: filepath.Join(dir, "spans.jsonl")}
	conf := filepath.Join(dir, "otelcol.yaml")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf(`receivers:
  otlp:
    protocols:
      grpc: {endpoint: %q}
exporters:
  file: {path: %q, flush_interval: 200ms}
service:
  telemetry:
    metrics: {level: none}
  pipelines:
    traces: {receivers: [otlp], exporters: [file]}
`, c.Endpoint, c.file)), 0o644); err != nil {
		t.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(dir, "otelcol.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(bin, "otelcol"), "--config=file:"+conf)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting the OpenTelemetry Collector: %v", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-exited; logf.Close() })
	for deadline := time.Now().Add(time.Minute); ; {
		log, _ := os.ReadFile(logf.Name())
		if bytes.Contains(log, []byte("Everything is ready")) {
			return c
		}
		select {
		case <-exited:
			t.Fatalf("the OpenTelemetry Collector ended:\n%s", log)
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("the OpenTelemetry Collector did not start:\n%s", log)
		}
	}
}

// Spans are the spans the collector's file exporter wrote so far (OTLP JSON, a request a line).
func (c *collector) Spans(t *testing.T) []testotlp.Span {
	t.Helper()
	f, err := os.Open(c.file)
	if os.IsNotExist(err) {
		return nil
	} else if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	type value struct {
		StringValue *string `json:"stringValue"`
		IntValue    *string `json:"intValue"`
		BoolValue   *bool   `json:"boolValue"`
	}
	type kv struct {
		Key   string `json:"key"`
		Value value  `json:"value"`
	}
	type request struct {
		ResourceSpans []struct {
			Resource struct {
				Attributes []kv `json:"attributes"`
			} `json:"resource"`
			ScopeSpans []struct {
				Spans []struct {
					TraceID      string `json:"traceId"`
					SpanID       string `json:"spanId"`
					ParentSpanID string `json:"parentSpanId"`
					Name         string `json:"name"`
					Start        string `json:"startTimeUnixNano"`
					End          string `json:"endTimeUnixNano"`
					Attributes   []kv   `json:"attributes"`
					Links        []struct {
						SpanID string `json:"spanId"`
					} `json:"links"`
					Status struct {
						Code    int    `json:"code"`
						Message string `json:"message"`
					} `json:"status"`
				} `json:"spans"`
			} `json:"scopeSpans"`
		} `json:"resourceSpans"`
	}
	str := func(v value) string {
		switch {
		case v.StringValue != nil:
			return *v.StringValue
		case v.IntValue != nil:
			return *v.IntValue
		case v.BoolValue != nil:
			return strconv.FormatBool(*v.BoolValue)
		}
		return ""
	}
	nanos := func(s string) time.Time { n, _ := strconv.ParseInt(s, 10, 64); return time.Unix(0, n) }
	var out []testotlp.Span
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		var r request
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			continue // a line being written
		}
		for _, rs := range r.ResourceSpans {
			service := ""
			for _, a := range rs.Resource.Attributes {
				if a.Key == "service.name" {
					service = str(a.Value)
				}
			}
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					o := testotlp.Span{Service: service, TraceID: s.TraceID, SpanID: s.SpanID, Parent: s.ParentSpanID, Name: s.Name,
						Start: nanos(s.Start), End: nanos(s.End), Attributes: map[string]string{}}
					if s.Status.Code == 2 { // STATUS_CODE_ERROR
						o.Error = cmp.Or(s.Status.Message, "error")
					}
					for _, a := range s.Attributes {
						o.Attributes[a.Key] = str(a.Value)
					}
					for _, l := range s.Links {
						o.Links = append(o.Links, l.SpanID)
					}
					out = append(out, o)
				}
			}
		}
	}
	return out
}

// checkStartTrace (docs/observability.md): the sample VM's first start, as the real collector
// received it from the chart's operator and agent: one trace whose root is the operator's,
// named by the VM's annotation, with the placement, the agent's start and its steps, the image
// fetch and the guest's boot with its phases beneath it; no span in error; the root within
// 10 % of what the test saw of create → Ready (seen: the shortest and the longest it can have
// been, from the test's polls), and its children adding up to it within 10 %.
func checkStartTrace(t *testing.T, c *collector, annotation string, seenMin, seenMax time.Duration) {
	t.Helper()
	want := []string{tracing.SpanStart, tracing.SpanPlace, tracing.SpanAgent, tracing.SpanFetch, "imp.agent.start.image",
		"imp.agent.start.network", "imp.agent.start.exec", tracing.SpanGuestBoot, "imp.guest.kernel", "imp.guest.network", "imp.guest.workload"}
	parts := strings.Split(annotation, "-")
	if len(parts) != 4 {
		t.Fatalf("the VM's %s annotation is %q, want a traceparent", tracing.Annotation, annotation)
	}
	traceID, rootID := parts[1], parts[2]
	var spans []testotlp.Span
	var missing []string
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(500 * time.Millisecond) {
		spans, missing = nil, nil
		for _, s := range c.Spans(t) {
			if s.TraceID == traceID {
				spans = append(spans, s)
			}
		}
		have := map[string]bool{}
		for _, s := range spans {
			have[s.Name] = true
		}
		for _, w := range want {
			if !have[w] {
				missing = append(missing, w)
			}
		}
		if len(missing) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the collector has no %v of trace %s; it has %+v", missing, traceID, spans)
		}
	}
	byID := map[string]testotlp.Span{}
	for _, s := range spans {
		byID[s.SpanID] = s
	}
	root, ok := byID[rootID]
	if !ok || root.Name != tracing.SpanStart || root.Parent != "" || root.Service != "imp-operator" || root.Attributes["imp.vm.name"] != "hello" {
		t.Fatalf("the trace's root %+v, want the operator's %s of hello with the annotation's span ID %s", root, tracing.SpanStart, rootID)
	}
	var children []testotlp.Span
	for _, s := range spans {
		t.Logf("trace: %-28s %-13s %6dms +%dms", s.Name, s.Service, s.End.Sub(s.Start).Milliseconds(), s.Start.Sub(root.Start).Milliseconds())
		if s.Error != "" {
			t.Errorf("span %s is in error: %s", s.Name, s.Error)
		}
		if s.SpanID != root.SpanID && byID[s.Parent].Name == "" {
			t.Errorf("span %s's parent %s is not in the trace", s.Name, s.Parent)
		}
		if s.Parent == root.SpanID {
			children = append(children, s)
		}
	}
	for name, parent := range map[string]string{tracing.SpanPlace: tracing.SpanStart, tracing.SpanAgent: tracing.SpanStart,
		tracing.SpanGuestBoot: tracing.SpanStart, "imp.agent.start.exec": tracing.SpanAgent, "imp.guest.workload": tracing.SpanGuestBoot} {
		for _, s := range spans {
			if s.Name == name && byID[s.Parent].Name != parent {
				t.Errorf("span %s's parent is %q, want %s", name, byID[s.Parent].Name, parent)
			}
		}
	}
	took := root.End.Sub(root.Start)
	t.Logf("the root lasts %v; the test saw create → Ready in %v to %v", took.Round(time.Millisecond), seenMin.Round(time.Millisecond), seenMax.Round(time.Millisecond))
	if took < seenMin*9/10 || took > seenMax*11/10 {
		t.Errorf("the root lasts %v; the test saw create → Ready in %v to %v", took, seenMin, seenMax)
	}
	if covered := testotlp.Cover(children, root.Start, root.End); covered < took*9/10 {
		t.Errorf("the root's children cover %v of its %v", covered, took)
	}
}
