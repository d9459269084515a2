"""A/B of the graph-free split backward inside a running pipeline: the same engine, one world,
steps alternating between the graph freed at ``I`` (``W`` computing Linear and LayerNorm weight
gradients directly, the forward without ``SavedForW`` hooks: the default) and the retained
graph with the engine's ``W`` (``split_backward.DIRECT_WEIGHT_GRADS = False``: what the engine
ran before), on the ``transformer`` workload.

Per-action wall times in a pipeline of 4 processes on 2 cores move by more than the difference
between the two (see docs/benchmarks.md), so the two ways are compared step by step in the same
processes instead of in two runs: rounds of ``--steps`` steps, the order swapped every round,
the first round and each round's first step left out.

Reported per way: the median step time over all ranks, and the mean ``layers`` seconds of the
engine's step records per action kind (the chunk's own computation: forward call, ``I``'s and
``W``'s autograd work) on the ranks that do not hold stage 0 (its ``I`` is a no-op).

Usage:
    python benchmarks/split_free_ab.py --schedule zb-h1 [--rounds 5 --steps 4 --pp 4 -m 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from benchmarks.bench_pipeline import SCHEDULE_VPP
from benchmarks.harness import launch
from benchmarks.ours import build_ours_engine
from benchmarks.workloads import Workload
from lightning_pp.runtime import split_backward

WAYS = ("retained", "freed")


def _worker(rank: int, world: int, device: torch.device, args: Any) -> dict[str, Any]:
    schedule, m, rounds, steps = args
    torch.set_num_threads(1)
    w = Workload("transformer")
    engine, params, _ = build_ours_engine(
        w, schedule, world, SCHEDULE_VPP[schedule], m, rank, device
    )
    x, y = w.batch(m)
    got: dict[str, dict[str, list[float]]] = {way: {"step": []} for way in WAYS}
    freed: dict[str, list[bool]] = {}  # per way: which local chunks' I freed the graph
    for rnd in range(rounds):
        for way in WAYS if rnd % 2 == 0 else tuple(reversed(WAYS)):
            split_backward.DIRECT_WEIGHT_GRADS = way == "freed"
            engine.graph_free = [False] * len(engine.graph_free)  # the chunks learn it again
            for i in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                res = engine.train_step((x, y))
                dt = time.perf_counter() - t0
                for p in params:
                    p.grad = None
                if rnd == 0 or i == 0:
                    continue
                got[way]["step"].append(dt)
                for e in res.record.events:
                    got[way].setdefault(e.action.op.name, []).append(e.layers or 0.0)
            freed[way] = [f for f, p in zip(engine.graph_free, engine.places) if not p.first]
    split_backward.DIRECT_WEIGHT_GRADS = True
    out: dict[str, Any] = {
        way: {
            k: (statistics.median(v) if k == "step" else statistics.mean(v)) * 1e3
            for k, v in d.items()
        }
        for way, d in got.items()
    }
    return out | {"first": any(p.first for p in engine.places), "chunks_freed": freed}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="zb-h1", choices=["zb-h1", "zbv"])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("-m", "--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    res = launch(
        _worker, args.pp, (args.schedule, args.microbatches, args.rounds, args.steps), timeout=1800
    )
    print(
        f"{args.schedule}, pp={args.pp}, m={args.microbatches}, transformer workload "
        f"({args.rounds - 1} rounds x {args.steps - 1} steps per way)"
    )
    out: dict[str, Any] = {}
    for way in WAYS:
        step = statistics.median(r[way]["step"] for r in res)
        rest = [r[way] for r in res if not r["first"]]
        ops = {
            op: statistics.mean(r[op] for r in rest)
            for op in ("F", "I", "W")
            if rest and op in rest[0]
        }
        out[way] = {"step_ms": step, **{f"{op}_ms": v for op, v in ops.items()}}
        print(
            f"  {way:9s} step {step:7.1f} ms   "
            + "  ".join(f"{op} {v:6.2f}" for op, v in ops.items())
        )
    print(f"  freed / retained step: {out['freed']['step_ms'] / out['retained']['step_ms']:.3f}")
    # which chunks (not holding stage 0) freed the graph at I, per way, over the ranks
    out["chunks_freed"] = {way: [f for r in res for f in r["chunks_freed"][way]] for way in WAYS}
    return out


if __name__ == "__main__":
    main()
