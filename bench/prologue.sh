# Sourced by bench/load.sh, bench/records.sh, bench/fill.sh,
# bench/gateway_instructions.sh and bench/gateway_profile.sh from the
# repository root: checks for wrk, builds the release binaries they start,
# makes a work directory removed (with every background job killed) on
# exit, and gives them free_port, private_redis, use_store, start_upstream,
# start_gateway, wait_served, check_order and gateway_flags.
command -v wrk >/dev/null || { echo "wrk is not installed (apt-get install wrk)" >&2; exit 1; }
cargo build --release -q -p axum-orders -p idem-gateway --features axum-orders/bench
bin=target/release/axum-orders
gateway=target/release/idem-gateway
work=$(mktemp -d)
# Waits for the jobs before removing: a server killed mid-write (redis-server's
# log) would otherwise leave a file behind.
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

# A free loopback port, chosen now: a fixed port can be some connection's
# ephemeral port after a heavy run, and a server that cannot bind would
# leave a bench measuring refusals.
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

# Starts a private redis-server on a free port (a job, stopped on exit;
# never the shared one on 6379) and waits for it: sets redis_port and
# store_url.
private_redis() {
  redis_port=$(free_port)
  redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
    --dir "$work" --logfile "$work/redis.log" &
  for _ in $(seq 50); do
    redis-cli -p "$redis_port" ping 2>/dev/null | grep -q PONG && break
    sleep 0.1
  done
  store_url="redis://127.0.0.1:$redis_port"
}

# The layered gateway's store: `memory`, or `redis` (a private
# redis-server, see private_redis). Sets store_url.
use_store() {
  store_url=memory
  if [ "$1" = redis ]; then
    private_redis
  fi
}

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
