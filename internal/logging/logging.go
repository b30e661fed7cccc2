// Package logging turns the --log-level and --log-format flags every IMP daemon takes into a
// structured logr.Logger (zap underneath, as controller-runtime uses).
package logging

import (
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/go-logr/logr"
	"go.uber.org/zap/zapcore"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
)

// Options are the logging flags.
type Options struct {
	Level  string
	Format string
}

// BindFlags registers --log-level and --log-format on fs.
func (o *Options) BindFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.Level, "log-level", "info", "log level: debug, info, warn or error (or a number: higher is more verbose)")
	fs.StringVar(&o.Format, "log-format", "json", "log format: json or text")
}

// Logger builds the logger the options describe, writing to standard error.
func (o *Options) Logger() (logr.Logger, error) { return o.logger(os.Stderr) }

func (o *Options) logger(w io.Writer) (logr.Logger, error) {
	var lvl zapcore.Level
	if err := lvl.UnmarshalText([]byte(o.Level)); err != nil {
		var n int
		if _, scanErr := fmt.Sscanf(o.Level, "%d", &n); scanErr != nil || n < 0 {
			return logr.Discard(), fmt.Errorf("--log-level %q: want debug, info, warn, error or a verbosity number", o.Level)
		}
		lvl = zapcore.Level(-n)
	}
	opts := []zap.Opts{zap.Level(lvl), zap.WriteTo(w)}
	switch o.Format {
	case "json":
		opts = append(opts, zap.JSONEncoder())
	case "text":
		opts = append(opts, zap.ConsoleEncoder())
	default:
		return logr.Discard(), fmt.Errorf("--log-format %q: want json or text", o.Format)
	}
	return logr.New(deferred{sink: zap.New(opts...).GetSink()}), nil
}

// deferred is a logr.LogSink that keeps what WithValues gives it and hands it to its sink only
// for a line it writes. controller-runtime gives each reconcile a logger with the controller,
// the object and a reconcile ID, and zap encodes such values as it is given them: a cost paid
// by every reconcile of every object (3 % of the operator's CPU placing and running VMs, in its
// profile), for lines that are rarely written.
type deferred struct {
	sink logr.LogSink
	kv   []any
}

var _ logr.CallDepthLogSink = deferred{}

// Init passes info on: the caller of a line stays the line's (TestCallerIsTheLines).
func (d deferred) Init(info logr.RuntimeInfo) { d.sink.Init(info) }

func (d deferred) Enabled(level int) bool { return d.sink.Enabled(level) }

func (d deferred) Info(level int, msg string, kv ...any) { d.withValues().Info(level, msg, kv...) }

func (d deferred) Error(err error, msg string, kv ...any) { d.withValues().Error(err, msg, kv...) }

func (d deferred) WithValues(kv ...any) logr.LogSink {
	return deferred{sink: d.sink, kv: append(d.kv[:len(d.kv):len(d.kv)], kv...)}
}

func (d deferred) WithName(name string) logr.LogSink {
	return deferred{sink: d.sink.WithName(name), kv: d.kv}
}

func (d deferred) WithCallDepth(depth int) logr.LogSink {
	if s, ok := d.sink.(logr.CallDepthLogSink); ok {
		return deferred{sink: s.WithCallDepth(depth), kv: d.kv}
	}
	return d
}

// withValues is the sink with the values kept so far.
func (d deferred) withValues() logr.LogSink {
	if len(d.kv) == 0 {
		return d.sink
	}
	return d.sink.WithValues(d.kv...)
}
