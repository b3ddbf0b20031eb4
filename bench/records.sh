#!/usr/bin/env bash
# What a record costs, through the gateway, as the store fills:
#
#   bench/records.sh [records] [memory|redis|postgres] [expiring]
#
# Two idem-gateway processes in front of one bare axum-orders upstream,
# identical but for `--methods PUT` on the second (so POST passes straight
# through the same proxy). wrk sends fresh-key POSTs to each for the same
# time, in 10-second steps until the store holds `records`; after each step
# the script prints the records held, the protected gateway's RSS growth
# beside the unprotected one's, and bytes per record: (protected growth -
# unprotected growth) / records. With
# `redis`, a private redis-server's `used_memory` growth per record too.
#
# Then expiry (`expiring` records, default 200000): a protected gateway with
# a 20 s retention is filled, a steady round measures p99 while nothing has
# expired, the records are left to expire, and a round of the same length
# measures p99 while the store removes them. Sleeps are part of the bench
# (waiting for records to expire), never of the tests.
#
# Needs wrk (Debian: apt-get install wrk). Traffic stays on 127.0.0.1.
set -euo pipefail
records=${1:-1000000}
store=${2:-memory}
expiring=${3:-200000}
cd "$(dirname "$0")/.."
. bench/prologue.sh

rss_kb() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }

redis_port=
use_store "$store"
pg_port=
if [ "$store" = postgres ]; then
  pg_bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
  pg_port=$(free_port)
  pg_dir=$(mktemp -d)
  chown postgres "$pg_dir"
  runuser -u postgres -- "$pg_bin/initdb" -D "$pg_dir/data" -A trust -U postgres --no-sync -E UTF8 >/dev/null
  runuser -u postgres -- "$pg_bin/postgres" -D "$pg_dir/data" -p "$pg_port" -k "$pg_dir" \
    -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c max_connections=300 \
    >"$work/postgres.log" 2>&1 &
  trap 'kill $(jobs -p) 2>/dev/null || true; sleep 1; rm -rf "$work" "$pg_dir"' EXIT
  for _ in $(seq 100); do "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$pg_port" && break; sleep 0.1; done
  store_url="postgres://postgres@127.0.0.1:$pg_port/postgres"
fi
pg_bytes() { "$pg_bin/psql" -h 127.0.0.1 -p "$pg_port" -U postgres -tAc \
  "SELECT COALESCE(pg_total_relation_size(to_regclass('idem_records')), 0)" postgres; }
used_memory() { redis-cli -p "$redis_port" info memory | tr -d '\r' | awk -F: '/^used_memory:/ {print $2}'; }

start_upstream
up=$upstream_port; protected=$(free_port); bare=$(free_port)
memory_flags=(--memory-capacity $((records * 2)) --memory-tenant-quota 0 --memory-max-bytes 16GiB)
RUST_LOG=warn "$gateway" --listen 127.0.0.1:$protected --upstream http://127.0.0.1:$up \
  --store "$store_url" "${memory_flags[@]}" --tenant-secret bench-secret-of-32-bytes-or-more-0001 \
  >"$work/protected.log" 2>&1 & protected_pid=$!
RUST_LOG=warn "$gateway" --listen 127.0.0.1:$bare --upstream http://127.0.0.1:$up \
  --methods PUT >"$work/bare.log" 2>&1 & bare_pid=$!
wait_served "$up"; wait_served "$protected"; wait_served "$bare"

# Fresh-key POSTs over 64 connections for a while; prints
# "requests rps p99ms errors".
send() { # port seconds tag -> "answered rps p99 errors"
  wrk -t2 -c64 -d"$2s" --latency -s bench/fresh_keys.lua "http://127.0.0.1:$1" -- "$3" |
    awk '/^RESULT/ {print $2, $3, $4, $5}'
}

echo "== bytes per record through the gateway, $store store"
printf '%10s %14s %14s %12s %10s %10s\n' records protected_MB unprotected_MB bytes/record p99_ms store_B/rec
p0=$(rss_kb $protected_pid); b0=$(rss_kb $bare_pid); m0=0
[ -n "$redis_port" ] && m0=$(used_memory)
[ -n "$pg_port" ] && m0=$(pg_bytes)
held=0
step=0
while [ "$held" -lt "$records" ]; do
  step=$((step + 1))
  read -r answered _ p99 errors < <(send "$protected" 10 "p$step")
  send "$bare" 10 "b$step" >/dev/null
  held=$((held + answered))
  p=$(rss_kb $protected_pid); b=$(rss_kb $bare_pid)
  per=$(( ((p - p0) - (b - b0)) * 1024 / held ))
  store_per=-
  [ -n "$redis_port" ] && store_per=$(( ($(used_memory) - m0) / held ))
  [ -n "$pg_port" ] && store_per=$(( ($(pg_bytes) - m0) / held ))
  printf '%10d %14.1f %14.1f %12d %10s %10s\n' "$held" "$(echo "$p / 1024" | bc -l)" \
    "$(echo "$b / 1024" | bc -l)" "$per" "$p99" "$store_per"
  [ "$errors" = 0 ] || echo "  $errors errors in this step" >&2
done
kill "$protected_pid" "$bare_pid"; wait "$protected_pid" "$bare_pid" 2>/dev/null || true
[ -n "$redis_port" ] && redis-cli -p "$redis_port" flushall >/dev/null
[ -n "$pg_port" ] && "$pg_bin/psql" -h 127.0.0.1 -p "$pg_port" -U postgres -qc "TRUNCATE idem_records" postgres

echo "== p99 while $expiring expired records are removed, $store store"
protected=$(free_port)
RUST_LOG=warn "$gateway" --listen 127.0.0.1:$protected --upstream http://127.0.0.1:$up \
  --store "$store_url" --retention 20s --lease 5s "${memory_flags[@]}" \
  --tenant-secret bench-secret-of-32-bytes-or-more-0001 >"$work/expiring.log" 2>&1 & protected_pid=$!
wait_served "$protected"
started=$(date +%s)
filled=0
while [ "$filled" -lt "$expiring" ]; do
  read -r answered _ < <(send "$protected" 2 "fill$filled")
  filled=$((filled + answered))
done
read -r _ srps sp99 _ < <(send "$protected" 5 steady)
# Wait until every filled record has expired (retention 20 s from its reservation).
sleep $(( 22 - ($(date +%s) - started) > 0 ? 22 - ($(date +%s) - started) : 0 ))
sleep 6  # the steady round's records too
expiring_round=5
[ -n "$pg_port" ] && expiring_round=70
read -r _ erps ep99 _ < <(send "$protected" "$expiring_round" expiring)
read -r _ arps ap99 _ < <(send "$protected" 5 after)
printf '%-26s %10s %10s\n' round req/s p99_ms
printf '%-26s %10s %10s\n' "steady (nothing expired)" "$srps" "$sp99"
printf '%-26s %10s %10s\n' "while $filled expire" "$erps" "$ep99"
printf '%-26s %10s %10s\n' "after" "$arps" "$ap99"
echo "p99 while expiring / steady: $(echo "$ep99 / $sp99" | bc -l | cut -c1-5)"
