# Shared by run.sh, large.sh and upload.sh: processes started in the
# background and stopped on exit, the Caddys' ports, a small job, memory,
# CPU time and medians. Sourced from the repository's root, after
# `set -euo pipefail`.
tmp=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
export HOME=$tmp XDG_DATA_HOME=$tmp XDG_CONFIG_HOME=$tmp # no state left behind

pin() { # pin CPUS command...: exec command on CPUS, or anywhere when CPUS is empty
	local cpus=$1; shift
	if [ -n "$cpus" ]; then exec taskset -c "$cpus" "$@"; else exec "$@"; fi
}
# start command...: run it in the background; exec makes $! its own pid.
start() { (pin "${PIN_SERVERS:-}" "$@") >"$tmp/log.${#pids[@]}" 2>&1 & pids+=($!); }
declare -A pid_of # the Caddy serving each port

# build_all: the Caddy ($CADDY, or one built from ./cmd/caddy) and the fake worker.
build_all() {
	caddy=${CADDY:-$tmp/caddy}
	[ -n "${CADDY:-}" ] || go build -o "$caddy" ./cmd/caddy
	go build -o "$tmp/fakeworker" ./cmd/fakeworker
}

# Caddy listens with SO_REUSEPORT: a leftover Caddy on a port would share
# the load silently, so refuse to start over one.
refuse_busy_ports() {
	for port in 31001 31002 31003 31004 30801 30802 30803; do
		if curl -s -o /dev/null "http://127.0.0.1:$port/"; then
			echo "port $port is in use: stop what listens there first" >&2; exit 1
		fi
	done
}

# start_workers ARGS...: the four fake workers on 31001-31004, with ARGS.
start_workers() {
	for i in 1 2 3 4; do
		start "$tmp/fakeworker" --port 3100$i --name w$i --unit-ms 1 "$@"
	done
}

# start_caddy NAME PORT CADDYFILE [BINARY]: a Caddy on PORT; admin API and
# pprof on localhost:2019 when PROFILE=NAME.
start_caddy() {
	local admin=off
	[ "${PROFILE:-}" = "$1" ] && admin=localhost:2019
	ADMIN=$admin PORT=$2 start "${4:-$caddy}" run --adapter caddyfile --config "$3"
	pid_of[$2]=${pids[-1]}
}

job() { # job URL: one zero-cost job; its answer on stderr if it fails
	curl -sS --fail-with-body -o "$tmp/job.out" -H 'Content-Type: application/json' -d @- "$1/v1/images/generations" \
		<<<'{"prompt":"x","size":"1x1","num_inference_steps":1,"response_format":"b64_json"}' || { cat "$tmp/job.out" >&2; return 1; }
}

# rss_mb PID FIELD: VmRSS or VmHWM of PID in MB.
rss_mb() { awk -v f="$2:" '$1 == f {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }

# cpu_us PID: the CPU time (user and system) the process has used, in µs.
hz=$(getconf CLK_TCK)
cpu_us() { awk -v hz="$hz" '{printf "%.0f", ($14 + $15) * 1000000 / hz}' "/proc/$1/stat"; }

ratio() { echo "$1 / $2" | bc -l; }
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1} END {printf "%.2f", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
