#!/usr/bin/env bash
# idem beside the strongest Rust peer, the crates.io `idempotent` 2.0.0 Tower
# layer, in ONE run: the same axum route bare, behind the peer's layer and
# behind idem's, on memory and on a private Redis, alternating in rounds.
#
#   bench/peer/run.sh
#
# Prints, per mode: req/s, p50/p99, and CPU microseconds per request of the
# app process and of redis-server (CPU per request is far steadier than req/s
# on a shared machine), Redis commands per request, the ratios of the medians
# to bare, and paired ratios (each round's idem run against its neighbour in
# the same round: the peer on Redis, bare in memory), median and range.
# Needs wrk, redis-server, redis-cli, curl, python3. Starts its own
# redis-server on a free loopback port and stops it at the end. Builds in
# $IDEM/target/peer-bench (the peer declares rust-version 1.98 and builds on
# 1.95 with --ignore-rust-version). Results: $IDEM/target/peer-bench/results.
# IDEM_RECORD_FORMAT=1 or 2: idem's Redis store writes that record format
# (format 3, a new key's record as one string, is the default); IDEM_LANES=N:
# its connections; IDEM_FINGERPRINT=blake3 and IDEM_SCOPE=blake3: idem hashes
# fingerprints and scopes with BLAKE3 (Fingerprints::format, scope_format);
# IDEM_TENANT=blake3 or hmac: the tenant from Authorization keyed with BLAKE3
# or HMAC-SHA256 (TenantFromAuthorization::keyed_as), else plain SHA-256.
# IDEM_SEALING=1: idem's Redis layer seals stored responses
# (IdempotencyLayer::sealing; off by default in the layer).
# Then a retry storm on Redis (storm.lua: 64 connections retrying a pool of
# STORM_KEYS keys, default 300; STORM_ROUNDS rounds, default 3, 0 skips it):
# the peer, idem, and idem without its replay cache (IDEM_REPLAY_CACHE=0),
# each with Redis commands per request, Redis and app CPU per request, p99.
# Last, the cost targets (bench/README.md, "The cost targets"): each met or
# short by how much, and for a mode with one unmet, the top ten functions of
# its profile under load (profile.sh; PROFILE=0 skips them).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
IDEM=$(cd "$here/../.." && pwd)
[ -f "$IDEM/crates/idem-layer/Cargo.toml" ] || { echo "run from the idem checkout, or set IDEM" >&2; exit 2; }
WORK=$IDEM/target/peer-bench
mkdir -p "$WORK"
cp "$here/post.lua" "$here/storm.lua" "$here/cmdstats.py" "$WORK/" 2>/dev/null || true
cd "$WORK"
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
RPORT=$(free_port)
APORT=$(free_port)
DUR=${DUR:-6s}
ROUNDS=${ROUNDS:-3}
BIN=./target/release/peerbench
OUTDIR=results
mkdir -p "$OUTDIR"
CARGO_TARGET_DIR=$WORK/target cargo build --manifest-path "$here/Cargo.toml" --release --ignore-rust-version -q

redis-server --port $RPORT --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
  --pidfile "$WORK/redis.pid" --logfile "$WORK/redis.log"
STARTED_REDIS=1
for i in $(seq 50); do redis-cli -p $RPORT ping >/dev/null 2>&1 && break; sleep 0.1; done
REDIS_URL=redis://127.0.0.1:$RPORT

SPID=
start_server() {  # start_server MODE [URL]
  $BIN $APORT "$@" 2>>"$OUTDIR/server.log" & SPID=$!
  for i in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$APORT/count" && return 0; sleep 0.05; done
  echo "server did not start" >&2; exit 1
}
stop_server() { kill -INT "$SPID" 2>/dev/null || true; wait "$SPID" 2>/dev/null || true; SPID=; }
cleanup() {
  [ -n "$SPID" ] && stop_server
  if [ $STARTED_REDIS = 1 ]; then redis-cli -p $RPORT shutdown nosave >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

# ---- correctness: same key twice, changed body, missing key ----
B='{"amount":100,"currency":"eur","items":[1,2,3]}'
H=(-H 'Content-Type: application/json' -H 'Authorization: Bearer bench')
for m in memory redis idem-memory idem-redis; do
  case $m in *redis) start_server $m $REDIS_URL;; *) start_server $m;; esac
  U=http://127.0.0.1:$APORT/orders; K="chk-$m-$RANDOM$RANDOM"
  {
    echo "=== correctness, mode $m, key $K"
    echo "--- 1st request";               curl -s -i "${H[@]}" -H "Idempotency-Key: $K" -d "$B" $U | grep -iv '^date'; echo
    echo "--- 2nd request, same key+body"; curl -s -i "${H[@]}" -H "Idempotency-Key: $K" -d "$B" $U | grep -iv '^date'; echo
    echo "--- same key, changed body";     curl -s -i "${H[@]}" -H "Idempotency-Key: $K" -d '{"amount":999}' $U | grep -iv '^date'; echo
    echo "--- no Idempotency-Key";         curl -s -i "${H[@]}" -d "$B" $U | grep -iv '^date'; echo
    echo "--- handler executions: $(curl -s http://127.0.0.1:$APORT/count) (expect 1)"
  } | tee -a "$OUTDIR/correctness.txt"
  stop_server
