#!/usr/bin/env python3
"""ksmd's CPU to 90% of the savings under rksm, against ksmd told only the duplicates,
the two taking turns.

`rksm bench` runs a configuration's repeats one after another, so a machine that drifts
over the minutes of a run (this one does) can show ksmd's part under rksm above its floor,
`ksmd-duplicates`, when the two did the same work. This script asks the question alone:
for each of RUNS rounds, fresh workloads of PROFILE (4 processes) are started twice, once
marking their own duplicates with ksmd paced as the daemon paces it, once with an rksm
daemon (ebpf, 1 s passes) over them; the order flips every round. Each notes ksmd's CPU
(its schedstat, to the nanosecond), its pages scanned and its full scans from the moment
the workloads are ready (ksmd set going, or the daemon started) until `pages_sharing` reached 90% of what the profile allows, and the
medians are printed. KSM is unmerged and stopped before and after each. Needs root.

    sudo scripts/ksmd-part.py static-4g 6 [RKSM]
"""
import contextlib
import statistics
import subprocess
import sys
import time

KSM = "/sys/kernel/mm/ksm/"
# pages_sharing each profile allows: 4 copies of each duplicated page, three of them shared.
SHARING = {"static-4g": 393216, "quarter-4g": 196608}
# Every wait is bounded: a configuration that has not reached 90% by then is reported so.
DEADLINE = 120.0


def read(name):
    with open(KSM + name) as f:
        return int(f.read())


def write(name, value):
    with open(KSM + name, "w") as f:
        f.write(str(value))


def ksmd_cpu(pid):
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


@contextlib.contextmanager
def workloads(rksm, profile, extra):
    procs = [subprocess.Popen([rksm, "--no-config", "workload", "--profile", profile,
                               "--index", str(i), *extra],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i in range(4)]
    try:
        for p in procs:
            while True:
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"ksmd-part.py: workload {p.pid} exited before it was "
                                       f"ready (status {p.wait()})")
                if "ready" in line:
                    break
        yield [a for p in procs for a in ("--pid", str(p.pid))]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def one(rksm, profile, mode, ksmd):
    """ksmd's CPU, pages scanned, full scans and seconds to 90%, for MODE (dups or rksm)."""
    target = SHARING[profile] * 0.9
    write("run", 2)
    write("run", 0)
    extra = ["--mark-duplicates"] if mode == "dups" else []
    with workloads(rksm, profile, extra) as pids:
        daemon = None
        cpu0, scanned0, scans0 = ksmd_cpu(ksmd), read("pages_scanned"), read("full_scans")
        started = time.monotonic()
        if mode == "dups":
            # The daemon's pace for the same marked set: swept in 0.5 s at 20 ms sleeps.
            write("sleep_millisecs", 20)
            write("pages_to_scan", max(100, SHARING[profile] * 4 // 3 // 25))
            write("run", 1)
        else:
            daemon = subprocess.Popen([rksm, "--no-config", "daemon", *pids, "--dirty", "ebpf",
                                       "--interval", "1"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        reached = None
        while time.monotonic() - started < DEADLINE:
            if read("pages_sharing") >= target:
                reached = time.monotonic() - started
                break
            time.sleep(0.02)
        result = (ksmd_cpu(ksmd) - cpu0, read("pages_scanned") - scanned0,
                  read("full_scans") - scans0, reached)
        if daemon:
            daemon.terminate()
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        write("run", 0)
    write("run", 2)
    write("run", 0)
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
    ksmd = subprocess.run(["pgrep", "-x", "ksmd"], capture_output=True, text=True,
                          check=True).stdout.split()[0]
    saved = {n: read(n) for n in ("run", "pages_to_scan", "sleep_millisecs")}
    seen = {"dups": [], "rksm": []}
    try:
        for r in range(runs):
            for mode in (("dups", "rksm") if r % 2 == 0 else ("rksm", "dups")):
                cpu, scanned, scans, secs = one(rksm, profile, mode, ksmd)
                seen[mode].append((cpu, scanned, scans, secs))
                print(f"round {r + 1} {mode}: ksmd {cpu:.3f} CPU s, {scanned} pages scanned, "
                      f"{scans} full scans, {secs:.2f} s to 90%", flush=True)
    finally:
        for name in ("pages_to_scan", "sleep_millisecs", "run"):
            write(name, saved[name])
    for mode, label in (("dups", "ksmd told only the duplicates"), ("rksm", "ksmd under rksm")):
        rows = seen[mode]
        print(f"{label}: ksmd {statistics.median(r[0] for r in rows):.3f} CPU s to 90%, "
              f"{statistics.median(r[1] for r in rows):.0f} pages scanned "
              f"(medians of {len(rows)})")


if __name__ == "__main__":
    main()
