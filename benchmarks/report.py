"""Turn raw benchmark records (JSON lines) into a markdown table, target verdicts and PNG plots.

Usage:
    python benchmarks/report.py benchmarks/results/raw_*.jsonl \
        --md benchmarks/results/results.md --png-dir benchmarks/results

Columns (see docs/benchmarks.md): median step time with its inter-quartile range, the
simulator's ideal step time, measured vs simulated bubble, peak saved activations, throughput,
and the ours/torch ratio of the same configuration in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_pp.schedules import Op, build_schedule
from lightning_pp.schedules.simulate import Costs, simulate


def load(paths: list[str]) -> list[dict]:
    recs = []
    for p in paths:
        with open(p) as f:
            recs += [json.loads(line) for line in f if line.strip()]
    return recs


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        v = xs[0] if xs else float("nan")
        return v, v, v
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def memory_bound(schedule, rank: int, chunk_bytes: list[float]) -> float:
    """Peak over the rank's action order of the activations its in-flight microbatch-chunks hold,
    each costing what one microbatch saves in that chunk: the schedule's memory bound."""
    live = peak = 0.0
    for a in schedule.ranks[rank]:
        if a.op is Op.F:
            live += chunk_bytes[a.chunk]
        elif a.op is Op.B:
            live -= chunk_bytes[a.chunk]
        peak = max(peak, live)
    return peak


def makespan_with_overhead(name: str, pp: int, vpp: int, m: int, costs: Costs, delta: float):
    """Simulated makespan when every action costs ``delta`` seconds more than its layers."""
    c = Costs(t_f=costs.t_f + vpp * delta, t_b=costs.t_b + vpp * delta)
    return simulate(build_schedule(name, pp=pp, microbatches=m, vpp=vpp), c).makespan


def fit_action_overhead(name: str, pp: int, vpp: int, m: int, costs: Costs, measured: float):
    """The per-action overhead ``delta`` for which the simulator reproduces ``measured``.

    The makespan grows monotonically with ``delta``, so bisection finds it. A schedule-
    independent ``delta`` fitted on 1F1B and used to predict interleaved separates "the runtime
    pays a fixed cost per action" from "the schedule itself misbehaves".
    """
    lo, hi = 0.0, max(costs.t_f, costs.t_b)
    if makespan_with_overhead(name, pp, vpp, m, costs, lo) >= measured:
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if makespan_with_overhead(name, pp, vpp, m, costs, mid) < measured:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def summarize(r: dict) -> dict:
    """Derived numbers of one record."""
    pp, vpp, m = r["pp"], r["vpp"], r["microbatches"]
    sched = build_schedule(r["schedule"], pp=pp, microbatches=m, vpp=vpp)
    steps = r["step_s"]
    q1, med, q3 = _quantiles(steps)
    busy = r["busy_s"]  # [rank][step]
    bubbles = []
    for i, t in enumerate(steps):
        b = [busy[k][i] for k in range(pp)]
        bubbles.append(sum(t - x for x in b) / sum(b))
    if r["workload"] == "sleep":
        costs = Costs(t_f=r["t_f"], t_b=r["t_b"])
        ideal_kind = "sim"
    else:  # the simulator fed with the costs this run measured (mean over ranks and steps)
        tf = statistics.mean(statistics.median(f) for f in r["fwd_s"]) / m
        tb = statistics.mean(statistics.median(b) for b in r["bwd_s"]) / m
        costs = Costs(t_f=tf, t_b=tb)
        ideal_kind = "sim@measured"
    sim = simulate(sched, costs)
    peaks = [max(p) for p in r["peak_saved_bytes"]]
    bounds = [memory_bound(sched, k, r["chunk_act_bytes"][k]) for k in range(pp)]
    samples = m * r["mb_size"]
    return {
        "key": (r["workload"], pp, r["schedule"], vpp, m),
        "impl": r["impl"],
        "step_ms": med * 1e3,
        "iqr_ms": (q1 * 1e3, q3 * 1e3),
        "ideal_ms": sim.makespan * 1e3,
        "ideal_kind": ideal_kind,
        "ratio_ideal": med / sim.makespan,
        "bubble": statistics.median(bubbles),
        "bubble_sim": sim.bubble_ratio,
        "peak_rank0": peaks[0],
        "peak_max": max(peaks),
        "bound_rank0": bounds[0],
        "peaks": peaks,
        "bounds": bounds,
        "samples_per_s": samples / med,
        "tokens_per_s": samples * r.get("seq", 64) / med if r["workload"] != "sleep" else None,
        "loss": statistics.mean(r["losses"]) if r["losses"] else float("nan"),
        "n_steps": len(steps),
        "costs": costs,
    }