done

# CPU seconds used so far by the app process and by redis-server: CPU per
# request is steadier than throughput on a shared machine.
app_cpu() { awk -v t="$(getconf CLK_TCK)" '{printf "%.4f", ($14+$15)/t}' /proc/$SPID/stat; }
redis_cpu() { redis-cli -p $RPORT info cpu | tr -d '\r' | awk -F: '/^used_cpu_(sys|user):/{s+=$2} END{printf "%.4f", s}'; }

# ---- throughput: alternating bare, memory, bare, redis per round ----
: > "$OUTDIR/bench.tsv"
# IDEM_ALSO_FORMAT=N: each round also runs idem on Redis writing record
# format N (mode idem-redis-fN), paired against the same round's peer.
ALSO=${IDEM_ALSO_FORMAT:+idem-redis-f$IDEM_ALSO_FORMAT}
start_mode() {  # start_mode MODE: a fresh Redis for the Redis modes
  case $1 in
    idem-redis-f*) redis-cli -p $RPORT flushall >/dev/null
                   IDEM_RECORD_FORMAT=${1#idem-redis-f} start_server idem-redis $REDIS_URL;;
    *redis) redis-cli -p $RPORT flushall >/dev/null; start_server $1 $REDIS_URL;;
    *) start_server $1;;
  esac
}
for r in $(seq "$ROUNDS"); do
  for m in bare memory idem-memory bare redis idem-redis $ALSO; do
    start_mode $m
    f="$OUTDIR/wrk-r$r-$m-$(date +%s%N).txt"
    a0=$(app_cpu); r0=$(redis_cpu)
    wrk -t2 -c64 -d"$DUR" --latency -s post.lua "http://127.0.0.1:$APORT/orders" > "$f"
    a1=$(app_cpu); r1=$(redis_cpu)
    runs=$(curl -s "http://127.0.0.1:$APORT/count")
    stop_server
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$m" "$f" "$runs" \
      "$(python3 -c "print($a1-$a0)")" "$(python3 -c "print(round($r1-$r0,4))")" >> "$OUTDIR/bench.tsv"
    echo "round $r $m: $(grep Requests/sec "$f")"
  done
done

python3 - "$OUTDIR/bench.tsv" <<'PY' | tee "$OUTDIR/summary.txt"
import re, statistics, sys
def ms(v):
    m = re.match(r"([\d.]+)(us|ms|s)", v); x = float(m.group(1))
    return x / 1000 if m.group(2) == "us" else x * 1000 if m.group(2) == "s" else x
rows = []
for line in open(sys.argv[1]):
    r, mode, path, runs, app_s, redis_s = line.rstrip("\n").split("\t")
    t = open(path).read()
    total = int(re.search(r"(\d+) requests in", t).group(1))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1))
    p50 = ms(re.search(r"^\s+50%\s+(\S+)", t, re.M).group(1)); p99 = ms(re.search(r"^\s+99%\s+(\S+)", t, re.M).group(1))
    n2 = re.search(r"Non-2xx or 3xx responses: (\d+)", t); err = re.search(r"Socket errors: (.*)", t)
    app_us = float(app_s) * 1e6 / total
    redis_us = float(redis_s) * 1e6 / total if "redis" in mode else 0.0
    rows.append((int(r), mode, rps, p50, p99, int(n2.group(1)) if n2 else 0, err.group(1) if err else "-", app_us, redis_us))
print(f"{'round':>5} {'mode':<11} {'req/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'app us/req':>10} {'redis us/req':>12} {'non2xx':>7}  socket-errors")
for r in rows:
    print(f"{r[0]:>5} {r[1]:<11} {r[2]:>10.0f} {r[3]:>8.2f} {r[4]:>8.2f} {r[7]:>10.1f} {r[8]:>12.1f} {r[5]:>7}  {r[6]}")
