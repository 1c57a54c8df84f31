package diffusionrouter

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
	"github.com/miles-rollout/miles-diffusion-router/internal/ha"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// High availability. With `ha etcd`, the routers of a pool elect one
// active router through etcd (internal/ha, the only etcd code), and keep
// the fleet's record there, written by the active router alone. The
// others stand by: they mirror the record and show the fleet it holds,
// refuse everything else with 503 naming the active router, and neither
// probe workers nor call them. Without it, the pool's election holds no campaign and
// always leads: no etcd code runs and a request costs one atomic load.

// HA is how the routers that share a pool pick the one that serves it.
type HA struct {
	// Etcd elects the active router through etcd. Default: none, the
	// router is the pool's only one.
	Etcd *EtcdElection `json:"etcd,omitempty"`
}

// EtcdElection is an election of the active router in etcd: the routers
// with the same pool and KeyPrefix form one group, of which one leads.
type EtcdElection struct {
	// Endpoints are etcd's client URLs, all http://host:port or all
	// https://host:port. Required.
	Endpoints []string `json:"endpoints,omitempty"`

	// KeyPrefix is where the group's keys live in etcd: the election under
	// <key_prefix>/election/<pool>, and the fleet's record at
	// <key_prefix>/diffusion_router/<pool>/fleet.json, the key it has in
	// Caddy's storage. Default /diffusion-router.
	KeyPrefix string `json:"key_prefix,omitempty"`

	// LeaseTTL is the lease of the active router: a standby takes over
	// within it of the active router's death, and an active router cut
	// off from etcd stops taking jobs once it can no longer renew it.
	// Whole seconds, at least 1s, as etcd's leases count seconds. Default 5s.
	LeaseTTL caddy.Duration `json:"lease_ttl,omitempty"`

	// Advertise is the URL clients and operators reach this router at;
	// standbys name it as the active router. Placeholders such as
	// {env.POD_IP} are expanded when the config loads. Default:
	// http://<hostname>:<port>, the port of the first address the
	// server that holds the handler listens on (https when it serves TLS).
	Advertise string `json:"advertise,omitempty"`

	// TLS is how the router checks etcd and shows itself to it, for
	// https:// endpoints. Default: etcd's certificate is checked against
	// the system's roots, and the router shows none.
	TLS *EtcdTLS `json:"tls,omitempty"`
}

// EtcdTLS is the TLS of the connection to etcd.
type EtcdTLS struct {
	// CA is a PEM file of the certificates that sign etcd's, in place of
	// the system's roots.
	CA string `json:"ca,omitempty"`

	// ClientCert and ClientKey are PEM files of the certificate and key
	// the router shows to an etcd that checks its clients
	// (--client-cert-auth). Both or neither.
	ClientCert string `json:"client_cert,omitempty"`
	ClientKey  string `json:"client_key,omitempty"`

	// ServerName is the name etcd's certificate must carry. Default: the
	// endpoint's host.
	ServerName string `json:"server_name,omitempty"`
}

// Defaults of `ha etcd`.
const (
	defaultKeyPrefix = "/diffusion-router"
	defaultLeaseTTL  = 5 * time.Second
)

// haConfig is a handler's `ha etcd`, ready for its pool's election.
type haConfig struct {
	ha.Config
	options string   // the options as provisioned, to tell whether a reload changes them
	handler *Handler // which server holds it says the default identity
}

// provisionHA checks `ha etcd` and reads its files; it dials nobody.
func (h *Handler) provisionHA() error {
	e := h.HA.Etcd
	if e == nil {
		return nil
	}
	secure, err := checkEndpoints(e.Endpoints)
	if err != nil {
		return optionError("ha etcd", "ha.etcd.endpoints", "%v", err)
	}
	e.KeyPrefix = cmp.Or(e.KeyPrefix, defaultKeyPrefix)
	e.LeaseTTL = cmp.Or(e.LeaseTTL, caddy.Duration(defaultLeaseTTL))
	if ttl := time.Duration(e.LeaseTTL); ttl < time.Second || ttl%time.Second != 0 {
		return optionError("lease_ttl", "ha.etcd.lease_ttl", "must be whole seconds, at least 1s (etcd's leases count seconds), got %s", ttl)
	}
	identity, err := advertised(e.Advertise)
	if err != nil {
		return optionError("advertise", "ha.etcd.advertise", "%v", err)
	}
	tlsConfig, err := etcdTLS(e.TLS, secure)
	if err != nil {
		return optionError("tls", "ha.etcd.tls", "%v", err)
	}
	options, err := json.Marshal(e)
	if err != nil {
		return err
	}
	h.ha = &haConfig{handler: h, options: string(options), Config: ha.Config{
		Endpoints: e.Endpoints, KeyPrefix: e.KeyPrefix, Pool: h.Pool,
		LeaseTTL: time.Duration(e.LeaseTTL), Identity: identity, TLS: tlsConfig,
	}}
	return nil
}

