"""How late a blocked pipeline wait notices that its work completed, and what the wait costs.

Every blocking wait of the engine goes through :class:`~lightning_pp.runtime.failure.FailureMonitor`
(abort channel, hang watchdog). Under NCCL its works report completion, and the monitor polls
``is_completed()`` with a sleep between polls; under gloo a helper thread runs the blocking
``wait()`` and hands the result back. Either way, the time from completion to the wait's return
is added to the hop whenever a rank waits on the pipeline's critical path.

This measures it with stand-in works that complete at a known time (no process group, no GPU):
for waits of 0.5-100 ms, the delay between completion and return (median and max of
``--repeats``) and the CPU the waiting thread used per second of waiting.

Usage:
    python benchmarks/poll_latency.py              # both modes
    python benchmarks/poll_latency.py --repeats 50
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_pp.runtime.failure import FailureMonitor

WAITS_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 100.0)


class _PolledWork:
    """An NCCL-like work: ``is_completed()`` turns true at ``at`` (``perf_counter`` time)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.at

    def wait(self) -> bool:
        return True


class _BlockingWork(_PolledWork):
    """A gloo-like work: ``wait()`` blocks until ``at``; ``is_completed()`` stays false."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        left = self.at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return True


def measure(poll_works: bool, wait_s: float, repeats: int) -> tuple[float, float, float]:
    """``(median delay, max delay, CPU seconds per second waited)`` of ``repeats`` waits."""
    monitor = FailureMonitor(None, 0, poll_works=poll_works, watchdog_timeout=60.0)
    work_type = _PolledWork if poll_works else _BlockingWork
    late = []
    cpu0, waited = time.thread_time(), 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        work = work_type(t0 + wait_s)
        monitor.wait([work], "a stand-in work")
        end = time.perf_counter()
        late.append(end - work.at)
        waited += end - t0
    return statistics.median(late), max(late), (time.thread_time() - cpu0) / waited


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args(argv)
    print(f"load average at start {os.getloadavg()[0]:.2f}; {a.repeats} waits each")
    print("| mode | wait ms | returned late by (median) ms | max ms | CPU per second waited |")
    print("|---|---|---|---|---|")
    for poll_works, mode in ((True, "NCCL-style polling"), (False, "gloo-style helper thread")):
        for ms in WAITS_MS:
            med, worst, cpu = measure(poll_works, ms / 1e3, a.repeats)
            print(f"| {mode} | {ms:g} | {med * 1e3:.2f} | {worst * 1e3:.2f} | {100 * cpu:.1f} % |")


if __name__ == "__main__":
    main()
