package diffusionrouter

import (
	"cmp"
	"fmt"
	"net/netip"
	"regexp"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// parseOptions fills in defaults and turns option strings into the values
// the handler works with.
func (h *Handler) parseOptions() error {
	if h.Pool == "" {
		h.Pool = defaultPoolName
	}
	if err := h.parseDispatch(); err != nil {
		return err
	}
	if err := h.parseCosts(); err != nil {
		return err
	}
	if err := h.parseWeights(); err != nil {
		return err
	}
	if err := h.parseHealth(); err != nil {
		return err
	}
	if h.MaxBody == 0 {
		h.MaxBody = defaultMaxBody
	}
	if h.MaxBody < 0 {
		return fmt.Errorf("max_body must be positive, got %d", h.MaxBody)
	}
	if h.UpstreamTimeout < 0 {
		return fmt.Errorf("upstream_timeout must not be negative")
	}
	for i, raw := range h.Workers {
		u, err := normalizeWorkerURL(raw)
		if err != nil {
			return fmt.Errorf("worker %q: %v", raw, err)
		}
		h.Workers[i] = u
	}
	allow := h.AdminAllow
	if len(allow) == 0 {
		allow = defaultAdminAllow
	}
	prefixes, err := parsePrefixes(allow)
	if err != nil {
		return err
	}
	h.allow = prefixes
	if h.AdminToken != "" {
		h.token = caddy.NewReplacer().ReplaceAll(h.AdminToken, "")
		if h.token == "" {
			return fmt.Errorf("admin_token %q expands to an empty token", h.AdminToken)
		}
	}
	return nil
}

// Defaults of the queue options.
const defaultMaxQueue = 10000

// parseDispatch reads the routing and queue options.
func (h *Handler) parseDispatch() error {
	d := &h.dispatch
	h.Policy = cmp.Or(h.Policy, defaultStrategy)
	var ok bool
	if d.strategy, ok = strategies[h.Policy]; !ok {
		return fmt.Errorf("unknown policy %q (want one of %s)", h.Policy, strategyNames())
	}
	switch {
	case h.MaxInflight > 0:
		d.maxInflight = h.MaxInflight
	case h.MaxInflight == 0 && h.Policy == "least_work":
		d.maxInflight = 1
	case h.MaxInflight < -1:
		return fmt.Errorf("max_inflight must be positive or -1 (no limit), got %d", h.MaxInflight)
	}
	if d.order, ok = queueOrders[cmp.Or(h.QueueOrder, "fifo")]; !ok {
		return fmt.Errorf("unknown queue_order %q (want fifo, largest_first or smallest_first)", h.QueueOrder)
	}
	if h.QueueTimeout < 0 {
		return fmt.Errorf("queue_timeout must not be negative")
	}
	d.timeout = time.Duration(h.QueueTimeout)
	if h.MaxQueue < 0 {
		return fmt.Errorf("max_queue must be positive, got %d", h.MaxQueue)
	}
	d.maxQueue = cmp.Or(h.MaxQueue, defaultMaxQueue)
	return nil
}

// parseCosts reads the cost model's defaults.
func (h *Handler) parseCosts() error {
	c := &h.costs
	var err error
	if c.width, c.height, err = parseSize(cmp.Or(h.DefaultSize, defaultSize)); err != nil {
		return fmt.Errorf("default_size %q is not WIDTHxHEIGHT", h.DefaultSize)
	}
	c.steps = cmp.Or(h.DefaultSteps, defaultSteps)
	c.frames = cmp.Or(h.DefaultFrames, defaultFrames)
	c.cfgFactor = cmp.Or(h.CFGFactor, defaultCFGFactor)
	if c.steps < 0 || c.frames < 0 || c.cfgFactor < 1 {
		return fmt.Errorf("default_steps and default_frames must be positive and cfg_factor at least 1")
	}
	return nil
}

// parseWeights reads the weight update options.
func (h *Handler) parseWeights() error {
	c := &h.weights
	c.mode = cmp.Or(h.WeightsMode, modeDrain)
	if c.mode != modeDrain && c.mode != modeRolling {
		return fmt.Errorf("unknown weights_mode %q (want drain or rolling)", h.WeightsMode)
	}
	if h.RollingBatch < 0 || h.DrainTimeout < 0 || h.WeightsTimeout < 0 {
		return fmt.Errorf("rolling_batch, drain_timeout and weights_timeout must be positive")
	}
	c.rollingBatch = cmp.Or(h.RollingBatch, 1)
	c.drainTimeout = cmp.Or(time.Duration(h.DrainTimeout), defaultDrainTimeout)
	c.timeout = cmp.Or(time.Duration(h.WeightsTimeout), defaultWeightsTimeout)
	c.pathPrefixes = h.WeightsPathPrefix
	return nil
}

// parseHealth reads the health options.
func (h *Handler) parseHealth() error {
	c := &h.health
	c.uri = cmp.Or(h.HealthURI, defaultHealthURI)
	c.interval = cmp.Or(time.Duration(h.HealthInterval), defaultHealthInterval)
	c.timeout = cmp.Or(time.Duration(h.HealthTimeout), defaultHealthTimeout)
	c.fails = cmp.Or(h.HealthFails, defaultHealthFails)
	c.passes = cmp.Or(h.HealthPasses, defaultHealthPasses)
	c.status = h.HealthStatus
	c.stallFactor = cmp.Or(h.StallFactor, defaultStallFactor)
	c.maxFails = cmp.Or(h.MaxFails, defaultMaxFails)
	c.failWindow = cmp.Or(time.Duration(h.FailWindow), defaultFailWindow)
	c.ejectTime = cmp.Or(time.Duration(h.EjectTime), defaultEjectTime)
	c.maxEjectTime = cmp.Or(time.Duration(h.MaxEjectTime), defaultMaxEjectTime)
	h.MinReady = cmp.Or(h.MinReady, 1)
	if !strings.HasPrefix(c.uri, "/") || c.interval <= 0 || c.timeout <= 0 || c.fails < 1 || c.passes < 1 ||
		c.stallFactor < 1 || c.maxFails < 1 || c.failWindow <= 0 || c.ejectTime <= 0 || c.maxEjectTime < c.ejectTime ||
		h.MinReady < 1 || (c.status != 0 && (c.status < 100 || c.status > 599)) {
		return fmt.Errorf("bad health options: health_uri must be a path; durations, counts and min_ready positive; stall_factor at least 1; max_eject_time at least eject_time; health_status a status code")
	}
	if h.HealthBody != "" {
		re, err := regexp.Compile(h.HealthBody)
		if err != nil {
			return fmt.Errorf("health_body: %v", err)
		}
		c.body = re
	}
	h.dispatch.health = c
	return nil
}

// parsePrefixes reads CIDRs and single addresses.
func parsePrefixes(list []string) ([]netip.Prefix, error) {
	out := make([]netip.Prefix, 0, len(list))
	for _, s := range list {
		if p, err := netip.ParsePrefix(s); err == nil {
			out = append(out, p.Masked())
			continue
		}
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, fmt.Errorf("admin_allow: %q is neither a CIDR nor an IP address", s)
		}
		out = append(out, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
	}
	return out, nil
}
