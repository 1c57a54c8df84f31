package main

import (
	"encoding/xml"
	"fmt"
	"io"
	"math"
	"strings"
)

// panel is one plot of the SVG: the cumulative distribution of latency of
// each strategy of one mode.
type panel struct {
	title  string
	xLabel string
	logX   bool // a logarithmic x axis, for latencies that span decades
	series []series
}

// series is one line of a panel.
type series struct {
	name   string
	values []float64 // sorted ascending, in the x axis' unit
	dashed bool      // a simulation rather than a measurement
}

// Plot geometry, in SVG user units.
const (
	svgWidth     = 960
	panelHeight  = 440
	plotLeft     = 80  // room for the y tick labels and axis label
	plotRight    = 250 // room for the legend
	plotTop      = 50  // room for the title
	plotBottom   = 60  // room for the x tick labels and axis label
	maxCDFPoints = 500 // per series; larger samples are thinned
)

var palette = []string{"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
	"#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"}

// writeSVG draws the panels one under the other as one self-contained SVG
// document: a CDF per series, axes with ticks and labels, and a legend.
func writeSVG(w io.Writer, panels []panel) error {
	var b strings.Builder
	height := panelHeight * max(1, len(panels))
	fmt.Fprintf(&b, `<?xml version="1.0" encoding="UTF-8"?>`+"\n")
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n",
		svgWidth, height, svgWidth, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	for i, p := range panels {
		fmt.Fprintf(&b, `<g transform="translate(0,%d)">`+"\n", i*panelHeight)
		drawPanel(&b, p)
		b.WriteString("</g>\n")
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// plotArea maps data coordinates (x from xMin to xMax, linear or
// logarithmic; y from 0 to 1) to the panel's user units.
type plotArea struct {
	x0, y0, w, h float64
	xMin, xMax   float64
	logX         bool
}

func (a plotArea) px(x float64) float64 {
	if a.logX {
		x = max(x, a.xMin)
		return a.x0 + a.w*math.Log(x/a.xMin)/math.Log(a.xMax/a.xMin)
	}
	return a.x0 + a.w*(x-a.xMin)/(a.xMax-a.xMin)
}

func (a plotArea) py(y float64) float64 { return a.y0 + a.h*(1-y) }

// newPlotArea fits the x axis to the series' values.
func newPlotArea(p panel) plotArea {
	a := plotArea{x0: plotLeft, y0: plotTop, w: svgWidth - plotLeft - plotRight,
		h: panelHeight - plotTop - plotBottom, logX: p.logX}
	lo, hi := math.Inf(1), 0.0
	for _, s := range p.series {
		for _, v := range s.values {
			if v > 0 {
				lo = min(lo, v)
				hi = max(hi, v)
			}
		}
	}
	if hi == 0 { // nothing to plot
		lo, hi = 0.1, 1
	}
	if a.logX {
		a.xMin = lo / 1.25 // ticks fall on 1, 2, 5 × 10^k inside the range
		a.xMax = math.Max(hi*1.1, a.xMin*10)
	} else {
		a.xMax = hi * 1.03 // a little air right of the last answer
	}
	return a
}

func drawPanel(b *strings.Builder, p panel) {
	a := newPlotArea(p)
	fmt.Fprintf(b, `<text x="%d" y="28" font-size="15" font-weight="bold">%s</text>`+"\n", plotLeft, esc(p.title))
	xLabel := p.xLabel
	if p.logX {
		xLabel += ", log scale"
	}
	drawAxes(b, a, xLabel)
	styles := seriesStyles(p.series)
	for i, s := range p.series {
		drawSeries(b, a, s, styles[i])
	}
	drawLegend(b, a, p.series, styles)
}

func drawAxes(b *strings.Builder, a plotArea, xLabel string) {
	for y := 0.0; y <= 1.0001; y += 0.25 { // horizontal grid and y ticks
		fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", a.x0, a.py(y), a.x0+a.w, a.py(y))
		fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="end">%.0f%%</text>`+"\n", a.x0-6, a.py(y)+4, y*100)
	}
	for _, t := range xTicks(a) { // vertical grid and x ticks
		x := a.px(t.value)
		fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#eee"/>`+"\n", x, a.y0, x, a.y0+a.h)
		fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="black"/>`+"\n", x, a.y0+a.h, x, a.y0+a.h+5)
		fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`+"\n", x, a.y0+a.h+18, t.label)
	}
	fmt.Fprintf(b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="none" stroke="black"/>`+"\n", a.x0, a.y0, a.w, a.h)
	fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`+"\n", a.x0+a.w/2, a.y0+a.h+42, esc(xLabel))
	fmt.Fprintf(b, `<text transform="translate(%.1f,%.1f) rotate(-90)" text-anchor="middle">share of requests answered (CDF)</text>`+"\n",
		a.x0-50, a.y0+a.h/2)
}

