#!/usr/bin/env bash
# Redis instructions per script call, counted by valgrind's callgrind inside
# a private redis-server: steady whatever the machine's load, unlike the
# microseconds of INFO commandstats (bench/lua_cost.sh). The scripts are
# assembled as idem-redis assembles them and sent pipelined on one
# connection, N calls per row (default 2000): a new-key reservation, its
# completion, a replay of the completed key (the "idem" rows: record
# format 2's scripts). With the peer's Lua scripts
# (the crates.io `idempotent` 2.0.0 crate, found in cargo's registry once
# bench/peer has been built), the same rows for the peer: its claim,
# completion and replay. The "native" rows: the floor, one native SET NX PX
# GET of a 300-byte string. The "v3" rows: record format 3 (the default), a
# new key's record as one string, reserved and replayed by that native
# command and completed by complete_string.lua. The "v1" rows: the same
# calls by a store that writes record format 1
# (RedisStoreBuilder::record_format).
#   bench/redis_instructions.sh [calls]
# Needs valgrind, redis-server, redis-cli, python3.
set -euo pipefail
calls=${1:-2000}
cd "$(dirname "$0")/.."
lua=crates/idem-redis/src/lua
work=$(mktemp -d)
port=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
. bench/lua_assemble.sh
assemble "$work/reserve.lua" "$lua/reserve.lua"
assemble "$work/complete.lua" "$lua/complete.lua"
assemble "$work/reserve-v1.lua" "$lua/reserve.lua" 1
assemble "$work/complete-v1.lua" "$lua/complete.lua" 1
peer=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/idempotent-2.0.0/valkey 2>/dev/null | head -1 || true)

valgrind --tool=callgrind --callgrind-out-file="$work/cg.%p" redis-server --port "$port" \
  --bind 127.0.0.1 --save "" --appendonly no >"$work/valgrind.log" 2>&1 &
pid=$!  # valgrind runs the server in this very process
trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; sleep 1; [ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.2; done

python3 - "$port" "$pid" "$work" "$calls" "$peer" <<'PY'
import glob, os, re, socket, subprocess, sys, time
port, pid, work, n, peer = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]

def cli(*args, stdin=None):
    return subprocess.run(["redis-cli", "-p", str(port), *args], input=stdin,
                          capture_output=True, text=True, check=True).stdout.strip()

def resp(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)

def pipelined(commands):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"".join(commands) + resp("PING"))
    buf = b""
    while not buf.endswith(b"+PONG\r\n"):
        buf += s.recv(1 << 20)
    s.close()
    return buf

def instructions():
    subprocess.run(["callgrind_control", "-d", pid], capture_output=True, check=True)
    newest = max(glob.glob(f"{work}/cg.{pid}.*"), key=os.path.getmtime)
    text = open(newest).read()
    return int(re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M).group(1))

def per_command(args, expect):
    """Instructions per command, over n pipelined commands args(0..n)."""
    commands = [resp(*args(i)) for i in range(n)]
    subprocess.run(["callgrind_control", "-z", pid], capture_output=True, check=True)
    replies = pipelined(commands)
    count = instructions() / n
    if replies.count(expect.encode()) < n:
        sys.exit(f"{args(0)[:2]}: expected {n} replies with {expect!r}")
    return count

def per_call(script, args, expect):
    sha = cli("-x", "SCRIPT", "LOAD", stdin=open(script).read())
    return per_command(lambda i: ("EVALSHA", sha, *args(i)), expect)

fp = "f" * 64
attempt, token = "1" * 8 + "-1111-1111-1111-111111111111", "2" * 8 + "-2222-2222-2222-222222222222"
tenant = "auth:" + "a" * 32
run = str(time.time_ns())
key = lambda i: f"idem:{{{run}-{i}}}"
reserve = lambda i: (1, key(i), fp, attempt, token, 30000, 86400000, tenant, "POST /orders",
                     "order-1")
rows = [
    ("idem", "new key", per_call(f"{work}/reserve.lua", reserve, ":1\r\n")),
    ("idem", "completion", per_call(f"{work}/complete.lua", lambda i: (
        1, key(i), 1, token, attempt, "201:1", "content-type: application/json", '{"id":"1"}', "1700000000000"),
        ":1\r\n")),
    ("idem", "replay", per_call(f"{work}/reserve.lua", reserve, "201:1:")),
]
# A response over 64 bytes is kept in a key of its own beside the record.
big = lambda i: f"idem:{{{run}-big-{i}}}"
reserve_big = lambda i: (1, big(i), fp, attempt, token, 30000, 86400000, tenant, "POST /orders",
                         "order-1")
