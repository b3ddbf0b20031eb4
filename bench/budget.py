#!/usr/bin/env python3
"""The cost budget's check, run by bench/budget.sh (which builds the
counting binary and starts a private Redis first).

For every path in bench/budget.toml: run `idem-budget PATH N` under
callgrind, collecting only inside `budget_window` (N requests after a
warm-up), and read its allocations from the line it prints. Then:

* over budget: instructions above `instructions * (1 + band)`, or
  allocations above `allocations * (1 + band)` (and at least one more):
  fail, with the path's ten costliest functions;
* drift: instructions above the last release's figure by more than
  `[rules] drift`: fail, even inside the band;
* ratchet: instructions below `instructions * (1 - ratchet)`: `check`
  fails and says to lock the gain in; `ratchet` writes the lower figure.

A budget is never raised by this script: raising one is a commit of its
own that says why in bench/HISTORY.md.
"""

import os
import re
import subprocess
import sys
import tempfile
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
BUDGET = os.path.join(HERE, "budget.toml")


def count(binary, path, requests, work):
    """Instructions and allocations per request of one path."""
    out = os.path.join(work, f"callgrind.{path}")
    run = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--toggle-collect=*budget_window*",
            f"--callgrind-out-file={out}",
            binary,
            path,
            str(requests),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        sys.exit(f"{path}: idem-budget failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
    collected = re.search(r"Collected : (\d+)", run.stderr)
    line = re.search(r"BUDGET path=\S+ requests=(\d+) allocations=(\d+) ok=(\d+)", run.stdout)
    if not collected or not line:
        sys.exit(f"{path}: no figures in the output:\n{run.stdout}\n{run.stderr}")
    n = int(line.group(1))
    return int(collected.group(1)) / n, int(line.group(2)) / n, out


def top_functions(profile):
    """The ten functions a profile spent most instructions in, themselves."""
    run = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", profile],
        capture_output=True,
        text=True,
        check=False,
    )
    rows = [l for l in run.stdout.splitlines() if re.match(r"^\s*[\d,]+ \(", l)]
    return "\n".join(rows[1:11])


def write_budget(text, path, figure):
    """`text` with `path`'s instruction budget set to `figure`."""
    pattern = re.compile(rf"(\[paths\.{re.escape(path)}\][^\[]*?\ninstructions = )(\d+)", re.S)
    return pattern.sub(lambda m: m.group(1) + str(figure), text, count=1)


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "check"
    if mode not in ("check", "measure", "ratchet"):
        sys.exit("usage: bench/budget.sh [check|measure|ratchet] [PATH…]")
    with open(BUDGET, "rb") as f:
        budget = tomllib.load(f)
    rules = budget["rules"]
    wanted = sys.argv[2:] or list(budget["paths"])
    binary = os.environ["IDEM_BUDGET_BIN"]
    failures, lower = [], {}
    measured = budget.get("measured", {})
    print(f"budgets measured {measured.get('date', '?')} with {measured.get('toolchain', '?')} "
          f"on {measured.get('host', '?')}")
    print(f"{'path':<15}{'instr/req':>11}{'budget':>11}{'vs':>8}{'release':>9}"
          f"{'allocs/req':>12}{'budget':>8}  verdict")
    with tempfile.TemporaryDirectory() as work:
        for path in wanted:
            spec = budget["paths"].get(path)
            if spec is None:
                sys.exit(f"{path}: not in {BUDGET}")
            instr, allocs, profile = count(binary, path, spec["requests"], work)
            limit = spec["instructions"]
            band = spec.get("band", rules["band"])
            ratchet = spec.get("ratchet", rules["ratchet"])
            release = spec.get("release", limit)
            alloc_limit = spec["allocations"]
            verdicts = []
            if instr > limit * (1 + band):
                verdicts.append(f"over budget by {instr / limit - 1:+.1%} (band {band:.0%})")
            if allocs > max(alloc_limit * (1 + band), alloc_limit + 1):
                verdicts.append(f"allocations over budget ({allocs:.1f} > {alloc_limit})")
            if instr > release * (1 + rules["drift"]):
                verdicts.append(
                    f"drifted {instr / release - 1:+.1%} since the release's {release} "
                    f"(at most {rules['drift']:.0%})")
            under = instr < limit * (1 - ratchet)
            if under:
                lower[path] = int(instr * (1 + band / 2))
                verdicts.append(f"well under budget ({instr / limit - 1:+.1%}): "
                                f"ratchet to {lower[path]}")
            print(f"{path:<15}{instr:>11.0f}{limit:>11}{instr / limit - 1:>+8.1%}"
                  f"{instr / release - 1:>+9.1%}{allocs:>12.1f}{alloc_limit:>8}  "
                  f"{'; '.join(verdicts) or 'ok'}", flush=True)
            hard = [v for v in verdicts if not v.startswith("well under")]
            if hard or (under and mode == "check"):
                failures.append(path)
            if hard:
                print(f"  where {path}'s instructions go (self):\n{top_functions(profile)}")
    if mode == "ratchet" and lower:
        with open(BUDGET) as f:
            text = f.read()
        for path, figure in lower.items():
            text = write_budget(text, path, figure)
        with open(BUDGET, "w") as f:
            f.write(text)
        print(f"lowered {', '.join(lower)} in {BUDGET}")
    if mode == "measure":
        return
    if failures:
        sys.exit(f"cost budget: {', '.join(failures)} failed (bench/README.md, 'The cost budget')")
    print("cost budget: every path within its budget")


if __name__ == "__main__":
    main()