// tick is one labelled mark on the x axis.
type tick struct {
	value float64
	label string
}

// xTicks are about six evenly spaced round values on a linear axis, or 1,
// 2 and 5 times each power of ten on a logarithmic one.
func xTicks(a plotArea) []tick {
	var ticks []tick
	if a.logX {
		for e := math.Floor(math.Log10(a.xMin)); e <= math.Log10(a.xMax); e++ {
			for _, m := range []float64{1, 2, 5} {
				if v := m * math.Pow(10, e); v >= a.xMin*0.999 && v <= a.xMax {
					ticks = append(ticks, tick{v, fmt.Sprintf("%.3g", v)})
				}
			}
		}
		return ticks
	}
	step := niceStep((a.xMax - a.xMin) / 6)
	for k := 0; a.xMin+float64(k)*step <= a.xMax; k++ {
		v := a.xMin + float64(k)*step
		ticks = append(ticks, tick{v, tickLabel(v, step)})
	}
	return ticks
}

func drawSeries(b *strings.Builder, a plotArea, s series, st style) {
	if len(s.values) == 0 {
		return
	}
	var pts strings.Builder
	for _, p := range cdfPoints(s.values, maxCDFPoints) {
		fmt.Fprintf(&pts, "%.1f,%.1f ", a.px(p[0]), a.py(p[1]))
	}
	fmt.Fprintf(b, `<polyline fill="none" stroke="%s" stroke-width="1.8"%s points="%s"/>`+"\n",
		st.color, st.dashAttr(), strings.TrimSpace(pts.String()))
}

func drawLegend(b *strings.Builder, a plotArea, ss []series, styles []style) {
	x := a.x0 + a.w + 20
	for i, s := range ss {
		y := a.y0 + 10 + float64(i)*20
		fmt.Fprintf(b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="2.5"%s/>`+"\n",
			x, y, x+28, y, styles[i].color, styles[i].dashAttr())
		fmt.Fprintf(b, `<text x="%.1f" y="%.1f">%s</text>`+"\n", x+34, y+4, esc(s.name))
	}
}

// style is how a series is drawn.
type style struct {
	color string
	dash  string // stroke-dasharray; empty for a solid line
}

func (s style) dashAttr() string {
	if s.dash == "" {
		return ""
	}
	return ` stroke-dasharray="` + s.dash + `"`
}

// seriesStyles gives measured series the palette's colours in order, and
// dashed series black lines, each with its own dash pattern.
func seriesStyles(ss []series) []style {
	dashes := []string{"7,4", "2,3", "10,3,2,3"}
	out := make([]style, len(ss))
	solid, dashed := 0, 0
	for i, s := range ss {
		if s.dashed {
			out[i] = style{"black", dashes[dashed%len(dashes)]}
			dashed++
			continue
		}
		out[i] = style{palette[solid%len(palette)], ""}
		solid++
	}
	return out
}

// cdfPoints is the empirical CDF of sorted as a staircase: at each value
// the curve rises to the share of values at or below it. Large samples are
// thinned to about maxPts steps; the last value always closes at 1.
func cdfPoints(sorted []float64, maxPts int) [][2]float64 {
	n := len(sorted)
	stride := max(1, n/maxPts)
	pts := make([][2]float64, 0, 2*(n/stride+2))
	prev := 0.0
	for i := 0; i < n; i += stride {
		if i+stride >= n {
			i = n - 1
		}
		y := float64(i+1) / float64(n)
		pts = append(pts, [2]float64{sorted[i], prev}, [2]float64{sorted[i], y})
		prev = y
	}
	return pts
}

// niceStep rounds raw up to 1, 2 or 5 times a power of ten.
func niceStep(raw float64) float64 {
	if raw <= 0 || math.IsNaN(raw) || math.IsInf(raw, 0) {
		return 1
	}
	pow := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*pow >= raw {
			return m * pow
		}
	}
	return 10 * pow
}

// tickLabel prints x with as many decimals as the step needs.
func tickLabel(x, step float64) string {
	decimals := max(0, int(math.Ceil(-math.Log10(step))))
	return fmt.Sprintf("%.*f", decimals, x)
}

// esc escapes text for XML character data and attribute values.
func esc(s string) string {
	var b strings.Builder
	_ = xml.EscapeText(&b, []byte(s))
	return b.String()
}
