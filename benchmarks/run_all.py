"""Reproduce every benchmark: both workloads, the full sweep, the strategy overhead, the report.

Usage:
    python benchmarks/run_all.py --out benchmarks/results            # full (~15 min on 2 cores)
    python benchmarks/run_all.py --out /tmp/bench --quick             # a few minutes
    python benchmarks/run_all.py --out benchmarks/results --device cuda   # NCCL, one GPU per rank

Writes ``raw_<workload>.jsonl`` (one record per configuration and implementation), the
lookahead/monitor ablation ``raw_ablation.jsonl``, the strategy overhead table
``strategy_overhead.md``, ``results.md`` (tables + target verdicts)
and ``bench_<workload>.png`` into ``--out``; with ``--docs-img DIR`` the PNGs are copied there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_pipeline, report
from benchmarks.workloads import Workload


def _workload(name: str, quick: bool) -> Workload:
    if name == "sleep":
        # quick: the same shape at a quarter of the cost (the ratios are what matter)
        return Workload("sleep", t_f=0.005, t_b=0.010) if quick else Workload("sleep")
    return Workload("transformer", dim=64 if quick else 128, seq=32 if quick else 64)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="fewer configurations and steps")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument(
        "--workloads", nargs="+", default=["sleep", "transformer", "ablation", "strategy"]
    )
    ap.add_argument("--pp", type=int, nargs="+", default=None)
    ap.add_argument("--microbatches", type=int, nargs="+", default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--docs-img", default=None, help="also copy the PNGs here (docs/img)")
    a = ap.parse_args(argv)

    pps = a.pp or [2, 4]
    ms = a.microbatches or ([4, 8] if a.quick else [4, 8, 16])
    rounds = a.rounds or (2 if a.quick else 4)
    steps = a.steps or (2 if a.quick else 3)
    os.makedirs(a.out, exist_ok=True)
    raws = []
    command = " ".join(["python"] + sys.argv)
    for wl in a.workloads:
        if wl in ("strategy", "ablation"):
            continue
        w = _workload(wl, a.quick)
        path = os.path.join(a.out, f"raw_{wl}.jsonl")
        if os.path.exists(path):
            os.remove(path)
        t0 = time.time()
        info = bench_pipeline.machine_info()
        recs = bench_pipeline.run(
            w,
            pps,
            ms,
            ["gpipe", "1f1b", "interleaved"],
            bench_pipeline.IMPLS,
            rounds,
            steps,
            2,
            a.device,
        )
        end = bench_pipeline.machine_info()
        bench_pipeline.write_records(path, recs, info, end, command)
        print(f"{wl}: {len(recs)} records in {time.time() - t0:.0f}s -> {path}", flush=True)
        raws.append(path)
    extra = ""
    if "ablation" in a.workloads:
        # What the engine's receive lookahead and the failure monitor are worth, same run.
        w = _workload("transformer", a.quick)
        path = os.path.join(a.out, "raw_ablation.jsonl")
        if os.path.exists(path):
            os.remove(path)
        info = bench_pipeline.machine_info()
        recs = bench_pipeline.run(
            w,
            pps,
            [8],
            ["1f1b", "interleaved"],
            ("ours", "ours-L1", "ours-nomon", "torch"),
            rounds,
            steps + 1,
            2,
            a.device,
        )
        bench_pipeline.write_records(path, recs, info, bench_pipeline.machine_info(), command)
        extra += (
            "## Ablation: receive lookahead and failure monitor (transformer, m=8)\n\n"
            f"- command: `{command}`; load average at start {info['loadavg']}\n"
            "- `ours`: defaults (receives up to 8 actions ahead, failure monitor on); "
            "`ours-L1`: receives posted just in time (the NCCL setting); `ours-nomon`: "
            "monitor off (`abort_on_failure=False`)\n\n" + report.ablation_table(recs) + "\n"
        )
    if "strategy" in a.workloads:
        from benchmarks import bench_strategy

        extra_path = os.path.join(a.out, "strategy_overhead.md")
        bench_strategy.main(
            ["--out", extra_path, "--device", a.device] + (["--quick"] if a.quick else [])
        )
        extra += open(extra_path).read()
    if raws:
        md, rows = report.render(report.load(raws), extra)
        with open(os.path.join(a.out, "results.md"), "w") as f:
            f.write("# lightning_pp vs torch.distributed.pipelining\n\n" + md)
        for wl in ("sleep", "transformer"):
            png = os.path.join(a.out, f"bench_{wl}.png")
            report.plot(rows, wl, png)
            if a.docs_img and os.path.exists(png):
                os.makedirs(a.docs_img, exist_ok=True)
                shutil.copy(png, os.path.join(a.docs_img, f"bench_{wl}.png"))
        print(md)


if __name__ == "__main__":
    main()
