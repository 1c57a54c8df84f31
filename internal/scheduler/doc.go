// Package scheduler decides which worker runs each job and when: the
// workers' load and speed as the router learns them, the queue of waiting
// jobs and the order it hands them out in, the strategies that choose a
// worker, and which worker made each job a client will ask about again.
package scheduler
