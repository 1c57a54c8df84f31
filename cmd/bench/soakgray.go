package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"slices"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
)

// The gray failures of the schedule: a worker that is up and answers its
// probes but never ends its work, and storage that fails. Broken answers
// and jobs out of memory are spells (soakfaults.go).

// Bounds the router must keep under these faults.
const (
	// updateLimit bounds a weight update one worker's call hangs in: the
	// drain (drain_timeout at most), that call (weights_timeout), and the
	// catch-ups of workers that missed the last update, which hold the
	// fleet's turn meanwhile (weights_timeout each, one per worker behind).
	updateLimit = soakDrainTimeout + 4*soakWeightsTimeout
	// catchUpLimit bounds how long a worker restarted after its update hung
	// takes to be brought to the fleet's weights: probes find it within
	// soakHealth, and catch-ups ahead of it take weights_timeout each.
	catchUpLimit = 30 * time.Second
	storageDown  = 2 * time.Second // storage stays unwritable this long after a worker registered
)

// startBlackhole starts the worker that takes jobs and never answers them,
// its /health answering all along, for the config the router starts with.
func (s *soak) startBlackhole() error {
	w, err := fakeworker.Start(fakeworker.Config{Name: "b1", UnitMs: s.o.unitMs})
	if err != nil {
		return err
	}
	w.Hang()
	s.blackhole = w
	return nil
}

// dropBlackhole takes the blackhole out of the config with a reload, then
// stops it: the jobs it still held lose their connection and run again
// elsewhere.
func (s *soak) dropBlackhole(ctx context.Context) error {
	w := s.blackhole
	s.blackhole = nil
	defer w.Close()
	return s.reload(ctx)
}

// hungUpdate updates the fleet's weights through the router while the
// next victim's update call hangs. The update must answer within
// updateLimit, failing on that worker (and on the blackhole, whose jobs
// hang) alone, and jobs must have been answered meanwhile. Then the worker
// is restarted, as an operator would, and must be brought to the new
// weights within catchUpLimit.
func (s *soak) hungUpdate(ctx context.Context) error {
	i := s.victim()
	s.images[i].HangUpdates()
	version := fmt.Sprintf("soak-%d", len(s.updates)+1)
	served := s.tally.total(answered)
	began := time.Now()
	uctx, cancel := context.WithTimeout(ctx, updateLimit)
	defer cancel()
	status, answer, err := s.control(uctx, http.MethodPost, "/update_weights_from_disk",
		map[string]string{"model_path": "/ckpt/" + version, "weight_version": version})
	took := time.Since(began)
	if err != nil {
		return fmt.Errorf("no answer within %s: %w", updateLimit, err)
	}
	s.updates = append(s.updates, took)
	if err := s.checkUpdate(status, answer, s.images[i].URL()); err != nil {
		return err
	}
	if s.tally.total(answered) == served {
		return fmt.Errorf("no job was answered in the %s the update took", took.Round(time.Millisecond))
	}
	if err := s.restart(i); err != nil {
		return err
	}
	return s.awaitVersion(ctx, s.images[i].URL(), version)
}

// checkUpdate checks the answer of an update in which hung's call hung:
// 502, failed on hung and on no other worker but the blackhole.
func (s *soak) checkUpdate(status int, answer map[string]any, hung string) error {
	var failed []string
	results, _ := answer["results"].([]any)
	for _, r := range results {
		r, _ := r.(map[string]any)
		if code, _ := r["status_code"].(float64); code != http.StatusOK {
			u, _ := r["worker_url"].(string)
			failed = append(failed, u)
		}
	}
	unexpected := slices.DeleteFunc(slices.Clone(failed), func(u string) bool {
		return u == hung || s.blackhole != nil && u == s.blackhole.URL()
	})
	if status != http.StatusBadGateway || !slices.Contains(failed, hung) || len(unexpected) > 0 {
		return fmt.Errorf("answered %d, failed on %v, with %s hung: %v", status, failed, hung, answer)
	}
	return nil
}

// awaitVersion waits until the worker serves the weight version.
func (s *soak) awaitVersion(ctx context.Context, worker, version string) error {
	deadline := time.Now().Add(catchUpLimit)
	for {
		_, answer, err := s.control(ctx, http.MethodGet, "/workers/"+url.PathEscape(worker), nil)
		if err != nil {
			return err
		}
		w, _ := answer["worker"].(map[string]any)
		if w["weight_version"] == version && w["state"] == "serving" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not serving %s %s after its restart: %v", worker, version, catchUpLimit, w)
		}
		if err := sleepCtx(ctx, 100*time.Millisecond); err != nil {
			return err
		}
	}
}

// unwritableStorage makes the router's storage unwritable, registers a
// worker, which must answer that its registration is not persisted, lets
// the load run on it for storageDown, then mends the storage and removes
// the worker, which must be persisted.
func (s *soak) unwritableStorage(ctx context.Context) error {
	err := s.withStorageBroken(func() error {
		answer, err := s.join(ctx)
		if err != nil {
			return err
		}
		time.Sleep(storageDown)
		return expectPersisted("a registration", answer, false)
	})
	if err != nil {
		return err
	}
	answer, err := s.leave(ctx)
	if err != nil {
		return err
	}
	return expectPersisted("a removal once storage works again", answer, true)
}

// withStorageBroken runs f while the router's storage folder is a file:
// every write under it fails, whoever the router runs as (a folder without
// write permission would not stop root).
func (s *soak) withStorageBroken(f func() error) error {
	aside := s.storage + ".aside"
	if err := os.Rename(s.storage, aside); err != nil {
		return err
	}
	if err := os.WriteFile(s.storage, []byte("not a folder\n"), 0o600); err != nil {
		return errors.Join(err, os.Rename(aside, s.storage))
	}
	err := f()
	return errors.Join(err, os.Remove(s.storage), os.Rename(aside, s.storage))
}

// expectPersisted checks that a control call's answer says its change is
// written to storage, or, with want false, that it is not.
func expectPersisted(call string, answer map[string]any, want bool) error {
	if got := answer["persisted"] != false; got != want {
		return fmt.Errorf("%s answered persisted %v, want %v: %v", call, got, want, answer)
	}
	return nil
}
