"""How accurate is the planner? Predicted vs measured step time and activation peak.

Runs a grid of pipeline shapes on the virtual device (``lightning_pp.models.virtual_device``
``SleepLayer``: known forward, input-gradient and weight-gradient costs; sleeping ranks do not
compete for the CPU, so 4 ranks on 2 cores behave like 4 devices) and compares each run with the
planner's prediction (:func:`lightning_pp.planner.search.predict`, the same code the search
ranks with).

The model: 8 layers, the first and the last heavy (per sample: 1.5 ms and 1.0 ms forward, the
six in between 0.25 ms; input gradient and weight gradient each cost the forward again; the
first layer has no input gradient, its input is data). Costs scale with the microbatch size, as
real layers' do. World 4 (``dp = 4 / pp``), global batch 16: each shape keeps it and splits it
over its own ``dp``, as the search does.

The grid: pp in {1, 2, 4}; vpp 1 (gpipe, 1f1b, zb-h1) and 2 (interleaved, zbv); m in
{2, 4, 8, 16} where the plan accepts it; the uniform and the cost-balanced split wherever they
differ. Every (pp, schedule) group runs in its own spawned world
(:func:`lightning_pp.planner.verify.measure_many`), each shape with a fresh engine.

Predictions: the layer costs are the virtual device's nominal ones; the saved bytes are
measured by the planner's profiler on the same layers; the compute scale, the per-action
overhead, the hop latency and the receive cost are calibrated first from one run (pp=2, 1f1b,
m=4) with :func:`lightning_pp.planner.verify.calibrate_from_run`. The table also gives the
error with the planner's uncalibrated defaults (1 ms, 200 us).

Reports: median and worst |error| of the step time and of every rank's activation peak;
whether the shape the planner ranks first measures within 1.05x of the best measured shape of
the grid; whether the cost-balanced split measures faster than the uniform one. Beside the
markdown: the records (``.jsonl``) and a plot of predicted against measured step time
(``.png``, with matplotlib; ``--replot FILE.jsonl`` redraws it from the records).

    python benchmarks/bench_planner.py --out benchmarks/results/planner.md
    python benchmarks/bench_planner.py --quick --out /tmp/planner_quick.md   # smoke: seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch.nn import functional as F

from benchmarks.harness import machine_info
from lightning_pp.layout.rules import PreflightError
from lightning_pp.planner.profile import DEFAULT_LATENCY_S, DEFAULT_OVERHEAD_S, ModelProfile
from lightning_pp.planner.profiler import profile_layers, profiling_threads
from lightning_pp.planner.search import describe_shape, make_candidate, predict
from lightning_pp.planner.verify import (
    BuiltModel,
    RunSpec,
    WorldFailure,
    calibrate_from_run,
    measure_many,
    pct_error,
)

WIDTH = 64
GLOBAL_BATCH = 16
#: forward seconds per sample of each layer: heavy first and last layer
PER_SAMPLE = (1.5e-3, *([0.25e-3] * 6), 1.0e-3)
SCHEDULES = {1: ("gpipe", "1f1b", "zb-h1"), 2: ("interleaved", "zbv")}


#: the transformer workload: pipeline layers of (dim 128, 4 heads, seq 64) blocks, the first
#: three blocks deep and the last two (heavy first and last layers, like an embedding and a head)
BLOCKS_PER_LAYER = (3, 1, 1, 1, 1, 1, 1, 2)
DIM, HEADS, SEQ = 128, 4, 64


@dataclasses.dataclass(frozen=True)
class Setup:
    workload: str = "sleep"
    per_sample: tuple[float, ...] = PER_SAMPLE
    pps: tuple[int, ...] = (1, 2, 4)
    ms: tuple[int, ...] = (2, 4, 8, 16)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "zb-h1", "interleaved", "zbv")
    world: int = 4
    warmup: int = 2
    steps: int = 3
    calibration: tuple[int, str, int] = (2, "1f1b", 4)  # pp, schedule, m
    #: the calibration run's timed steps: it fits four numbers, each shape's median needs one
    calibration_steps: int = 10


QUICK = Setup(
    per_sample=(0.5e-3, *([0.1e-3] * 6), 0.4e-3),
    pps=(2,),
    ms=(4,),
    schedules=("1f1b", "zb-h1"),
    world=2,
    warmup=1,
    steps=2,
    calibration_steps=2,
)


def layer_times(per_sample: tuple[float, ...], n: int) -> list[tuple[float, float, float]]:
    """(t_f, t_i, t_w) of each layer at microbatch size ``n``; layer 0's input is data, so it
    has no input gradient (the SleepLayer computes none and holds nothing for it)."""
    out = []
    for i, t in enumerate(per_sample):
        out.append((t * n, 0.0 if i == 0 else t * n, t * n))
    return out


def sleep_model(times: tuple[tuple[float, float, float], ...]) -> BuiltModel:
    """The virtual-device model with these (t_f, t_i, t_w) per layer (same seed every rank)."""
    from lightning_pp.models.virtual_device import SleepLayer

    torch.manual_seed(0)
    layers = [SleepLayer(WIDTH, t_f=f, t_i=i, t_w=w) for f, i, w in times]
    return BuiltModel(layers, lambda mb: mb[0], lambda out, mb: F.mse_loss(out, mb[1]))


def transformer_model() -> BuiltModel:
    """The transformer workload (same seed every rank): ``BLOCKS_PER_LAYER`` blocks per layer."""
    from benchmarks.workloads import Block

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [
        torch.nn.Sequential(*[Block(DIM, HEADS) for _ in range(k)]) for k in BLOCKS_PER_LAYER
    ]
    return BuiltModel(layers, lambda mb: mb[0], lambda out, mb: F.mse_loss(out, mb[1]))


def build_profile(setup: Setup, sizes: list[int]) -> ModelProfile:
    """Sleep: nominal times; saved, boundary and parameter bytes measured by the planner's
    profiler on the same layers (zero-cost copies: bytes do not depend on the sleep).
    Transformer: everything measured by the planner's profiler, in CPU time on one thread (what
    each rank runs with)."""
    from lightning_pp.models.virtual_device import SleepLayer

    if setup.workload == "transformer":
        with profiling_threads(1) as clock:
            measured = profile_layers(
                transformer_model().layers,
                lambda n: torch.randn(n, SEQ, DIM),
                sizes,
                repeats=3,
                log=None,
                clock=clock,
            )
        return ModelProfile(
            measured, device="cpu", layer_names=("Block",) * len(measured[sizes[0]])
        )

    torch.manual_seed(0)
    layers = [SleepLayer(WIDTH, t_f=0.0, t_i=0.0, t_w=0.0) for _ in setup.per_sample]
    measured = profile_layers(layers, lambda n: torch.randn(n, WIDTH), sizes, repeats=1, log=None)
    by_size = {}
    for n in sizes:
        by_size[n] = [
            dataclasses.replace(c, t_f=f, t_i=i, t_w=w, t_fused=i + w)
            for c, (f, i, w) in zip(measured[n], layer_times(setup.per_sample, n))
        ]
    return ModelProfile(by_size, device="cpu", layer_names=("SleepLayer",) * len(layers))


def batch(setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (GLOBAL_BATCH, SEQ, DIM) if setup.workload == "transformer" else (GLOBAL_BATCH, WIDTH)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def grid(setup: Setup, profile: ModelProfile) -> list[tuple[Any, Any]]:
    """(candidate, plan) of every shape the plan accepts, both splits where they differ."""
    out = []
    for pp in setup.pps:
        for vpp in (1,) if pp == 1 else (1, 2):
            names = ("1f1b",) if pp == 1 else SCHEDULES[vpp]
            for name in (s for s in names if s in setup.schedules):
                for m in setup.ms:
                    seen = set()
                    for split in ("cost", "uniform"):
                        try:
                            cand, plan = make_candidate(
                                profile, setup.world, GLOBAL_BATCH, pp=pp, vpp=vpp,
                                microbatches=m, schedule=name, split=split,
                            )  # fmt: skip
                        except PreflightError:
                            continue
                        if cand.counts in seen:
                            continue
                        seen.add(cand.counts)
                        out.append((cand, plan))
    return out


def spec_of(setup: Setup, cand: Any, records: bool = False) -> RunSpec:
    if setup.workload == "transformer":
        build: Any = transformer_model
    else:
        build = functools.partial(
            sleep_model, tuple(layer_times(setup.per_sample, int(cand.microbatch_size)))
        )
    return RunSpec.for_candidate(
        build,
        batch(setup),
        cand,
        warmup=setup.warmup,
        steps=setup.steps,
        keep_records=records,
    )


def calibration_run(setup: Setup, profile: ModelProfile) -> tuple[Any, Any, Any]:
    """The calibration shape (pp, schedule, m of ``setup.calibration``): its candidate, plan and
    the run spec (more timed steps than a shape: it fits four numbers)."""
    pp, name, m = setup.calibration
    cand, plan = make_candidate(
        profile, setup.world, GLOBAL_BATCH, pp=pp, vpp=1, microbatches=m, schedule=name
    )
    longer = dataclasses.replace(setup, steps=max(setup.steps, setup.calibration_steps))
    return cand, plan, spec_of(longer, cand, records=True)


def calibration_of(
    setup: Setup, profile: ModelProfile, cand: Any, plan: Any, got: Any, seconds: float
) -> dict[str, Any]:
    """What the calibration run ``got`` measured: the engine's overhead, the layers' scale,
    the hop latency and the receive cost."""
    pp, name, m = setup.calibration
    cal = calibrate_from_run(got, plan, profile.layers(cand.microbatch_size), None, profile)
    return {
        "overhead_s": cal.overhead_s,
        "compute_scale": cal.compute_scale,
        "latency_s": cal.latency_s,
        "receive_s": cal.receive_s,
        "actions": cal.actions,
        "hops": cal.hops,
        "shape": f"dp={cand.dp} x pp={pp} {name} m={m}",
        "step_s": got.step_s,
        "seconds": seconds,
    }


def run(
    setup: Setup,
    *,
    timeout: float = 600.0,
    log=print,
    partial: str | None = None,
    rounds: int = 1,
) -> tuple[list[dict], dict]:
    """Calibrate, then measure every shape of the grid; ``rounds`` times over, alternating the
    order of the worlds. Each shape keeps its fastest round (the median of that round's steps),
    and the predictions use the calibration of the fastest calibration run: on a shared machine
    interference only ever slows a run down (the same transformer shape measured 173 and 256 ms
    in two worlds back to back), while the profile is CPU time, which no other process adds to.
    """
    sizes = sorted(
        {GLOBAL_BATCH * pp // setup.world // m for pp in setup.pps for m in setup.ms} - {0}
    )
    profile = build_profile(setup, sizes)
    shapes = grid(setup, profile)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (cand, _) in enumerate(shapes):
        # one world per (pp, vpp): a world per schedule cost minutes of start-up on the loaded
        # 2-core machine, and zb-h1 and zbv (the pair seen to hang in one world, see
        # bench_recompute) never share one
        groups.setdefault((cand.pp, cand.vpp), []).append(i)
    cals: list[dict[str, Any]] = []
    # per shape, one Measured per round (None: its world failed, with the reason)
    runs: list[list[Any]] = [[] for _ in shapes]
    failures: list[str | None] = [None] * len(shapes)
    cal_cand, cal_plan, cal_spec = calibration_run(setup, profile)
    for r in range(rounds):
        order = list(groups.items())
        for g, ((pp, vpp), members) in enumerate(order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            specs = [spec_of(setup, shapes[i][0]) for i in members]
            if g == 0:
                # The round's calibration runs first in its first world (a world of its own
                # cost one more start-up per round). If that world fails, its shapes count as
                # failed and the calibration runs again alone (a failure there ends the run).
                try:
                    cal_got, *got = measure_many([cal_spec, *specs], setup.world, timeout=timeout)
                except WorldFailure as err:
                    got = [None] * len(members)
                    for i in members:
                        failures[i] = str(err)
                    cal_got = measure_many([cal_spec], setup.world, timeout=timeout)[0]
                elapsed = time.perf_counter() - t0
                cals.append(calibration_of(setup, profile, cal_cand, cal_plan, cal_got, elapsed))
                c = cals[-1]
                log(
                    f"round {r + 1}/{rounds} calibrated: overhead "
                    f"{c['overhead_s'] * 1e3:.3f} ms/action, layers x{c['compute_scale']:.3f}, "
                    f"hop latency {c['latency_s'] * 1e6:.0f} us ({c['actions']} actions, "
                    f"{c['hops']} hops), a receive {c['receive_s'] * 1e6:.0f} us; step "
                    f"{c['step_s'] * 1e3:.1f} ms"
                )
            else:
                try:
                    got = measure_many(specs, setup.world, timeout=timeout)
                except WorldFailure as err:
                    got = [None] * len(members)
                    for i in members:
                        failures[i] = str(err)
            log(
                f"round {r + 1}/{rounds} pp={pp} vpp={vpp}: {len(members)} shapes in "
                f"{time.perf_counter() - t0:.1f} s"
            )
            for i, meas in zip(members, got):
                runs[i].append(meas)
                if partial is not None and meas is not None:  # a later timeout loses nothing
                    with open(partial, "a") as f:
                        cand = shapes[i][0]
                        row = {"round": r, "shape": describe_shape(cand), "steps_s": meas.steps_s}
                        f.write(json.dumps(row) + "\n")
    cal = min(cals, key=lambda c: c["step_s"])
    cal["rounds"] = rounds
    cal["round_steps_s"] = [c["step_s"] for c in cals]
    calibrated = profile.with_links(
        latency_s=cal["latency_s"],
        overhead_s=cal["overhead_s"],
        compute_scale=cal["compute_scale"],
        receive_s=cal["receive_s"],
    )
    defaults = profile.with_links(latency_s=DEFAULT_LATENCY_S, overhead_s=DEFAULT_OVERHEAD_S)
    # real compute competes for the cores (sleep does not): the oversubscription term
    cores = (os.cpu_count() or 1) if setup.workload == "transformer" else None
    recs = []
    for (cand, plan), got_rounds, failure in zip(shapes, runs, failures):
        pred = predict(calibrated, cand, plan, cores=cores)
        pred_default = predict(defaults, cand, plan, cores=cores)
        rec = {
            "dp": cand.dp,
            "pp": cand.pp,
            "vpp": cand.vpp,
            "m": cand.microbatches,
            "schedule": cand.schedule,
            "split": cand.split,
            "counts": list(cand.counts),
            "predicted_s": pred.step_s,
            "predicted_default_s": pred_default.step_s,
            "predicted_act": [mem.activations for mem in pred.memory],
        }
        measured = [g for g in got_rounds if g is not None]
        if not measured:
            rec["error"] = failure or "not measured"
        else:
            meas = min(measured, key=lambda g: g.step_s)
            rec.update(
                measured_s=meas.step_s,
                steps_s=meas.steps_s,
                rounds_s=[g.step_s for g in measured],
                measured_act=meas.peak_saved,
                step_err=pct_error(pred.step_s, meas.step_s),
                step_err_default=pct_error(pred_default.step_s, meas.step_s),
                act_err=[pct_error(p, m) for p, m in zip(rec["predicted_act"], meas.peak_saved)],
            )
        recs.append(rec)
    return recs, cal


def summarize(recs: list[dict]) -> dict[str, Any]:
    ok = [r for r in recs if "error" not in r]
    step = [abs(r["step_err"]) for r in ok]
    step_d = [abs(r["step_err_default"]) for r in ok]
    act = [abs(e) for r in ok for e in r["act_err"]]
    out: dict[str, Any] = {
        "shapes": len(recs),
        "measured": len(ok),
        "step_median": statistics.median(step) if step else None,
        "step_worst": max(step) if step else None,
        "step_default_median": statistics.median(step_d) if step_d else None,
        "step_default_worst": max(step_d) if step_d else None,
        "act_median": statistics.median(act) if act else None,
        "act_worst": max(act) if act else None,
    }
    if ok:
        chosen = min(ok, key=lambda r: r["predicted_s"])
        best = min(ok, key=lambda r: r["measured_s"])
        out["choice"] = {
            "chosen": _label(chosen),
            "chosen_measured_s": chosen["measured_s"],
            "best": _label(best),
            "best_measured_s": best["measured_s"],
            "ratio": chosen["measured_s"] / best["measured_s"],
        }
    pairs = []
    by = {(r["pp"], r["vpp"], r["m"], r["schedule"], r["split"]): r for r in ok}
    for (pp, vpp, m, name, split), r in by.items():
        u = by.get((pp, vpp, m, name, "uniform"))
        if split == "cost" and u is not None:
            pairs.append(
                {
                    "shape": f"pp={pp} vpp={vpp} m={m} {name}",
                    "cost": r["counts"],
                    "uniform": u["counts"],
                    "cost_s": r["measured_s"],
                    "uniform_s": u["measured_s"],
                    "cost_predicted_s": r["predicted_s"],
                    "uniform_predicted_s": u["predicted_s"],
                }
            )
    out["splits"] = pairs
    return out


def _label(r: dict) -> str:
    return (
        f"dp={r['dp']} pp={r['pp']} vpp={r['vpp']} m={r['m']} {r['schedule']} {r['split']} "
        f"{'/'.join(map(str, r['counts']))}"
    )


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} %"


def _model_line(meta: dict) -> str:
    if meta.get("workload") == "transformer":
        return (
            f"{len(BLOCKS_PER_LAYER)} pipeline layers of {list(BLOCKS_PER_LAYER)} transformer "
            f"blocks (dim {DIM}, {HEADS} heads, seq {SEQ}), costs measured by the planner's "
            f"profiler (CPU time, one thread); predictions with the oversubscription term "
            f"(cores={meta.get('cores')})"
        )
    return (
        f"{len(meta['per_sample'])} SleepLayers, forward ms per sample "
        f"{[round(t * 1e3, 3) for t in meta['per_sample']]} (input and weight gradient: the "
        f"same again each; layer 0 has no input gradient)"
    )


def _calibration_source(cal: dict) -> str:
    rounds = cal.get("rounds", 1)
    if rounds == 1:
        return "one run"
    steps = ", ".join(f"{t * 1e3:.1f}" for t in cal["round_steps_s"])
    return f"the fastest of {rounds} runs, one per round (steps {steps} ms)"


def to_markdown(recs: list[dict], summary: dict, meta: dict) -> str:
    cal = meta["calibration"]
    lines = [
        f"# Planner accuracy: predicted vs measured ({meta.get('workload', 'sleep')} workload)",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"- machine: {meta['machine']['nproc']} CPUs, torch {meta['machine']['torch']}, commit "
        f"{meta['machine']['commit']}; {meta['seconds']:.0f} s; load average at start "
        f"{meta['machine']['loadavg']}, at end {meta['loadavg_end']}",
        f"- model: {_model_line(meta)}, global batch {GLOBAL_BATCH}, "
        f"world {meta['world']} (dp = world / pp); {meta['warmup']} warm-up + "
        f"{meta['steps']} timed steps per shape (median)"
        + (
            f"; the grid measured {meta['rounds']} times (alternating order), each shape's "
            f"fastest round kept"
            if meta.get("rounds", 1) > 1
            else ""
        ),
        f"- calibrated from {_calibration_source(cal)} ({cal['shape']}): engine overhead "
        f"{cal['overhead_s'] * 1e3:.3f} ms per action, layers {cal['compute_scale']:.3f}x "
        f"their profiled time (fitted over {cal['actions']} actions), "
        f"hop latency {cal['latency_s'] * 1e6:.0f} us ({cal['hops']} hops), of which a "
        f"receive costs {cal['receive_s'] * 1e6:.0f} us",
        "",
        "## Summary",
        "",
        f"- shapes: {summary['shapes']} ({summary['measured']} measured)",
        f"- step time |error| (calibrated): median **{_pct(summary['step_median'])}**, worst "
        f"**{_pct(summary['step_worst'])}** (targets <= 5 %, <= 10 %)",
        f"- step time |error| with the uncalibrated defaults (1 ms/action, 200 us): median "
        f"{_pct(summary['step_default_median'])}, worst {_pct(summary['step_default_worst'])}",
        f"- activation peak |error| over every rank of every shape: median "
        f"{_pct(summary['act_median'])}, worst **{_pct(summary['act_worst'])}** (target <= 10 %)",
    ]
    ch = summary.get("choice")
    if ch:
        lines.append(
            f"- choice: the planner's first, {ch['chosen']}, measured "
            f"{ch['chosen_measured_s'] * 1e3:.1f} ms; the best measured, {ch['best']}, "
            f"{ch['best_measured_s'] * 1e3:.1f} ms: ratio **{ch['ratio']:.3f}** (target <= 1.05)"
        )
    for p in summary["splits"]:
        lines.append(
            f"- split, {p['shape']}: cost {'/'.join(map(str, p['cost']))} measured "
            f"{p['cost_s'] * 1e3:.1f} ms (predicted {p['cost_predicted_s'] * 1e3:.1f}), uniform "
            f"{'/'.join(map(str, p['uniform']))} {p['uniform_s'] * 1e3:.1f} ms (predicted "
            f"{p['uniform_predicted_s'] * 1e3:.1f}): cost "
            f"{'faster' if p['cost_s'] < p['uniform_s'] else 'NOT faster'}"
        )
    lines += [
        "",
        "## Every shape",
        "",
        "| dp | pp | vpp | m | schedule | split | predicted ms | measured ms | error | error, "
        "defaults | predicted act KiB per rank | measured act KiB per rank | act error per rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        head = (
            f"| {r['dp']} | {r['pp']} | {r['vpp']} | {r['m']} | {r['schedule']} | {r['split']} "
            f"{'/'.join(map(str, r['counts']))} | {r['predicted_s'] * 1e3:.1f} |"
        )
        if "error" in r:
            lines.append(f"{head} FAILED: {r['error'].strip().splitlines()[-1][:100]} |")
            continue
        lines.append(
            f"{head} {r['measured_s'] * 1e3:.1f} | {r['step_err']:+.1f} % | "
            f"{r['step_err_default']:+.1f} % | "
            f"{' / '.join(f'{b / 1024:.1f}' for b in r['predicted_act'])} | "
            f"{' / '.join(f'{b / 1024:.1f}' for b in r['measured_act'])} | "
            f"{' / '.join(f'{e:+.1f}' for e in r['act_err'])} % |"
        )
    return "\n".join(lines) + "\n"


def plot(recs: list[dict], summary: dict, title: str, path: str) -> bool:
    """Predicted against measured step time, one point per shape (coloured by schedule), on
    the diagonal where the prediction is exact, with the 5 % and 10 % bands of the targets.
    Returns False (and writes nothing) without matplotlib (``pip install -e ".[plot]"``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in recs if "measured_s" in r]
    fig, ax = plt.subplots(figsize=(6.4, 6.0))
    top = 1.08 * max(max(r["measured_s"], r["predicted_s"]) for r in ok) * 1e3
    low = 0.92 * min(min(r["measured_s"], r["predicted_s"]) for r in ok) * 1e3
    line = [low, top]
    ax.plot(line, line, color="black", lw=1, label="exact")
    for band, shade in ((0.10, 0.08), (0.05, 0.16)):
        ax.fill_between(line, [x * (1 - band) for x in line], [x * (1 + band) for x in line],
                        color="tab:green", alpha=shade, lw=0,
                        label=f"within {band:.0%}")  # fmt: skip
    for name in ("gpipe", "1f1b", "zb-h1", "interleaved", "zbv"):
        pts = [r for r in ok if r["schedule"] == name]
        if pts:
            ax.scatter([r["measured_s"] * 1e3 for r in pts],
                       [r["predicted_s"] * 1e3 for r in pts], s=22, label=name)  # fmt: skip
    ax.set_xlim(low, top)
    ax.set_ylim(low, top)
    ax.set_xlabel("measured step (ms, median)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title(
        f"{title}\n|error| median {summary['step_median']:.1f} %, worst "
        f"{summary['step_worst']:.1f} % over {summary['measured']} shapes",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_beside(report: str, recs: list[dict], summary: dict, meta: dict) -> str | None:
    """The plot of a run next to its report or records (same name, ``.png``); its path, or
    ``None`` without matplotlib."""
    path = os.path.splitext(report)[0] + ".png"
    title = f"planner accuracy, {meta.get('workload', 'sleep')} workload"
    return path if plot(recs, summary, title, path) else None


def replot(jsonl: str) -> str | None:
    """The plot of a finished run from its ``.jsonl`` (beside it, ``.png``)."""
    with open(jsonl) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    tail = next(r for r in rows if "summary" in r)
    recs = [r for r in rows if "summary" not in r]
    return plot_beside(jsonl, recs, tail["summary"], tail["meta"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--out", help="markdown report (a .jsonl and a predicted-vs-measured .png beside it)"
    )
    ap.add_argument("--replot", metavar="JSONL", help="only redraw the .png of a finished run")
    ap.add_argument("--quick", action="store_true", help="a smoke run: pp=2, two shapes")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per spawned world")
    ap.add_argument("--ms", type=int, nargs="+", default=None, help="microbatch counts")
    ap.add_argument(
        "--scale",
        type=float,
        default=None,
        help="multiply every layer cost (default 1: the per-sample costs in the docstring)",
    )
    ap.add_argument("--workload", choices=("sleep", "transformer"), default="sleep")
    ap.add_argument("--world", type=int, default=None, help="processes (default 4)")
    ap.add_argument("--pps", type=int, nargs="+", default=None, help="pipeline sizes")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure the whole grid this many times (alternating order); each shape keeps "
        "its fastest round, the predictions the fastest calibration run's fit",
    )
    args = ap.parse_args(argv)
    if args.replot:
        print(replot(args.replot) or "no plot: matplotlib is not installed")
        return {}
    if not args.out:
        ap.error("--out is required (or --replot JSONL)")
    setup = QUICK if args.quick else Setup()
    setup = dataclasses.replace(setup, workload=args.workload)
    if args.world:
        setup = dataclasses.replace(setup, world=args.world)
    if args.pps:
        setup = dataclasses.replace(setup, pps=tuple(args.pps))
    if args.scale:
        setup = dataclasses.replace(
            setup, per_sample=tuple(t * args.scale for t in setup.per_sample)
        )
    if args.steps:
        setup = dataclasses.replace(setup, steps=args.steps)
    if args.ms:
        setup = dataclasses.replace(setup, ms=tuple(args.ms))
    info = machine_info()
    t0 = time.perf_counter()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    partial = os.path.splitext(args.out)[0] + ".partial.jsonl"
    if os.path.exists(partial):
        os.remove(partial)
    recs, cal = run(setup, timeout=args.timeout, partial=partial, rounds=args.rounds)
    os.remove(partial)
    summary = summarize(recs)
    meta = {
        "command": "python benchmarks/bench_planner.py " + " ".join(argv or sys.argv[1:]),
        "machine": info,
        "loadavg_end": machine_info()["loadavg"],
        "seconds": time.perf_counter() - t0,
        "calibration": cal,
        "per_sample": list(setup.per_sample),
        "workload": setup.workload,
        "cores": os.cpu_count(),
        "world": setup.world,
        "warmup": setup.warmup,
        "steps": setup.steps,
        "rounds": args.rounds,
    }
    with open(args.out, "w") as f:
        f.write(to_markdown(recs, summary, meta))
    with open(os.path.splitext(args.out)[0] + ".jsonl", "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
        f.write(json.dumps({"summary": summary, "meta": meta}) + "\n")
    if summary["measured"]:
        plot_beside(args.out, recs, summary, meta)
    print(open(args.out).read())
    return summary


if __name__ == "__main__":
    main()
