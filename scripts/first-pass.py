#!/usr/bin/env python3
"""What a first pass costs rksm, build against build, side by side.

Starts the four workloads of PROFILE once, then runs a fresh daemon of each build given
over them for one pass, in turn, RUNS times, and prints each build's median CPU seconds:
the daemon's own count to the end of its first pass (`first_pass_cpu_seconds` in its
--json counters) where it has one, and every build's CPU from start to exit (getrusage of
the child), which a build without that counter can be compared by, with the page faults it
took in its own memory from start to exit (each a page the kernel had to clear), which
move far less than CPU time does. One pass marks nothing,
so every run finds the workloads as the first did. This machine's speed moves by a fifth
from minute to minute: compare builds of one run only. The builds take turns at going
first, and an even RUNS gives each the same share of both places.

    sudo scripts/first-pass.py quarter-4g 7 target/release/rksm /tmp/rksm-before
"""
import json
import os
import resource
import statistics
import subprocess
import sys

import workloads


def main():
    if len(sys.argv) < 4:
        sys.exit("usage: first-pass.py PROFILE RUNS RKSM [RKSM...]")
    profile, runs, builds = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    with workloads.running(builds[0], profile) as pids:
        seen = {b: {"first": [], "total": [], "faults": [], "pages": None}
                for b in builds}
        for run in range(runs):
            # In turn first and last: whichever build ran first in a round paid less here
            # (8 to 9% at quarter-4g, either build), for reasons not known.
            for b in (builds if run % 2 == 0 else builds[::-1]):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                done = subprocess.run(
                    [b, "--no-config", "daemon", *pids, "--dirty", "ebpf", "--interval", "1",
                     "--passes", "1", "--json"],
                    capture_output=True, text=True, check=True)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                stats = json.loads(done.stdout)
                seen[b]["total"].append(after.ru_utime - before.ru_utime
                                        + after.ru_stime - before.ru_stime)
                seen[b]["faults"].append(after.ru_minflt - before.ru_minflt)
                if stats.get("first_pass_cpu_seconds"):
                    seen[b]["first"].append(stats["first_pass_cpu_seconds"])
                seen[b]["pages"] = stats.get("first_pass_pages")
        for b, s in seen.items():
            first = (f"{statistics.median(s['first']):.3f}" if s["first"] else "-")
            print(f"{b}: first pass {first} CPU s, start to exit "
                  f"{statistics.median(s['total']):.3f} CPU s, "
                  f"{statistics.median(s['faults']):.0f} page faults (medians of {runs}), "
                  f"{s['pages']} pages")


if __name__ == "__main__":
    main()
