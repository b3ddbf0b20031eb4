#!/usr/bin/env bash
# Redis CPU per script call, from Redis' own accounting: a private
# redis-server, the scripts assembled as idem-redis assembles them, driven by
# redis-benchmark (8 connections), read back from INFO commandstats
# (usec_per_call). Shows what a reservation costs inside Redis and where:
# an empty script, the shared prologue (TIME and helpers), the new-key
# reservation, the replay of a completed key, and a bare HSET of 3 and of
# 15 fields on fresh keys (the cost of each field a record writes).
#   bench/lua_cost.sh [calls]
set -euo pipefail
calls=${1:-40000}
cd "$(dirname "$0")/.."
lua=crates/idem-redis/src/lua
port=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
work=$(mktemp -d)
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
  --pidfile "$work/redis.pid" --logfile "$work/redis.log"
trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
cli() { redis-cli -p "$port" "$@"; }
load() { cli -x SCRIPT LOAD <"$1"; }
. bench/lua_assemble.sh
assemble "$work/reserve.lua" "$lua/reserve.lua"
assemble "$work/complete.lua" "$lua/complete.lua"
printf 'return 1\n' >"$work/empty.lua"
printf 'return 1\n' >"$work/return.lua"; assemble "$work/prologue.lua" "$work/return.lua"
printf "redis.call('HSET', KEYS[1], 'a', ARGV[1], 'b', ARGV[2], 'c', ARGV[3])\nreturn 1\n" >"$work/hset3.lua"
{
  printf "redis.call('HSET', KEYS[1]"
  for i in $(seq 15); do printf ", 'f%d', ARGV[%d]" "$i" $(( (i - 1) % 10 + 1 )); done
  printf ")\nreturn 1\n"
} >"$work/hset15.lua"

fp=$(printf 'f%.0s' $(seq 64)); attempt=11111111-1111-1111-1111-111111111111
token=22222222-2222-2222-2222-222222222222; tenant="auth:$(printf 'a%.0s' $(seq 32))"
reserve_args=("$fp" "$attempt" "$token" 30000 86400000 "$tenant" "POST /orders" order-1)
# usec_per_call of one script over `calls` calls; KEY may hold __rand_int__.
cost() { # script key
  local sha; sha=$(load "$1")
  cli CONFIG RESETSTAT >/dev/null
  redis-benchmark -p "$port" -n "$calls" -r 100000000 -c 8 -q EVALSHA "$sha" 1 "$2" \
    "${reserve_args[@]}" >/dev/null 2>&1
  cli INFO commandstats | sed -n 's/^cmdstat_evalsha:.*usec_per_call=\([0-9.]*\).*/\1/p'
}
# A completed record for the replay row.
rsha=$(load "$work/reserve.lua"); csha=$(load "$work/complete.lua")
cli EVALSHA "$rsha" 1 'idem:{replay}' "${reserve_args[@]}" >/dev/null
cli EVALSHA "$csha" 1 'idem:{replay}' 1 "$token" "$attempt" 201:1 \
  'content-type: application/json' '{"id":"1"}' 1700000000000 >/dev/null
printf '%-34s %10s\n' script usec/call
printf '%-34s %10s\n' 'empty script' "$(cost "$work/empty.lua" 'idem:{__rand_int__}')"
printf '%-34s %10s\n' 'shared prologue only' "$(cost "$work/prologue.lua" 'idem:{__rand_int__}')"
printf '%-34s %10s\n' 'reserve, new key' "$(cost "$work/reserve.lua" 'idem:{__rand_int__}')"
printf '%-34s %10s\n' 'reserve, completed key (replay)' "$(cost "$work/reserve.lua" 'idem:{replay}')"
printf '%-34s %10s\n' 'HSET of 3 fields, new key' "$(cost "$work/hset3.lua" 'h:{__rand_int__}')"
printf '%-34s %10s\n' 'HSET of 15 fields, new key' "$(cost "$work/hset15.lua" 'h:{__rand_int__}')"
