package scheduler

import (
	"context"
	"math"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// Placement decides which workers hold which adapter. Its rule is the
// fluid one: a worker joins an adapter's holders when the work waiting
// for that adapter would take its holders longer than the worker needs to
// get there (its own jobs, then the switch), and it leaves one adapter
// for another only when the other's wait exceeds what the first's would
// be without it by more than the switch. So workers stay where they are
// while demand is balanced, an adapter with no holder takes a worker from
// one with several, or from one with nothing waiting, at once, and when
// adapters with work outnumber workers each keeps its only worker for a
// turn (PlacementConfig.Turn) before the next in the queue's order takes
// it. A worker switches at most MaxSwitches times a minute, and serves at
// least as long as its switch took before it switches again.

// A Switcher makes the calls that change a worker's adapter. Its methods
// are called in the pool's background, without the pool's lock.
type Switcher interface {
	// Active reads which adapter the worker has active: its nickname and
	// path, both "" for the base weights.
	Active(ctx context.Context, workerURL string) (name, path string, err error)
	// Switch makes a the worker's adapter (nil: the base weights), first
	// taking off what the worker has merged when unmerge is set. It
	// returns the worker's status and message.
	Switch(ctx context.Context, workerURL string, a *Adapter, unmerge bool) (status int, message string, err error)
}

// UseSwitcher sets how the pool changes workers' adapters: it is called
// as the router starts, not as a config is provisioned, so that
// provisioning calls no worker.
func (p *Pool) UseSwitcher(s Switcher) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.placement.switcher = s
	p.tickLocked()
	p.dispatchLocked()
}

// tickLocked starts placement's clock in the pool's background, once the
// pool places adapters and can switch them.
func (p *Pool) tickLocked() {
	pl := &p.placement
	if pl.on && pl.switcher != nil && !pl.ticking {
		pl.ticking = true
		p.bg.Go("adapter placement", p.tickPlacement)
	}
}

// policyTally is what placement counts of a policy on each pass.
type policyTally struct {
	waiting int            // jobs waiting
	queued  float64        // their cost
	head    *Ticket        // the first of them in the queue's order
	tasks   []request.Task // what they need a worker to make
	holders int            // workers holding it or switching to it
	arrived int            // those of them holding it already
	speed   float64        // their speeds' sum
	work    float64        // the work they have before the waiting jobs, in cost units
	floor   float64        // see floorsLocked
}

// join counts a worker of the speed and work given among the holders;
// arrived: it holds the policy already, rather than switching to it.
func (t *policyTally) join(speed, work float64, arrived bool) {
	t.holders++
	t.speed += speed
	t.work += work
	if arrived {
		t.arrived++
	}
}

// leave takes a worker of the speed and work given, which holds the
// policy, out of the holders.
func (t *policyTally) leave(speed, work float64) {
	t.holders--
	t.arrived--
	t.speed -= speed
	t.work -= work
}

// servableBy reports whether w can make what a waiting job needs.
func (t *policyTally) servableBy(w *worker) bool {
	return slices.ContainsFunc(t.tasks, w.can)
}

// wait is how long the jobs waiting would take the holders, in seconds:
// 0 with none waiting, +Inf with no holder.
func (t *policyTally) wait() float64 {
	if t.queued == 0 {
		return 0
	}
	if t.holders == 0 {
		return math.Inf(1)
	}
	return (t.work + t.queued) / t.speed
}

// placementTick is how often placement looks again without an event:
// turns and switch budgets end with time.
const placementTick = time.Second

// tickPlacement runs placement once a tick while the pool lives.
func (p *Pool) tickPlacement(ctx context.Context) {
	p.mu.Lock()
	tick := time.NewTimer(p.placementTickLocked())
	p.mu.Unlock()
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			p.mu.Lock()
			if p.placement.on {
				p.dispatchLocked()
			}
			tick.Reset(p.placementTickLocked())
			p.mu.Unlock()
		}
	}
}

// placementTickLocked is how long placement waits before it looks again:
// a tick, or adapter_retry when that is shorter, so that a failed LoRA
// call is tried again when its retry is due rather than at the next tick.
func (p *Pool) placementTickLocked() time.Duration {
	if r := p.placement.cfg.Retry; r > 0 && r < placementTick {
		return r
	}
	return placementTick
}

