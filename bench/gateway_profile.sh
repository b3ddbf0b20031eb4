#!/usr/bin/env bash
# Where the gateway's CPU goes under load, natively: `perf record -e
# cpu-clock` (a software clock, so it works where hardware counters are
# not exposed) on the gateway process, started as bench/load.sh starts it,
# while wrk drives it (64 connections, a fresh Idempotency-Key per POST).
# Prints the gateway's CPU microseconds per request, its page faults per
# request, the split between the kernel and user space, and the top
# symbols by self time. Unlike callgrind (gateway_instructions.sh) this
# sees what only real cores show: page faults and the zeroing of fresh
# pages, atomics shared between cores, the kernel's share.
#
#   bench/gateway_profile.sh [memory|redis] [layered|pass] [seconds] [top]
#
# LAYERED_FLAGS: more flags for the layered gateway (as bench/load.sh).
# Needs perf, wrk, curl (and redis-server for redis: a private one on a
# free loopback port).
set -euo pipefail
store=${1:-memory}
mode=${2:-layered}
seconds=${3:-8}
top=${4:-25}
cd "$(dirname "$0")/.."
. bench/prologue.sh
command -v perf >/dev/null || { echo "perf is not installed" >&2; exit 1; }

use_store "$store"
start_upstream
port=$(free_port)
start_gateway "$port" "$mode" gateway
wait_served "$port"
wrk -t2 -c64 -d2s -s bench/fresh_keys.lua "http://127.0.0.1:$port" -- warm >/dev/null
# CPU ticks (user + system) and minor faults of the gateway so far.
usage() { awk '{print $14 + $15, $10}' "/proc/$gateway_pid/stat"; }
perf record -q -e cpu-clock -F 999 -p "$gateway_pid" -o "$work/gateway.data" 2>/dev/null & perf_pid=$!
read -r ticks0 faults0 < <(usage)
answered=$(wrk -t2 -c64 -d"${seconds}s" -s bench/fresh_keys.lua "http://127.0.0.1:$port" -- profile \
  | awk '/^RESULT/ {print $2}')
read -r ticks1 faults1 < <(usage)
kill -INT "$perf_pid"
wait "$perf_pid" || true
awk -v t0="$ticks0" -v t1="$ticks1" -v f0="$faults0" -v f1="$faults1" -v n="$answered" \
  -v hz="$(getconf CLK_TCK)" -v what="$store $mode" \
  'BEGIN { printf "gateway (%s): %d requests, %.1f us of CPU and %.3f page faults per request\n",
           what, n, (t1 - t0) / hz / n * 1e6, (f1 - f0) / n }'
perf report -i "$work/gateway.data" --no-children --sort dso 2>/dev/null | grep -v '^#' | grep -v '^$' | head -4
perf report -i "$work/gateway.data" --no-children --sort sym 2>/dev/null | grep -v '^#' | grep -v '^$' | head -"$top"
