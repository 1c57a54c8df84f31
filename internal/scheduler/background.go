package scheduler

import (
	"context"
	"sync"

	"go.uber.org/zap"
)

// background runs a pool's own goroutines. Each gets the pool's context,
// is waited for when the pool ends, and a panic in one is logged rather
// than taking Caddy down, as Caddy's own health checker does.
type background struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     *sync.WaitGroup
	logger *zap.Logger
}

func newBackground(logger *zap.Logger) background {
	ctx, cancel := context.WithCancel(context.Background())
	return background{ctx: ctx, cancel: cancel, wg: new(sync.WaitGroup), logger: logger}
}

// Go runs f in the background; what names it in the log should it panic.
func (b background) Go(what string, f func(ctx context.Context)) {
	GoSafely(b.wg, b.logger, what, func() { f(b.ctx) })
}

// stop ends the background's context and waits for its goroutines.
func (b background) stop() {
	b.cancel()
	b.wg.Wait()
}

// GoSafely runs f in a goroutine counted by wg, logging a panic instead of
// crashing the process.
func GoSafely(wg *sync.WaitGroup, logger *zap.Logger, what string, f func()) {
	wg.Go(func() {
		defer func() {
			if v := recover(); v != nil {
				logger.Error("panic in background work", zap.String("work", what), zap.Any("panic", v), zap.Stack("stack"))
			}
		}()
		f()
	})
}
