#!/usr/bin/env python3
"""Where the marking pass's CPU goes: the pass after the first, which turns the duplicates the
first pass held into candidates and marks them, from perf's samples of the daemon.

For each build given, starts the four workloads of PROFILE afresh (a daemon leaves what it
marked marked), runs one daemon over them for two passes under `perf record` (cpu-clock,
DWARF call chains), and files every sample of the second pass (the samples under
`Daemon::pass` after the wait between the two) under the first part of it its call chain
names, from the pass out. One run a build: this machine's speed moves from minute to
minute, so run the builds more than once, in turn, before reading a change in seconds into
it. Needs perf and root.

    sudo scripts/marking-pass-profile.py quarter-4g target/release/rksm
"""
import collections
import os
import subprocess
import sys
import tempfile

import perfdata
import workloads

# Parts of the marking pass, by the outermost frame below the pass that names one.
PARTS = [
    ("held duplicates let through the gate", ["Scanner>::release_held"]),
    ("sample index given back room", ["SampleIndex::shrink"]),
    ("candidates taken up, listed and settled", ["Target::take_up_candidates_found",
                                                 "Target::unmarked_candidates",
                                                 "Target::settle_candidates"]),
    ("marking (madvise) and its plan", ["rksm::engine::merge::"]),
    ("pages merged noted", ["Target::note_merged"]),
    ("what the dirty source says", ["Scanner>::plan"]),
    ("pages read", ["Scanner>::read_side_by_side"]),
]


def part_of(frames):
    for frame in reversed(frames):
        for name, needles in PARTS:
            if any(n in frame for n in needles):
                return name
    return "the rest of the pass"


def profile_one(rksm, pids, tmp):
    data = os.path.join(tmp, "perf.data")
    subprocess.run(
        ["perf", "record", "-q", "-F", "2999", "--call-graph", "dwarf,16384", "-o", data,
         "--", rksm, "--no-config", "daemon", *pids, "--dirty", "ebpf", "--interval", "1",
         "--passes", "2", "--json"],
        capture_output=True, text=True, check=True)
    in_pass = [(t, p, f) for t, p, f in perfdata.samples(data)
               if any("rksm::daemon::Daemon::pass" in x for x in f)]
    if not in_pass:
        sys.exit(f"{rksm}: no samples in a pass")
    # The passes are a second apart; the second begins after the longest gap between them.
    gaps = [(b[0] - a[0], i + 1) for i, (a, b) in enumerate(zip(in_pass, in_pass[1:]))]
    start = max(gaps)[1]
    parts = collections.Counter()
    for _, period, frames in in_pass[start:]:
        parts[part_of(frames)] += period
    return parts


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: marking-pass-profile.py PROFILE RKSM [RKSM...]")
    profile, builds = sys.argv[1], sys.argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        for rksm in builds:
            with workloads.running(rksm, profile) as pids:
                parts = profile_one(rksm, pids, tmp)
            total = sum(parts.values())
            print(f"{rksm}: marking pass over {profile}: {total / 1e9:.3f} CPU s sampled")
            for name, ns in parts.most_common():
                print(f"  {name:42} {ns / 1e9:7.3f} {ns / total:6.1%}")


if __name__ == "__main__":
    main()
