#!/bin/sh
# Where rksm's heap goes once it has converged: starts the four workloads of PROFILE, runs
# the daemon under heaptrack, kills it after pass PASSES (so what is live then is what
# heaptrack calls leaked), and prints the live heap by the two innermost rksm frames that
# allocated it, with rksm's VmRSS and VmHWM at that moment. With `maps` as third argument it
# runs the daemon as it is (no heaptrack, which has an allocator of its own) and prints its
# resident memory by mapping instead (the heap, the tracer's ring, the program's own pages,
# and every mapping above 1 MiB with its size), then, where gdb is installed, has the daemon
# print glibc's malloc_stats (the heap in use) and call malloc_trim, and prints VmRSS after.
#
#   cargo xtask build && sudo scripts/heap-profile.sh quarter-16g 8
#   cargo xtask build && sudo scripts/heap-profile.sh quarter-16g 8 maps
#
# Needs heaptrack (apt install heaptrack) and python3.
set -eu
profile=${1:-quarter-4g}
passes=${2:-8}
what=${3:-heap}
rksm=${RKSM:-target/release/rksm}
dir=$(mktemp -d)
trap 'kill $(cat "$dir"/w*.pid) 2>/dev/null || true; rm -rf "$dir"' EXIT
for i in 0 1 2 3; do
    # A workload runs until its input ends: held open here, on fds 3 to 6, until exit.
    mkfifo "$dir/in$i"
    eval "exec $((i + 3))<>\"\$dir/in$i\""
    "$rksm" --no-config workload --profile "$profile" --index $i <"$dir/in$i" >"$dir/w$i.out" &
    echo $! >"$dir/w$i.pid"
done
pids=""
for i in 0 1 2 3; do
    until grep -q ready "$dir/w$i.out" 2>/dev/null; do sleep 0.2; done
    pids="$pids --pid $(cat "$dir/w$i.pid")"
done
if [ "$what" = maps ]; then
    # shellcheck disable=SC2086
    "$rksm" --no-config daemon $pids --dirty ebpf --interval 1 --passes 1000 \
        2>"$dir/daemon.err" >/dev/null &
    until grep -q "pass $passes " "$dir/daemon.err" 2>/dev/null; do sleep 0.5; done
    daemon=$(pgrep -f "^$rksm --no-config daemon" | head -1)
    grep -E "VmRSS|VmHWM|RssAnon|RssFile" "/proc/$daemon/status"
    python3 - "/proc/$daemon/smaps" <<'PY'
import collections, sys
rss, name = collections.Counter(), None
for line in open(sys.argv[1]):
    fields = line.split()
    if "-" in fields[0] and not fields[0].endswith(":"):
        name = fields[5] if len(fields) > 5 else "[anonymous]"
        span = fields[0]
    elif fields[0] == "Rss:":
        rss[name] += int(fields[1])
        start, end = (int(x, 16) for x in span.split("-"))
        if int(fields[1]) > 1024:
            print(f"{(end - start) >> 10:9d} KiB mapped, {int(fields[1]):9d} KiB resident  {name}")
for name, kib in rss.most_common(8):
    print(f"{kib / 1024:8.1f} MiB  {name}")
PY
    if command -v gdb >/dev/null; then
        gdb -p "$daemon" -batch -ex 'call (void)malloc_stats()' -ex 'call (int)malloc_trim(0)' \
            >/dev/null 2>&1 || true
        grep -A3 "^Arena 0:" "$dir/daemon.err" || true
        echo "after malloc_trim: $(grep VmRSS "/proc/$daemon/status")"
    fi
    kill "$daemon"
    exit 0
fi
# shellcheck disable=SC2086
heaptrack -o "$dir/heap" "$rksm" --no-config daemon $pids --dirty ebpf --interval 1 \
    --passes 1000 2>"$dir/daemon.err" >/dev/null &
until grep -q "pass $passes " "$dir/daemon.err" 2>/dev/null; do sleep 0.5; done
daemon=$(pgrep -f "^$rksm --no-config daemon" | head -1)
grep -E "VmRSS|VmHWM" "/proc/$daemon/status"
kill -9 "$daemon"
sleep 5
heaptrack_print -f "$dir"/heap.zst --print-peaks 0 --print-allocators 0 --print-temporary 0 \
    --print-leaks 0 -F "$dir/stacks" --flamegraph-cost-type leaked >/dev/null
python3 - "$dir/stacks" <<'PY'
import collections, re, sys
live = collections.Counter()
for line in open(sys.argv[1]):
    stack, cost = line.rsplit(" ", 1)
    frames = [re.sub(r"::h[0-9a-f]{16}", "", f) for f in stack.split(";") if f.startswith("rksm::")]
    live[" < ".join(reversed(frames[-2:])) or "(outside rksm)"] += int(cost)
print(f"live heap {sum(live.values()) / 1e6:.1f} MB")
for site, size in live.most_common(12):
    print(f"{size / 1e6:8.2f} MB  {site[:140]}")
PY
