#!/usr/bin/env python3
"""What a daemon's first PASSES passes cost, build against build, on fresh workloads.

For each of RUNS rounds and each build in turn (the builds take turns at going first), starts
the four workloads of PROFILE afresh, runs the build's daemon over them for PASSES passes
(the second marks what the first found; ksmd runs as the daemon sets it), and takes from the
kernel's accounting of that daemon alone (wait4): its CPU from start to exit, the page faults
it took (each a page of its own memory the kernel had to clear, or one of the program's
pages), and its peak resident memory. Prints each build's medians. Unlike first-pass.py,
which runs one pass over the same workloads again and again, every run here starts from
memory nothing has merged. Needs root.

    sudo scripts/first-passes.py static-4g 2 4 target/release/rksm /tmp/rksm-before
"""
import os
import statistics
import subprocess
import sys

import ksm
import workloads


def one_run(build, profile, passes):
    ksm.reset()
    with workloads.running(build, profile) as pids:
        daemon = subprocess.Popen(
            [build, "--no-config", "daemon", *pids, "--dirty", "ebpf", "--interval", "1",
             "--passes", str(passes), "--json"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        stderr = daemon.stderr.read().decode(errors="replace")
        # wait4 gives this child's own accounting, not that of every child reaped so far.
        _, status, usage = os.wait4(daemon.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"{build} failed: {stderr.strip().splitlines()[-1:]}")
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt, usage.ru_maxrss


def main():
    if len(sys.argv) < 5:
        sys.exit("usage: first-passes.py PROFILE PASSES RUNS RKSM [RKSM...]")
    try:
        profile, passes, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    except ValueError:
        sys.exit("first-passes.py: PASSES and RUNS are whole numbers")
    builds = sys.argv[4:]
    seen = {b: [] for b in builds}
    try:
        for run in range(runs):
            for b in (builds if run % 2 == 0 else builds[::-1]):
                cpu, faults, peak = one_run(b, profile, passes)
                seen[b].append((cpu, faults, peak))
                print(f"run {run + 1} {b}: {cpu:.3f} CPU s, {faults} page faults, "
                      f"peak {peak / 1024:.1f} MiB", flush=True)
    finally:
        ksm.reset()
    for b, values in seen.items():
        cpu, faults, peak = (statistics.median(v[i] for v in values) for i in range(3))
        print(f"{b}: {passes} passes {cpu:.3f} CPU s, {faults:.0f} page faults, peak "
              f"{peak / 1024:.1f} MiB (medians of {len(values)})")


if __name__ == "__main__":
    main()
