#!/usr/bin/env bash
# One large upload through two builds of the router: a POST
# /v1/images/generations whose JSON body is MB megabytes, nearly all of it
# a field the worker ignores (a prompt would come back whole in the answer's
# revised_prompt), sent by curl from a file to a Caddy of each build with
# max_body 256MiB over the four fake workers. Each round starts a fresh
# Caddy of each build in turn, the two taking turns at going first, warms
# it with one small job, sends the upload and stops it.
#
#   BEFORE=<another caddy> bash cmd/bench/wrk/upload.sh [rounds] [MB]
#
# Environment: BEFORE (a Caddy binary with the build to compare against;
# required), CADDY (a Caddy binary with the plugin; built from ./cmd/caddy
# when unset), MAX_BODY (the router's max_body; 256MiB when unset),
# LOG_LEVEL (INFO when unset).
#
# Per process: its resident memory before the upload, its peak (VmHWM)
# after the answer, the CPU time (user and system, from /proc) the upload
# cost it and the system part of it, and curl's time for the upload; then
# the median and range of each over the rounds.
set -euo pipefail
cd "$(dirname "$0")/../../.."
rounds=${1:-5} mb=${2:-200}
. cmd/bench/wrk/lib.sh
[ -n "${BEFORE:-}" ] || { echo "upload.sh needs BEFORE=<another Caddy binary>" >&2; exit 2; }
export MAX_BODY=${MAX_BODY:-256MiB}

build_all
refuse_busy_ports
start_workers
body=$tmp/body.json prefix='{"prompt":"x","size":"64x64","num_inference_steps":1,"response_format":"b64_json","ignored":"'
{
	printf '%s' "$prefix"
	head -c $((mb * 1000000 - ${#prefix} - 2)) /dev/zero | tr '\0' x
	printf '"}'
} >"$body"

declare -A binary=([before]=$BEFORE [after]=$caddy) rows=()
# seconds PID FIELDS: the CPU time of PID in /proc/PID/stat's FIELDS (an awk
# sum: $14 + $15 for user and system), in seconds.
seconds() { awk -v hz="$hz" "{printf \"%.2f\", ($2) / hz}" "/proc/$1/stat"; }
# measure BUILD: one fresh Caddy of BUILD and one upload through it; sets
# last to its figures (as named in heads) and adds them to rows[BUILD].
measure() {
	local url=http://127.0.0.1:30802 pid idle cpu sys code secs
	start_caddy "$1" 30802 cmd/bench/wrk/router.Caddyfile "${binary[$1]}"
	pid=${pid_of[30802]}
	for _ in $(seq 100); do job "$url" 2>/dev/null && break; sleep 0.1; done
	job "$url"
	idle=$(rss_mb "$pid" VmRSS) cpu=$(seconds "$pid" '$14 + $15') sys=$(seconds "$pid" '$15')
	read -r code secs < <(curl -sS -o "$tmp/answer" -w '%{http_code} %{time_total}\n' \
		-H 'Content-Type: application/json' --data-binary @"$body" "$url/v1/images/generations")
	if [ "$code" != 200 ]; then echo "$1 answered $code: $(head -c 300 "$tmp/answer")" >&2; exit 1; fi
	last="$idle $(rss_mb "$pid" VmHWM) $(echo "$(seconds "$pid" '$14 + $15') - $cpu" | bc) $(echo "$(seconds "$pid" '$15') - $sys" | bc) $secs"
	rows[$1]+="$last;"
	kill "$pid"
	wait "$pid" || true
}
heads=('idle RSS (MiB)' 'peak RSS (MiB)' 'CPU (s)' 'of it system' 'time (s)')
formats=(%.0f %.0f %.2f %.2f %.2f)

echo "load average (1, 5, 15 min) at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "bodies of $(stat -c %s "$body") bytes, max_body $MAX_BODY, $rounds rounds"
printf '%-6s %-7s' round build
printf ' %15s' "${heads[@]}" 'load (1 min)'
echo
for i in $(seq "$rounds"); do
	order="before after"
	[ $((i % 2)) = 0 ] && order="after before"
	for build in $order; do
		measure "$build"
		read -ra v <<<"$last"
		printf '%-6s %-7s' "$i" "$build"
		for n in "${!v[@]}"; do printf " %15s" "$(printf "${formats[n]}" "${v[n]}")"; done
		printf ' %15s\n' "$(cut -d' ' -f1 /proc/loadavg)"
	done
done
echo
printf '%-14s' 'median (range)'
printf ' %22s' "${heads[@]}"
echo
for build in before after; do
	printf '%-14s' "$build"
	for n in "${!heads[@]}"; do
		mapfile -t v < <(tr ';' '\n' <<<"${rows[$build]}" | awk -v n=$((n + 1)) 'NF {print $n}' | sort -g)
		f=${formats[n]}
		printf ' %22s' "$(printf "$f ($f-$f)" "$(median "${v[@]}")" "${v[0]}" "${v[-1]}")"
	done
	echo
done
echo "load average (1, 5, 15 min) at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