// checkEndpoints checks etcd's client URLs and reports whether they are
// https.
func checkEndpoints(endpoints []string) (secure bool, err error) {
	if len(endpoints) == 0 {
		return false, fmt.Errorf("needs at least one etcd endpoint, like http://etcd:2379")
	}
	schemes := map[string]bool{}
	for _, raw := range endpoints {
		u, err := url.Parse(raw)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil ||
			(u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" {
			return false, fmt.Errorf("%q is not an etcd client URL like http://etcd:2379", raw)
		}
		schemes[u.Scheme] = true
	}
	if len(schemes) > 1 {
		return false, fmt.Errorf("endpoints mix http:// and https://; give all of one")
	}
	return schemes["https"], nil
}

// advertised expands and checks the advertise option; "" stays "", for
// the default worked out as the router starts.
func advertised(raw string) (string, error) {
	if raw == "" {
		return "", nil
	}
	v := caddy.NewReplacer().ReplaceAll(raw, "")
	u, err := url.Parse(v)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("%q is not a URL like http://router-0.router:8080", v)
	}
	return v, nil
}

// etcdTLS is the TLS config of the connection to etcd; nil for http://
// endpoints, which take no tls block.
func etcdTLS(t *EtcdTLS, secure bool) (*tls.Config, error) {
	if !secure {
		if t != nil {
			return nil, fmt.Errorf("needs https:// endpoints")
		}
		return nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if t == nil {
		return cfg, nil
	}
	cfg.ServerName = t.ServerName
	if t.CA != "" {
		pem, err := os.ReadFile(t.CA)
		if err != nil {
			return nil, fmt.Errorf("ca: %v", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("ca: %s holds no PEM certificate", t.CA)
		}
	}
	if (t.ClientCert == "") != (t.ClientKey == "") {
		return nil, fmt.Errorf("client_cert needs both a certificate and a key file")
	}
	if t.ClientCert != "" {
		cert, err := tls.LoadX509KeyPair(t.ClientCert, t.ClientKey)
		if err != nil {
			return nil, fmt.Errorf("client_cert: %v", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// exitPoll is how often a campaign checks whether the process is exiting.
const exitPoll = 100 * time.Millisecond

// election is a pool's standing in its HA group for as long as the pool
// lives: the campaign of the config started last, kept across reloads
// that leave `ha` as it was, so that a reload hands nothing over. It is
// what control.Standing asks.
type election struct {
	pool     *pool
	logger   *zap.Logger
	running  atomic.Pointer[campaign] // nil: no `ha`, the router is the pool's only one
	electing sync.Mutex               // one elect at a time

	mu      sync.Mutex    // guards changed
	changed chan struct{} // closed and replaced when the standing changes
}

// campaign is one run of the pool's election, with one config.
type campaign struct {
	key      string // the config, to tell whether a reload changes it
	role     *ha.Role
	stop     context.CancelFunc
	followed chan struct{} // closed once follow has returned
	// leading: the role leads, the fleet was read from the group's record
	// and the workers were made unverified since it took the lead, so that
	// every worker passes a probe before a job. Writes of the pool's state
	// wait for it.
	leading atomic.Bool
	// term fences the record's writes: the term the role leads in, set as
	// it takes the lead (before the record is read, whose copy kept aside
	// goes out in it), nil otherwise.
	term atomic.Pointer[ha.Term]
}

func newElection(p *pool, logger *zap.Logger) *election {
	return &election{pool: p, logger: logger, changed: make(chan struct{})}
}

// elect runs the pool's campaign with cfg, or none when cfg is nil. A
// campaign whose config has the same key goes on; another one ends
// first, so that a router never campaigns twice.
func (e *election) elect(cfg *ha.Config, key string) error {
	e.electing.Lock()
	defer e.electing.Unlock()
	old := e.running.Load()
	if old == nil && cfg == nil || old != nil && old.key == key {
		return nil
	}
	if old != nil {
		old.end() // it leads no more from here on, so no gap where the router would lead alone
	}
	if cfg == nil {
		e.running.Store(nil)
		e.broadcast()
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	role, err := ha.Campaign(ctx, *cfg)
	if err != nil {
		cancel()
		return fmt.Errorf("ha etcd: %w", err)
	}
	c := &campaign{key: key, role: role, stop: cancel, followed: make(chan struct{})}
	e.running.Store(c)
	go e.follow(ctx, c)
	return nil
}

// end stops the campaign and waits until a leader has resigned.
func (c *campaign) end() {
	c.stop()
	<-c.role.Ended()
	<-c.followed
}

// follow turns the role's changes into the pool's standing. A standby
// mirrors the group's record of the fleet; a router that takes the lead
// reads the record as its predecessor left it and makes every worker
// unverified before it says it leads.
func (e *election) follow(ctx context.Context, c *campaign) {
	defer close(c.followed)
	standby := e.standBy(ctx)
	defer func() { standby() }()
	exitCheck := time.NewTicker(exitPoll)
	defer exitCheck.Stop()
	for {
		select {
		case <-ctx.Done():
			c.term.Store(nil)
			c.leading.Store(false)
			e.broadcast()
			return
		case <-exitCheck.C:
			// A process told to exit resigns as it begins to, not once the
			// server's grace period has let its jobs end: a standby takes
			// the new jobs meanwhile, and this router finishes those it
			// holds, as one that lost its lease does. Caddy has no hook
			// that runs before its http app's drain in every start order,
			// so the flag it sets first is polled.
			if caddy.Exiting() {
				c.stop()
			}
			continue
		case <-c.role.Changed():
		}
		term, leading := c.role.Term()
		held := c.term.Load()
		switch {
		case leading && (!c.leading.Load() || held == nil || *held != term): // a new lead, or a lead lost and taken again since
			standby()
			if e.takeLead(ctx, c) {
				e.logger.Info("this router leads the pool; it probes every worker before it sends jobs")
			} else {
				standby = e.standBy(ctx)
			}
		case !leading && c.leading.Load():
			c.term.Store(nil)
			c.leading.Store(false)
			standby = e.standBy(ctx)
			e.logger.Warn("this router no longer leads the pool: it takes no new jobs and finishes those it holds",
				zap.String("leader", c.role.Leader()))
		}
		e.broadcast()
	}
}

// standBy mirrors the group's record until the returned function is
// called, which waits until the mirroring has stopped.
func (e *election) standBy(ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		e.pool.store.Follow(ctx)
	}()
	return func() { cancel(); <-done }
}

// takeLead reads the group's record of the fleet within the term the role
// leads in, so that the record written next is the predecessor's carried
// on, and leads from then on. It reports false if the role stopped leading
// first.
func (e *election) takeLead(ctx context.Context, c *campaign) bool {
	c.leading.Store(false)
	for {
		term, leading := c.role.Term()
		if !leading {
			c.term.Store(nil)
			return false
		}
		c.term.Store(&term)
		err := e.pool.store.Reload(ctx)
		if now, _ := c.role.Term(); err == nil && now == term {
			e.pool.Reverify()
			c.leading.Store(true)
			e.pool.store.Changed()
			return true
		}
		c.term.Store(nil)
		if err != nil {
			e.logger.Error("could not read the group's record of the fleet as this router takes the lead; retrying", zap.Error(err))
		}
		if !scheduler.Sleep(ctx, time.Second) {
			return false
		}
	}
}

func (e *election) broadcast() {
	e.mu.Lock()
	defer e.mu.Unlock()
	close(e.changed)
	e.changed = make(chan struct{})
}

// changes is closed at the next change of the standing.
func (e *election) changes() <-chan struct{} {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.changed
}

// Leading reports whether this router is the pool's active one: always,
// without `ha`.
func (e *election) Leading() bool {
	c := e.running.Load()
	return c == nil || c.leading.Load() && c.role.Leading()
}

// Leader is the active router's identity, "" while none is known or
// without `ha`.
func (e *election) Leader() string {
	if c := e.running.Load(); c != nil {
		return c.role.Leader()
	}
	return ""
}

// inGroup reports whether the pool runs a campaign.
func (e *election) inGroup() bool { return e.running.Load() != nil }

// groupRecord keeps the pool's record in etcd, where only the group's
// active router writes it, each write fenced by the term it leads in. It
// is a fleet.Storage, a fleet.Fenced and a fleet.Watcher.
type groupRecord struct {
	election *election
	// seed is Caddy's storage, read while etcd holds no record yet, so that
	// a router that joins a group takes its fleet there; nil with persist
	// off.
	seed fleet.Storage
}

// errNoCampaign is why the record cannot be reached before the pool's
// campaign has started, or after it ended.
var errNoCampaign = errors.New("the pool runs no election, so the group's record in etcd is out of reach")

// Load reads the record from etcd, or from Caddy's storage while etcd has
// none.
func (g *groupRecord) Load(ctx context.Context, key string) ([]byte, error) {
	c := g.election.running.Load()
	if c == nil {
		return nil, errNoCampaign
	}
	data, err := c.role.Load(ctx, key)
	if errors.Is(err, fs.ErrNotExist) && g.seed != nil {
		return g.seed.Load(ctx, key)
	}
	return data, err
}

// Store writes to etcd if this router leads, within its term: the copy
// of a record kept aside as the router takes the lead.
func (g *groupRecord) Store(ctx context.Context, key string, value []byte) error {
	c := g.election.running.Load()
	if c == nil {
		return errNoCampaign
	}
	term := c.term.Load()
	if term == nil {
		return fleet.ErrNotWriter
	}
	return c.store(ctx, *term, key, value)
}

// Writer is how the pool's state is written: once this router leads, in
// the term it leads in as the state is read.
func (g *groupRecord) Writer() (store func(ctx context.Context, key string, value []byte) error, ok bool) {
	c := g.election.running.Load()
	if c == nil || !c.leading.Load() {
		return nil, false
	}
	term := c.term.Load()
	if term == nil {
		return nil, false
	}
	return func(ctx context.Context, key string, value []byte) error { return c.store(ctx, *term, key, value) }, true
}

// store writes in term; a term that has ended makes this router no
// writer.
func (c *campaign) store(ctx context.Context, term ha.Term, key string, value []byte) error {
	err := c.role.Store(ctx, term, key, value)
	if errors.Is(err, ha.ErrDeposed) {
		return fmt.Errorf("%w: %w", fleet.ErrNotWriter, err)
	}
	return err
}

// Watch follows the record the active router writes.
func (g *groupRecord) Watch(ctx context.Context, key string) <-chan []byte {
	c := g.election.running.Load()
	if c == nil {
		none := make(chan []byte)
		close(none)
		return none
	}
	return c.role.Watch(ctx, key)
}

// refuseAsStandby answers a request a standby does not serve: 503 naming
// the active router, to be retried there, or here after a second.
func (h *Handler) refuseAsStandby(w http.ResponseWriter) error {
	w.Header().Set("Retry-After", "1")
	leader := h.pool.election.Leader()
	if leader == "" {
		return answer.WriteJSON(w, http.StatusServiceUnavailable, map[string]any{
			"error":  fmt.Sprintf("this router is a standby of pool %s and no router leads it right now; retry in a second", h.Pool),
			"leader": nil,
		})
	}
	return answer.WriteJSON(w, http.StatusServiceUnavailable, map[string]any{
		"error":  fmt.Sprintf("this router is a standby of pool %s; send requests to the active router, %s", h.Pool, leader),
		"leader": leader,
	})
}

// standbyServes reports whether a standby answers r: the requests that
// show the router and its fleet, so that an operator can see who leads.
func standbyServes(r *http.Request, answered bool) bool {
	if !answered || (r.Method != http.MethodGet && r.Method != http.MethodHead) {
		return false
	}
	switch r.URL.Path {
	case "/health", "/healthz", "/readyz", "/workers", "/list_workers", "/dashboard", "/dashboard/data":
		return true
	}
	return strings.HasPrefix(r.URL.Path, "/workers/")
}

// campaign is the election's config, with the identity the handler
// advertises by default once the http app says where it listens, and the
// key that tells it apart from another's.
func (c *haConfig) campaign(app *caddyhttp.App) (cfg ha.Config, key string) {
	cfg = c.Config
	if cfg.Identity == "" {
		cfg.Identity = defaultAdvertise(app, c.handler)
	}
	return cfg, c.options + " as " + cfg.Identity
}

// defaultAdvertise is http://<hostname>:<port>, the port of the first
// address the server that holds h listens on, https when that server
// serves TLS.
func defaultAdvertise(app *caddyhttp.App, h *Handler) string {
	host, err := os.Hostname()
	if err != nil {
		host = "localhost"
	}
	srv := serverOf(app, h)
	if srv == nil || len(srv.Listen) == 0 {
		return "http://" + host
	}
	scheme := "http"
	if len(srv.TLSConnPolicies) > 0 {
		scheme = "https"
	}
	addr, err := caddy.ParseNetworkAddress(srv.Listen[0])
	if err != nil {
		return scheme + "://" + host
	}
	return scheme + "://" + net.JoinHostPort(host, strconv.FormatUint(uint64(addr.StartPort), 10))
}

// serverOf is the server whose routes hold h, or else the first by name.
func serverOf(app *caddyhttp.App, h *Handler) *caddyhttp.Server {
	if app == nil || len(app.Servers) == 0 {
		return nil
	}
	names := slices.Sorted(maps.Keys(app.Servers))
	for _, name := range names {
		if holds(app.Servers[name].Routes, h) {
			return app.Servers[name]
		}
	}
	return app.Servers[names[0]]
}

// holds reports whether routes, or the subroutes within them, hold h.
func holds(routes caddyhttp.RouteList, h *Handler) bool {
	for _, r := range routes {
		for _, mh := range r.Handlers {
			switch m := mh.(type) {
			case *Handler:
				if m == h {
					return true
				}
			case *caddyhttp.Subroute:
				if holds(m.Routes, h) {
					return true
				}
			}
		}
	}
	return false
}
