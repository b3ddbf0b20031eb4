#!/usr/bin/env bash
# Instructions per request of the gateway process, counted by valgrind's
# callgrind: steady whatever the machine's load, unlike the throughput
# ratio of bench/load.sh. A bare axum-orders upstream runs natively; the
# gateway runs under callgrind twice, as bench/load.sh starts it: with the
# layer on (memory, or a private redis-server) and passing every POST
# straight through (`--methods PUT`). wrk sends POSTs with a fresh
# Idempotency-Key each on 2 connections; the counters are zeroed after a
# warm-up and dumped after SECONDS, and the count is divided by the
# requests wrk saw answered in that window (give or take the 2 in flight
# at either end). The gateway's own chores (the lapsed-records sweep every
# 5 s) fall into the window as they fall into a real one.
#   bench/gateway_instructions.sh [memory|redis] [seconds]
# LAYERED_FLAGS: more flags for the layered gateway (as bench/load.sh).
# Needs valgrind (callgrind_control), wrk, redis-server for redis.
set -euo pipefail
store=${1:-memory}
seconds=${2:-15}
cd "$(dirname "$0")/.."
. bench/prologue.sh

use_store "$store"
start_upstream

count() { # mode -> "instructions-per-request requests"
  local mode=$1 port
  port=$(free_port)
  # shellcheck disable=SC2046 # the flags are words
  RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$work/cg.$mode.%p" "$gateway" \
    --listen "127.0.0.1:$port" --upstream "http://127.0.0.1:$upstream_port" $(gateway_flags "$mode") \
    >"$work/$mode.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do
    curl -s -o /dev/null "http://127.0.0.1:$port/orders/0" && break
    sleep 0.2
  done
  wrk -t1 -c2 -d3s -s bench/fresh_keys.lua "http://127.0.0.1:$port" -- warm >/dev/null
  callgrind_control -z "$pid" >/dev/null 2>&1
  local answered
  answered=$(wrk -t1 -c2 -d"${seconds}s" -s bench/fresh_keys.lua "http://127.0.0.1:$port" -- count \
    | awk '/^RESULT/ {print $2}')
  callgrind_control -d "$pid" >/dev/null 2>&1
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  local total
  total=$(awk '/^totals:/ {print $2}' "$work"/cg."$mode".*.1)
  echo "$((total / answered)) $answered"
}

read -r bare bare_n < <(count bare)
read -r layered layered_n < <(count layered)
printf '%-8s %14s %10s\n' gateway instr/request requests
printf '%-8s %14d %10d\n' bare "$bare" "$bare_n" layered "$layered" "$layered_n"
echo "store: $store; the layer adds $((layered - bare)) instructions per request ($(awk -v a="$layered" -v b="$bare" 'BEGIN { printf "%.2f", a / b }')x pass-through)"