// passWorkers is how many workers one pass of placement per job that
// arrives or ends is worth: see placementDueLocked.
const passWorkers = 32

// placementDueLocked reports whether a job that arrived or ended, freeing
// freed (nil: none), calls for a pass of placement once the queue has
// been dispatched. A job moves the balance placement weighs by one job,
// while a pass reads every worker: on a fleet of more than passWorkers
// workers, placement looks again after every len(workers)/passWorkers such
// jobs, so that its cost per job stays that of a small fleet. At 1,024
// workers that is every 32 jobs, a fraction of a second of a rollout's
// completions, where a switch takes seconds. What moves the balance by
// more runs a pass at once: the queue gains or loses a class of jobs or a
// priority (an adapter's first waiting job, or its last), a class's first
// job is of a higher priority than before, or freed may start its LoRA
// call now that its jobs have ended; and so does anything else that
// dispatches, and the tick. What moves it by less (a job that ends lets
// a worker serve again, a tenant's first job in a class) waits for those.
func (p *Pool) placementDueLocked(freed *worker, now int64) bool {
	pl := &p.placement
	pl.moved++
	return pl.moved >= len(p.workers)/passWorkers || pl.shape != p.queue.shape ||
		freed != nil && p.fleet.callDueLocked(freed, now)
}

// placeLocked runs a pass of placement: it starts the calls workers are
// ready for and decides the switches the queue asks for.
func (p *Pool) placeLocked() {
	pl := &p.placement
	if !pl.on || pl.switcher == nil {
		return
	}
	now := p.now().UnixNano()
	pl.moved, pl.shape = 0, p.queue.shape
	p.tallyLocked(now)
	for p.switchOneLocked(now) {
	}
	for _, w := range p.workers {
		if p.fleet.callDueLocked(w, now) {
			p.callLocked(w, now)
		}
	}
	p.refuseUnservableLocked(now)
	p.stopPlacementLocked()
}

// refuseUnservableLocked ends the waiting jobs that no worker can serve:
// every worker that could is out after failed LoRA calls. They would
// otherwise wait until their clients give up.
func (p *Pool) refuseUnservableLocked(now int64) {
	if !slices.ContainsFunc(p.workers, func(w *worker) bool { return w.adapter.out(now) != "" }) {
		return
	}
	for _, c := range p.queue.all {
		if c.key.policy == nil {
			continue
		}
		err := p.unservableLocked(c.lines[0].head().wt.t, now) // a class's jobs are served by the same workers
		for _, l := range c.lines {
			for i := 0; err != nil && i < len(l.places); i++ {
				if t := l.places[i].wt.t; t.Cancelled() == nil {
					t.Cancel(err)
				}
			}
		}
	}
}

// unservableLocked says why no worker can serve t, or nil when some
// worker that may serve it is not out for failed LoRA calls.
func (p *Pool) unservableLocked(t *Ticket, now int64) error {
	var err *UnservableAdapterError
	q := question{asks: mayServe, upcoming: p.fleet.target()}
	for _, w := range p.workers {
		if !p.mayTakeLocked(t, w, now, q) {
			continue
		}
		if !w.adapter.outFor(t.policy, now) {
			return nil
		}
		err = &UnservableAdapterError{Name: t.policy.Name, Worker: w.url, Last: w.adapter.failure}
	}
	if err == nil {
		return nil // no worker at all: the queue's own errors say so
	}
	return err
}

