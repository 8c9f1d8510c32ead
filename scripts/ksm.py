"""KSM's sysfs knobs and ksmd's CPU, for the scripts that run ksmd themselves."""
import functools
import os
import sys

KSM = "/sys/kernel/mm/ksm/"


def sysfs(name, value=None):
    """The number in /sys/kernel/mm/ksm/NAME, or, given VALUE, writes it there."""
    path = KSM + name
    if value is None:
        with open(path) as f:
            return int(f.read().split()[0])
    with open(path, "w") as f:
        f.write(str(value))


def reset():
    """Unmerges what an earlier run left merged and stops ksmd."""
    sysfs("run", 2)
    sysfs("run", 0)


@functools.cache
def ksmd_pid():
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and open(f"/proc/{p}/comm").read().strip() == "ksmd":
                return p
        except OSError:
            continue
    sys.exit(f"{os.path.basename(sys.argv[0])}: no ksmd (a kernel without KSM?)")


def ksmd_cpu():
    """ksmd's CPU seconds so far, to the nanosecond (its schedstat)."""
    with open(f"/proc/{ksmd_pid()}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9
