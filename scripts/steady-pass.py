#!/usr/bin/env python3
"""What rksm's steady state costs, build against build, side by side.

Starts the four workloads of PROFILE once (they keep rewriting their volatile pages), then
runs a fresh daemon of each build given over them in ebpf mode at 1 s passes, in turn, RUNS
times. Each daemon runs SECONDS; its CPU from SETTLE seconds on to its end, to the
nanosecond (its threads' schedstat), is its steady state. Prints each build's median CPU
seconds a minute and milliseconds a pass. The first run of all merges the workloads' copies;
every run after finds them merged, so the first is left out. This machine's speed moves by
a fifth from minute to minute: compare builds of one run only.

    sudo scripts/steady-pass.py static-4g 5 target/release/rksm /tmp/rksm-before
"""
import os
import statistics
import subprocess
import sys
import time

import workloads

SECONDS = 30
SETTLE = 14


def cpu_ns(pid, seen):
    """The process's CPU so far: its threads' run times, an exited thread's last one kept."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return sum(seen.values())
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                seen[tid] = int(f.read().split()[0])
        except OSError:
            pass
    return sum(seen.values())


def main():
    if len(sys.argv) < 4:
        sys.exit("usage: steady-pass.py PROFILE RUNS RKSM [RKSM...]")
    profile, runs, builds = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    with workloads.running(builds[0], profile) as pids:
        per_minute = {b: [] for b in builds}
        for run in range(runs + 1):
            for b in builds:
                daemon = subprocess.Popen(
                    [b, "--no-config", "--log-level", "warn", "daemon", *pids, "--dirty",
                     "ebpf", "--interval", "1", "--duration", str(SECONDS)],
                    stdout=subprocess.DEVNULL)
                seen = {}
                time.sleep(SETTLE)
                start, t0 = cpu_ns(daemon.pid, seen), time.monotonic()
                time.sleep(SECONDS - SETTLE - 1)
                end, t1 = cpu_ns(daemon.pid, seen), time.monotonic()
                daemon.wait()
                if run > 0:
                    per_minute[b].append((end - start) / 1e9 / (t1 - t0) * 60)
        for b, values in per_minute.items():
            m = statistics.median(values)
            print(f"{b}: steady state {m:.3f} CPU s a minute, {m / 60 * 1e3:.2f} ms a pass "
                  f"(median of {runs}: {', '.join(f'{v:.3f}' for v in values)})")


if __name__ == "__main__":
    main()
