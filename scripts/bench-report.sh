#!/bin/sh
# Measures rksm against its goals (docs/BENCHMARKS.md, "Goals"): every profile a goal is set
# on, ksmd-tuned and rksm's rows side by side in one invocation per profile. Each report
# (Markdown, JSON, SVG) goes to OUT/<profile>/; the verdict lines end each report.
#
#   cargo xtask build && sudo scripts/bench-goals.sh [OUT]
#
# Takes about 20 minutes on two cores; needs about 17 GiB free for the 16 GiB profile.
set -eu
out=${1:-bench-goals}
rksm=${RKSM:-target/release/rksm}
run() {
    profile=$1 seconds=$2 only=$3
    "$rksm" --no-config bench --profile "$profile" --seconds "$seconds" \
        --only "$only" --checksum xxh64 --repeat 1 --out "$out/$profile"
}
run quarter-4g 30 ksmd-tuned,ebpf,ebpf-read
run static-4g 30 ksmd-tuned,hash-only,ebpf,ebpf-read
run alike-4g 30 ebpf,ebpf-read
run quarter-16g 45 ebpf,ebpf-read
run static 30 ksmd-tuned,ebpf
