"""Where our engine's step loses time against the bare executor of the same order, per action.

Issue 36's benchmark puts our ``zb-auto`` 2.5-2.8 % of a step behind ``benchmarks/bare.py``
running the very same actions. This script says where: one process group of ``pp`` ranks on
the virtual device (sleep layers with split costs ``t_f : t_i : t_w``), our engine and the bare
executor built side by side, their steps alternating (ABBA), and per rank:

* the step time (the pipeline's, as every benchmark measures it) and the CPU time of the rank;
* ``fill``: how long the rank's first action waited for its input (the pipeline's start-up);
* ``busy``: the rank's time in its actions, less the time blocked on receives;
* the mean busy time of one ``F``, ``B`` (a fused backward), ``I`` and ``W``: ours from the
  engine's step records, bare from its per-action log (``build_bare_step(..., log=...)``).

The rank the step waits for is the one whose ``fill + busy`` is largest; the difference of its
per-op means between the two executors is our engine's own cost per action on the critical
path. ``--variants`` adds our engine with one of its options off, in the same rotation, to
price that option: ``ours-nomon`` (``abort_on_failure=False``: no failure monitor, no landing
marks, plain blocking waits) and ``ours-norelease`` (``release_outputs=False``). Nothing is
asserted; docs/benchmarks.md reports a run.

Usage:
    python benchmarks/ops_vs_bare.py                          # zb-auto-2p, 1 : 1.5 : 0.5, p=4, m=8
    python benchmarks/ops_vs_bare.py --schedule zbv --ratio 1:1:1 --rounds 12
    python benchmarks/ops_vs_bare.py --rounds 40 --variants ours-nomon ours-norelease
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.bare import build_bare_step
from benchmarks.bench_pipeline import SCHEDULE_VPP, TORCH_ONLY
from benchmarks.bench_zb_auto import _with_costs
from benchmarks.harness import RankStats, launch, timed_step
from benchmarks.ours import build_ours_step
from benchmarks.workloads import Workload
from lightning_pp.schedules import Costs

#: our engine with one option off (``build_ours_step``'s keyword arguments)
VARIANTS: dict[str, dict[str, bool]] = {
    "ours-nomon": {"monitor": False},
    "ours-norelease": {"release_outputs": False},
}


def _workload(ratio: tuple[float, float, float], t: float, overhead: float) -> Workload:
    """The sleep workload of ``bench_zb_auto`` at ``ratio`` (``t``: t_f of a rank's share), with
    the costs zb-auto plans with: the layers' own and ``overhead`` per action."""
    f, i, w = ratio
    sleep = Workload("sleep", t_f=f * t, t_b=(i + w) * t, t_i=i * t, t_w=w * t)
    costs = Costs(t_f=f * t, t_b=(i + w) * t, t_i=i * t, t_w=w * t, overhead=overhead)
    return _with_costs(sleep, costs)


def _worker(rank: int, world: int, device: torch.device, args: tuple) -> dict[str, list]:
    schedule, m, rounds, ratio, t, overhead, impls = args
    w = _workload(ratio, t, overhead)
    vpp = SCHEDULE_VPP[schedule]
    bare_log: list[tuple[str, float, float]] = []
    steps = {}
    for impl in impls:
        if impl == "bare":
            steps[impl] = build_bare_step(
                w, schedule, world, vpp, m, rank, device, RankStats(), bare_log
            )[0]
        else:
            options = VARIANTS.get(impl, {})
            steps[impl] = build_ours_step(
                w, schedule, world, vpp, m, rank, device, RankStats(), **options
            )[0]
    x, y = w.batch(m)
    out: dict[str, list] = {impl: [] for impl in impls}
    for rnd in range(rounds):
        for impl in impls if rnd % 2 == 0 else impls[::-1]:
            c0 = time.process_time()
            wall, _, _ = timed_step(lambda impl=impl: steps[impl](x, y), device)
            cpu = time.process_time() - c0
            if rnd < 2:  # warm-up rounds
                continue
            if impl == "bare":
                log = list(bare_log)
            else:
                rec = steps[impl].records[-1]  # type: ignore[attr-defined]
                log = [(e.action.op.value, e.duration, e.comm_wait) for e in rec.events]
            out[impl].append((wall, cpu, log))
    return out


def summarize(results: list[dict[str, list]]) -> list[str]:
    """Markdown rows: per implementation and rank, the medians over the measured steps."""
    rows = [
        "| impl | rank | step ms | CPU ms | fill ms | busy ms | F ms | B ms | I ms | W ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    med = statistics.median
    for impl in results[0]:
        for rank, res in enumerate(results):
            runs = res[impl]

            def per_op(op: str, runs: list = runs) -> str:
                means = [
                    statistics.mean(d - b for o, d, b in log if o == op)
                    for _, _, log in runs
                    if any(o == op for o, _, _ in log)
                ]
                return f"{med(means) * 1e3:.2f}" if means else "-"

            rows.append(
                f"| {impl} | {rank} | {med(r[0] for r in runs) * 1e3:.1f} "
                f"| {med(r[1] for r in runs) * 1e3:.1f} "
                f"| {med(r[2][0][2] for r in runs) * 1e3:.1f} "
                f"| {med(sum(d - b for _, d, b in r[2]) for r in runs) * 1e3:.1f} "
                f"| {per_op('F')} | {per_op('B')} | {per_op('I')} | {per_op('W')} |"
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--schedule", default="zb-auto-2p")
    ap.add_argument("--ratio", default="1:1.5:0.5", help="t_f:t_i:t_w")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds, 2 of them warm-up")
    ap.add_argument("--t", type=float, default=0.020, help="t_f of one rank's share (s)")
    ap.add_argument(
        "--overhead", type=float, default=0.00095, help="per-action overhead zb-auto plans with (s)"
    )
    ap.add_argument(
        "--variants", nargs="*", default=[], choices=list(VARIANTS), help="ours with an option off"
    )
    a = ap.parse_args(argv)
    ours = sorted(set(SCHEDULE_VPP) - TORCH_ONLY)
    if a.schedule not in ours:
        ap.error(f"--schedule {a.schedule!r}: expected one of ours, {ours}")
    if a.rounds < 3:
        ap.error(f"--rounds must be at least 3 (2 are warm-up), got {a.rounds}")
    ratio = tuple(float(v) for v in a.ratio.split(":"))
    if len(ratio) != 3:
        ap.error(f"--ratio needs three numbers t_f:t_i:t_w, got {a.ratio!r}")
    torch.set_num_threads(1)
    load = os.getloadavg()
    impls = ("ours", *a.variants, "bare")
    args = (a.schedule, a.microbatches, a.rounds, ratio, a.t, a.overhead, impls)
    results = launch(_worker, a.pp, args, timeout=1800)
    print(
        f"{a.schedule}, t_f:t_i:t_w = {a.ratio} (t_f = {a.t * 1e3:g} ms per rank share), "
        f"p={a.pp}, m={a.microbatches}, {a.rounds - 2} measured steps each, alternating; "
        f"load average at start {load[0]:.2f}"
    )
    print("\n".join(summarize(results)))


if __name__ == "__main__":
    main()
