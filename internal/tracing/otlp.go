package tracing

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"golang.org/x/net/http2"
	"google.golang.org/protobuf/encoding/protowire"
)

// The OTLP exporter is IMP's own: the trace export request encoded field by field with
// protowire, sent over HTTP (POST /v1/traces) or as a gRPC unary call over HTTP/2. OpenTelemetry's
// exporters link the generated OTLP types and gRPC into every binary: 9 MiB more resident
// memory in each node's agent (make bench-agent, measured), for one message. The tests check the
// bytes against the collector's own generated types, over both protocols (package testotlp).

// grpcPath is the collector's trace service method.
const grpcPath = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

// maxResponse bounds what is read of a collector's answer.
const maxResponse = 64 << 10

// exporter is an sdktrace.SpanExporter speaking OTLP.
type exporter struct {
	grpc     bool
	url      string
	client   *http.Client
	headers  map[string]string
	resource []byte // the encoded Resource
}

var _ sdktrace.SpanExporter = (*exporter)(nil)

func newExporter(c Config, tlsConf *tls.Config, headers map[string]string, resource []attribute.KeyValue) *exporter {
	e := &exporter{headers: headers, resource: encodeResource(resource)}
	scheme := "https"
	if c.Insecure {
		scheme = "http"
	}
	switch c.Protocol {
	case ProtocolHTTP:
		e.url = scheme + "://" + c.Endpoint + "/v1/traces"
		e.client = &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: tlsConf, Proxy: http.ProxyFromEnvironment,
			IdleConnTimeout: time.Minute, MaxIdleConnsPerHost: 2}}
	default:
		e.grpc, e.url = true, scheme+"://"+c.Endpoint+grpcPath
		t := &http2.Transport{TLSClientConfig: tlsConf, ReadIdleTimeout: 30 * time.Second}
		if c.Insecure { // h2c: HTTP/2 over plain TCP, as gRPC's insecure credentials speak it
			t.AllowHTTP = true
			t.DialTLSContext = func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, network, addr)
			}
		}
		e.client = &http.Client{Timeout: 10 * time.Second, Transport: t}
	}
	return e
}

// ExportSpans sends spans in one request; an error is the batch's loss (the SDK's batcher
// logs it and goes on).
func (e *exporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	if len(spans) == 0 {
		return nil
	}
	msg := encodeRequest(e.resource, spans)
	body := msg
	if e.grpc {
		body = make([]byte, 5, 5+len(msg)) // uncompressed, then the length
		binary.BigEndian.PutUint32(body[1:], uint32(len(msg)))
		body = append(body, msg...)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	for k, v := range e.headers {
		req.Header.Set(k, v)
	}
	if e.grpc {
		req.Header.Set("Content-Type", "application/grpc")
		req.Header.Set("TE", "trailers")
	} else {
		req.Header.Set("Content-Type", "application/x-protobuf")
	}
	resp, err := e.client.Do(req)
	if err != nil {
		return fmt.Errorf("tracing: exporting %d spans: %w", len(spans), err)
	}
	defer resp.Body.Close()
	answer, _ := io.ReadAll(io.LimitReader(resp.Body, maxResponse))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("tracing: exporting %d spans: HTTP %d: %.200s", len(spans), resp.StatusCode, answer)
	}
	if e.grpc {
		status := resp.Trailer.Get("Grpc-Status")
		if status == "" {
			status = resp.Header.Get("Grpc-Status") // a trailers-only answer
		}
		if status != "0" {
			return fmt.Errorf("tracing: exporting %d spans: gRPC status %q: %.200s", len(spans), status,
				resp.Trailer.Get("Grpc-Message")+resp.Header.Get("Grpc-Message"))
		}
	}
	return nil
}

// Shutdown lets the exporter's connections go.
func (e *exporter) Shutdown(context.Context) error {
	e.client.CloseIdleConnections()
	return nil
}

