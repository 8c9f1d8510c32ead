#!/bin/sh
# Every table of docs/BENCHMARKS.md that `rksm bench` measures: one invocation per profile,
# ksmd's and rksm's rows side by side, one run of each row. Each report (Markdown with the
# goals' verdict lines, JSON with the time series, an SVG plot) goes to OUT/<profile>/.
#
#   cargo xtask build && sudo scripts/bench-report.sh [OUT]
#
# Takes about 20 minutes on two cores; needs about 17 GiB free for the 16 GiB profile.
set -eu
out=${1:-bench-report}
rksm=${RKSM:-target/release/rksm}
run() {
    profile=$1 seconds=$2 only=$3
    shift 3
    "$rksm" --no-config bench --profile "$profile" --seconds "$seconds" \
        --only "$only" --repeat 1 --out "$out/$profile" "$@"
}
# What rksm costs against ksmd and hash-only, and each dirty mode, both checksums.
# ksmd-duplicates: ksmd told only the duplicates, the floor of what merging them costs it.
run static 30 ksmd,ksmd-tuned,ksmd-advisor,ksmd-duplicates,hash-only,pagemap,ebpf
run static-4g 30 ksmd-tuned,ksmd-advisor,ksmd-duplicates,hash-only,pagemap,ebpf,ebpf-read --checksum xxh64
# New memory: sampled against read whole, where a quarter is duplicated, at 4 and 16 GiB,
# and where every page looks alike to the sample.
run quarter-4g 30 ksmd-tuned,ksmd-duplicates,ebpf,ebpf-read --checksum xxh64
run quarter-16g 45 hash-only,ebpf,ebpf-read --checksum xxh64
run alike-4g 30 ebpf,ebpf-read --checksum xxh64
