package scheduler

// A trainer that moves weights into the workers itself (miles_diffusion
// pushes tensors into each engine over CUDA IPC) tells the router what
// they hold: a declaration. The router cannot ask an engine for its
// version (sglang-diffusion keeps none), but it can ask for the checksums
// of its weights, and a worker whose checksums do not match the trainer's
// is kept from jobs, stale, rather than serve samples from weights nobody
// meant. The mark is beside the lifecycle state, as a pause is, so that a
// sleep or a wake cannot end it: only a later declaration that names the
// worker, or an update through the router, does.

// Where the router learned a worker's weight version, as /workers shows
// it in weight_version_source.
const (
	SourceReported = "reported" // the model id its /v1/models gives, before any update
	SourceRouter   = "router"   // an update through the router
	SourceDeclared = "declared" // a trainer's declaration
	SourceVerified = "verified" // a declaration whose checksums the worker matched
	SourceUnknown  = "unknown"  // changed behind the router's back since it was known
)

// VersionSources are the values of weight_version_source, in the order
// the docs list them.
var VersionSources = []string{SourceReported, SourceRouter, SourceDeclared, SourceVerified, SourceUnknown}

// DeclareVersion records a trainer's declaration of version: each worker
// of on holds it, learned as its source there says (SourceDeclared or
// SourceVerified), and leaves stale if it was; each worker of off did not
// match the declaration's checksums and is stale until a later one, or an
// update through the router, brings it back, as is each worker not named
// that waited to be caught up with the updates before. The fleet's version becomes
// version, and the history of updates is dropped: replaying it would not
// lead to weights that moved behind the router. A worker that left since
// it was named is skipped.
func (p *Pool) DeclareVersion(version string, on map[string]string, off []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for u, source := range on {
		if w := p.findLocked(u); w != nil {
			w.life.version, w.life.source, w.life.undeclared = version, source, false
			if w.life.state == Stale {
				p.fleet.leaveLocked(w)
				w.life.state, w.life.missed = Serving, false
			}
		}
	}
	for _, u := range off {
		if w := p.findLocked(u); w != nil {
			w.life.undeclared = true
		}
	}
	for _, w := range p.workers {
		if _, named := on[w.url]; !named && (w.life.behind != upToDate || w.life.missed) {
			// It waits to be brought to the fleet's weights by replaying
			// the updates, which do not lead to the declared ones.
			p.fleet.leaveLocked(w)
			w.life.undeclared = true
		}
	}
	p.fleet.version, p.fleet.history, p.fleet.inherited = version, nil, nil
	p.Changed()
	p.dispatchLocked()
}

// versionSource is where the router learned w's version: "" while it
// knows none.
func (w *worker) versionSource() string {
	switch {
	case w.life.version == "":
		return ""
	case w.life.source == "":
		return SourceReported
	}
	return w.life.source
}