// tallyLocked counts, for each policy, the jobs waiting for it and its
// holders, and files the workers that may leave what they serve (see
// fileDonorLocked): one read of each worker for both.
func (p *Pool) tallyLocked(now int64) {
	pl := &p.placement
	pl.adrift = pl.adrift[:0]
	for pol := range pl.each() {
		pol.tally, pol.donors = policyTally{}, pol.donors[:0]
	}
	for _, c := range p.queue.all {
		pol := c.key.policy
		if pol == nil || c.key.pin != "" {
			continue
		}
		tl := &pol.tally
		for _, l := range c.lines {
			if head := l.head().wt.t; tl.head == nil || head.before(tl.head) {
				tl.head = head
			}
		}
		tl.waiting += c.waiting
		tl.queued += c.cost
		if !slices.Contains(tl.tasks, c.key.task) {
			tl.tasks = append(tl.tasks, c.key.task)
		}
	}
	for i, w := range p.workers {
		pol, speed, work := p.placedOnLocked(w, now), p.speedOfLocked(w), p.workLeftLocked(w, now)
		if pol != nil {
			pol.tally.join(speed, work+p.switchLeftLocked(w, now)*speed, !w.adapter.switching)
		}
		p.fileDonorLocked(donor{w: w, at: i, speed: speed, work: work, cost: p.switchCostLocked(w)}, pol, now)
	}
}

// placedOnLocked is the policy whose jobs w serves, or will once its
// switch ends; nil when w serves none now.
func (p *Pool) placedOnLocked(w *worker, now int64) *policy {
	wa := &w.adapter
	if !w.serving(now) {
		return nil
	}
	switch {
	case wa.switching:
		return wa.target
	case !wa.known || wa.holds == nil || wa.publish != wa.holds.publish:
		return nil
	}
	return wa.holds
}

// switchLeftLocked is how long w's switch is predicted to go on, in
// seconds: 0 when it is not switching.
func (p *Pool) switchLeftLocked(w *worker, now int64) float64 {
	wa := &w.adapter
	if !wa.switching {
		return 0
	}
	cost := p.switchCostLocked(w)
	if wa.calling {
		cost -= float64(now-wa.called) / float64(time.Second)
	}
	return max(cost, 0)
}

// switchCostLocked is how long w is predicted to take to switch, in
// seconds.
func (p *Pool) switchCostLocked(w *worker) float64 {
	if w.adapter.cost > 0 {
		return w.adapter.cost
	}
	return p.placement.cfg.SwitchPrior.Seconds()
}

// donor is a worker that may leave what it serves for another policy's
// jobs, as a pass of placement reads it once.
type donor struct {
	w     *worker
	at    int     // its index among the pool's workers: of equal donors, the first
	speed float64 // cost units a second
	work  float64 // its jobs' cost left
	cost  float64 // its switch's predicted seconds
}

// delay is how long until d could start another policy's jobs, in
// seconds: its jobs, then its switch.
func (d *donor) delay() float64 { return d.work/d.speed + d.cost }

// leaves is how long from's waiting jobs would take its holders without
// d, in seconds, and how many holders that leaves it.
func (d *donor) leaves(from *policy) (float64, int) {
	t := &from.tally
	rest := policyTally{queued: t.queued, holders: t.holders, speed: t.speed, work: t.work}
	rest.leave(d.speed, d.work)
	return rest.wait(), rest.holders
}

// fileDonorLocked files d's worker, which serves from (nil: none), for
// a pass's switches if it may leave what it serves: under from
// (placement.adrift: none). It may while it serves, its adapter known,
// with no call under way, not out, within its switch budget and, while
// jobs wait for what it holds, once it has served as long as its switch
// took. from's tally must count its waiting jobs already.
func (p *Pool) fileDonorLocked(d donor, from *policy, now int64) {
	w, wa := d.w, &d.w.adapter
	if !w.serving(now) || wa.switching || wa.calling || !wa.known || wa.out(now) != "" || !p.switchBudgetLocked(w, now) {
		return
	}
	switch {
	case from == nil:
		p.placement.adrift = append(p.placement.adrift, d)
	case from.tally.waiting == 0 || float64(now-wa.since)/float64(time.Second) >= d.cost:
		from.donors = append(from.donors, d)
	}
}

// switchOneLocked decides one switch, for the neediest policy that some
// worker should switch to, and reports whether it made one.
func (p *Pool) switchOneLocked(now int64) bool {
	pl := &p.placement
	needy := pl.needy[:0]
	for pol := range pl.each() {
		if pol.tally.waiting > 0 {
			needy = append(needy, pol)
		}
	}
	pl.needy = needy
	slices.SortFunc(needy, func(a, b *policy) int {
		if p.needierLocked(a, b) {
			return -1
		}
		return 1
	})
	p.floorsLocked()
	for _, pol := range needy {
		if d := p.donorLocked(pol, now); d != nil {
			p.startSwitchLocked(d.w, pol, now)
			return true
		}
	}
	return false
}

