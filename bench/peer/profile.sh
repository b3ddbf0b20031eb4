#!/usr/bin/env bash
# Where the app's CPU goes under load, natively: `perf record -e cpu-clock`
# (a software clock, so it works where hardware counters are not exposed)
# on peerbench in one mode while wrk drives it (64 connections, a fresh key
# per POST, 6 s), then the top symbols by self time and the app's CPU
# microseconds per request. Unlike callgrind (inproc.sh) this sees what
# only real cores show: memory copies at full size, atomics shared
# between cores, the kernel's share, SHA-256 in hardware.
#
#   bench/peer/profile.sh bare|memory|idem-memory|redis|idem-redis [top]
#
# Needs perf, wrk, curl, python3 (and redis-server for the Redis modes: a
# private one on a free loopback port). Builds like run.sh.
set -euo pipefail
mode=${1:?mode}
top=${2:-25}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/serve.sh"
serve "$mode" profile
cpu() { awk '{print $14 + $15}' "/proc/$SPID/stat"; }
perf record -q -e cpu-clock -F 999 -p "$SPID" -o "$WORK/profile-$mode.data" 2>/dev/null & PERF=$!
before=$(cpu)
out=$(wrk -t2 -c64 -d6s -s "$here/post.lua" "http://127.0.0.1:$APORT/orders")
after=$(cpu)
kill -INT "$PERF"; wait "$PERF" || true
n=$(echo "$out" | awk '/requests in/ {print $1}')
python3 -c "import sys; print(f'{sys.argv[1]}: {int(sys.argv[2])} requests, app CPU {(int(sys.argv[4]) - int(sys.argv[3])) / int(sys.argv[5]) / int(sys.argv[2]) * 1e6:.1f} us per request')" \
  "$mode" "$n" "$before" "$after" "$(getconf CLK_TCK)"
perf report -i "$WORK/profile-$mode.data" --no-children --sort dso 2>/dev/null | grep -v '^#' | grep -v '^$' | head -4
perf report -i "$WORK/profile-$mode.data" --no-children --sort sym 2>/dev/null | grep -v '^#' | grep -v '^$' | head -"$top"
