#!/usr/bin/env bash
# The outbox relay's throughput and lag (bench/README.md, "The outbox
# relay"): tests/benches/outbox_relay.rs on a private PostgreSQL and a
# private nats-server -js, in a release build.
#
#   bench/outbox.sh                      # 50,000 events; 2,500 a second for 10 s
#   EVENTS=100000 RATE=5000 bench/outbox.sh
#
# Needs PostgreSQL's binaries and nats-server. Traffic stays on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo bench -p idem-tests --bench outbox_relay
