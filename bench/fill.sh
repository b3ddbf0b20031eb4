#!/usr/bin/env bash
# p99 and the longest request as one protected gateway's store fills:
#
#   bench/fill.sh [seconds] [memory|redis]
#
# One idem-gateway (the layer on, LAYERED_FLAGS as bench/load.sh) in front
# of a bare axum-orders upstream; wrk sends fresh-key POSTs on 64
# connections for `seconds` (default 75: about 1.2 to 1.7 million records
# here) while bench/fill_probe.py sends one keyed POST every 20 ms on a
# connection of its own and samples both processes' CPU, faults and RSS
# from /proc every 100 ms. Prints wrk's p99 and longest request over the
# whole fill, then the probe's p99 and longest per 10-s window, and the
# records the store ended with. PERF=1 also records `perf record -e
# cpu-clock -a -g -k CLOCK_MONOTONIC` (whole machine, the probe's clock)
# to the work directory, kept: a window whose probe took long can then be
# read with `perf script --time START,END`. Needs wrk and python3 (and
# perf for PERF=1). Traffic stays on 127.0.0.1.
set -euo pipefail
seconds=${1:-75}
store=${2:-memory}
cd "$(dirname "$0")/.."
. bench/prologue.sh

use_store "$store"
start_upstream
layered_port=$(free_port)
start_gateway "$layered_port" layered layered
wait_served "$layered_port"
check_order "$layered_port"

if [ "${PERF:-0}" = 1 ]; then
  kept=$(mktemp -d)
  perf record -e cpu-clock -F 300 -a -g -k CLOCK_MONOTONIC -o "$kept/perf.data" \
    -- sleep $((seconds + 2)) >"$kept/perf.log" 2>&1 &
  perf_pid=$!
fi
python3 bench/fill_probe.py "$layered_port" $((seconds + 1)) "$work/probe" "$gateway_pid" "$upstream_pid" &
probe_pid=$!
wrk -t2 -c64 -d"${seconds}s" --latency -s bench/fresh_keys.lua "http://127.0.0.1:$layered_port" >"$work/wrk.txt"
wait "$probe_pid"
if [ "${PERF:-0}" = 1 ]; then wait "$perf_pid"; fi

awk '/^RESULT/ {printf "wrk: %d answered, %s requests/s, p99 %s ms, %d errors\n", $2, $3, $4, $5}' "$work/wrk.txt"
awk '$1 == "Latency" && NF > 3 {print "wrk: longest request " $4}' "$work/wrk.txt"
python3 - "$work/probe" <<'PY'
import sys
rows = [line.split() for line in open(sys.argv[1])]
start = float(rows[0][0])
failed = sum(1 for row in rows if row[2] != "201")
print(f"probe: {len(rows)} requests, {failed} not 201")
for window in range(0, int(float(rows[-1][0]) - start) + 1, 10):
    took = sorted(float(row[1]) for row in rows if window <= float(row[0]) - start < window + 10)
    if took:
        p99 = took[max(0, -(-len(took) * 99 // 100) - 1)]
        print(f"  {window:3d}-{window + 10:<3d} s  p99 {p99:7.1f} ms  longest {took[-1]:7.1f} ms")
PY
curl -s "http://127.0.0.1:$layered_port/metrics" | awk '/^idem_store_records / {print "records held:", $2}'
if [ "${PERF:-0}" = 1 ]; then
  cp "$work/probe" "$work/probe.proc" "$kept/"
  echo "perf data, the probe's log and /proc samples: $kept"
fi