// floorsLocked works out each busy policy's floor: the least wait any of
// its donors would leave its jobs with, plus that donor's switch. A
// policy whose jobs would wait no longer than that takes none of them
// (see switchLossLocked), so that a pass over a fleet in balance weighs
// each donor once, not once for each policy with jobs waiting.
func (p *Pool) floorsLocked() {
	for from := range p.placement.each() {
		if !from.busy() {
			continue
		}
		from.tally.floor = math.Inf(1)
		for i := range from.donors {
			if d := &from.donors[i]; !d.w.adapter.switching {
				left, _ := d.leaves(from)
				from.tally.floor = min(from.tally.floor, left+d.cost)
			}
		}
	}
}

// busy reports whether pol has jobs waiting and more than one holder: a
// holder leaves it only for a policy whose jobs would wait longer than
// the rest of its holders take over its own, plus the switch.
func (pol *policy) busy() bool { return pol.tally.waiting > 0 && pol.tally.holders > 1 }

// needierLocked reports whether policy a's waiting jobs come before b's:
// the higher priority at their heads, then the one with no holder, then
// the longer wait, then the queue's order (with tenants, the lower
// counter first).
func (p *Pool) needierLocked(a, b *policy) bool {
	ha, hb := a.tally.head, b.tally.head
	if ha.Priority != hb.Priority {
		return ha.Priority > hb.Priority
	}
	if (a.tally.holders == 0) != (b.tally.holders == 0) {
		return a.tally.holders == 0
	}
	if wa, wb := a.tally.wait(), b.tally.wait(); wa != wb {
		return wa > wb
	}
	return p.headsBeforeLocked(ha, hb)
}

// headsBeforeLocked reports whether waiting job a goes before b: the
// queue's order, with the tenants' counters first when tenants are on.
func (p *Pool) headsBeforeLocked(a, b *Ticket) bool {
	if a.Priority == b.Priority && a.tenant != nil && b.tenant != nil && a.tenant.served != b.tenant.served {
		return a.tenant.served < b.tenant.served
	}
	return a.before(b)
}

// donorLocked picks the worker that switches to pol, or nil when none
// should: among the donors, the one whose leaving costs least.
func (p *Pool) donorLocked(pol *policy, now int64) *donor {
	var best *donor
	bestLoss := math.Inf(1)
	consider := func(from *policy, donors []donor) {
		for i := range donors {
			d := &donors[i]
			loss, ok := p.switchLossLocked(d, from, pol, now)
			if ok && (best == nil || loss < bestLoss || loss == bestLoss && d.before(best)) {
				best, bestLoss = d, loss
			}
		}
	}
	consider(nil, p.placement.adrift)
	need := pol.tally.wait()
	for from := range p.placement.each() {
		if from != pol && !(from.busy() && from.tally.floor >= need) {
			consider(from, from.donors)
		}
	}
	return best
}

// before reports whether donor d goes before e at an equal loss: an idle
// worker first, since one whose jobs overran their prediction may not end
// soon, then the pool's order of workers.
func (d *donor) before(e *donor) bool {
	if d.w.load.inflight != e.w.load.inflight {
		return d.w.load.inflight < e.w.load.inflight
	}
	return d.at < e.at
}

// switchLossLocked reports whether d, a donor serving from, may switch to
// pol now and, if it may, what it costs: the time until d could start
// pol's jobs, plus the wait its leaving leaves from's jobs with.
func (p *Pool) switchLossLocked(d *donor, from, pol *policy, now int64) (float64, bool) {
	if d.w.adapter.switching || !pol.tally.servableBy(d.w) {
		return 0, false
	}
	delay, need := d.delay(), pol.tally.wait()
	// A policy with holders gets another only once one of them holds it:
	// the first jobs of a batch to arrive, a few milliseconds before the
	// others, must not draw the idle workers to the policies they happen
	// to name.
	if need <= delay || pol.tally.holders > 0 && pol.tally.arrived == 0 {
		return 0, false
	}
	if from == nil || from.tally.waiting == 0 {
		return delay, true // it holds what nobody waits for
	}
	left, holders := d.leaves(from)
	if holders == 0 {
		return delay + left, p.takesTurnLocked(d.w, pol, from, now)
	}
	return delay + left, need > left+d.cost
}

