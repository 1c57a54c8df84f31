#!/usr/bin/env bash
# Rollouts with large answers, through the router and through Caddy's plain
# reverse_proxy over the same four fake workers: one POST /rollout/generate
# at a time, whose answer carries MB megabytes of tensor (a third more as
# base64), the two Caddys taking turns, and each going first every other
# round so that neither always finds the machine as the other left it.
#
#   bash cmd/bench/wrk/large.sh [rounds] [MB]
#
# Environment: CADDY (a Caddy binary with the plugin; built from ./cmd/caddy
# when unset), WORKER_ARGS (the fake workers' flags; --rollout-json when
# unset), LOG_LEVEL (both Caddys' log level; INFO when unset),
# PROFILE=router|least_conn (admin on :2019 with pprof, for profiling).
#
# The ratio is router / reverse_proxy per round; the median of the rounds'
# ratios is the figure. RSS is the router's resident memory after each round
# and its peak (VmHWM) over the run: it stays flat when answers stream
# through, and would grow by the answer's size if one were held whole.
set -euo pipefail
cd "$(dirname "$0")/../../.."
rounds=${1:-10} mb=${2:-200}
. cmd/bench/wrk/lib.sh

build_all
refuse_busy_ports
# The older JSON form of the answer splices one tensor encoded once, so a
# worker takes the same time over every answer; msgpack (WORKER_ARGS=) is
# encoded anew each time, and the worker's own pauses over 267 MB swamp the
# comparison.
# shellcheck disable=SC2086 # WORKER_ARGS is a list of flags
start_workers --image-bytes "$((mb * 1000000))" ${WORKER_ARGS---rollout-json}
start_caddy least_conn 30801 cmd/bench/wrk/least_conn.Caddyfile
start_caddy router 30802 cmd/bench/wrk/router.Caddyfile

rollout='{"prompt":"x","seed":1,"width":1,"height":1,"num_inference_steps":1}'
# fetch URL: one rollout; prints its seconds and the bytes received.
fetch() {
	curl -sS --fail -o /dev/null -w '%{time_total} %{size_download}\n' \
		-H 'Content-Type: application/json' -d "$rollout" "$1/rollout/generate"
}
for port in 30801 30802; do
	for _ in $(seq 100); do curl -sf -o /dev/null "http://127.0.0.1:$port/v1/models" && break; sleep 0.1; done
done
# Each worker builds its answer's tensor once, on its first rollout; the
# first rollouts through each Caddy, one per worker, find its connections
# and its memory to grow into, and take seconds more: they are not counted.
for i in 1 2 3 4; do fetch "http://127.0.0.1:3100$i" >/dev/null; done
for port in 30801 30802; do
	for _ in 1 2 3 4; do fetch "http://127.0.0.1:$port" >/dev/null; done
done

echo "load average (1, 5, 15 min) at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-6s %14s %10s %6s %12s\n' round reverse_proxy router ratio 'router RSS'
ratios=()
for i in $(seq "$rounds"); do
	order="30801 30802"
	[ $((i % 2)) = 0 ] && order="30802 30801"
	declare -A secs=() size=()
	for port in $order; do
		read -r "secs[$port]" "size[$port]" < <(fetch "http://127.0.0.1:$port")
	done
	diff=$((size[30801] - size[30802]))
	if [ "${diff#-}" -gt 100 ]; then # the answers' timings differ in a digit or two
		echo "answers differ in size: ${size[30801]} and ${size[30802]} bytes" >&2; exit 1
	fi
	ratios+=("$(ratio "${secs[30802]}" "${secs[30801]}")")
	printf '%-6s %13.2fs %9.2fs %6.2f %9s MB\n' "$i" "${secs[30801]}" "${secs[30802]}" "${ratios[-1]}" "$(rss_mb "${pid_of[30802]}" VmRSS)"
done
printf '%-6s %14s %10s %6s\n' median "" "" "$(median "${ratios[@]}")"
echo "answers of ${size[30801]} bytes; peak RSS: router $(rss_mb "${pid_of[30802]}" VmHWM) MB, reverse_proxy $(rss_mb "${pid_of[30801]}" VmHWM) MB"
echo "load average (1, 5, 15 min) at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
