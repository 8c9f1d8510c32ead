#!/usr/bin/env python3
"""The per-profile tables of docs/BENCHMARKS.md, from the reports scripts/bench-report.sh
wrote: one Markdown table per profile, every row of its report.json.

    scripts/bench-tables.py docs/bench static static-4g quarter-4g quarter-16g alike-4g
"""
import json
import sys

HEADER = ("| mode | checksum | pages_sharing | pages hashed / steady pass | CPU s to 90% "
          "(ksmd's part) | s to 90% | steady CPU s/min, rksm + ksmd | steady pass | first pass "
          "CPU s | rksm RSS B/page, end and peak | memory intact |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def num(v, digits=2, thousands=False):
    if v is None:
        return "-"
    if thousands:
        return f"{v:,}"
    return f"{v:,.{digits}f}"


def row(r):
    ksmd = r["write_protect"] is None
    hashed = f"{r['pages_hashed']:,}" + (" (scanned)" if ksmd else "")
    to90 = (f"{num(r['cpu_to_90pct'])} ({num(r['ksmd_cpu_to_90pct'])})"
            if r["cpu_to_90pct"] is not None else "-")
    steady_pass = (f"{r['steady_pass_seconds'] * 1e3:,.1f} ms"
                   if r.get("steady_pass_seconds") is not None else "-")
    rss = (f"{r['rss_bytes_per_page']:.1f}, {r['peak_rss_bytes_per_page']:.1f}"
           if r.get("rss_bytes_per_page") is not None else "-")
    return "| " + " | ".join([
        r["mode"],
        "(kernel)" if ksmd else r["checksum"],
        f"{r['pages_sharing']:,}",
        hashed,
        to90,
        num(r["seconds_to_90pct"], 1),
        num(r["steady_cpu_per_minute"]),
        steady_pass,
        num(r["first_pass_cpu"]),
        rss,
        "yes" if r["integrity_ok"] else "NO",
    ]) + " |"


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: bench-tables.py DIR PROFILE [PROFILE...]")
    out = sys.argv[1]
    for profile in sys.argv[2:]:
        with open(f"{out}/{profile}/report.json") as f:
            report = json.load(f)
        print(f"{profile} (memcpy {report['memcpy_gbps']:.1f} GB/s, "
              f"process_vm_readv {report['process_vm_readv_gbps']:.1f} GB/s)\n")
        # Reports written before the bench recorded its machine have none.
        machine = report.get("machine")
        if machine:
            print(f"on {machine['cpu_model']}, {machine['cpus']} CPUs, "
                  f"{machine['memory_gib']:.1f} GiB, Linux {machine['kernel']}\n")
        print(HEADER)
        for r in report["runs"]:
            print(row(r))
        print()


if __name__ == "__main__":
    main()