// Field numbers of the OTLP messages written (opentelemetry-proto's trace, common and resource).
const (
	fRequestResourceSpans = 1
	fResourceSpansRes     = 1
	fResourceSpansScopes  = 2
	fResourceAttrs        = 1
	fScopeSpansScope      = 1
	fScopeSpansSpans      = 2
	fScopeName            = 1
	fScopeVersion         = 2
	fSpanTraceID          = 1
	fSpanSpanID           = 2
	fSpanTraceState       = 3
	fSpanParent           = 4
	fSpanName             = 5
	fSpanKind             = 6
	fSpanStart            = 7
	fSpanEnd              = 8
	fSpanAttrs            = 9
	fSpanDroppedAttrs     = 10
	fSpanEvents           = 11
	fSpanLinks            = 13
	fSpanStatus           = 15
	fSpanFlags            = 16
	fEventTime            = 1
	fEventName            = 2
	fEventAttrs           = 3
	fLinkTraceID          = 1
	fLinkSpanID           = 2
	fLinkAttrs            = 4
	fStatusMessage        = 2
	fStatusCode           = 3
	fKeyValueKey          = 1
	fKeyValueValue        = 2
	fAnyString            = 1
	fAnyBool              = 2
	fAnyInt               = 3
	fAnyDouble            = 4
	fAnyArray             = 5
	fArrayValues          = 1
)

func encodeResource(attrs []attribute.KeyValue) []byte {
	var b []byte
	for _, kv := range attrs {
		b = appendMessage(b, fResourceAttrs, appendKeyValue(nil, kv))
	}
	return b
}

// encodeRequest is an ExportTraceServiceRequest of spans, of one resource, grouped by scope.
func encodeRequest(resource []byte, spans []sdktrace.ReadOnlySpan) []byte {
	var order []string
	byScope := map[string][]byte{}
	for _, s := range spans {
		scope := s.InstrumentationScope()
		key := scope.Name + "\x00" + scope.Version
		if _, ok := byScope[key]; !ok {
			order = append(order, key)
			var sc []byte
			sc = appendString(sc, fScopeName, scope.Name)
			if scope.Version != "" {
				sc = appendString(sc, fScopeVersion, scope.Version)
			}
			byScope[key] = appendMessage(nil, fScopeSpansScope, sc)
		}
		byScope[key] = appendMessage(byScope[key], fScopeSpansSpans, encodeSpan(s))
	}
	rs := appendMessage(nil, fResourceSpansRes, resource)
	for _, key := range order {
		rs = appendMessage(rs, fResourceSpansScopes, byScope[key])
	}
	return appendMessage(nil, fRequestResourceSpans, rs)
}

