# Sourced by bench/prologue.sh and bench/grpc.sh from the repository root:
# makes a work directory removed (with every background job killed) on
# exit, and gives free_port, private_redis and use_store.
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