med = {}
modes = ["bare", "memory", "idem-memory", "redis", "idem-redis"]
modes += sorted({r[1] for r in rows} - set(modes))
for mode in modes:
    sel = [r for r in rows if r[1] == mode]
    med[mode] = tuple(statistics.median(x[i] for x in sel) for i in (2, 3, 4, 7, 8))
    print(f"median {mode:<11} rps={med[mode][0]:.0f} p50={med[mode][1]:.2f}ms p99={med[mode][2]:.2f}ms "
          f"app={med[mode][3]:.1f}us/req redis={med[mode][4]:.1f}us/req (n={len(sel)})")
for mode in modes[1:]:
    print(f"median ratio {mode}/bare: rps {med[mode][0]/med['bare'][0]:.3f}  "
          f"p50 {med[mode][1]/med['bare'][1]:.2f}x  p99 {med[mode][2]/med['bare'][2]:.2f}x")
# Paired ratios: each round's run against its neighbour of the same round
# (idem on Redis against the peer's run just before it; a memory mode
# against the round's first bare run), so the hour's drift between rounds
# cancels; the median over rounds and the range.
by = {}
for r in rows:
    by.setdefault((r[0], r[1]), r)
def paired(name, num, den, field):
    ratios = [by[(n, num)][field] / by[(n, den)][field]
              for n in sorted({r[0] for r in rows})
              if (n, num) in by and (n, den) in by and by[(n, den)][field] > 0]
    if ratios:
        print(f"paired {name}: median {statistics.median(ratios):.3f}, "
              f"rounds {min(ratios):.3f} to {max(ratios):.3f} (n={len(ratios)})")
        return statistics.median(ratios)
rps = paired("idem-redis/redis req/s", "idem-redis", "redis", 2)
app = paired("idem-redis/redis app CPU", "idem-redis", "redis", 7)
rcpu = paired("idem-redis/redis Redis CPU", "idem-redis", "redis", 8)
for mode in modes[5:]:
    for name, field in (("req/s", 2), ("app CPU", 7), ("Redis CPU", 8), ("p99", 4)):
        paired(f"{mode}/redis {name}", mode, "redis", field)
mem = paired("idem-memory/bare req/s", "idem-memory", "bare", 2)
paired("idem-memory/bare app CPU", "idem-memory", "bare", 7)
paired("memory/bare req/s", "memory", "bare", 2)
# The cost targets (bench/README.md, "The cost targets") on these paired
# medians, on idem's defaults: met, or short by how much; the modes whose
# targets are not met are profiled after the summary (where the time goes).
unmet = set()
def target(name, value, goal, higher, mode):
    if value is None:
        return
    met = value >= goal if higher else value <= goal
    gap = goal / value - 1 if higher else value / goal - 1
    bound = "at least" if higher else "at most"
    print(f"target {name}: {value:.3f}, {bound} {goal}: " + ("met" if met else f"short by {gap:.1%}"))
    if not met:
        unmet.add(mode)
def over_bare(mode):
    return med[mode][3] - med["bare"][3]
target("memory req/s against bare", mem, 0.7, True, "idem-memory")
if over_bare("memory") > 0:
    target("memory: the layer's own app CPU against the peer's", over_bare("idem-memory") / over_bare("memory"), 0.4, False, "idem-memory")
target("Redis req/s against the peer", rps, 1.5, True, "idem-redis")
target("Redis app CPU against the peer", app, 0.7, False, "idem-redis")
client = med["idem-redis"][3] - med["idem-memory"][3]
peer_client = med["redis"][3] - med["memory"][3]
if peer_client > 0:
    target("Redis: the client path in process against the peer's", client / peer_client, 1.0, False, "idem-redis")
target("Redis Redis CPU against the peer", rcpu, 0.5, False, "idem-redis")
target("p99 in memory against the peer", med["idem-memory"][2] / med["memory"][2], 1.0, False, "idem-memory")
target("p99 on Redis against the peer", med["idem-redis"][2] / med["redis"][2], 1.0, False, "idem-redis")
print("unmet-modes: " + " ".join(sorted(unmet)))
bare_app = med["bare"][3]
for mode in ("redis", "idem-redis", "idem-memory"):
    app_us, redis_us = med[mode][3], med[mode][4]
    print(f"time per request, {mode}: app CPU {app_us:.1f} us ({app_us - bare_app:.1f} over bare's "
          f"{bare_app:.1f}: the layer, its store client and the kernel's share of its round trips), "
          f"Redis CPU {redis_us:.1f} us")
PY

