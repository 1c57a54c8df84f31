package request

import (
	"slices"
	"strings"
)

// Task is what a request needs a worker to generate, which decides the
// workers that may serve it.
type Task int

// The tasks; the endpoint table gives each endpoint its own.
const (
	AnyTask   Task = iota // RL and other endpoints: whatever the model makes
	ImageTask             // /v1/images/*
	VideoTask             // /v1/videos
)

// sglang-diffusion task types, as /v1/models reports them.
var (
	imageTaskTypes = []string{"T2I", "I2I", "TI2I"}
	videoTaskTypes = []string{"T2V", "I2V", "TI2V"}
)

func hasTaskType(taskTypes, kinds []string) bool {
	for _, t := range taskTypes {
		if slices.Contains(kinds, strings.ToUpper(t)) {
			return true
		}
	}
	return false
}

// Tasks is a set of tasks, a bit for each: what a worker may be given.
type Tasks uint8

// Has reports whether task is in the set.
func (s Tasks) Has(task Task) bool {
	return s&(1<<task) != 0
}

// Unprobed is what a worker not yet probed may be given: images (most
// workers make them) but not videos, which only a worker known to be
// video-capable gets, as in the Python router.
const Unprobed Tasks = 1<<AnyTask | 1<<ImageTask

// TasksOf is what a worker whose model card lists taskTypes may be given.
func TasksOf(taskTypes []string) Tasks {
	tasks := Tasks(1 << AnyTask)
	if hasTaskType(taskTypes, imageTaskTypes) {
		tasks |= 1 << ImageTask
	}
	if hasTaskType(taskTypes, videoTaskTypes) {
		tasks |= 1 << VideoTask
	}
	return tasks
}

// VideoSupport is the Python router's video_support: null while unknown.
func VideoSupport(taskTypes []string) *bool {
	if taskTypes == nil {
		return nil
	}
	v := hasTaskType(taskTypes, videoTaskTypes)
	return &v
}
