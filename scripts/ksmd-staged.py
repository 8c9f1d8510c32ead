#!/usr/bin/env python3
"""What ksmd spends merging copies, and whether telling it of them in stages lowers it.

Kernels whose `cmp_and_merge_page` looks a page up in the stable tree before it checks the
page's checksum merge a copy of contents merged already at its first visit; on those that
check the checksum first (6.18), every page not merged yet is visited once for its checksum
and merged at the next visit at the earliest. This script measures what telling ksmd of
the copies in stages is worth on ksmd alone, with nothing else running: COPIES processes
each hold the same MIB of pages (every page's contents its own), and in turn:

- `all`: every process marks its pages mergeable at once (what rksm and the bench's
  ksmd-duplicates do);
- `staged`: two processes mark theirs, and the others only once those two have merged;
- `round`: two processes mark theirs, and the others as soon as ksmd has ended the round
  that first visited those two, in time to meet the two's contents merged at their own
  first visit where the stable tree is looked in first;
- `seeded`: as `round`, but the others first mark one page each along with the two, so that
  ksmd lists their processes in its first round, where a process that marks while ksmd
  scans joins its list behind its cursor; the rest of their pages are marked when that
  round ends.

For each, ksmd's CPU (its schedstat) and the seconds until pages_sharing reached 90% of
what the pages allow, with ksmd paced as the daemon paces it (the marked pages swept in
0.5 s, waking every 20 ms); and, for `all`, ksmd's CPU phase by phase (its first round, the
first copies into the unstable tree, the second copies merged with them, the rest merged
from the stable tree), from its counters polled every 10 ms. ksmd's settings are put back
at the end. Needs root and KSM with nothing else merging.

    sudo scripts/ksmd-staged.py 256 4 6
"""
import mmap
import os
import statistics
import struct
import sys
import time

import ksm

PAGE = 4096


def child(pages, commands, ready):
    """Fills `pages` pages, says so, marks them when told, then waits to be killed."""
    m = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(pages):
        m[i * PAGE:i * PAGE + 16] = struct.pack("<QQ", i + 1, (i * 0x9E3779B97F4A7C15) & (2**64 - 1))
    os.write(ready, b"r")
    if os.read(commands, 1) == b"s":
        m.madvise(mmap.MADV_MERGEABLE, 0, PAGE)
        os.write(ready, b"s")
        os.read(commands, 1)
    m.madvise(mmap.MADV_MERGEABLE)
    os.write(ready, b"m")
    while True:
        time.sleep(3600)


def merging(pid):
    with open(f"/proc/{pid}/ksm_merging_pages") as f:
        return int(f.read())


def one_run(pages, copies, mode):
    ksm.reset()
    kids = []
    for _ in range(copies):
        c_r, c_w = os.pipe()
        r_r, r_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                child(pages, c_r, r_w)
            finally:
                os._exit(0)
        kids.append((pid, c_w, r_r))
    try:
        for _, _, r in kids:
            os.read(r, 1)
        base_sharing = ksm.sysfs("pages_sharing")
        target = 0.9 * pages * (copies - 1)
        staged = mode != "all"
        first = kids[:2] if staged else kids
        ksm.sysfs("pages_to_scan", max(1, int(len(first) * pages * 0.020 / 0.5)))
        # Marked while ksmd is stopped, so that its first round visits all of them: a
        # process marked while ksmd scans another joins the list behind its cursor, and is
        # first visited in the next round.
        for _, w, r in first:
            os.write(w, b"m")
            os.read(r, 1)
        if mode == "seeded":
            for _, w, r in kids[2:]:
                os.write(w, b"s")
                os.read(r, 1)
        cpu0, t0 = ksm.ksmd_cpu(), time.monotonic()
        scans_at_start = ksm.sysfs("full_scans")
        ksm.sysfs("run", 1)
        rest = [] if not staged else kids[2:]
        deadline = t0 + 120
        while rest:
            if mode in ("round", "seeded"):
                ready = ksm.sysfs("full_scans") > scans_at_start
            else:
                ready = all(merging(pid) >= pages for pid, _, _ in first)
            if ready:
                ksm.sysfs("pages_to_scan", max(1, int(copies * pages * 0.020 / 0.5)))
                for _, w, r in rest:
                    os.write(w, b"m")
                    os.read(r, 1)
                rest = []
            elif time.monotonic() > deadline:
                awaited = ("ksmd did not end its first round" if mode in ("round", "seeded")
                           else "the first two did not merge")
                raise SystemExit(f"ksmd-staged.py: {awaited} within 120 s")
            time.sleep(0.01)
        # ksmd's CPU when each phase ended: its first round (every page visited once, for
        # its checksum), the first merge (the first copy of each page in the unstable tree),
        # the second copies merged (pages_sharing at one a page), 90% of the savings.
        scans0, phases = ksm.sysfs("full_scans"), {}
        while True:
            sharing, cpu = ksm.sysfs("pages_sharing") - base_sharing, ksm.ksmd_cpu() - cpu0
            if "round 1" not in phases and ksm.sysfs("full_scans") > scans0:
                phases["round 1"] = cpu
            if "first copies" not in phases and sharing > 0:
                phases["first copies"] = cpu
            if "second copies" not in phases and sharing >= pages:
                phases["second copies"] = cpu
            if sharing >= target:
                phases["90%"] = cpu
                break
            if time.monotonic() > deadline:
                raise SystemExit("ksmd-staged.py: ksmd did not reach 90% within 120 s")
            time.sleep(0.01)
        return cpu, time.monotonic() - t0, phases
    finally:
        for pid, _, _ in kids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)


