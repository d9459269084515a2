"""Where the test suite's CPU goes: each test file run alone, its CPU-seconds measured machine-wide.

On a 2-core machine the full suite is CPU-bound: its worlds, launched jobs and background jobs
keep both cores busy, so pytest's ``--durations`` (wall time, shared with whatever ran beside)
cannot say which file costs what. This script runs ``python -m pytest -q FILE`` for one file
after another and reads the machine's busy time from ``/proc/stat`` before and after each run,
so every process a file starts (forked world ranks, launched jobs, their launchers) is counted,
whoever reaps it. The machine must be otherwise idle: the figure is machine-wide. Each run also
pays pytest's start and the conftest's imports; the first row, ``(start-up)``, measures that
alone (collecting ``tests/conftest.py``, which holds no test: exit 5), to subtract by eye.

Linux only (``/proc/stat``). Nothing is asserted; docs/testing.md reports a run.

Usage:
    python benchmarks/suite_cpu.py                                 # every tests/test_*.py, ~22 min
    python benchmarks/suite_cpu.py tests/test_engine.py tests/test_strategy.py --out cpu.md
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class FileCost:
    """One run: the file, its exit status, wall seconds and machine-wide busy CPU-seconds."""

    name: str
    rc: int
    wall_s: float
    cpu_s: float


def busy_seconds(stat: str = "/proc/stat") -> float:
    """Busy CPU-seconds of the whole machine since boot: every time column but idle and iowait."""
    with open(stat) as f:
        fields = f.readline().split()
    if fields[0] != "cpu":
        raise ValueError(f"{stat}: the first line is not the machine's total: {fields[:3]}")
    ticks = [int(v) for v in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    # guest time is already inside user (proc(5)); count the columns up to steal only
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def measure(name: str, cmd: list[str], log: str | None = None) -> FileCost:
    """Run ``cmd`` to its end; its wall time and the machine's busy CPU-seconds meanwhile."""
    b0, t0 = busy_seconds(), time.monotonic()
    with open(log or os.devnull, "wb") as out:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    return FileCost(name, rc, time.monotonic() - t0, busy_seconds() - b0)


def table(rows: list[FileCost]) -> str:
    """Markdown, the costliest first, with each file's share of the total."""
    total = sum(r.cpu_s for r in rows) or 1.0
    lines = [
        "| file | CPU s | share | wall s | exit |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: r.cpu_s, reverse=True):
        share = 100 * r.cpu_s / total
        lines.append(f"| {r.name} | {r.cpu_s:.0f} | {share:.1f} % | {r.wall_s:.0f} | {r.rc} |")
    wall = sum(r.wall_s for r in rows)
    lines.append(f"| **total** ({len(rows)} runs) | {total:.0f} | | {wall:.0f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[FileCost]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="test files (default: every tests/test_*.py)")
    ap.add_argument("--out", help="write the table here (markdown) as well as to stdout")
    ap.add_argument("--logs", help="keep each run's output in this directory")
    a = ap.parse_args(argv)
    if not os.path.exists("/proc/stat"):
        sys.exit("suite_cpu: needs Linux's /proc/stat to read the machine's busy time")
    files = a.files or sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py")))
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"suite_cpu: the 1-minute load is {load:.2f}; figures include whatever else runs")
    if a.logs:
        os.makedirs(a.logs, exist_ok=True)
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    # collecting conftest.py alone: pytest's start and the conftest's imports, no test (exit 5)
    runs = [("(start-up)", [*pytest, "--collect-only", os.path.join(ROOT, "tests", "conftest.py")])]
    runs += [(os.path.basename(f).removesuffix(".py"), [*pytest, f]) for f in files]
    rows = []
    for i, (name, cmd) in enumerate(runs):
        log = os.path.join(a.logs, f"{name.strip('()')}.log") if a.logs else None
        rows.append(measure(name, cmd, log))
        r = rows[-1]
        print(f"[{i + 1}/{len(runs)}] {name}: {r.cpu_s:.0f} CPU s, {r.wall_s:.0f} s, exit {r.rc}")
    text = table(rows)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return rows


if __name__ == "__main__":
    main()
