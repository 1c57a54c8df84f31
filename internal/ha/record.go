package ha

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/url"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// The group's records live in etcd beside its election, under the same
// keys a single router uses in Caddy's storage: only the leader writes
// them, and each write is fenced by the leader key of the term it was
// made in, so that a router deposed while it still runs (its lease lost
// to a partition or a long pause) can write nothing over its successor's.

// ErrDeposed is what a write made outside a term of leading returns.
var ErrDeposed = errors.New("this router does not lead its pool's group, so it writes nothing: the active router does")

// Term is one stretch of a router's lead, from its election until its
// lease ends. The zero Term is no lead at all.
type Term struct {
	key string // the leader key the router holds, in the election's prefix
	rev int64  // the revision the key was created at: a new term makes a new key
}

// Term is the current term while the router leads.
func (r *Role) Term() (Term, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.term, r.leading
}

// electionKey is the prefix of the pool's election, escaped so that no
// pool's election holds another's keys or the records.
func (r *Role) electionKey() string {
	return r.cfg.KeyPrefix + "/election/" + url.PathEscape(r.cfg.Pool)
}

// recordKey is where a record named as in Caddy's storage lives in etcd.
func (r *Role) recordKey(name string) string { return r.cfg.KeyPrefix + "/" + name }

// Load reads the record name, reporting fs.ErrNotExist for one never
// written, as Caddy's storage does.
func (r *Role) Load(ctx context.Context, name string) ([]byte, error) {
	resp, err := r.client.Get(ctx, r.recordKey(name))
	if err != nil {
		return nil, err
	}
	if len(resp.Kvs) == 0 {
		return nil, fs.ErrNotExist
	}
	return resp.Kvs[0].Value, nil
}

// Store writes the record name if term is still the group's current one:
// its leader key is in etcd as it was created. Otherwise it writes
// nothing and returns ErrDeposed.
func (r *Role) Store(ctx context.Context, term Term, name string, value []byte) error {
	if term.key == "" {
		return ErrDeposed
	}
	resp, err := r.client.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(term.key), "=", term.rev)).
		Then(clientv3.OpPut(r.recordKey(name), string(value))).
		Commit()
	switch {
	case err != nil:
		return err
	case !resp.Succeeded:
		return fmt.Errorf("writing %s: %w", name, ErrDeposed)
	}
	return nil
}

// Watch sends the record name each time the leader writes it, until ctx
// ends; a watch etcd breaks off is started again, from the record as it
// is then, so that no write is missed for good.
func (r *Role) Watch(ctx context.Context, name string) <-chan []byte {
	out := make(chan []byte)
	go func() {
		defer close(out)
		for ctx.Err() == nil {
			r.watch(ctx, r.recordKey(name), out)
			sleep(ctx, retryPause)
		}
	}()
	return out
}

// watch sends the record as it is now, then each write, until the watch
// ends.
func (r *Role) watch(ctx context.Context, key string, out chan<- []byte) {
	resp, err := r.client.Get(ctx, key)
	if err != nil {
		return
	}
	if len(resp.Kvs) > 0 && !send(ctx, out, resp.Kvs[0].Value) {
		return
	}
	watchCtx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	for w := range r.client.Watch(watchCtx, key, clientv3.WithRev(resp.Header.Revision+1)) {
		if w.Err() != nil {
			return
		}
		for _, ev := range w.Events {
			if ev.Type == clientv3.EventTypePut && !send(ctx, out, ev.Kv.Value) {
				return
			}
		}
	}
}

func send(ctx context.Context, out chan<- []byte, v []byte) bool {
	select {
	case out <- v:
		return true
	case <-ctx.Done():
		return false
	}
}
