#!/usr/bin/env bash
# Instructions per request, in process, under valgrind's callgrind: the same
# axum route driven N times through tower's oneshot (no sockets), bare, behind
# the peer's layer and behind idem's, memory stores. Instruction counts do not
# move with the machine's load, so two runs of the same code agree closely.
#   bench/peer/inproc.sh   (IDEM_FINGERPRINT=blake3: idem writes BLAKE3 fingerprints;
#                           IDEM_SCOPE=blake3: idem hashes scopes with BLAKE3;
#                           IDEM_TENANT=blake3 or hmac: the tenant from Authorization
#                           keyed with BLAKE3 or HMAC-SHA256, else plain SHA-256)
# Each figure is (count at N=6000 - count at N=1000) / 5000: start-up cancels.
# Caveat: valgrind does not run SHA-NI, so SHA-256 counts as software here.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
IDEM=$(cd "$here/../.." && pwd)
WORK=$IDEM/target/peer-bench
mkdir -p "$WORK"
cp "$here/post.lua" "$here/cmdstats.py" "$WORK/" 2>/dev/null || true
cd "$WORK"
CARGO_TARGET_DIR=$WORK/target cargo build --manifest-path "$here/Cargo.toml" --release --ignore-rust-version -q --bin inproc
# A private redis-server for the Redis modes (only this process's
# instructions are counted; Redis's are not).
RPORT=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
redis-server --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
  --pidfile "$WORK/inproc-redis.pid" --logfile "$WORK/inproc-redis.log"
trap 'redis-cli -p "$RPORT" shutdown nosave >/dev/null 2>&1 || true' EXIT
for _ in $(seq 50); do redis-cli -p "$RPORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
export REDIS_URL=redis://127.0.0.1:$RPORT
count() { valgrind --tool=callgrind --callgrind-out-file=/dev/null ./target/release/inproc "$@" 2>&1 \
  | awk '/Collected/{print $4}'; }
printf '%-12s %-7s %12s %12s\n' mode path instr/req over-bare
for path in new replay; do
  base=0
  for mode in bare memory idem-memory redis idem-redis; do
    a=$(count "$mode" 1000 "$path"); b=$(count "$mode" 6000 "$path")
    per=$(( (b - a) / 5000 )); [ "$mode" = bare ] && base=$per
    printf '%-12s %-7s %12d %12d\n' "$mode" "$path" "$per" $(( per - base ))
  done
done
