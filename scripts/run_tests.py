#!/usr/bin/env python3
"""Runs test binaries that cargo built, several at once, and says how long each took.

`cargo test` runs a workspace's test binaries one after another; the end-to-end ones (a real
daemon, real runsc sandboxes, real brokers) spend most of their time waiting, so one binary's
slow tail leaves the machine's cores idle. This runs them in `--lanes` lanes (each binary still
runs its own tests on RUST_TEST_THREADS threads), longest first: the durations of the last run
(kept in `--times`, else the checked-in `--seed-times`) order the next one, and binaries never
timed go first in the order given.

Input (stdin): the JSON messages of `cargo test --no-run --message-format=json`. Each test
binary runs from its package's directory, as `cargo test` runs it. Its output is kept in
`--log-dir` and printed whole when it ends (so two lanes never interleave lines). Exit status:
0 when every binary passed, 1 otherwise (every binary runs: no fail-fast).
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


def artifacts(stream):
    """(name, executable, cwd) of every test binary in cargo's JSON messages."""
    seen = set()
    for line in stream:
        line = line.strip()
        if not line.startswith("{"):
            continue
        m = json.loads(line)
        if m.get("reason") != "compiler-artifact" or not m["profile"]["test"]:
            continue
        exe = m.get("executable")
        if not exe or exe in seen:
            continue
        seen.add(exe)
        crate_dir = Path(m["manifest_path"]).parent
        kind = m["target"]["kind"][0]
        name = f"{crate_dir.name}::{m['target']['name']}"
        if kind in ("lib", "bin"):
            name += f" ({kind})"
        yield name, exe, str(crate_dir)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--times", required=True, help="JSON file of the last run's durations")
    ap.add_argument("--seed-times", help="durations to order by when --times has none yet "
                    "(a clean clone: the ones checked in)")
    ap.add_argument("--one-thread", action="append", default=[], metavar="NAME",
                    help="a binary (as named in the summary) that runs one test at a time")
    ap.add_argument("test_args", nargs="*", help="passed to every test binary")
    args = ap.parse_args()

    bins = list(artifacts(sys.stdin))
    if not bins:
        print("run_tests: no test binaries in cargo's output", file=sys.stderr)
        return 1
    last = {}
    for source in (args.times, args.seed_times):
        try:
            last = json.loads(Path(source).read_text()) if source else {}
        except (OSError, ValueError):
            continue
        break
    # Longest first; never-timed ones first of all (they may be long, and nothing says not).
    order = sorted(range(len(bins)), key=lambda i: (-last.get(bins[i][0], float("inf")), i))
    queue = [bins[i] for i in order]

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    results = {}
    started = time.monotonic()

    def lane(n):
        while True:
            with lock:
                if not queue:
                    return
                name, exe, cwd = queue.pop(0)
            log = log_dir / (name.replace("::", "-").replace(" ", "").replace("/", "_") + ".log")
            t0 = time.monotonic()
            extra = ["--test-threads=1"] if name in args.one_thread else []
            with open(log, "wb") as out:
                rc = subprocess.call([exe, *args.test_args, *extra], cwd=cwd, stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            took = time.monotonic() - t0
            with lock:
                results[name] = (rc, took)
                state = "ok" if rc == 0 else f"FAILED (exit {rc})"
                print(f"\n== {name}: {state} in {took:.1f} s "
                      f"(lane {n}, {time.monotonic() - started:.0f} s into the run)", flush=True)
                sys.stdout.write(log.read_text(errors="replace"))
                sys.stdout.flush()

    threads = [threading.Thread(target=lane, args=(n,)) for n in range(max(1, args.lanes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    wall = time.monotonic() - started
    total = sum(t for _, t in results.values())
    print(f"\n== test binaries: {len(results)} in {wall:.0f} s wall "
          f"({total:.0f} s if run one after another), {args.lanes} lanes")
    for name, (rc, took) in sorted(results.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"   {took:7.1f} s  {'ok' if rc == 0 else 'FAILED'}  {name}")
    failed = sorted(name for name, (rc, _) in results.items() if rc != 0)
    try:
        Path(args.times).parent.mkdir(parents=True, exist_ok=True)
        Path(args.times).write_text(json.dumps({n: round(t, 1) for n, (_, t) in results.items()},
                                               indent=1, sort_keys=True))
    except OSError as e:
        print(f"run_tests: durations not kept: {e}", file=sys.stderr)
    if failed:
        print("== FAILED: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