// takesTurnLocked reports whether pol, which has jobs waiting and no
// holder, may take w, the only holder of from, whose jobs wait too: from
// has had w for a turn and pol's jobs come first in the queue's order, or
// pol's are of a higher priority.
func (p *Pool) takesTurnLocked(w *worker, pol, from *policy, now int64) bool {
	if pol.tally.holders > 0 {
		return false
	}
	if pol.tally.head.Priority > from.tally.head.Priority {
		return true
	}
	turn := p.placement.cfg.Turn
	return now-w.adapter.since >= int64(turn) && p.headsBeforeLocked(pol.tally.head, from.tally.head)
}

// switchBudgetLocked reports whether w has switched fewer than
// MaxSwitches times in the last minute.
func (p *Pool) switchBudgetLocked(w *worker, now int64) bool {
	recent := w.adapter.recent[:0]
	for _, at := range w.adapter.recent {
		if now-at < int64(time.Minute) {
			recent = append(recent, at)
		}
	}
	w.adapter.recent = recent
	return len(recent) < p.placement.cfg.MaxSwitches
}

// startSwitchLocked sends w to pol: it takes no job from now on, and
// switches once its jobs end. The switch's time counts against the
// tenant whose job asked for it.
func (p *Pool) startSwitchLocked(w *worker, pol *policy, now int64) {
	wa := &w.adapter
	from := p.placedOnLocked(w, now)
	wa.switching, wa.target = true, pol
	wa.recent = append(wa.recent, now)
	speed, work, cost := p.speedOfLocked(w), p.workLeftLocked(w, now), p.switchCostLocked(w)
	if from != nil {
		from.tally.leave(speed, work)
	}
	pol.tally.join(speed, work+cost*speed, false)
	if tn := pol.tally.head.tenant; tn != nil {
		p.serveLocked(tn, cost*speed/pol.tally.head.cfg.weight(tn.name))
	}
	if ce := p.logger.Check(zap.DebugLevel, "adapter switch decided"); ce != nil {
		ce.Write(zap.String("worker", w.url), zap.String("to", adapterName(pol.Name)), zap.Int("waiting", pol.tally.waiting))
	}
}

// callDueLocked reports whether a call to w is due now: it switches, or
// its adapter is unknown, and it runs no job and no other call.
func (fs *fleetState) callDueLocked(w *worker, now int64) bool {
	wa := &w.adapter
	if wa.calling || (wa.known && !wa.switching) || w.load.inflight > 0 || now < wa.retryAt || fs.target() != "" || w.life.pausedAt != 0 {
		return false // not while a fleet operation, or a trainer that paused it, changes the weights
	}
	return !w.life.dead && !w.life.removed && w.life.state == Serving && !w.health.down
}

