#!/usr/bin/env bash
# Router overhead against Caddy's least_conn, measured from outside with wrk:
# four fake workers whose jobs take ~0 ms, the two Caddys side by side, and
# wrk driving them in alternating runs so that the machine's drift hits both.
#
#   bash cmd/bench/wrk/run.sh [pairs] [seconds]
#
# Environment: CONNS (16), THREADS (2), IMAGE_BYTES (size of each fake
# image before base64, 1024 by default), CADDY (a Caddy binary with the
# plugin; built from ./cmd/caddy when unset), PIN_WRK / PIN_SERVERS (CPU
# lists for taskset, e.g. PIN_WRK=1 PIN_SERVERS=0; unset: no pinning),
# PROFILE=router|least_conn|before (admin on :2019 with pprof, for profiling),
# BEFORE (another Caddy binary: its router runs too, as a third column, to
# compare two builds of the router in the same alternation), LOG_LEVEL (both
# Caddys' log level; Caddy's default, INFO, when unset).
#
# The ratio is router / least_conn per pair; on a shared machine the median
# of the pairs' ratios is the figure least moved by another load's bursts.
# cpu/req is the CPU time each Caddy process spent per request answered
# (user and system, from /proc), which another load on the machine moves
# far less than requests per second: one core answers 1 s / cpu/req.
set -euo pipefail
cd "$(dirname "$0")/../../.."
pairs=${1:-4} secs=${2:-10}
conns=${CONNS:-16} threads=${THREADS:-2}
. cmd/bench/wrk/lib.sh

command -v wrk >/dev/null || { echo "run.sh needs wrk (apt-get install wrk)" >&2; exit 1; }
build_all
refuse_busy_ports
start_workers --image-bytes "${IMAGE_BYTES:-1024}"
start_caddy least_conn 30801 cmd/bench/wrk/least_conn.Caddyfile
start_caddy router 30802 cmd/bench/wrk/router.Caddyfile
ports="30801 30802"
if [ -n "${BEFORE:-}" ]; then
	start_caddy before 30803 cmd/bench/wrk/router.Caddyfile "$BEFORE"
	ports="$ports 30803"
fi

for port in $ports; do
	for _ in $(seq 100); do job http://127.0.0.1:$port 2>/dev/null && break; sleep 0.1; done
	job http://127.0.0.1:$port
done

# run NAME PORT SECONDS: one wrk run; prints its requests per second and the
# Caddy's CPU time per request in µs.
run() {
	local out before after
	before=$(cpu_us "${pid_of[$2]}")
	out=$(pin "${PIN_WRK:-}" wrk -t"$threads" -c"$conns" -d"$3"s -s cmd/bench/wrk/job.lua "http://127.0.0.1:$2")
	after=$(cpu_us "${pid_of[$2]}")
	if grep -q 'Non-2xx' <<<"$out"; then echo "$1: failed requests" >&2; echo "$out" >&2; exit 1; fi
	awk -v cpu=$((after - before)) '/^Requests\/sec/ {rps = $2} / requests in / {n = $1} END {printf "%.0f %.0f\n", rps, cpu / n}' <<<"$out"
}

for port in $ports; do run warm-up "$port" 2 >/dev/null; done # connections, learned speeds
echo "load average (1, 5, 15 min) at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "wrk -t$threads -c$conns -d${secs}s, $pairs alternating rounds, images of ${IMAGE_BYTES:-1024} bytes${PIN_WRK:+, wrk on CPU $PIN_WRK}${PIN_SERVERS:+, servers on CPU $PIN_SERVERS}"
printf '%-6s %10s %10s %6s' round least_conn router ratio
[ -n "${BEFORE:-}" ] && printf ' %10s %6s' before ratio
printf '   cpu/req (µs): %10s %10s %6s' least_conn router ratio
[ -n "${BEFORE:-}" ] && printf ' %10s' before
echo
sum=(0 0 0) cpu=(0 0 0) ratios=() before_ratios=() cpu_ratios=()
for i in $(seq "$pairs"); do
	row=() per=() j=0
	for port in $ports; do
		read -r row[j] per[j] < <(run "port $port" "$port" "$secs")
		sum[j]=$((sum[j] + row[j])) cpu[j]=$((cpu[j] + per[j])) j=$((j + 1))
	done
	ratios+=("$(ratio "${row[1]}" "${row[0]}")")
	printf '%-6s %10s %10s %6.2f' "$i" "${row[0]}" "${row[1]}" "${ratios[-1]}"
	if [ -n "${BEFORE:-}" ]; then
		before_ratios+=("$(ratio "${row[2]}" "${row[0]}")")
		printf ' %10s %6.2f' "${row[2]}" "${before_ratios[-1]}"
	fi
	cpu_ratios+=("$(ratio "${per[1]}" "${per[0]}")")
	printf '                 %10s %10s %6.2f' "${per[0]}" "${per[1]}" "${cpu_ratios[-1]}"
	[ -n "${BEFORE:-}" ] && printf ' %10s' "${per[2]}"
	echo
done
printf '%-6s %10d %10d %6.2f' mean $((sum[0] / pairs)) $((sum[1] / pairs)) "$(ratio "${sum[1]}" "${sum[0]}")"
[ -n "${BEFORE:-}" ] && printf ' %10d %6.2f' $((sum[2] / pairs)) "$(ratio "${sum[2]}" "${sum[0]}")"
printf '                 %10d %10d %6.2f' $((cpu[0] / pairs)) $((cpu[1] / pairs)) "$(ratio "${cpu[1]}" "${cpu[0]}")"
[ -n "${BEFORE:-}" ] && printf ' %10d' $((cpu[2] / pairs))
echo
printf '%-6s %10s %10s %6s' median "" "" "$(median "${ratios[@]}")"
[ -n "${BEFORE:-}" ] && printf ' %10s %6s' "" "$(median "${before_ratios[@]}")"
printf '                 %10s %10s %6s' "" "" "$(median "${cpu_ratios[@]}")"
echo
echo "load average (1, 5, 15 min) at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