func encodeSpan(s sdktrace.ReadOnlySpan) []byte {
	sc := s.SpanContext()
	tid, sid := sc.TraceID(), sc.SpanID()
	var b []byte
	b = appendBytes(b, fSpanTraceID, tid[:])
	b = appendBytes(b, fSpanSpanID, sid[:])
	if ts := sc.TraceState().String(); ts != "" {
		b = appendBytes(b, fSpanTraceState, []byte(ts))
	}
	if p := s.Parent(); p.SpanID().IsValid() {
		psid := p.SpanID()
		b = appendBytes(b, fSpanParent, psid[:])
	}
	b = appendString(b, fSpanName, s.Name())
	b = protowire.AppendTag(b, fSpanKind, protowire.VarintType)
	b = protowire.AppendVarint(b, uint64(s.SpanKind())) // trace.SpanKind numbers OTLP's kinds alike
	b = appendTime(b, fSpanStart, s.StartTime())
	b = appendTime(b, fSpanEnd, s.EndTime())
	for _, kv := range s.Attributes() {
		b = appendMessage(b, fSpanAttrs, appendKeyValue(nil, kv))
	}
	if n := s.DroppedAttributes(); n > 0 {
		b = protowire.AppendTag(b, fSpanDroppedAttrs, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(n))
	}
	for _, ev := range s.Events() {
		var e []byte
		e = appendTime(e, fEventTime, ev.Time)
		e = appendString(e, fEventName, ev.Name)
		for _, kv := range ev.Attributes {
			e = appendMessage(e, fEventAttrs, appendKeyValue(nil, kv))
		}
		b = appendMessage(b, fSpanEvents, e)
	}
	for _, l := range s.Links() {
		ltid, lsid := l.SpanContext.TraceID(), l.SpanContext.SpanID()
		var lb []byte
		lb = appendBytes(lb, fLinkTraceID, ltid[:])
		lb = appendBytes(lb, fLinkSpanID, lsid[:])
		for _, kv := range l.Attributes {
			lb = appendMessage(lb, fLinkAttrs, appendKeyValue(nil, kv))
		}
		b = appendMessage(b, fSpanLinks, lb)
	}
	if st := s.Status(); st.Code != codes.Unset {
		var sb []byte
		if st.Description != "" {
			sb = appendString(sb, fStatusMessage, st.Description)
		}
		code := uint64(1) // STATUS_CODE_OK
		if st.Code == codes.Error {
			code = 2 // STATUS_CODE_ERROR
		}
		sb = protowire.AppendTag(sb, fStatusCode, protowire.VarintType)
		sb = protowire.AppendVarint(sb, code)
		b = appendMessage(b, fSpanStatus, sb)
	}
	b = protowire.AppendTag(b, fSpanFlags, protowire.Fixed32Type)
	flags := uint32(sc.TraceFlags()) | 0x100 // whether the parent is remote is known (bit 8) ...
	if s.Parent().IsRemote() {
		flags |= 0x200 // ... and it is (bit 9)
	}
	b = protowire.AppendFixed32(b, flags)
	return b
}

func appendKeyValue(b []byte, kv attribute.KeyValue) []byte {
	b = appendString(b, fKeyValueKey, string(kv.Key))
	return appendMessage(b, fKeyValueValue, anyValue(kv.Value))
}

func anyValue(v attribute.Value) []byte {
	var b []byte
	switch v.Type() {
	case attribute.BOOL:
		b = protowire.AppendTag(b, fAnyBool, protowire.VarintType)
		b = protowire.AppendVarint(b, protowire.EncodeBool(v.AsBool()))
	case attribute.INT64:
		b = protowire.AppendTag(b, fAnyInt, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(v.AsInt64()))
	case attribute.FLOAT64:
		b = protowire.AppendTag(b, fAnyDouble, protowire.Fixed64Type)
		b = protowire.AppendFixed64(b, math.Float64bits(v.AsFloat64()))
	case attribute.STRINGSLICE:
		var arr []byte
		for _, s := range v.AsStringSlice() {
			arr = appendMessage(arr, fArrayValues, appendString(nil, fAnyString, s))
		}
		b = appendMessage(b, fAnyArray, arr)
	default: // strings, and what else is written as its text
		b = appendString(b, fAnyString, v.Emit())
	}
	return b
}

func appendBytes(b []byte, field protowire.Number, v []byte) []byte {
	b = protowire.AppendTag(b, field, protowire.BytesType)
	return protowire.AppendBytes(b, v)
}

// appendString writes a string field: valid UTF-8, as the collector's decoder requires.
func appendString(b []byte, field protowire.Number, v string) []byte {
	return appendBytes(b, field, []byte(strings.ToValidUTF8(v, "?")))
}

func appendMessage(b []byte, field protowire.Number, msg []byte) []byte {
	return appendBytes(b, field, msg)
}

func appendTime(b []byte, field protowire.Number, t time.Time) []byte {
	b = protowire.AppendTag(b, field, protowire.Fixed64Type)
	return protowire.AppendFixed64(b, uint64(t.UnixNano()))
}
