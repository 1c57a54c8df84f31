package testrouter

import (
	"context"
	"errors"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/certmagic"

	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/memstore"
)

func init() {
	caddy.RegisterModule(memStorage{})
}

// memStorages is the storage the next config that uses memStorage gets.
var memStorages atomic.Pointer[memstore.Storage]

// UseStorage makes s the storage of the routers started from now on with
// the global option it returns, so that a test can fail or hold their
// writes.
func UseStorage(s *memstore.Storage) (globalOption string) {
	memStorages.Store(s)
	return "storage testrouter"
}

// memStorage is Caddy's storage module caddy.storage.testrouter: the
// storage last given to UseStorage.
type memStorage struct{}

// CaddyModule returns the Caddy module information.
func (memStorage) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "caddy.storage.testrouter", New: func() caddy.Module { return new(memStorage) }}
}

// CertMagicStorage returns the storage last given to UseStorage.
func (memStorage) CertMagicStorage() (certmagic.Storage, error) {
	return statless{memStorages.Load()}, nil
}

// statless is a memstore.Storage as certmagic needs it: with a Stat,
// which nothing the router does calls.
type statless struct{ *memstore.Storage }

// Stat implements certmagic.Storage.
func (statless) Stat(context.Context, string) (certmagic.KeyInfo, error) {
	return certmagic.KeyInfo{}, errors.New("no stat")
}

// UnmarshalCaddyfile reads `storage testrouter`, which has no options.
func (memStorage) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	return nil
}

// StoredWorker is a worker as the fleet record holds it: the record is read
// back by a later process, so its JSON is a format to keep.
type StoredWorker struct {
	URL           string `json:"url"`
	Registered    bool   `json:"registered,omitempty"`
	IsDead        bool   `json:"is_dead,omitempty"`
	WeightVersion string `json:"weight_version,omitempty"`
}
