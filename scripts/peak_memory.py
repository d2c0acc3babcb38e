"""Run a command and report its peak memory, split into anonymous and file-backed pages.

``/usr/bin/time -v`` reports the peak resident set size, which counts the pages of memory-mapped
files the process has read (clean page cache the kernel may drop at any time) together with the
memory the process allocated. This samples ``/proc/PID/status`` of the command and its children
every ``--interval`` seconds and prints, as JSON, the peak ``RssAnon`` (allocated memory: what can
run the machine out of memory), the peak ``VmRSS``, the wall time and the exit status.
``--kill-above-gb`` stops the command (SIGKILL to its process group) once its anonymous memory
passes the bound, so a measurement of a converter that would exhaust a shared machine ends as a
finding instead of an out-of-memory kill of someone else's process::

    python scripts/peak_memory.py --kill-above-gb 18 -- dsv2-mlc compile MODEL -o OUT ...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _status_kb(pid: int) -> dict[str, int]:
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0])
    except OSError:
        pass
    return fields


def _tree_kb(root: int) -> dict[str, int]:
    total = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    stack = [root]
    while stack:
        pid = stack.pop()
        for key, kb in _status_kb(pid).items():
            total[key] += kb
        stack += _children(pid)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--kill-above-gb", type=float, default=None)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)
    peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    killed = False
    while proc.poll() is None:
        now = _tree_kb(proc.pid)
        peak = {k: max(peak[k], now[k]) for k in peak}
        if args.kill_above_gb and now["RssAnon"] > args.kill_above_gb * 1e6:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            proc.wait()
            break
        time.sleep(args.interval)
    report = {
        "cmd": " ".join(cmd),
        "returncode": proc.returncode,
        "killed_above_gb": args.kill_above_gb if killed else None,
        "wall_s": round(time.perf_counter() - start, 1),
        "peak_anon_gb": round(peak["RssAnon"] / 1e6, 2),
        "peak_rss_gb": round(peak["VmRSS"] / 1e6, 2),
        "peak_file_gb": round(peak["RssFile"] / 1e6, 2),
    }
    print(json.dumps(report), file=sys.stderr)


if __name__ == "__main__":
    main()
