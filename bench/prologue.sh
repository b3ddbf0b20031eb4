# Sourced by bench/load.sh and bench/records.sh from the repository root:
# checks for wrk, builds the release binaries they start, and makes a
# work directory removed (with every background job killed) on exit.
command -v wrk >/dev/null || { echo "wrk is not installed (apt-get install wrk)" >&2; exit 1; }
cargo build --release -q -p axum-orders -p idem-gateway
bin=target/release/axum-orders
gateway=target/release/idem-gateway
work=$(mktemp -d)
# Waits for the jobs before removing: a server killed mid-write (redis-server's
# log) would otherwise leave a file behind.
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
