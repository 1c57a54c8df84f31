package kubediscovery

import (
	"github.com/go-logr/logr"
	"go.uber.org/zap"
)

// zapSink hands client-go's own logs to zap at debug level: this package
// logs what an operator needs itself, and client-go would otherwise write
// to the process's stderr through klog.
type zapSink struct{ log *zap.Logger }

// maxVerbosity drops client-go's chattier logs (klog's V(3) and above:
// every watch restart, every resync).
const maxVerbosity = 2

// Init is logr's hook for call depth, which zap's caller annotation does
// not need here.
func (zapSink) Init(logr.RuntimeInfo) {}

// Enabled says whether a log at this verbosity is kept.
func (s zapSink) Enabled(level int) bool {
	return level <= maxVerbosity && s.log.Core().Enabled(zap.DebugLevel)
}

// Info logs msg at debug level.
func (s zapSink) Info(_ int, msg string, keysAndValues ...any) {
	s.log.Debug(msg, fields(keysAndValues)...)
}

// Error logs msg with err at debug level: the failures that matter reach
// the operator through the watch loop's own warning.
func (s zapSink) Error(err error, msg string, keysAndValues ...any) {
	s.log.Debug(msg, append(fields(keysAndValues), zap.Error(err))...)
}

// WithValues adds fields to every later log.
func (s zapSink) WithValues(keysAndValues ...any) logr.LogSink {
	return zapSink{log: s.log.With(fields(keysAndValues)...)}
}

// WithName names the logger.
func (s zapSink) WithName(name string) logr.LogSink {
	return zapSink{log: s.log.Named(name)}
}

// fields turns logr's alternating keys and values into zap fields.
func fields(keysAndValues []any) []zap.Field {
	out := make([]zap.Field, 0, len(keysAndValues)/2)
	for i := 0; i+1 < len(keysAndValues); i += 2 {
		key, ok := keysAndValues[i].(string)
		if !ok {
			continue
		}
		out = append(out, zap.Any(key, keysAndValues[i+1]))
	}
	return out
}
