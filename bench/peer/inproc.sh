#!/usr/bin/env bash
# Instructions per request, in process, under valgrind's callgrind: the same
# axum route driven N times through tower's oneshot (no sockets), bare, behind
# the peer's layer and behind idem's, memory stores. Instruction counts do not
# move with the machine's load, so two runs of the same code agree closely.
#   bench/peer/inproc.sh
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
count() { valgrind --tool=callgrind --callgrind-out-file=/dev/null ./target/release/inproc "$@" 2>&1 \
  | awk '/Collected/{print $4}'; }
printf '%-12s %-7s %12s %12s\n' mode path instr/req over-bare
for path in new replay; do
  base=0
  for mode in bare memory idem-memory; do
    a=$(count "$mode" 1000 "$path"); b=$(count "$mode" 6000 "$path")
    per=$(( (b - a) / 5000 )); [ "$mode" = bare ] && base=$per
    printf '%-12s %-7s %12d %12d\n' "$mode" "$path" "$per" $(( per - base ))
  done
done