per_call(f"{work}/reserve.lua", reserve_big, ":1\r\n")
body = '{"id":"1","items":[' + ",".join(['{"sku":"book","qty":1}'] * 8) + "]}"
rows.append(("idem", "completion, 200-byte body", per_call(f"{work}/complete.lua", lambda i: (
    1, big(i), 1, token, attempt, "201:1", "content-type: application/json", body, "1700000000000"),
    ":1\r\n")))
rows.append(("idem", "replay, 200-byte body",
             per_call(f"{work}/reserve.lua", reserve_big, "201:1:")))
# The same calls by a store that writes record format 1 (record_format).
v1 = lambda i: f"idem:{{{run}-v1-{i}}}"
reserve_v1 = lambda i: (1, v1(i), fp, attempt, token, 30000, 86400000, tenant,
                        "POST /orders", "order-1")
rows += [
    ("v1", "new key", per_call(f"{work}/reserve-v1.lua", reserve_v1, ":1\r\n")),
    ("v1", "completion", per_call(f"{work}/complete-v1.lua", lambda i: (
        1, v1(i), 1, token, attempt, "201:1", "content-type: application/json", '{"id":"1"}', "1700000000000"),
        ":1\r\n")),
    ("v1", "replay", per_call(f"{work}/reserve-v1.lua", reserve_v1, "201:1:")),
]
# The floor: a record kept as one string, reserved by one native command
# (SET NX GET answers nil for a new key, the record for a retry).
native = lambda i: ("SET", f"n:{{{run}-{i}}}", "r" * 300, "NX", "PX", 86400000, "GET")
rows += [
    ("native", "new key", per_command(native, "$-1\r\n")),
    ("native", "replay", per_command(native, "$300\r\n")),
]
# Record format 3 (the default): the record kept as one string,
# reserved and replayed by that native command, completed by
# complete_string.lua (a compare-and-set on the state byte and the owner
# token, the completed record set in its place, KEEPTTL). The record as
# string_record.rs writes it.
cas = os.path.join(work, "complete_string.lua")
open(cas, "w").write(open("crates/idem-redis/src/lua/complete_string.lua").read()
                     .replace("@NOTIFY@", "true"))
processing = ("3p" + token + attempt + fp + "1700000000000:30000:86400000:"
              + f"t{len(tenant)}:{tenant}" + "12:POST /orders" + "7:order-1")
headers = "\x01\x0ccontent-type\x10application/json"
def tail(body):
    return f"201:1:1700000000500:{len(headers)}:" + headers + body
v3 = lambda i: ("SET", f"s:{{{run}-{i}}}", processing, "NX", "PX", 86400000, "GET")
v3_big = lambda i: ("SET", f"s:{{{run}-big-{i}}}", processing, "NX", "PX", 86400000, "GET")
rows += [
    ("v3", "new key", per_command(v3, "$-1\r\n")),
    ("v3", "completion", per_call(cas, lambda i: (1, f"s:{{{run}-{i}}}", token,
                                                  tail('{"id":"1"}')), ":1\r\n")),
    ("v3", "replay", per_command(v3, "$%d\r\n" % (len(processing) + len(tail('{"id":"1"}'))))),
]
per_command(v3_big, "$-1\r\n")
rows.append(("v3", "completion, 200-byte body", per_call(cas, lambda i: (
    1, f"s:{{{run}-big-{i}}}", token, tail(body)), ":1\r\n")))
rows.append(("v3", "replay, 200-byte body",
             per_command(v3_big, "$%d\r\n" % (len(processing) + len(tail(body))))))
if peer:
    data = "x" * 120
    pkey = lambda i: f"p:{{{run}-{i}}}"
    claim = lambda i: (2, pkey(i), pkey(i) + ":c", data, 86400000, fp)
    rows.append(("peer", "new key", per_call(f"{peer}/claim.lua", claim, "created")))
    run_id = cli("HGET", pkey(0), "run_id")
    # Each key has a counter of its own: the first claim's token is 1.
    complete = lambda i: (1, pkey(i), data + "y" * 40, run_id, "1", 86400000, fp)
    rows.append(("peer", "completion", per_call(f"{peer}/complete.lua", complete, ":0")))
    rows.append(("peer", "replay", per_call(f"{peer}/claim.lua", claim, "complete")))
print(f"{'layer':<6} {'call':<26} {'instructions/call':>18}")
for layer, call, count in rows:
    print(f"{layer:<6} {call:<26} {count:>18.0f}")
for layer in ("idem", "v1", "v3", "peer", "native"):
    got = {call: count for l, call, count in rows if l == layer}
    if got and "completion" not in got:
        print(f"{layer}: new key {got['new key']:.0f}, replay {got['replay']:.0f}")
    elif got:
        print(f"{layer}: new key + completion {got['new key'] + got['completion']:.0f}, "
              f"replay {got['replay']:.0f}")
PY
