#!/usr/bin/env python3
"""Where a first pass's CPU goes, by mechanism, from perf's samples of the daemon.

Starts the four workloads of PROFILE, runs one daemon over them for one pass under
`perf record` (cpu-clock, DWARF call chains, so rksm's own frames are named), and files
every sample under the first mechanism its call chain names, from the innermost frame out:
a page fault taken while copying into rksm's buffer is a fault, a compare under the index is
a compare. Start-up (loading the eBPF programs, the kernel's verifier included) and the
daemon's exit (its userfaultfds closed, which un-protects every page) are apart; the
first pass's own CPU (the daemon's `first_pass_cpu_seconds`) covers start-up and the pass.
It also prints what a page of fresh memory costs to fault in, with the workloads running
and after they ended: what each page rksm's tables grow into costs on this machine at that
moment (on a virtual machine whose host takes free memory back, that moves). Needs perf and
root. One run: this machine's speed moves from minute to minute, so compare
shares, not seconds, across runs.

With --functions N it also lists the N of rksm's functions that the most of the pass's
samples are in, with what they call (a function inlined into another counts apart), and of
those the samples whose innermost own frame of rksm's it is (the kernel's and libc's work
counted to the function of rksm's that called it).

    sudo scripts/first-pass-profile.py quarter-4g [RKSM] [--functions N]
"""
import collections
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

import perfdata
import workloads

# madvise(2): fault in a range for writing (Linux 5.14).
MADV_POPULATE_WRITE = 23

# Phases, by a frame anywhere in the chain.
PHASES = [
    ("start-up", ["rksm::daemon::Daemon::start"]),
    ("pass", ["rksm::daemon::Daemon::pass"]),
    ("exit", ["rksm::daemon::Daemon::finish", "do_exit", "exit_mmap"]),
]

# Mechanisms of a pass, by the innermost frame that names one.
MECHANISMS = [
    ("first touch of rksm's own memory", ["asm_exc_page_fault"]),
    ("sampling in the kernel", ["rksm::ebpf::sampler::Sampler::sample"]),
    ("copying pages out (process_vm_readv)", ["rksm::kernel::reader::read_pages"]),
    ("pagemap reads", ["rksm::kernel::procfs::pagemap::Pagemap::read",
                       "rksm::kernel::procfs::pagemap::Pagemap::present_runs"]),
    ("write protection", ["rksm::kernel::procfs::pagemap::PageScan::protect",
                          "rksm::kernel::userfaultfd::"]),
    ("checksums and compares", ["rksm::engine::checksum::", "__memcmp",
                                "rksm::engine::scan::reads::RecentBatches::twin",
                                "rksm_common::sample::digest_of"]),
    ("sample index", ["rksm::engine::samples::", "SampleBatch::take_up"]),
    # The hash tables (engine::table) are counted with their owner, the frame above them.
    ("page index and page state", ["rksm::engine::index::", "rksm::engine::pages::"]),
    ("allocator", ["malloc", "_int_free", "cfree", "realloc", "__libc_calloc"]),
]


def first_match(frames, rules):
    for frame in frames:
        for name, needles in rules:
            if any(n in frame for n in needles):
                return name
    return None


def fresh_page_us(mib=64, runs=3):
    """Microseconds to fault in a page of memory this process never had (the median of
    RUNS mappings of MIB, each populated for writing in one call): the price of each page
    rksm's tables grow into. On a virtual machine whose host takes free memory back it
    depends on what else has just been allocated."""
    costs = []
    for _ in range(runs):
        m = mmap.mmap(-1, mib << 20)
        started = time.perf_counter()
        m.madvise(MADV_POPULATE_WRITE)
        costs.append((time.perf_counter() - started) / (mib << 20 >> 12) * 1e6)
        m.close()
    return statistics.median(costs)


def main():
    args = sys.argv[1:]
    functions = 0
    if "--functions" in args:
        at = args.index("--functions")
        if at + 1 >= len(args) or not args[at + 1].isdigit():
            sys.exit("first-pass-profile.py: --functions takes a number of functions")
        functions = int(args[at + 1])
        del args[at:at + 2]
    if not args:
        sys.exit("usage: first-pass-profile.py PROFILE [RKSM] [--functions N]")
    profile = args[0]
    rksm = args[1] if len(args) > 1 else "target/release/rksm"
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        with workloads.running(rksm, profile) as pids:
            fresh = fresh_page_us()
            done = subprocess.run(
                ["perf", "record", "-q", "-F", "1999", "--call-graph", "dwarf,16384",
                 "-o", data, "--", rksm, "--no-config", "daemon", *pids, "--dirty", "ebpf",
                 "--interval", "1", "--passes", "1", "--json"],
                capture_output=True, text=True, check=True)
        stats = json.loads(done.stdout)
        phases = collections.Counter()
        mechanisms = collections.Counter()
        inner = collections.Counter()
        within = collections.Counter()
        for _, period, frames in perfdata.samples(data):
            phase = first_match(reversed(frames), PHASES) or "process start and end"
            phases[phase] += period
            if phase == "pass":
                mechanisms[first_match(frames, MECHANISMS) or "the rest of the pass"] += period
                own = [f for f in frames if f.startswith("rksm")]
                if own:
                    inner[own[0]] += period
                for name in set(own):
                    within[name] += period
    total = sum(phases.values())
    pages = stats.get("first_pass_pages") or 0
    gb = pages * 4096 / 1e9
    print(f"{profile}: {pages} pages ({gb:.2f} GB) present; first pass "
          f"{stats.get('first_pass_cpu_seconds', 0):.3f} CPU s by the daemon's count; "
          f"perf sampled {total / 1e9:.3f} s from start to exit")
    print(f"a page of fresh memory took {fresh:.2f} us to fault in, with the workloads "
          f"running (the median of 3 mappings of 64 MiB); {fresh_page_us():.2f} us after "
          f"they ended")
    print(f"{'':44} {'CPU s':>7} {'s/GB':>7} {'share':>6}")
    for name, ns in phases.most_common():
        print(f"{name:44} {ns / 1e9:7.3f} {ns / 1e9 / gb:7.4f} {ns / total:6.1%}")
        if name == "pass":
            for mech, mns in mechanisms.most_common():
                print(f"  {mech:42} {mns / 1e9:7.3f} {mns / 1e9 / gb:7.4f} {mns / total:6.1%}")
    if functions:
        print(f"\nthe {functions} functions of rksm's the most of the pass is in: CPU s with what "
              f"they call, and where they are the innermost of rksm's")
        for name, ns in within.most_common(functions):
            print(f"  {ns / 1e9:7.3f} {inner[name] / 1e9:7.3f}  {name[:110]}")


if __name__ == "__main__":
    main()
