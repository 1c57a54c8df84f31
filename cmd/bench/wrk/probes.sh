#!/usr/bin/env bash
# The router's CPU time per active health probe: a router over WORKERS fake
# workers, each probed every INTERVAL, and no traffic, for SECONDS. A fleet
# of n workers probed every health_interval costs n / health_interval probes
# a second.
#
#   bash cmd/bench/wrk/probes.sh [workers] [interval] [seconds]
#
# Environment: CADDY (a Caddy binary with the plugin; built from ./cmd/caddy
# when unset).
set -euo pipefail
cd "$(dirname "$0")/../../.."
workers=${1:-16} interval=${2:-40ms} secs=${3:-10}
[[ $interval =~ ^[0-9.]+m?s$ ]] || { echo "interval: want a duration in ms or s, like 40ms" >&2; exit 2; }
tmp=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT

caddy=${CADDY:-$tmp/caddy}
[ -n "${CADDY:-}" ] || go build -o "$caddy" ./cmd/caddy
go build -o "$tmp/fakeworker" ./cmd/fakeworker

urls=()
for i in $(seq "$workers"); do
	port=$((32000 + i))
	"$tmp/fakeworker" --port "$port" --name "w$i" >/dev/null 2>&1 & pids+=($!)
	urls+=("http://127.0.0.1:$port")
done
cat >"$tmp/Caddyfile" <<CADDYFILE
{
	admin off
	auto_https off
	persist_config off
	log {
		level WARN
	}
}
http://127.0.0.1:32000 {
	diffusion_router {
		workers ${urls[*]}
		health_interval $interval
	}
}
CADDYFILE
export HOME=$tmp XDG_DATA_HOME=$tmp XDG_CONFIG_HOME=$tmp # no state left behind
"$caddy" run --adapter caddyfile --config "$tmp/Caddyfile" >"$tmp/caddy.log" 2>&1 & pids+=($!)
router=${pids[-1]}
for _ in $(seq 100); do curl -sf -o /dev/null http://127.0.0.1:32000/health && break; sleep 0.1; done
sleep 2 # every worker probed at least once

hz=$(getconf CLK_TCK)
cpu_us() { awk -v hz="$hz" '{printf "%.0f", ($14 + $15) * 1000000 / hz}' "/proc/$1/stat"; }
before=$(cpu_us "$router") start=$(date +%s.%N)
sleep "$secs"
after=$(cpu_us "$router") end=$(date +%s.%N)
case $interval in
*ms) rounds=$(echo "1000 / ${interval%ms}" | bc -l) ;; # probe rounds a second
*s) rounds=$(echo "1 / ${interval%s}" | bc -l) ;;
esac
probes=$(echo "$workers * $rounds" | bc -l)
awk -v cpu=$((after - before)) -v wall="$(echo "$end - $start" | bc -l)" -v rate="$probes" -v w="$workers" -v i="$interval" 'BEGIN {
	printf "%d workers probed every %s: %.0f probes/s; router CPU %.1f%% of a core, %.0f µs per probe\n", w, i, rate, 100 * cpu / wall / 1e6, cpu / wall / rate
}'