# ---- retry storm: a pool of keys retried by every connection ----
STORM_ROUNDS=${STORM_ROUNDS:-3}
: > "$OUTDIR/storm.tsv"
redis_calls() { redis-cli -p $RPORT info commandstats | tr -d '\r' | awk -F'[=,:]' '/^cmdstat_/ && !/^cmdstat_info:/{s+=$3} END{print s+0}'; }
for r in $(seq "$STORM_ROUNDS"); do
  for m in redis idem-redis idem-redis-nocache $ALSO; do
    redis-cli -p $RPORT flushall >/dev/null
    case $m in
      idem-redis-nocache) IDEM_REPLAY_CACHE=0 start_server idem-redis $REDIS_URL;;
      *) start_mode $m;;
    esac
    f="$OUTDIR/storm-r$r-$m-$(date +%s%N).txt"
    export STORM_PREFIX="storm-$r-$m-$RANDOM"
    a0=$(app_cpu); r0=$(redis_cpu); c0=$(redis_calls)
    wrk -t2 -c64 -d"$DUR" --latency -s storm.lua "http://127.0.0.1:$APORT/orders" > "$f"
    a1=$(app_cpu); r1=$(redis_cpu); c1=$(redis_calls)
    runs=$(curl -s "http://127.0.0.1:$APORT/count")
    stop_server
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$m" "$f" "$runs" \
      "$(python3 -c "print($a1-$a0)")" "$(python3 -c "print(round($r1-$r0,4))")" "$((c1-c0))" >> "$OUTDIR/storm.tsv"
    echo "storm round $r $m: $(grep Requests/sec "$f"), handler runs $runs"
  done
done
[ "$STORM_ROUNDS" -gt 0 ] && python3 - "$OUTDIR/storm.tsv" <<'PY' | tee "$OUTDIR/storm-summary.txt"
import re, statistics, sys
def ms(v):
    m = re.match(r"([\d.]+)(us|ms|s)", v); x = float(m.group(1))
    return x / 1000 if m.group(2) == "us" else x * 1000 if m.group(2) == "s" else x
rows = {}
for line in open(sys.argv[1]):
    r, mode, path, runs, app_s, redis_s, calls = line.rstrip("\n").split("\t")
    t = open(path).read()
    total = int(re.search(r"(\d+) requests in", t).group(1))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1))
    p99 = ms(re.search(r"^\s+99%\s+(\S+)", t, re.M).group(1))
    rows.setdefault(mode, []).append((rps, p99, float(app_s) * 1e6 / total,
                                      float(redis_s) * 1e6 / total, int(calls) / total, int(runs)))
print(f"{'storm mode':<19} {'req/s':>9} {'p99 ms':>7} {'app us/req':>10} {'redis us/req':>12} {'cmds/req':>8} {'runs':>5}")
med = {}
for mode, sel in rows.items():
    med[mode] = [statistics.median(x[i] for x in sel) for i in range(6)]
    m = med[mode]
    print(f"{mode:<19} {m[0]:>9.0f} {m[1]:>7.2f} {m[2]:>10.1f} {m[3]:>12.2f} {m[4]:>8.3f} {m[5]:>5.0f}")
if "redis" in med and "idem-redis" in med:
    i, p = med["idem-redis"], med["redis"]
    print(f"idem/peer in the storm: req/s {i[0]/p[0]:.2f}x, app CPU {i[2]/p[2]:.2f}x, "
          f"Redis CPU {i[3]/max(p[3], 1e-9):.2f}x, p99 {i[1]/p[1]:.2f}x")
PY

# ---- Redis commands per request (1000 sequential new keys, then 1000 replays) ----
redis-cli -p $RPORT flushall >/dev/null
: > "$OUTDIR/cmdstats.txt"
for m in redis idem-redis; do
  redis-cli -p $RPORT flushall >/dev/null
  start_server $m $REDIS_URL
  echo "### $m" | tee -a "$OUTDIR/cmdstats.txt"
  python3 cmdstats.py $APORT $RPORT 1000 | tee -a "$OUTDIR/cmdstats.txt"
  stop_server
done

# ---- where the time goes, for each mode whose cost targets are not met ----
# The top ten functions by self time under load (profile.sh: perf's
# software clock while wrk drives the mode, the kernel's share included).
# PROFILE=0 skips it.
if [ "${PROFILE:-1}" != 0 ]; then
  for m in $(awk '/^unmet-modes:/ { $1 = ""; print }' "$OUTDIR/summary.txt"); do
    echo "### where the time goes: $m (a cost target is not met)"
    bash "$here/profile.sh" "$m" 10 \
      || echo "(profile.sh failed: perf is needed; bench/peer/inproc.sh counts instructions without it)"
  done
fi
