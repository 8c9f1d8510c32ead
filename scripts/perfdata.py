"""Samples of a `perf record --call-graph` file, for the scripts that file them by mechanism."""
import subprocess


def samples(data):
    """(time, period, [frames, innermost first]) of every sample in perf data `data`."""
    out = subprocess.run(["perf", "script", "-i", data, "-F", "time,period,ip,sym"],
                         capture_output=True, text=True, check=True).stdout
    for block in out.split("\n\n"):
        lines = [l.strip() for l in block.strip().splitlines()]
        if not lines:
            continue
        head = lines[0].split()
        if len(head) < 2 or not head[1].isdigit():
            continue
        frames = [l.split(None, 1)[1] if " " in l else l for l in lines[1:]]
        yield float(head[0].rstrip(":")), int(head[1]), frames
