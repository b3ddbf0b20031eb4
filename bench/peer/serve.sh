# Sourced by profile.sh, kernel.sh and served.sh: builds peerbench and starts it in
# one mode on a free loopback port, with a private redis-server for the
# Redis modes, and stops both when the script exits.
#
#   . "$here/serve.sh"; serve MODE NAME   # sets WORK, APORT, SPID
#
# NAME names the private Redis' pid and log files under $WORK.
IDEM=$(cd "$here/../.." && pwd)
WORK=$IDEM/target/peer-bench
mkdir -p "$WORK"
CARGO_TARGET_DIR=$WORK/target cargo build --manifest-path "$here/Cargo.toml" --release \
  --ignore-rust-version -q --bin peerbench
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
RPORT=
SPID=
cleanup() {
  [ -n "$SPID" ] && { kill -INT "$SPID" 2>/dev/null || true; wait "$SPID" 2>/dev/null || true; }
  [ -n "$RPORT" ] && { redis-cli -p "$RPORT" shutdown nosave >/dev/null 2>&1 || true; }
  return 0
}
trap cleanup EXIT
serve() {  # serve MODE NAME
  local mode=$1 name=$2 args=("$1")
  APORT=$(free_port)
  case $mode in *redis)
    RPORT=$(free_port)
    redis-server --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
      --pidfile "$WORK/$name-redis.pid" --logfile "$WORK/$name-redis.log"
    for _ in $(seq 50); do redis-cli -p "$RPORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
    args+=("redis://127.0.0.1:$RPORT");;
  esac
  # SERVE_UNDER: words to start the server under (served.sh: valgrind),
  # which also gives it longer to come up.
  # shellcheck disable=SC2086 # SERVE_UNDER is words
  ${SERVE_UNDER:-} "$WORK/target/release/peerbench" "$APORT" "${args[@]}" 2>/dev/null & SPID=$!
  for _ in $(seq 600); do curl -s -o /dev/null "http://127.0.0.1:$APORT/count" && return 0; sleep 0.05; done
  echo "peerbench ($mode) did not answer" >&2
  return 1
}