def main():
    if len(sys.argv) != 4:
        sys.exit("usage: ksmd-staged.py MIB COPIES RUNS")
    try:
        mib, copies, runs = (int(a) for a in sys.argv[1:])
    except ValueError:
        sys.exit("ksmd-staged.py: MIB, COPIES and RUNS are whole numbers")
    if copies < 3:
        sys.exit("ksmd-staged.py: COPIES must be at least 3 (two merge first, the rest later)")
    pages = mib * 256
    saved = {n: ksm.sysfs(n) for n in ("run", "pages_to_scan", "sleep_millisecs")}
    seen = {"all": [], "staged": [], "round": [], "seeded": []}
    phase_cpu = []
    try:
        ksm.sysfs("sleep_millisecs", 20)
        for run in range(runs):
            modes = list(seen)
            for mode in modes[run % len(modes):] + modes[:run % len(modes)]:
                cpu, secs, phases = one_run(pages, copies, mode)
                seen[mode].append((cpu, secs))
                if mode == "all":
                    phase_cpu.append(phases)
                print(f"run {run + 1} {mode}: ksmd {cpu:.3f} CPU s, {secs:.2f} s to 90%",
                      flush=True)
    finally:
        ksm.reset()
        ksm.sysfs("pages_to_scan", saved["pages_to_scan"])
        ksm.sysfs("sleep_millisecs", saved["sleep_millisecs"])
        ksm.sysfs("run", saved["run"])
    # Each phase's CPU over the pages it is about: every copy for the first round, one copy
    # for the first and second copies, the others for the rest.
    if all(len(p) == 4 for p in phase_cpu):
        ends = {k: statistics.median(p[k] for p in phase_cpu) for k in phase_cpu[0]}
        spans = [("round 1: every copy visited for its checksum", ends["round 1"],
                  pages * copies),
                 ("first copies into the unstable tree", ends["first copies"] - ends["round 1"],
                  pages),
                 ("second copies merged with them", ends["second copies"] - ends["first copies"],
                  pages),
                 ("the rest merged from the stable tree, to 90%",
                  ends["90%"] - ends["second copies"], 0.9 * pages * (copies - 1) - pages)]
        print("all, by phase (medians of the phases' ends):")
        for name, cpu, n in spans:
            print(f"  {name:48} {cpu:6.3f} CPU s, {cpu / n * 1e6:5.2f} us a page")
    for mode, values in seen.items():
        cpu = statistics.median(v[0] for v in values)
        secs = statistics.median(v[1] for v in values)
        print(f"{mode}: ksmd {cpu:.3f} CPU s, {secs:.2f} s to 90% (medians of {len(values)}), "
              f"{cpu / (pages * copies) * 1e6:.2f} us a page")


if __name__ == "__main__":
    main()
