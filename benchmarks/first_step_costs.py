"""Which training step to measure zb-auto's costs on: the first against the ones after it.

``PipelineStrategy(schedule="zb-auto")`` rebuilds its order from one step's measured costs
(:func:`~lightning_pp.strategy.auto_schedule.measured_auto_costs`: per (pp rank, chunk) the
typical F, I and W, the engine's per-action overhead, the hop latency). This runs our engine
under zbv (p=4, m=8) on four gloo processes for ``--steps`` steps and prints those costs as each
step would give them, on the virtual device (sleep layers: known t_f = 10 ms, t_i = 15 ms,
t_w = 5 ms per chunk) and on the real-compute transformer (four processes sharing this
machine's cores). The first step pays one-time costs (gloo's lazy pair connections, first
allocations, the split backward's first analysis of each graph shape); the strategy therefore
profiles on the second (``auto_schedule.PROFILE_STEP``).

Usage:
    python benchmarks/first_step_costs.py                 # both workloads, 5 steps each
    python benchmarks/first_step_costs.py --workload sleep --steps 3
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist

from benchmarks import bench_pipeline
from benchmarks.harness import RankStats, launch, machine_info
from benchmarks.workloads import Workload
from lightning_pp.strategy.auto_schedule import measured_auto_costs

MICROBATCHES = 8


def _worker(rank: int, world: int, device, args: tuple[Workload, int]) -> list[dict] | None:
    w, steps = args
    build = bench_pipeline._builder("ours")
    runner, params = build(w, "zbv", world, 2, MICROBATCHES, rank, device, RankStats())
    for i in range(steps):
        x, y = w.batch(MICROBATCHES, step=i % 3)
        bench_pipeline._call_step(runner, x.to(device), y.to(device), [])
        for p in params:
            p.grad = None
    records = runner.records[-steps:]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, records)
    if rank != 0:
        return None
    out = []
    for s in range(steps):
        costs = measured_auto_costs([r[s] for r in everyone])
        out.append(
            {
                "step": s + 1,
                "overhead_s": costs.overhead,
                "latency_s": costs.latency,
                "chunks": {f"{r},{c}": v for (r, c), v in sorted((costs.overrides or {}).items())},
            }
        )
    return out


def _table(rows: list[dict]) -> str:
    lines = ["| step | overhead per action | hop latency | typical F / I / W, first three chunks |"]
    lines.append("|---|---|---|---|")
    for row in rows:
        chunks = " ".join(
            f"({rc}): {v[0] * 1e3:.2f} / {v[2] * 1e3:.2f} / {v[3] * 1e3:.2f}"
            for rc, v in list(row["chunks"].items())[:3]
        )
        lines.append(
            f"| {row['step']} | {row['overhead_s'] * 1e3:.3f} | {row['latency_s'] * 1e3:.3f} | "
            f"{chunks} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", choices=["sleep", "transformer", "both"], default="both")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    workloads = {
        "sleep": Workload("sleep", t_f=0.02, t_b=0.04, t_i=0.03, t_w=0.01),
        "transformer": Workload("transformer", dim=128, seq=64),
    }
    names = list(workloads) if a.workload == "both" else [a.workload]
    print(f"load average at start: {machine_info()['loadavg']}")
    results = {}
    for name in names:
        results[name] = launch(_worker, 4, (workloads[name], a.steps))[0]
        print(f"\n{name}, zbv p=4 m=8, ms\n")
        print(_table(results[name]))
    return results


if __name__ == "__main__":
    main()
