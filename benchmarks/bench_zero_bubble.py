"""Zero-bubble benchmark: lightning_pp's zb-h1 and zbv against its 1f1b / interleaved and
against torch.distributed.pipelining's Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble (``izb``, 2 stages per rank; at 1 stage per rank it is torch's
ZB-H1, row ``zb-h1``) and ScheduleZBVZeroBubble, on the same layers, in one process group per
workload, alternating implementations (see ``bench_pipeline.py``).

* ``sleep``: virtual-device layers whose backward is two timed autograd nodes, t_f = t_i = t_w
  (20 ms each per rank share: t_b = 40 ms). "ideal" is the simulator's makespan with those costs.
* ``transformer``: real compute; t_f, t_b (our 1f1b's B) and t_i, t_w (our zb-h1's I and W) are
  measured per action in the same run by the engine's step records; peak saved activation bytes
  per rank against the schedule's bound.

Each workload also runs ``bare`` (``benchmarks/bare.py``): our schedules' actions with nothing
but the layers, the autograd calls and gloo's posted receives and sends. Its rows are no target.
On the sleep workload they say what any executor pays on this machine, so a missed makespan
target splits into the machine's share (bare / simulated) and the engine's (ours / bare). On the
transformer it is no lower bound: its W re-enters the retained graph, where ours frees the
graph at I and computes weight gradients directly.

Usage:
    python benchmarks/bench_zero_bubble.py --out benchmarks/results/zero_bubble.md
    python benchmarks/bench_zero_bubble.py --out /tmp/zb.md --quick   # a minute, toy sizes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_pipeline
from benchmarks.workloads import Workload
from lightning_pp.schedules import Costs, Op, build_schedule, simulate

OURS = ("1f1b", "interleaved", "zb-h1", "zbv")
TORCH = ("1f1b", "interleaved", "zb-h1", "izb", "zbv")
TORCH_NAMES = {
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble (1 stage/rank)",
    "izb": "ScheduleInterleavedZeroBubble (2 stages/rank)",
    "zbv": "ScheduleZBVZeroBubble",
}


def _median_ms(rec: dict) -> float:
    return statistics.median(rec["step_s"]) * 1e3


def _iqr_ms(rec: dict) -> str:
    q = statistics.quantiles(rec["step_s"], n=4) if len(rec["step_s"]) > 1 else rec["step_s"] * 3
    return f"{q[0] * 1e3:.1f}-{q[-1] * 1e3:.1f}"


def _ideal_ms(schedule: str, pp: int, m: int, costs: Costs) -> float | None:
    if schedule == "izb":
        return None
    return (
        simulate(
            build_schedule(
                schedule, pp=pp, microbatches=m, vpp=bench_pipeline.SCHEDULE_VPP[schedule]
            ),
            costs,
        ).makespan
        * 1e3
    )


def _bound_bytes(schedule: str, pp: int, m: int, rank: int, chunk_bytes: list[float]) -> float:
    """The schedule's activation bound on ``rank``: walk its order, add one microbatch's saved
    bytes on F, release on B or W (a split backward's graph lives until W); the maximum."""
    s = build_schedule(schedule, pp=pp, microbatches=m, vpp=bench_pipeline.SCHEDULE_VPP[schedule])
    held = peak = 0.0
    for a in s.ranks[rank]:
        if a.op is Op.F:
            held += chunk_bytes[a.chunk]
        elif a.op in (Op.B, Op.W):
            held -= chunk_bytes[a.chunk]
        peak = max(peak, held)
    return peak


def _sweep(
    w: Workload, pp: int, m: int, rounds: int, steps: int, device: str, impls: tuple[str, ...]
) -> list[dict]:
    schedules = [s for s in dict.fromkeys(OURS + TORCH)]
    return bench_pipeline.run(w, [pp], [m], schedules, impls, rounds, steps, 2, device)


def _table(recs: list[dict], costs: Costs | None) -> tuple[str, dict]:
    rows = [
        "| impl | schedule | step ms (median) | IQR ms | ideal ms | step/ideal | peak act KiB per "
        "rank | bound KiB per rank | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    med: dict[tuple[str, str], float] = {}
    for r in recs:
        key = (r["impl"], r["schedule"])
        med[key] = _median_ms(r)
        pp, m = r["pp"], r["microbatches"]
        ideal = _ideal_ms(r["schedule"], pp, m, costs) if costs is not None else None
        peaks = [max(p) / 1024 for p in r["peak_saved_bytes"]]
        bound = ""
        if r["impl"] == "ours":
            bound = " / ".join(
                f"{_bound_bytes(r['schedule'], pp, m, k, r['chunk_act_bytes'][k]) / 1024:.0f}"
                for k in range(pp)
            )
        name = TORCH_NAMES[r["schedule"]] if r["impl"] == "torch" else r["schedule"]
        rows.append(
            f"| {r['impl']} | {name} | {med[key]:.1f} | {_iqr_ms(r)} | "
            f"{'' if ideal is None else f'{ideal:.1f}'} | "
            f"{'' if ideal is None else f'{med[key] / ideal:.3f}'} | "
            f"{' / '.join(f'{p:.0f}' for p in peaks)} | {bound} | "
            f"{statistics.mean(r['losses']) if r['losses'] else float('nan'):.6f} |"
        )
    return "\n".join(rows), med


def _verdicts(med: dict, recs: list[dict], costs: Costs) -> str:
    out = ["| target | measured | verdict |", "|---|---|---|"]

    def row(name: str, value: float, limit: float, detail: str) -> None:
        out.append(
            f"| {name} <= {limit} | {value:.3f} ({detail}) | "
            f"{'PASS' if value <= limit else 'MISS'} |"
        )

    ref = med[("ours", "1f1b")]
    row(
        "our zbv / our 1f1b",
        med[("ours", "zbv")] / ref,
        0.80,
        f"{med[('ours', 'zbv')]:.1f} / {ref:.1f} ms",
    )
    row(
        "our zb-h1 / our 1f1b",
        med[("ours", "zb-h1")] / ref,
        0.87,
        f"{med[('ours', 'zb-h1')]:.1f} / {ref:.1f} ms",
    )
    ours_best = min((v, k[1]) for k, v in med.items() if k[0] == "ours")
    torch_best = min((v, k[1]) for k, v in med.items() if k[0] == "torch")
    row(
        "our best / torch's best",
        ours_best[0] / torch_best[0],
        0.95,
        f"ours {ours_best[1]} {ours_best[0]:.1f} ms, torch {torch_best[1]} {torch_best[0]:.1f} ms",
    )
    for r in recs:
        if r["impl"] != "ours":
            continue
        ideal = _ideal_ms(r["schedule"], r["pp"], r["microbatches"], costs)
        row(
            f"our {r['schedule']} / simulated makespan",
            med[("ours", r["schedule"])] / ideal,
            1.08,
            f"{med[('ours', r['schedule'])]:.1f} / {ideal:.1f} ms",
        )
    bare = [r for r in recs if r["impl"] == "bare"]
    if bare:
        out += ["", "| bare executor (no target) | bare / simulated | ours / bare |"]
        out += ["|---|---|---|"]
    for r in bare:
        s = r["schedule"]
        ideal = _ideal_ms(s, r["pp"], r["microbatches"], costs)
        out.append(
            f"| {s} | {med[('bare', s)] / ideal:.3f} ({med[('bare', s)]:.1f} / {ideal:.1f} ms)"
            f" | {med[('ours', s)] / med[('bare', s)]:.3f} |"
        )
    if ("bare", "zbv") in med and ("bare", "1f1b") in med:
        out.append(
            f"| bare zbv / bare 1f1b | {med[('bare', 'zbv')] / med[('bare', '1f1b')]:.3f} "
            f"(the zbv / 1f1b target, bare) | |"
        )
    return "\n".join(out)


def _op_costs(recs: list[dict]) -> str:
    """Measured per-action compute (ms, mean over ranks and chunks) from our engine's records."""
    by = {r["schedule"]: r for r in recs if r["impl"] == "ours"}

    def mean_op(schedule: str, k: int) -> float:
        vals = [row[k] for row in by[schedule]["op_compute_s"] if row[k] >= 0]
        return statistics.mean(vals) * 1e3 if vals else float("nan")

    tf, tb = mean_op("1f1b", 0), mean_op("1f1b", 1)
    ti, tw = mean_op("zb-h1", 2), mean_op("zb-h1", 3)
    ratio = (ti + tw) / tb
    return (
        f"- measured per action (mean over ranks, ms): t_f = {tf:.2f}, t_b = {tb:.2f} (1f1b's B), "
        f"t_i = {ti:.2f}, t_w = {tw:.2f} (zb-h1's I and W); zbv chunk (half a stage): "
        f"t_i = {mean_op('zbv', 2):.2f}, t_w = {mean_op('zbv', 3):.2f}\n"
        f"- **(t_i + t_w) / t_b = {ratio:.3f}** (target <= 1.10: "
        f"{'PASS' if ratio <= 1.10 else 'MISS'}); the first stage's I is a no-op (its W holds "
        f"the whole backward), so these means are over every stage\n",
        Costs(t_f=tf / 1e3, t_b=tb / 1e3, t_i=ti / 1e3, t_w=tw / 1e3),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/zero_bubble.md")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--workloads", nargs="+", default=["sleep", "transformer"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--no-bare", action="store_true", help="skip the bare executor's rows")
    a = ap.parse_args(argv)
    impls = ("ours", "torch") if a.no_bare else ("ours", "torch", "bare")
    rounds = a.rounds or (2 if a.quick else 4)
    steps = a.steps or (2 if a.quick else 3)
    t = 0.005 if a.quick else 0.020
    command = " ".join(["python"] + sys.argv)
    md = [
        f"# Zero-bubble schedules: lightning_pp vs torch.distributed.pipelining\n\n"
        f"- command: `{command}`\n"
    ]
    raw = []
    for wl in a.workloads:
        info = bench_pipeline.machine_info()
        t0 = time.time()
        if wl == "sleep":
            w = Workload("sleep", t_f=t, t_b=2 * t, t_i=t, t_w=t)
        else:
            w = Workload("transformer", dim=64 if a.quick else 128, seq=32 if a.quick else 64)
        recs = _sweep(w, a.pp, a.microbatches, rounds, steps, a.device, impls)
        end = bench_pipeline.machine_info()
        raw += recs
        md.append(
            f"## {wl}: {w.flops_note()}, p={a.pp}, m={a.microbatches}\n\n"
            f"- machine: {info.get('nproc')} CPUs, torch {info.get('torch')}, commit "
            f"{info.get('commit')}; {time.time() - t0:.0f} s; load average (1/5/15 min) at start "
            f"{info['loadavg']}, at end {end['loadavg']}; {rounds} rounds x {steps} measured "
            f"steps per implementation, alternating\n"
        )
        if wl == "sleep":
            costs = Costs(t_f=t, t_b=2 * t, t_i=t, t_w=t)
            extra = ""
        else:
            extra, costs = _op_costs(recs)
        table, med = _table(recs, costs)
        md.append(extra + "\n" + table + "\n\n" + _verdicts(med, recs, costs) + "\n")
    text = "\n".join(md)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(a.out)[0] + ".jsonl", "w") as f:
        for r in raw:
            f.write(json.dumps(r) + "\n")
    print(text)


if __name__ == "__main__":
    main()
