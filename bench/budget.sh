#!/usr/bin/env bash
# The cost budget: instructions and allocations per request of every path
# users pay (bench/budget/src/paths.rs), counted in process under valgrind's
# callgrind, checked against bench/budget.toml. CI runs `bench/budget.sh
# check`; see bench/README.md ("The cost budget") for the rules.
#   bench/budget.sh check [PATH…]    fail when a path is over its budget, or
#                                    well under it (lower it: ratchet)
#   bench/budget.sh measure [PATH…]  print the figures, check nothing
#   bench/budget.sh ratchet [PATH…]  lower every budget a path came in well
#                                    under to its new figure (never raises)
# Needs valgrind, redis-server and python3 (3.11: tomllib).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/servers.sh

cargo build --release --locked -q -p idem-budget
private_redis
export REDIS_URL=$store_url
export IDEM_BUDGET_BIN=target/release/idem-budget
# The gateway reads IDEM_* settings from the environment: none may leak in.
while read -r name; do unset "$name"; done < <(env | awk -F= '/^IDEM_/ && $1 != "IDEM_BUDGET_BIN" {print $1}')
python3 bench/budget.py "$@"
