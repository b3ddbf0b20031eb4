#!/usr/bin/env bash
# Load test, in alternating rounds, a fresh Idempotency-Key per POST:
#
#   bench/load.sh [rounds] [seconds-per-round] [connections] [memory|redis] [app|gateway]
#
# app (default): axum-orders with the idempotency layer against the same
# app without it. gateway: the idem-gateway binary in front of a bare
# axum-orders upstream, with the layer on against `--methods PUT` (so POST
# passes straight through the same proxy).
#
# With `redis`, the layered server uses a private redis-server started on a
# free loopback port for the run (never the shared one on 6379).
#
# Prints requests/s and p99 latency per round, and the median ratio of
# layered to bare throughput. The layered server keeps running across
# rounds, so its memory store fills up as the rounds go: a flat p99 over
# the rounds shows that filling the store does not slow requests down.
# LAYERED_FLAGS: more flags for the layered gateway (for example
# `--redis-record-format 1`). Needs `wrk` (Debian: apt-get install wrk).
# Traffic stays on 127.0.0.1.
set -euo pipefail
rounds=${1:-6}
seconds=${2:-10}
connections=${3:-64}
store=${4:-memory}
target=${5:-app}
cd "$(dirname "$0")/.."
. bench/prologue.sh

layered_port=$(free_port)
bare_port=$(free_port)
use_store "$store"
if [ "$target" = gateway ]; then
  # One bare upstream; two gateways in front of it, identical but for the methods.
  start_upstream
  start_gateway "$layered_port" layered layered
  start_gateway "$bare_port" pass bare
else
  IDEM_LISTEN=127.0.0.1:$layered_port IDEM_LAYER=on IDEM_STORE="$store_url" "$bin" >"$work/layered.log" 2>&1 &
  IDEM_LISTEN=127.0.0.1:$bare_port IDEM_LAYER=off "$bin" >"$work/bare.log" 2>&1 &
fi
for port in $layered_port $bare_port; do
  wait_served "$port"
done
for port in $layered_port $bare_port; do
  check_order "$port"
done

run() { # port -> "rps p99ms errors"
  wrk -t2 -c"$connections" -d"${seconds}s" --latency -s bench/fresh_keys.lua "http://127.0.0.1:$1" | awk '/^RESULT/ {print $3, $4, $5}'
}

printf '%-6s %12s %10s %12s %10s %8s %10s\n' round bare_rps bare_p99 layer_rps layer_p99 ratio records
ratios=()
records=0
# Redis' own CPU (user and system, seconds), read from INFO: only the
# layered gateway talks to it.
redis_cpu() { redis-cli -p "$redis_port" info cpu | awk -F: '/^used_cpu_(sys|user):/ { s += $2 } END { print s }'; }
[ "$store" = redis ] && redis_cpu_start=$(redis_cpu)
for round in $(seq "$rounds"); do
  read -r brps bp99 berr < <(run "$bare_port")
  read -r lrps lp99 lerr < <(run "$layered_port")
  records=$((records + ${lrps%.*} * seconds))
  ratio=$(awk -v a="$lrps" -v b="$brps" 'BEGIN { printf "%.3f", a / b }')
  ratios+=("$ratio")
  printf '%-6s %12s %9sms %12s %9sms %8s %9s~\n' "$round" "$brps" "$bp99" "$lrps" "$lp99" "$ratio" "$records"
  if [ "$berr" != 0 ] || [ "$lerr" != 0 ]; then echo "  errors: bare $berr, layered $lerr" >&2; fi
done
median=$(printf '%s\n' "${ratios[@]}" | sort -n | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
echo "target: $target, store: $store; median layered/bare throughput ratio: $median (records: approximate records in the layered store)"
if [ "$store" = redis ]; then
  # Each command's calls and time per call (record format 3: a new key is a
  # native SET and the completion's EVALSHA, whose own GET and SET are
  # counted under them too; format 2: two EVALSHA).
  redis-cli -p "$redis_port" info commandstats | awk -F'[:,=]' '/cmdstat_(evalsha|set|get|pttl)/ { sub("cmdstat_", "", $1); printf "redis: %s %s calls, %.1f us per call\n", $1, $3, $7 }'
  # usec_per_call is the call's wall time inside Redis (a preempted Redis
  # counts the pause); INFO cpu is the CPU Redis used, its network included.
  awk -v a="$redis_cpu_start" -v b="$(redis_cpu)" -v n="$records" \
    'BEGIN { printf "redis CPU (INFO cpu): %.1f us per layered request\n", (b - a) * 1e6 / n }'
fi
