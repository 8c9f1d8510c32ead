"""The four workload processes of a profile, for the scripts that run daemons over them.

    with workloads.running(rksm, "quarter-4g") as pids:
        subprocess.run([rksm, "--no-config", "daemon", *pids, ...])
"""
import contextlib
import subprocess


@contextlib.contextmanager
def running(rksm, profile, extra=()):
    """Starts the four workloads of PROFILE with the RKSM binary (with EXTRA arguments, such
    as `--mark-duplicates`), waits until each has filled its memory, and gives the daemon's
    `--pid` arguments for them; they are killed and reaped on leaving. A workload that exits
    before it is ready is an error, not a wait."""
    workloads = [
        subprocess.Popen(
            [rksm, "--no-config", "workload", "--profile", profile, "--index", str(i),
             *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for i in range(4)
    ]
    try:
        for w in workloads:
            while True:
                line = w.stdout.readline()
                if not line:
                    raise RuntimeError(f"workload {w.pid} of {profile} exited before it was "
                                       f"ready (status {w.wait()})")
                if "ready" in line:
                    break
        yield [arg for w in workloads for arg in ("--pid", str(w.pid))]
    finally:
        for w in workloads:
            w.kill()
        for w in workloads:
            w.wait(timeout=30)
