#!/usr/bin/env bash
# Where a request's native CPU goes, from /proc: user and system CPU
# microseconds, voluntary and involuntary context switches, write system
# calls (`/proc/PID/io` counts `writev`, not socket receives) and minor page
# faults per request of peerbench in one mode,
# under wrk (64 connections, a fresh key per POST). Cheap enough to repeat
# and to alternate modes; reads counters, samples nothing.
#
#   bench/peer/kernel.sh bare|memory|idem-memory|redis|idem-redis [seconds]
#
# TOKIO_WORKER_THREADS=N sets the app's worker threads (read by its
# `#[tokio::main]`): with one, the two cores' sharing with wrk shows.
# SPIN_NS=N makes the handler busy its thread N ns per request (every
# mode): `SPIN_NS=7000 bench/peer/kernel.sh bare` against `bare` shows
# what spending more user CPU per request costs in the kernel here.
#
# Needs wrk, curl, python3 (and redis-server for the Redis modes: a
# private one on a free loopback port). Builds like run.sh; the IDEM_*
# variables of run.sh apply.
set -euo pipefail
mode=${1:?mode}
seconds=${2:-6}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/serve.sh"
serve "$mode" kernel
# utime stime (ticks), voluntary and involuntary switches over all threads,
# read and write system calls (syscr syscw), minor faults.
snapshot() {
  read -r -a stat < <(sed 's/^.*) //' "/proc/$SPID/stat")
  switches=$(cat /proc/"$SPID"/task/*/status | awk '/^voluntary_ctxt/{v+=$2} /^nonvoluntary_ctxt/{n+=$2} END{print v, n}')
  io=$(awk '/^syscw|^syscr/{print $2}' "/proc/$SPID/io" | paste -sd' ')
  echo "${stat[11]} ${stat[12]} $switches $io ${stat[7]}"
}
before=$(snapshot)
out=$(wrk -t2 -c64 -d"${seconds}s" -s "$here/post.lua" "http://127.0.0.1:$APORT/orders")
after=$(snapshot)
requests=$(awk '/requests in/{print $1}' <<<"$out")
python3 - "$before" "$after" "$requests" "$mode" "$(getconf CLK_TCK)" <<'PY'
import sys
a = list(map(int, sys.argv[1].split())); b = list(map(int, sys.argv[2].split()))
n, mode, tick = int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
d = [y - x for x, y in zip(a, b)]
us = lambda ticks: ticks / tick / n * 1e6
print(f"{mode:12} {n:8d} requests: user {us(d[0]):5.2f} us, system {us(d[1]):5.2f} us, "
      f"switches {d[2]/n:.3f} voluntary {d[3]/n:.3f} involuntary, "
      f"write calls {d[5]/n:.2f}, minor faults {d[6]/n:.3f} per request")
PY
