"""The latency probe of bench/fill.sh: one keyed POST every 20 ms on its
own connection to the gateway at 127.0.0.1:PORT, for SECONDS, each
request's start (CLOCK_MONOTONIC, the clock `perf record -k
CLOCK_MONOTONIC` stamps its samples with) and latency in ms written to
OUT; beside it, every 100 ms, the gateway's and the upstream's CPU ticks,
minor faults and RSS from /proc, to OUT.proc.

usage: python3 bench/fill_probe.py PORT SECONDS OUT GATEWAY_PID UPSTREAM_PID
"""
import http.client
import os
import sys
import threading
import time

port, seconds, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
pids = {"gateway": sys.argv[4], "upstream": sys.argv[5]}
stop = time.monotonic() + seconds


def process(pid):
    """utime stime minflt rss_kb of a process, or zeros once it is gone."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        rss = next(l.split()[1] for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS"))
        return f"{fields[11]} {fields[12]} {fields[7]} {rss}"
    except (OSError, StopIteration):
        return "0 0 0 0"


def sample():
    with open(out + ".proc", "w") as f:
        while time.monotonic() < stop:
            now = time.monotonic()
            f.write(f"{now:.4f} " + " ".join(f"{name} {process(pid)}" for name, pid in pids.items()) + "\n")
            time.sleep(0.1)


sampler = threading.Thread(target=sample)
sampler.start()
connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
n = 0
with open(out, "w") as f:
    while time.monotonic() < stop:
        n += 1
        started = time.monotonic()
        try:
            connection.request("POST", "/orders", body='{"sku":"probe","qty":1}', headers={
                "Authorization": "Bearer bench",
                "Idempotency-Key": f"probe-{os.getpid()}-{n}",
                "Content-Type": "application/json",
            })
            response = connection.getresponse()
            response.read()
            status = response.status
        except (OSError, http.client.HTTPException):
            status = 0
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        took = time.monotonic() - started
        f.write(f"{started:.4f} {1000 * took:.2f} {status}\n")
        time.sleep(max(0.0, 0.02 - took))
sampler.join()
