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
# Needs wrk, curl, python3 (and redis-server for the Redis modes: a
# private one on a free loopback port). Builds like run.sh; the IDEM_*
# variables of run.sh apply.
set -euo pipefail
mode=${1:?mode}
seconds=${2:-6}
here=$(cd "$(dirname "$0")" && pwd)
IDEM=$(cd "$here/../.." && pwd)
WORK=$IDEM/target/peer-bench
mkdir -p "$WORK"
cp "$here/post.lua" "$WORK/"
CARGO_TARGET_DIR=$WORK/target cargo build --manifest-path "$here/Cargo.toml" --release \
  --ignore-rust-version -q --bin peerbench
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
APORT=$(free_port)
args=("$mode")
RPORT=
SPID=
cleanup() {
  [ -n "$SPID" ] && { kill -INT "$SPID" 2>/dev/null || true; wait "$SPID" 2>/dev/null || true; }
  [ -n "$RPORT" ] && { redis-cli -p "$RPORT" shutdown nosave >/dev/null 2>&1 || true; }
}
trap cleanup EXIT
case $mode in *redis)
  RPORT=$(free_port)
  redis-server --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
    --pidfile "$WORK/kernel-redis.pid" --logfile "$WORK/kernel-redis.log"
  for _ in $(seq 50); do redis-cli -p "$RPORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
  args+=("redis://127.0.0.1:$RPORT");;
esac
"$WORK/target/release/peerbench" "$APORT" "${args[@]}" 2>/dev/null & SPID=$!
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$APORT/count" && break; sleep 0.05; done
# utime stime (ticks), voluntary and involuntary switches over all threads,
# read and write system calls (syscr syscw), minor faults.
snapshot() {
  read -r -a stat < <(sed 's/^.*) //' "/proc/$SPID/stat")
  switches=$(cat /proc/"$SPID"/task/*/status | awk '/^voluntary_ctxt/{v+=$2} /^nonvoluntary_ctxt/{n+=$2} END{print v, n}')
  io=$(awk '/^syscw|^syscr/{print $2}' "/proc/$SPID/io" | paste -sd' ')
  echo "${stat[11]} ${stat[12]} $switches $io ${stat[7]}"
}
before=$(snapshot)
out=$(wrk -t2 -c64 -d"${seconds}s" -s "$WORK/post.lua" "http://127.0.0.1:$APORT/orders")
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
