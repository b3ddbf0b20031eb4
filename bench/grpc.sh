#!/usr/bin/env bash
# What a unary gRPC call costs through the layer: the grpc-payments
# service with the layer (memory store, or a private redis-server) against
# the same service without it, in alternating rounds, each call with a
# fresh key over one HTTP/2 connection:
#
#   bench/grpc.sh [rounds] [seconds-per-round] [concurrency] [memory|redis]
#
# Prints, per round and server, calls per second and the server process's
# CPU per call (user and system, from /proc), then the median ratios of
# layered to bare. The load generator (grpc-load) runs beside the servers
# on the same cores, so calls per second are shared-machine figures; the
# CPU per call is the server's own. Traffic stays on 127.0.0.1.
set -euo pipefail
rounds=${1:-5}
seconds=${2:-5}
concurrency=${3:-32}
store=${4:-memory}
cd "$(dirname "$0")/.."
cargo build --release -q -p grpc-payments --features bench --bins
server=target/release/grpc-payments
load=target/release/grpc-load
. bench/servers.sh
use_store "$store"

layered_port=$(free_port)
bare_port=$(free_port)
IDEM_LISTEN=127.0.0.1:$layered_port IDEM_STORE="$store_url" "$server" >"$work/layered.log" 2>&1 &
layered_pid=$!
IDEM_LISTEN=127.0.0.1:$bare_port IDEM_LAYER=off "$server" >"$work/bare.log" 2>&1 &
bare_pid=$!
for port in $layered_port $bare_port; do
  # A short call proves the server answers before anything is measured.
  for _ in $(seq 100); do
    "$load" "127.0.0.1:$port" 0.05 1 2>/dev/null | grep -qv '^calls 0 ' && break
    sleep 0.1
  done
done

ticks=$(getconf CLK_TCK)
cpu() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
run() { # port pid -> "calls_per_s cpu_us_per_call failed"
  local before after out calls failed secs
  before=$(cpu "$2")
  out=$("$load" "127.0.0.1:$1" "$seconds" "$concurrency")
  after=$(cpu "$2")
  read -r _ calls _ failed _ secs <<<"$out"
  awk -v c="$calls" -v f="$failed" -v s="$secs" -v t="$((after - before))" -v hz="$ticks" \
    'BEGIN { printf "%.0f %.1f %d\n", c / s, (c > 0 ? t / hz * 1e6 / c : 0), f }'
}

printf '%-6s %10s %12s %10s %12s %8s %8s\n' round bare_cps bare_us/call layer_cps layer_us/call cps cpu
cps_ratios=()
cpu_ratios=()
for round in $(seq "$rounds"); do
  read -r bare_cps bare_cpu bare_failed <<<"$(run "$bare_port" "$bare_pid")"
  read -r layer_cps layer_cpu layer_failed <<<"$(run "$layered_port" "$layered_pid")"
  if [ "$bare_failed" != 0 ] || [ "$layer_failed" != 0 ]; then
    echo "calls failed (bare $bare_failed, layered $layer_failed); see the logs:" >&2
    cat "$work"/*.log >&2
    exit 1
  fi
  cps=$(awk -v a="$layer_cps" -v b="$bare_cps" 'BEGIN { printf "%.3f", a / b }')
  cpu_ratio=$(awk -v a="$layer_cpu" -v b="$bare_cpu" 'BEGIN { printf "%.3f", a / b }')
  cps_ratios+=("$cps")
  cpu_ratios+=("$cpu_ratio")
  printf '%-6s %10s %12s %10s %12s %8s %8s\n' "$round" "$bare_cps" "$bare_cpu" "$layer_cps" "$layer_cpu" "$cps" "$cpu_ratio"
done
median() { printf '%s\n' "$@" | sort -n | awk '{ v[NR] = $1 } END { print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
echo "median layered/bare calls per second: $(median "${cps_ratios[@]}")"
echo "median layered/bare server CPU per call: $(median "${cpu_ratios[@]}")"