def build_rows(recs: list[dict]) -> dict:
    """``{key: {impl: summary}}`` with key = (workload, pp, schedule, vpp, m)."""
    rows: dict = defaultdict(dict)
    for r in recs:
        s = summarize(r)
        rows[s["key"]][s["impl"]] = s
    return dict(
        sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], _sorder(kv[0][2]), kv[0][4]))
    )


def _sorder(name: str) -> int:
    return {"gpipe": 0, "1f1b": 1, "interleaved": 2}.get(name, 9)


def _kib(b: float) -> str:
    return f"{b / 1024:.1f}"


def markdown_table(rows: dict, workload: str) -> str:
    head = (
        "| p | schedule | v | m | impl | step ms (median) | IQR ms | ideal ms | step/ideal | "
        "ours/torch | bubble meas. | bubble sim | peak act r0 KiB | bound r0 KiB | "
        "peak act max KiB | samples/s | loss |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for (wl, pp, sched, vpp, m), impls in rows.items():
        if wl != workload:
            continue
        ratio = ""
        if "ours" in impls and "torch" in impls:
            ratio = f"{impls['ours']['step_ms'] / impls['torch']['step_ms']:.3f}"
        for impl in ("ours", "torch"):
            if impl not in impls:
                continue
            s = impls[impl]
            lines.append(
                f"| {pp} | {sched} | {vpp} | {m} | {impl} | {s['step_ms']:.1f} | "
                f"{s['iqr_ms'][0]:.1f}-{s['iqr_ms'][1]:.1f} | {s['ideal_ms']:.1f} | "
                f"{s['ratio_ideal']:.3f} | {ratio if impl == 'ours' else ''} | "
                f"{s['bubble']:.3f} | {s['bubble_sim']:.3f} | {_kib(s['peak_rank0'])} | "
                f"{_kib(s['bound_rank0']) if impl == 'ours' else ''} | {_kib(s['peak_max'])} | "
                f"{s['samples_per_s']:.1f} | {s['loss']:.6f} |"
            )
    return head + "\n".join(lines) + "\n"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def targets(rows: dict) -> list[tuple[str, str, str]]:
    """(target, verdict, evidence) for targets 1-4 (target 5 comes from the strategy bench)."""
    out = []
    get = rows.get
    # 1. sleep, p=4, m=8: ours <= 1.05 x ideal for 1f1b and interleaved
    ev, oks = [], []
    for sched, v in (("1f1b", 1), ("interleaved", 2)):
        s = get(("sleep", 4, sched, v, 8), {}).get("ours")
        if s:
            oks.append(s["ratio_ideal"] <= 1.05)
            ev.append(
                f"{sched}: {s['step_ms']:.1f} / {s['ideal_ms']:.1f} ms = {s['ratio_ideal']:.3f}"
            )
    out.append(
        (
            "1. sleep p=4 m=8 step <= 1.05 x ideal",
            _verdict(all(oks) if oks else None),
            "; ".join(ev),
        )
    )
    # 2. ours/torch <= 0.95 for 1f1b and interleaved (every configuration of the sweep)
    for wl in ("sleep", "transformer"):
        ev, oks = [], []
        for (w, pp, sched, _v, m), impls in rows.items():
            if w != wl or sched == "gpipe" or not {"ours", "torch"} <= set(impls):
                continue
            r = impls["ours"]["step_ms"] / impls["torch"]["step_ms"]
            oks.append(r <= 0.95)
            ev.append(f"p{pp} {sched} m{m}: {r:.3f}")
        if ev:
            out.append(
                (
                    f"2. ours/torch <= 0.95 ({wl})",
                    f"{_verdict(all(oks))} ({sum(oks)}/{len(oks)})",
                    "; ".join(ev),
                )
            )
    # 3. interleaved speed-up over 1f1b within 5 % of the simulator's at m=4 and m=8
    for wl in ("sleep", "transformer"):
        ev, oks = [], []
        for pp in (2, 4):
            for m in (4, 8):
                a = get((wl, pp, "1f1b", 1, m), {}).get("ours")
                b = get((wl, pp, "interleaved", 2, m), {}).get("ours")
                if not (a and b):
                    continue
                meas = a["step_ms"] / b["step_ms"]
                pred = a["ideal_ms"] / b["ideal_ms"]
                oks.append(abs(meas / pred - 1) <= 0.05)
                # per-action overhead fitted on 1F1B, then used to predict interleaved
                delta = fit_action_overhead("1f1b", pp, 1, m, a["costs"], a["step_ms"] / 1e3)
                pred_d = (
                    a["step_ms"]
                    / 1e3
                    / makespan_with_overhead("interleaved", pp, 2, m, b["costs"], delta)
                )
                ev.append(
                    f"p{pp} m{m}: measured {meas:.3f} vs sim {pred:.3f} ({meas / pred - 1:+.1%}); "
                    f"sim with the {delta * 1e3:.2f} ms/action overhead fitted on 1f1b: "
                    f"{pred_d:.3f}"
                )
        if ev:
            out.append(
                (
                    f"3. interleaved/1f1b speed-up within 5 % of sim ({wl})",
                    f"{_verdict(all(oks))} ({sum(oks)}/{len(oks)})",
                    "; ".join(ev),
                )
            )
    # 4. memory: 1f1b rank-0 peak flat in m; interleaved rank-0 within 10 % of its bound
    for wl in ("sleep", "transformer"):
        ev, oks = [], []
        for pp in (2, 4):
            peaks = {
                m: impls["ours"]["peak_rank0"]
                for (w, p, sched, v, m), impls in rows.items()
                if w == wl and p == pp and sched == "1f1b" and "ours" in impls
            }
            if len(peaks) >= 2:
                flat = max(peaks.values()) <= min(peaks.values()) * 1.001
                oks.append(flat)
                ev.append(
                    f"p{pp} 1f1b r0 peak KiB by m: "
                    + ", ".join(f"m{m}={_kib(b)}" for m, b in sorted(peaks.items()))
                )
            for (w, p, sched, _v, m), impls in rows.items():
                if w == wl and p == pp and sched == "interleaved" and "ours" in impls:
                    s = impls["ours"]
                    rel = s["peak_rank0"] / s["bound_rank0"]
                    oks.append(abs(rel - 1) <= 0.10)
                    ev.append(f"p{pp} interleaved m{m} r0 peak/bound = {rel:.3f}")
        if ev:
            out.append((f"4. activation memory ({wl})", _verdict(all(oks)), "; ".join(ev)))
    return out


def plot(rows: dict, workload: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pps = sorted({k[1] for k in rows if k[0] == workload})
    if not pps:
        return
    fig, axes = plt.subplots(2, len(pps), figsize=(6 * len(pps), 8), squeeze=False)
    colors = {"gpipe": "tab:gray", "1f1b": "tab:blue", "interleaved": "tab:orange"}
    ms_all = sorted({k[4] for k in rows if k[0] == workload})
    for j, pp in enumerate(pps):
        ax_t, ax_m = axes[0][j], axes[1][j]
        for sched in ("gpipe", "1f1b", "interleaved"):
            keys = sorted(
                (k for k in rows if k[0] == workload and k[1] == pp and k[2] == sched),
                key=lambda k: k[4],
            )
            if not keys:
                continue
            ms = [k[4] for k in keys]
            c = colors[sched]
            for impl, style in (("ours", "-o"), ("torch", "--s")):
                alpha = 0.95 if impl == "ours" else 0.6
                ys = [rows[k][impl]["ratio_ideal"] for k in keys if impl in rows[k]]
                if len(ys) == len(ms):
                    ax_t.plot(ms, ys, style, color=c, label=f"{sched} {impl}", alpha=alpha)
                mem = [rows[k][impl]["peak_rank0"] / 1024 for k in keys if impl in rows[k]]
                if len(mem) == len(ms):
                    ax_m.plot(ms, mem, style, color=c, label=f"{sched} {impl}", alpha=alpha)
            first = next(iter(rows[keys[0]].values()))
            ax_m.plot(
                ms,
                [next(iter(rows[k].values()))["bound_rank0"] / 1024 for k in keys],
                ":",
                color=c,
                lw=2,
                label=f"{sched} bound",
            )
        ax_t.axhline(1.0, color="k", lw=1)
        ax_t.axhline(1.05, color="k", lw=1, ls=":", label="1.05 x ideal")
        kind = first["ideal_kind"]
        ax_t.set(
            title=f"{workload}: median step time / ideal ({kind}), p={pp}",
            xlabel="microbatches m",
            ylabel="step time / simulator makespan",
        )
        ax_m.set(
            title=f"{workload}: rank-0 peak saved activations, p={pp}",
            xlabel="microbatches m",
            ylabel="KiB",
        )
        for ax in (ax_t, ax_m):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ms_all, [str(m) for m in ms_all])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ablation_table(recs: list[dict]) -> str:
    """Markdown: median step of each implementation variant per configuration, and its ratio to
    torch in the same run (``ours-L1``: receives just in time; ``ours-nomon``: no monitor)."""
    by_cfg: dict[tuple, dict[str, float]] = {}
    for r in recs:
        if "step_s" not in r:
            continue
        key = (r["workload"], r["pp"], r["schedule"], r["vpp"], r["microbatches"])
        by_cfg.setdefault(key, {})[r["impl"]] = statistics.median(r["step_s"]) * 1e3
    impls = sorted({i for v in by_cfg.values() for i in v}, key=lambda i: (i == "torch", i))
    head = "| workload | p | schedule | v | m | " + " | ".join(f"{i} ms (/torch)" for i in impls)
    lines = [head + " |", "|---" * (5 + len(impls)) + "|"]
    for key in sorted(by_cfg):
        vals = by_cfg[key]
        torch_ms = vals.get("torch")
        cells = []
        for i in impls:
            if i not in vals:
                cells.append("")
            elif i == "torch" or not torch_ms:
                cells.append(f"{vals[i]:.1f}")
            else:
                cells.append(f"{vals[i]:.1f} ({vals[i] / torch_ms:.3f})")
        lines.append("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render(recs: list[dict], extra_md: str = "") -> tuple[str, dict]:
    rows = build_rows(recs)
    parts = []
    machines = {json.dumps(r.get("machine", {}), sort_keys=True) for r in recs}
    for wl in ("sleep", "transformer"):
        wrecs = [r for r in recs if r["workload"] == wl]
        if not wrecs:
            continue
        r0 = wrecs[0]
        mi = r0.get("machine", {})
        parts.append(f"## Workload: {wl}\n")
        parts.append(f"- model: {r0.get('workload_desc', '')}")
        parts.append(f"- command: `{r0.get('command', '')}`")
        parts.append(
            f"- machine: {mi.get('nproc')} x {mi.get('cpu')}, gpu: {mi.get('gpu')}, torch "
            f"{mi.get('torch')}, lightning {mi.get('lightning')}, commit {mi.get('commit')}"
        )
        parts.append(
            f"- date {mi.get('date')}; load average at start {mi.get('loadavg')}, at end "
            f"{r0.get('loadavg_end')}; device {r0.get('device')}; "
            f"{r0 and len(r0['step_s'])} measured steps per row\n"
        )
        per_pp = {}
        for r in wrecs:
            if "loadavg_pp" in r:
                per_pp[r["pp"]] = r["loadavg_pp"]
        if per_pp:
            parts.append(
                "- load average (1/5/15 min) before -> after each pipeline size: "
                + "; ".join(f"p={k}: {v[0]} -> {v[1]}" for k, v in sorted(per_pp.items()))
                + "\n"
            )
        parts.append(markdown_table(rows, wl))
    parts.append("## Targets\n")
    parts.append("| target | verdict | evidence |\n|---|---|---|")
    for name, verdict, ev in targets(rows):
        parts.append(f"| {name} | {verdict} | {ev} |")
    if extra_md:
        parts.append("\n" + extra_md)
    if len(machines) > 1:
        parts.append(
            f"\nNote: records come from {len(machines)} separate runs (see per-workload dates)."
        )
    return "\n".join(parts) + "\n", rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("raw", nargs="+", help="JSON-lines files written by bench_pipeline.py")
    ap.add_argument("--md", required=True, help="markdown file to write")
    ap.add_argument("--png-dir", default=None, help="write bench_<workload>.png here")
    ap.add_argument(
        "--extra-md", default=None, help="markdown file to append (e.g. strategy bench)"
    )
    a = ap.parse_args(argv)
    extra = open(a.extra_md).read() if a.extra_md and os.path.exists(a.extra_md) else ""
    recs = load(a.raw)
    md, rows = render(recs, extra)
    os.makedirs(os.path.dirname(os.path.abspath(a.md)), exist_ok=True)
    with open(a.md, "w") as f:
        f.write("# lightning_pp vs torch.distributed.pipelining\n\n" + md)
    if a.png_dir:
        for wl in ("sleep", "transformer"):
            plot(rows, wl, os.path.join(a.png_dir, f"bench_{wl}.png"))
    print(md)


if __name__ == "__main__":
    main()
