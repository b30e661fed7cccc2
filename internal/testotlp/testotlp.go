// Package testotlp is an OTLP trace receiver for tests: the collector's wire protocol, over
// gRPC and over HTTP (protobuf at /v1/traces), on 127.0.0.1, keeping every span it is sent.
package testotlp

import (
	"context"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// Span is what a test reads of a span received.
type Span struct {
	Service, Name           string
	TraceID, SpanID, Parent string // hex; Parent "" for a root
	Start, End              time.Time
	Attributes              map[string]string
	Error                   string // the status's message when its code is Error
	Links                   []string
}

// Receiver keeps the spans it was sent, and the headers of the last export.
type Receiver struct {
	collectortrace.UnimplementedTraceServiceServer
	// GRPC and HTTP are the addresses (host:port) it listens on.
	GRPC, HTTP string

	mu      sync.Mutex
	spans   []Span
	headers map[string]string
}

// Start serves a Receiver until the test ends.
func Start(t testing.TB) *Receiver {
	t.Helper()
	r := &Receiver{}
	gl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	collectortrace.RegisterTraceServiceServer(srv, r)
	go func() { _ = srv.Serve(gl) }()
	t.Cleanup(srv.Stop)
	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: http.HandlerFunc(r.serveHTTP), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = hs.Serve(hl) }()
	t.Cleanup(func() { _ = hs.Close() })
	r.GRPC, r.HTTP = gl.Addr().String(), hl.Addr().String()
	return r
}

// Export receives spans over gRPC.
func (r *Receiver) Export(ctx context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	h := map[string]string{}
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		for k, v := range md {
			h[k] = v[0]
		}
	}
	r.keep(req, h)
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

func (r *Receiver) serveHTTP(w http.ResponseWriter, req *http.Request) {
	if req.URL.Path != "/v1/traces" || req.Method != http.MethodPost {
		http.NotFound(w, req)
		return
	}
	b, err := io.ReadAll(io.LimitReader(req.Body, 64<<20))
	msg := &collectortrace.ExportTraceServiceRequest{}
	if err == nil {
		err = proto.Unmarshal(b, msg)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	h := map[string]string{}
	for k := range req.Header {
		h[http.CanonicalHeaderKey(k)] = req.Header.Get(k)
	}
	r.keep(msg, h)
	out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

func (r *Receiver) keep(req *collectortrace.ExportTraceServiceRequest, headers map[string]string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.headers = headers
	for _, rs := range req.ResourceSpans {
		service := attrs(rs.GetResource().GetAttributes())["service.name"]
		for _, ss := range rs.ScopeSpans {
			for _, s := range ss.Spans {
				sp := Span{Service: service, Name: s.Name, TraceID: hex.EncodeToString(s.TraceId), SpanID: hex.EncodeToString(s.SpanId),
					Start: time.Unix(0, int64(s.StartTimeUnixNano)), End: time.Unix(0, int64(s.EndTimeUnixNano)), Attributes: attrs(s.Attributes)}
				if len(s.ParentSpanId) > 0 {
					sp.Parent = hex.EncodeToString(s.ParentSpanId)
				}
				if s.Status != nil && s.Status.Code == 2 { // STATUS_CODE_ERROR
					sp.Error = s.Status.Message
					if sp.Error == "" {
						sp.Error = "error"
					}
				}
				for _, l := range s.Links {
					sp.Links = append(sp.Links, hex.EncodeToString(l.SpanId))
				}
				r.spans = append(r.spans, sp)
			}
		}
	}
}

func attrs(kvs []*commonpb.KeyValue) map[string]string {
	m := map[string]string{}
	for _, kv := range kvs {
		switch v := kv.Value.GetValue().(type) {
		case *commonpb.AnyValue_StringValue:
			m[kv.Key] = v.StringValue
		case *commonpb.AnyValue_IntValue:
			m[kv.Key] = strconv.FormatInt(v.IntValue, 10)
		case *commonpb.AnyValue_BoolValue:
			m[kv.Key] = strconv.FormatBool(v.BoolValue)
		case *commonpb.AnyValue_DoubleValue:
			m[kv.Key] = strconv.FormatFloat(v.DoubleValue, 'g', -1, 64)
		}
	}
	return m
}

// Spans returns the spans received so far.
func (r *Receiver) Spans() []Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.spans)
}

// Headers returns the headers (gRPC metadata) of the last export.
func (r *Receiver) Headers() map[string]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.headers
}

// Cover is how much of [from, to] the spans cover together (a root's children adding up to it).
func Cover(spans []Span, from, to time.Time) time.Duration {
	spans = slices.Clone(spans)
	slices.SortFunc(spans, func(a, b Span) int { return a.Start.Compare(b.Start) })
	var total time.Duration
	at := from
	for _, s := range spans {
		b, e := s.Start, s.End
		if b.Before(at) {
			b = at
		}
		if e.After(to) {
			e = to
		}
		if e.After(b) {
			total += e.Sub(b)
			at = e
		}
	}
	return total
}
