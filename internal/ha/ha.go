// Package ha elects one active router per pool through etcd. It holds all
// of the router's etcd code, so that a router without `ha etcd` links it
// but never runs it, and the scheduler never sees etcd.
package ha

import (
	"context"
	"crypto/tls"
	"errors"
	"math"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
)

// Config says where the group's election lives and what this router
// advertises to the others.
type Config struct {
	// Endpoints are etcd's client URLs.
	Endpoints []string
	// KeyPrefix holds the group's keys: the election under
	// <KeyPrefix>/election/<pool> and the records under <KeyPrefix>/<key>.
	// Routers with the same prefix and pool form one group.
	KeyPrefix string
	// Pool is the pool's name.
	Pool string
	// LeaseTTL bounds how long a dead leader keeps the lead, and how long a
	// leader cut off from etcd goes on believing it leads.
	LeaseTTL time.Duration
	// Identity is what the others name as the active router.
	Identity string
	// TLS, when set, secures the connection to etcd.
	TLS *tls.Config
}

// retryPause spaces out new sessions while etcd is unreachable.
const retryPause = time.Second

// Role is this router's standing in its pool's group.
type Role struct {
	cfg     Config
	client  *clientv3.Client
	changed chan struct{}
	ended   chan struct{}

	mu      sync.Mutex
	leading bool
	leader  string
	term    Term // while leading: the fence of this router's writes
}

// Campaign joins the election and returns at once; the campaign runs until
// ctx ends, when a leader resigns so that a standby takes over at once.
func Campaign(ctx context.Context, cfg Config) (*Role, error) {
	client, err := clientv3.New(clientv3.Config{
		Endpoints:   cfg.Endpoints,
		DialTimeout: cfg.LeaseTTL,
		TLS:         cfg.TLS,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		return nil, err
	}
	r := &Role{cfg: cfg, client: client, changed: make(chan struct{}, 1), ended: make(chan struct{})}
	go func() {
		defer close(r.ended)
		defer client.Close()
		for ctx.Err() == nil {
			if err := r.lead(ctx); err != nil && ctx.Err() == nil {
				sleep(ctx, retryPause)
			}
		}
	}()
	return r, nil
}

// Leading reports whether this router is the active one now.
func (r *Role) Leading() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.leading
}

// Leader is the identity of the active router, or "" when none is known.
func (r *Role) Leader() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.leader
}

// Changed receives a value after Leading or Leader changes.
func (r *Role) Changed() <-chan struct{} { return r.changed }

// Ended is closed once the campaign is over after ctx ended: a leader has
// resigned, so a process that waits for it before exiting hands over at
// once rather than after the lease.
func (r *Role) Ended() <-chan struct{} { return r.ended }

// lead runs one etcd session: observe who leads, campaign, and lead until
// the session's lease is lost or ctx ends.
func (r *Role) lead(ctx context.Context) error {
	ttl := int(math.Ceil(r.cfg.LeaseTTL.Seconds()))
	session, err := concurrency.NewSession(r.client, concurrency.WithTTL(ttl), concurrency.WithContext(ctx))
	if err != nil {
		return err
	}
	defer session.Close()
	termCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		// A lost lease ends the term: stop leading before anyone else can.
		<-session.Done()
		cancel()
	}()
	election := concurrency.NewElection(session, r.electionKey())
	go r.observe(termCtx, election)
	defer r.set(false, "", Term{})
	if err := election.Campaign(termCtx, r.cfg.Identity); err != nil {
		return err
	}
	r.set(true, r.cfg.Identity, Term{key: election.Key(), rev: election.Rev()})
	<-termCtx.Done()
	if ctx.Err() != nil {
		r.resign(election)
	}
	return errors.New("session ended")
}

// observe follows the election's leader key while this router waits.
func (r *Role) observe(ctx context.Context, election *concurrency.Election) {
	for resp := range election.Observe(ctx) {
		if len(resp.Kvs) > 0 {
			r.setLeader(string(resp.Kvs[0].Value))
		}
	}
}

// resign hands over at once instead of after the lease, bounded because
// Caddy's context has already ended.
func (r *Role) resign(election *concurrency.Election) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = election.Resign(ctx)
}

func (r *Role) set(leading bool, leader string, term Term) {
	r.mu.Lock()
	same := r.leading == leading && r.leader == leader
	r.leading, r.leader, r.term = leading, leader, term
	r.mu.Unlock()
	if !same {
		r.notify()
	}
}

func (r *Role) setLeader(leader string) {
	r.mu.Lock()
	same := r.leader == leader
	r.leader = leader
	r.mu.Unlock()
	if !same {
		r.notify()
	}
}

func (r *Role) notify() {
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
