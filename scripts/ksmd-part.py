#!/usr/bin/env python3
"""ksmd's CPU to 90% of the savings under rksm, against ksmd told only the duplicates,
the two taking turns.

Whether ksmd does more work under rksm than the floor, `ksmd-duplicates`, is hard to read
off a bench of three runs of each on a machine that drifts over its minutes (this one
does). This script asks it alone: for each of RUNS rounds, fresh workloads of PROFILE (4
processes) are started twice, once marking their own duplicates with ksmd paced as the
daemon paces it, once with an rksm daemon (ebpf, 1 s passes) over them; the order flips
every round. Each notes ksmd's CPU (its schedstat, to the nanosecond), its pages scanned
and its full scans from the moment the workloads are ready (ksmd set going, or the daemon
started) until `pages_sharing` reached 90% of what the profile allows, and the medians are
printed. KSM is unmerged and stopped before and after each. Needs root.

    sudo scripts/ksmd-part.py static-4g 6 [RKSM]
"""
import statistics
import subprocess
import sys
import time

import ksm
import workloads

# pages_sharing each profile allows: 4 copies of each duplicated page, three of them shared.
SHARING = {"static-4g": 393216, "quarter-4g": 196608}
# Every wait is bounded: a configuration that has not reached 90% by then is reported so.
DEADLINE = 120.0


def one(rksm, profile, mode):
    """ksmd's CPU, pages scanned, full scans and seconds to 90%, for MODE (dups or rksm)."""
    target = SHARING[profile] * 0.9
    ksm.reset()
    extra = ["--mark-duplicates"] if mode == "dups" else []
    with workloads.running(rksm, profile, extra) as pids:
        daemon = None
        cpu0 = ksm.ksmd_cpu()
        scanned0, scans0 = ksm.sysfs("pages_scanned"), ksm.sysfs("full_scans")
        started = time.monotonic()
        if mode == "dups":
            # The daemon's pace for the same marked set: swept in 0.5 s at 20 ms sleeps.
            ksm.sysfs("sleep_millisecs", 20)
            ksm.sysfs("pages_to_scan", max(100, SHARING[profile] * 4 // 3 // 25))
            ksm.sysfs("run", 1)
        else:
            daemon = subprocess.Popen([rksm, "--no-config", "daemon", *pids, "--dirty", "ebpf",
                                       "--interval", "1"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        reached = None
        while time.monotonic() - started < DEADLINE:
            if ksm.sysfs("pages_sharing") >= target:
                reached = time.monotonic() - started
                break
            time.sleep(0.02)
        result = (ksm.ksmd_cpu() - cpu0, ksm.sysfs("pages_scanned") - scanned0,
                  ksm.sysfs("full_scans") - scans0, reached)
        if daemon:
            daemon.terminate()
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        ksm.sysfs("run", 0)
    ksm.reset()
    if reached is None:
        sys.exit(f"ksmd-part.py: {mode} did not reach 90% of the savings in {DEADLINE:.0f} s")
    return result


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in SHARING:
        sys.exit(f"usage: ksmd-part.py {{{','.join(SHARING)}}} RUNS [RKSM]")
    profile = sys.argv[1]
    try:
        runs = int(sys.argv[2])
    except ValueError:
        runs = 0
    if runs < 1:
        sys.exit(f"ksmd-part.py: RUNS must be a whole number of at least 1, not {sys.argv[2]!r}")
    rksm = sys.argv[3] if len(sys.argv) > 3 else "target/release/rksm"
    saved = {n: ksm.sysfs(n) for n in ("run", "pages_to_scan", "sleep_millisecs")}
    seen = {"dups": [], "rksm": []}
    try:
        for r in range(runs):
            for mode in (("dups", "rksm") if r % 2 == 0 else ("rksm", "dups")):
                cpu, scanned, scans, secs = one(rksm, profile, mode)
                seen[mode].append((cpu, scanned, scans, secs))
                print(f"round {r + 1} {mode}: ksmd {cpu:.3f} CPU s, {scanned} pages scanned, "
                      f"{scans} full scans, {secs:.2f} s to 90%", flush=True)
    finally:
        for name in ("pages_to_scan", "sleep_millisecs", "run"):
            ksm.sysfs(name, saved[name])
    for mode, label in (("dups", "ksmd told only the duplicates"), ("rksm", "ksmd under rksm")):
        rows = seen[mode]
        print(f"{label}: ksmd {statistics.median(r[0] for r in rows):.3f} CPU s to 90%, "
              f"{statistics.median(r[1] for r in rows):.0f} pages scanned "
              f"(medians of {len(rows)})")


if __name__ == "__main__":
    main()
