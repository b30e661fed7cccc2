// Package logging turns the --log-level and --log-format flags every IMP daemon takes into a
// structured logr.Logger (zap underneath, as controller-runtime uses).
package logging

import (
	"flag"
	"fmt"

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

// Logger builds the logger the options describe.
func (o *Options) Logger() (logr.Logger, error) {
	var lvl zapcore.Level
	if err := lvl.UnmarshalText([]byte(o.Level)); err != nil {
		var n int
		if _, scanErr := fmt.Sscanf(o.Level, "%d", &n); scanErr != nil || n < 0 {
			return logr.Discard(), fmt.Errorf("--log-level %q: want debug, info, warn, error or a verbosity number", o.Level)
		}
		lvl = zapcore.Level(-n)
	}
	opts := []zap.Opts{zap.Level(lvl)}
	switch o.Format {
	case "json":
		opts = append(opts, zap.JSONEncoder())
	case "text":
		opts = append(opts, zap.ConsoleEncoder())
	default:
		return logr.Discard(), fmt.Errorf("--log-format %q: want json or text", o.Format)
	}
	return zap.New(opts...), nil
}
