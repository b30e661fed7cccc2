// Package tracing gives the operator and the agent their OpenTelemetry traces: a tracer
// provider exporting over OTLP (gRPC or HTTP) when an endpoint is configured, and nothing at all
// when not (docs/observability.md, "Traces"). A VM's start is one trace, whose root span is the
// operator's from the VM seen to Ready and whose children are the operator's placement, the
// agent's plan and every step of it, and the guest's boot. Both processes find the trace from the
// VM alone (package-level Start): no ID travels between them but what the object says.
package tracing

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Protocols an exporter speaks.
const (
	ProtocolGRPC = "grpc"
	ProtocolHTTP = "http/protobuf"
)

// Config is where and how traces are exported: off when Endpoint is empty.
type Config struct {
	// Endpoint is the collector's host:port (gRPC, or HTTP at /v1/traces).
	Endpoint string
	// Protocol is ProtocolGRPC or ProtocolHTTP.
	Protocol string
	// Insecure sends in the clear; otherwise TLS, verified against CAFile when set (else the
	// system's roots).
	Insecure bool
	CAFile   string
	// HeadersFile holds "name: value" lines sent with every export (a collector's token, from a
	// Secret); read at start.
	HeadersFile string
	// SampleRatio is the share of VM starts traced, 0 to 1: decided on the trace's ID, so that
	// every process decides the same for one start.
	SampleRatio float64
}

// Enabled reports whether traces are exported.
func (c Config) Enabled() bool { return c.Endpoint != "" }

// AddFlags registers the tracing flags on fs.
func (c *Config) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Endpoint, "tracing-endpoint", "", "host:port of an OTLP collector to export traces to (empty: no traces)")
	fs.StringVar(&c.Protocol, "tracing-protocol", ProtocolGRPC, "OTLP protocol: grpc or http/protobuf")
	fs.BoolVar(&c.Insecure, "tracing-insecure", false, "export traces without TLS")
	fs.StringVar(&c.CAFile, "tracing-ca-file", "", "PEM bundle that verifies the collector's certificate (default: the system's roots)")
	fs.StringVar(&c.HeadersFile, "tracing-headers-file", "", `file of "name: value" lines sent with each export`)
	fs.Float64Var(&c.SampleRatio, "tracing-sample-ratio", 1, "share of VM starts traced, 0 to 1")
}

// maxHeaders bounds the headers file: a token or two, never a file read whole into memory.
const maxHeaders = 16 << 10

// Provider returns the tracer provider of service (imp-operator, imp-agent) for c, and its
// shutdown, which exports what is left; a disabled c gives a provider that records nothing.
// An unreachable collector fails nothing: spans are dropped when its queue is full.
func Provider(ctx context.Context, c Config, service string) (trace.TracerProvider, func(context.Context) error, error) {
	if !c.Enabled() {
		return noop.NewTracerProvider(), func(context.Context) error { return nil }, nil
	}
	if c.SampleRatio < 0 || c.SampleRatio > 1 {
		return nil, nil, fmt.Errorf("tracing: sample ratio %v is not between 0 and 1", c.SampleRatio)
	}
	headers, err := readHeaders(c.HeadersFile)
	if err != nil {
		return nil, nil, err
	}
	var tlsConf *tls.Config
	if !c.Insecure {
		tlsConf = &tls.Config{MinVersion: tls.VersionTLS12}
		if c.CAFile != "" {
			pem, err := os.ReadFile(c.CAFile)
			if err != nil {
				return nil, nil, fmt.Errorf("tracing: reading the collector's CA: %w", err)
			}
			tlsConf.RootCAs = x509.NewCertPool()
			if !tlsConf.RootCAs.AppendCertsFromPEM(pem) {
				return nil, nil, fmt.Errorf("tracing: %s holds no PEM certificate", c.CAFile)
			}
		}
	}
	switch c.Protocol {
	case ProtocolGRPC, ProtocolHTTP:
	case "":
		c.Protocol = ProtocolGRPC
	default:
		return nil, nil, fmt.Errorf("tracing: protocol %q is neither %s nor %s", c.Protocol, ProtocolGRPC, ProtocolHTTP)
	}
	exp := newExporter(c, tlsConf, headers, []attribute.KeyValue{attribute.String("service.name", service)})
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(time.Second), sdktrace.WithMaxQueueSize(4096)),
		sdktrace.WithSampler(Sampler(c.SampleRatio)),
		sdktrace.WithIDGenerator(idGenerator{}),
	)
	return tp, tp.Shutdown, nil
}

// Flush runs a provider's shutdown, which exports the spans left, for at most 5 seconds (a
// process's last act).
func Flush(shutdown func(context.Context) error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = shutdown(ctx)
}

// Sampler decides on the trace's ID for spans with no parent or a remote one (the VM's start,
// whose ID every process derives alike), and follows a local parent: one start is traced whole
// or not at all, and a flag on an object cannot ask for more traces than the ratio.
func Sampler(ratio float64) sdktrace.Sampler {
	byID := sdktrace.TraceIDRatioBased(ratio)
	return sdktrace.ParentBased(byID, sdktrace.WithRemoteParentSampled(byID), sdktrace.WithRemoteParentNotSampled(byID))
}

// readHeaders reads "name: value" lines (blank lines and # comments skipped).
func readHeaders(path string) (map[string]string, error) {
	if path == "" {
		return nil, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("tracing: reading headers: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxHeaders+1))
	if err != nil {
		return nil, fmt.Errorf("tracing: reading headers: %w", err)
	}
	if len(b) > maxHeaders {
		return nil, fmt.Errorf("tracing: %s is over %d bytes", path, maxHeaders)
	}
	h := map[string]string{}
	for i, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, ":")
		if !ok || strings.TrimSpace(k) == "" {
			return nil, fmt.Errorf("tracing: %s line %d is not \"name: value\"", path, i+1)
		}
		h[strings.TrimSpace(k)] = strings.TrimSpace(v)
	}
	return h, nil
}
