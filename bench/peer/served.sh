#!/usr/bin/env bash
# Instructions per request served over HTTP: peerbench in one mode at a
# time under valgrind's callgrind, driven by wrk (2 connections, a fresh
# key per POST) through real sockets, hyper and tokio. The counters are
# zeroed after a 2 s warm-up and dumped after SECONDS, and the count is
# divided by the requests wrk saw answered in that window. Beside
# inproc.sh (no sockets) this shows whether the served path costs a layer
# anything the in-process count misses: a timer, an extra poll, a system
# call. Steady whatever the machine's load, like inproc.sh.
#
#   bench/peer/served.sh [seconds] [mode ...]   (default: 8 bare idem-memory memory)
#
# The IDEM_* variables of run.sh apply. Needs valgrind (callgrind_control),
# wrk, curl, python3, and redis-server for the Redis modes.
set -euo pipefail
seconds=${1:-8}
shift || true
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(bare idem-memory memory)
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
printf '%-12s %14s %10s\n' mode instr/request requests
for mode in "${modes[@]}"; do
  (
    SERVE_UNDER="valgrind --tool=callgrind --callgrind-out-file=$out/$mode.%p"
    . "$here/serve.sh"
    serve "$mode" served
    url="http://127.0.0.1:$APORT/orders"
    wrk -t1 -c2 -d2s -s "$here/post.lua" "$url" >/dev/null
    callgrind_control -z "$SPID" >/dev/null 2>&1
    answered=$(wrk -t1 -c2 -d"${seconds}s" -s "$here/post.lua" "$url" | awk '/requests in/ {print $1}')
    callgrind_control -d "$SPID" >/dev/null 2>&1
    total=$(awk '/^totals:/ {print $2}' "$out/$mode".*.1)
    printf '%-12s %14d %10d\n' "$mode" $((total / answered)) "$answered"
  )
done
