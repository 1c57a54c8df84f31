package testkit

import (
	"io"
	"os/exec"
)

// Process is a server a test runs as a child process, and may kill and
// start again, as when the server goes away and comes back.
type Process struct {
	args   []string
	exited chan struct{} // closed when the last start has ended
	cmd    *exec.Cmd
}

// NewProcess is a process that runs args (the program, then its flags)
// at each Start.
func NewProcess(args ...string) *Process {
	exited := make(chan struct{})
	close(exited)
	return &Process{args: args, exited: exited}
}

// Start runs the program once more, its output to out (nil: none), after
// the previous run, if any, has been stopped.
func (p *Process) Start(out io.Writer) error {
	p.Stop()
	cmd := exec.Command(p.args[0], p.args[1:]...)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	p.cmd, p.exited = cmd, exited
	go func() { _ = cmd.Wait(); close(exited) }()
	return nil
}

// Exited reports whether the last run has ended (or none has started).
func (p *Process) Exited() bool {
	select {
	case <-p.exited:
		return true
	default:
		return false
	}
}

// Stop kills the program and waits for it to exit; calling it twice is
// harmless.
func (p *Process) Stop() {
	if p.Exited() {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.exited
}
