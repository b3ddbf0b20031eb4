# Sourced by bench/load.sh, bench/records.sh, bench/fill.sh,
# bench/gateway_instructions.sh and bench/gateway_profile.sh from the
# repository root: checks for wrk, builds the release binaries they start,
# sources bench/servers.sh (the work directory, free_port, private_redis,
# use_store), and gives them start_upstream, start_gateway, wait_served,
# check_order and gateway_flags.
command -v wrk >/dev/null || { echo "wrk is not installed (apt-get install wrk)" >&2; exit 1; }
cargo build --release -q -p axum-orders -p idem-gateway --features axum-orders/bench
bin=target/release/axum-orders
gateway=target/release/idem-gateway
. bench/servers.sh

# Starts a bare axum-orders upstream on a free port (a job, stopped on
# exit): sets upstream_port and upstream_pid.
start_upstream() {
  upstream_port=$(free_port)
  IDEM_LISTEN=127.0.0.1:$upstream_port IDEM_LAYER=off "$bin" >"$work/upstream.log" 2>&1 &
  upstream_pid=$!
}

# Waits (at most about 10 s) until the server on port $1 answers; exits
# with the servers' logs if it never does.
wait_served() {
  for _ in $(seq 100); do
    curl -s -o /dev/null "http://127.0.0.1:$1/orders/0" && return 0
    sleep 0.1
  done
  echo "nothing answered on port $1; see the logs:" >&2
  cat "$work"/*.log >&2
  exit 1
}

# Starts a gateway on port $1 in front of the upstream (start_upstream),
# with gateway_flags $2 (`layered` or `pass`), logging to $work/$3.log (a
# job, stopped on exit): sets gateway_pid.
start_gateway() {
  # shellcheck disable=SC2046 # the flags are words
  RUST_LOG=warn "$gateway" --listen "127.0.0.1:$1" --upstream "http://127.0.0.1:$upstream_port" \
    $(gateway_flags "$2") >"$work/$3.log" 2>&1 &
  gateway_pid=$!
}

# One order through the server on port $1 before measuring: a server or
# upstream that did not come up would otherwise be measured answering
# errors. Exits with the servers' logs unless it is created.
check_order() {
  local status
  status=$(curl -s -o /dev/null -w '%{http_code}' -X POST "http://127.0.0.1:$1/orders" \
    -H 'Authorization: Bearer bench' -H "Idempotency-Key: check-$1-$$" \
    -H 'Content-Type: application/json' -d '{"sku":"check","qty":1}')
  if [ "$status" != 201 ]; then
    echo "the server on port $1 answered $status to an order; see its log:" >&2
    cat "$work"/*.log >&2
    exit 1
  fi
}

# The gateway's flags as the benches start it (prints words, to be used
# unquoted): `layered` is the layer on `$store_url` for one caller (no
# tenant quota, room for every record), then LAYERED_FLAGS; anything else
# passes every POST straight through (`--methods PUT`).
gateway_flags() {
  if [ "$1" = layered ]; then
    echo "--store $store_url --memory-tenant-quota 0 --memory-capacity 10000000 --memory-max-bytes 16GiB ${LAYERED_FLAGS:-}"
  else
    echo "--methods PUT"
  fi
}
