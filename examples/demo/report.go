package main

import (
	"fmt"
	"io"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// report prints the work each worker did and the batch's wall time against
// the ideal. It fails if the workers' own counts disagree with the
// X-Fake-Worker headers the client saw.
func report(out io.Writer, f testrouter.Fleet, b batch, res result) error {
	total, longest := b.totalCost()
	var speedSum, fastest float64
	for _, w := range f {
		speedSum += w.Speed
		fastest = max(fastest, w.Speed)
	}

	const row = "%-6s  %-22s  %5s  %8s  %11s  %8s  %13s  %14s\n"
	fmt.Fprintf(out, row, "worker", "url", "speed", "requests", "cost served", "busy", "share of cost", "share of speed")
	for _, w := range f {
		st := w.Stats()
		if st.Jobs != res.servedBy[w.Name] {
			return fmt.Errorf("%s counts %d jobs but the client saw it answer %d", w.Name, st.Jobs, res.servedBy[w.Name])
		}
		fmt.Fprintf(out, row, w.Name, w.URL(), fmt.Sprint(w.Speed), fmt.Sprint(st.Jobs),
			fmt.Sprintf("%.0f", st.Cost), st.Busy.Round(time.Millisecond),
			fmt.Sprintf("%.1f%%", 100*st.Cost/total), fmt.Sprintf("%.1f%%", 100*w.Speed/speedSum))
	}

	ideal := max(longest/fastest, total/speedSum) * unitMs * float64(time.Millisecond)
	fmt.Fprintf(out, "\ntotal cost        %.0f units\n", total)
	fmt.Fprintf(out, "batch wall time   %s\n", res.wall.Round(time.Millisecond))
	fmt.Fprintf(out, "ideal lower bound %s  = max(longest job on the fastest worker, total cost / total speed)\n",
		time.Duration(ideal).Round(time.Millisecond))
	fmt.Fprintf(out, "wall / ideal      %.2f\n", res.wall.Seconds()/time.Duration(ideal).Seconds())
	return nil
}