// callLocked starts w's call in the pool's background: a switch, or a
// read of the adapter it has. Each call is bounded, so that a worker whose
// LoRA endpoints hang fails its calls rather than holds its jobs.
func (p *Pool) callLocked(w *worker, now int64) {
	wa := &w.adapter
	wa.calling, wa.called = true, now
	sw, epoch, cfg := p.placement.switcher, wa.epoch, p.placement.cfg
	read := func(ctx context.Context) (name, path string, err error) {
		ctx, cancel := context.WithTimeout(ctx, cfg.readTimeout())
		defer cancel()
		return sw.Active(ctx, w.url)
	}
	if !wa.switching {
		p.bg.Go("adapter check of "+w.url, func(ctx context.Context) {
			name, path, err := read(ctx)
			p.mu.Lock()
			defer p.mu.Unlock()
			if p.callCurrentLocked(w, epoch) {
				p.checkedLocked(w, name, path, err)
			}
		})
		return
	}
	sc := switchCall{target: wa.target, want: wa.target.Adapter, publish: wa.target.publish}
	var a *Adapter
	if sc.want.Name != "" {
		a = &sc.want
	}
	// sglang-diffusion's set_lora takes off the adapter merged before it
	// merges another, or the same from a new path; only the base weights,
	// and the same adapter again over new base weights (which set_lora
	// would take for merged already), need an unmerge.
	unmerge := a == nil || wa.holds == sc.target && wa.publish == sc.publish
	p.bg.Go("adapter switch of "+w.url, func(ctx context.Context) {
		switchCtx, cancel := context.WithTimeout(ctx, cfg.SwitchTimeout)
		sc.status, sc.message, sc.err = sw.Switch(switchCtx, w.url, a, unmerge)
		cancel()
		if sc.err == nil {
			sc.name, sc.path, sc.err = read(ctx)
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.callCurrentLocked(w, epoch) {
			p.switchedLocked(w, &sc)
		}
	})
}

// callCurrentLocked ends w's call begun at epoch, and reports whether what
// it found still holds: no restart or failure made w's adapter unknown
// meanwhile. If one did, w is read back anew.
func (p *Pool) callCurrentLocked(w *worker, epoch uint64) bool {
	w.adapter.calling = false
	if w.adapter.epoch == epoch {
		return true
	}
	p.wakeWaitersLocked()
	p.dispatchLocked()
	return false
}

// switchCall is a switch of one worker: what it was to load, and what
// came of it.
type switchCall struct {
	target  *policy
	want    Adapter // target as it was when the call began
	publish int     // target's publish then
	status  int     // the worker's answer
	message string
	name    string // the adapter read back after it
	path    string
	err     error
}

// worked reports whether the worker reads back the adapter it was to load.
func (sc *switchCall) worked() bool {
	return sc.err == nil && sc.name == sc.want.Name && (sc.want.Name == "" || sc.path == sc.want.Path)
}

// checkedLocked records what w's /v1/list_loras said: it holds the base
// weights, an adapter at its latest publish, or something stray, which
// placement will switch.
func (p *Pool) checkedLocked(w *worker, name, path string, err error) {
	wa := &w.adapter
	now := p.now().UnixNano()
	if err != nil {
		wa.unread++
		p.adapterCallFailedLocked(w, &readCalls, wa.unread, err.Error(), now)
		p.dispatchLocked()
		return
	}
	p.adapterCallWorkedLocked(w)
	wa.known, wa.since, wa.seen = true, now, name
	wa.holds, wa.publish = p.matchLocked(name, path)
	p.wakeWaitersLocked()
	p.dispatchLocked()
}

// loraCalls is a kind of LoRA call placement makes, and what the log says
// when its failures change what a worker does.
type loraCalls struct {
	first string // at the first failure in a row
	out   string // at the one that takes the worker out
}

// The kinds of LoRA calls.
var (
	readCalls = loraCalls{
		first: "could not read the worker's LoRA adapter; it serves nothing until it can be read",
		out:   "the worker's LoRA adapter could not be read 3 times in a row; it is out of placement, and jobs no other worker can serve are answered 503",
	}
	switchCalls = loraCalls{
		first: "adapter switch failed; the worker serves nothing until its adapter is known",
		out:   "3 adapter switches of the worker failed in a row; placement switches it no more for a minute, and it serves only what it holds",
	}
)

// adapterCallFailedLocked counts a failed LoRA call of w, the streak'th
// of its kind in a row, as the worker's failure: it is not called again
// for a while. It is logged when it changes what w does (the first of a
// streak, and the one that takes w out), not on every retry.
func (p *Pool) adapterCallFailedLocked(w *worker, kind *loraCalls, streak int, why string, now int64) {
	wa := &w.adapter
	wa.failure, wa.retryAt = why, now+int64(p.placement.cfg.Retry)
	w.stats.failures++
	level, msg := zap.DebugLevel, "LoRA call of the worker failed again"
	switch streak {
	case 1:
		level, msg = zap.WarnLevel, kind.first
	case FailuresOut:
		level, msg = zap.WarnLevel, kind.out
	}
	if ce := p.logger.Check(level, msg); ce != nil {
		ce.Write(zap.String("worker", w.url), zap.Int("in_a_row", streak), zap.String("error", why))
	}
}

// adapterCallWorkedLocked notes that a LoRA call of w worked: its
// adapter can be read (and, after a switch, switched) again.
func (p *Pool) adapterCallWorkedLocked(w *worker) {
	wa := &w.adapter
	if wa.unread > 0 {
		p.logger.Info("the worker's LoRA adapter can be read again", zap.String("worker", w.url), zap.Int("failed_reads", wa.unread))
	}
	wa.unread = 0
}

// matchLocked is the policy a worker that has adapter name at path active
// holds, and its publish; the stray policy when none matches.
func (p *Pool) matchLocked(name, path string) (*policy, int) {
	pl := &p.placement
	if name == "" {
		return &pl.base, 0
	}
	if pol := pl.policies[name]; pol != nil && pol.Path == path {
		return pol, pol.publish
	}
	return &pl.stray, 0
}

// switchedLocked records how w's switch sc ended.
func (p *Pool) switchedLocked(w *worker, sc *switchCall) {
	wa := &w.adapter
	now := p.now().UnixNano()
	took := time.Duration(now - wa.called) // the switch and its check: what a job waits for
	ok := sc.worked()
	wa.last = SwitchResult{Adapter: sc.want.Name, Publish: sc.publish, OK: ok, Status: sc.status, Message: sc.message, At: now}
	if ok {
		if wa.failed > 0 {
			p.logger.Info("adapter switch of the worker worked again", zap.String("worker", w.url), zap.Int("failed_switches", wa.failed))
		}
		wa.failed, wa.unread = 0, 0
		wa.cost = learnSwitchCost(wa.cost, took.Seconds())
		sc.target.switches++
		sc.target.switching += took.Seconds()
		wa.known, wa.since, wa.seen = true, now, sc.name
		wa.holds, wa.publish = p.matchLocked(sc.name, sc.path)
	} else {
		p.switchFailedLocked(w, sc, now)
	}
	// A publish while it switched sends it to load the newer path too.
	if !ok || wa.target == sc.target && sc.target.publish == sc.publish {
		wa.switching, wa.target = false, nil
	}
	p.wakeWaitersLocked()
	p.dispatchLocked()
}

// switchFailedLocked records a switch of w that failed: w serves nothing
// until its adapter is read back, tried again after the retry time; after
// FailuresOut failed switches in a row it is switched no more for
// switchOutTime, and serves only what it holds.
func (p *Pool) switchFailedLocked(w *worker, sc *switchCall, now int64) {
	wa := &w.adapter
	sc.target.failures++
	wa.known = false
	if sc.err != nil {
		wa.last.Message = sc.err.Error()
	} else {
		wa.last.Message = "the worker reports adapter " + adapterName(sc.name) + " active after the switch"
	}
	if wa.failed++; wa.failed >= FailuresOut {
		wa.outUntil = now + int64(switchOutTime)
	}
	p.adapterCallFailedLocked(w, &switchCalls, wa.failed, "switch to "+adapterName(sc.target.Name)+": "+wa.last.Message, now)
}

// learnSwitchCost folds a switch's seconds into a worker's learned switch
// time, a moving average that weighs the last switch by half: one slow
// switch (a cold page cache) moves it only halfway.
func learnSwitchCost(cost, secs float64) float64 {
	if cost == 0 {
		return secs
	}
	return (cost + secs) / 2
}

// wakeWaitersLocked wakes what waits for a worker to change: drains and
// publishes.
func (d *dispatchState) wakeWaitersLocked() {
	for _, c := range d.onRelease {
		close(c)
	}
	d.onRelease = d.onRelease[:0]
}

// remergeLocked notes that w loaded new base weights under its adapter:
// it merges its adapter again (a switch to it, which unmerges first)
// before it serves.
func (p *Pool) remergeLocked(w *worker) {
	wa := &w.adapter
	switch {
	case !p.placement.on || wa.holds == &p.placement.base:
	case wa.holds == nil || wa.holds == &p.placement.stray:
		wa.known = false
	default:
		wa.switching, wa.target = true, wa.holds
	}
}
