"""``lightning-pp plan CONFIG --search --verify K`` and ``--calibrate``: run shapes, compare.

``--verify K`` runs the top ``K`` candidates of the search and the config's own shape for a few
training steps each (:mod:`lightning_pp.planner.verify`: one spawned world of ``--devices``
processes per shape, on the engine directly), and prints predicted against measured step time
and heaviest-rank activation peak. ``--calibrate`` first runs the config's own shape and fits
the engine's per-action overhead and the hop latency from its step records, and the search then
uses them (an explicit ``--overhead`` / ``--latency`` wins).

Example::

    lightning-pp plan configs/demo_cpu.yaml --search --devices 2 --calibrate --verify 3
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

from lightning_pp.commands.config import RunConfig

__all__ = ["ConfigShape", "calibrate", "config_batch", "config_shape", "verify"]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def config_batch(cfg: RunConfig) -> Any:
    """The config's data module's first training batch (built on this process)."""
    from lightning_pp.commands.config import instantiate

    dm = instantiate(cfg.get("data"))
    for hook, arg in (("prepare_data", None), ("setup", "fit")):
        fn = getattr(dm, hook, None)
        if callable(fn):
            fn() if arg is None else fn(arg)
    return next(iter(dm.train_dataloader()))


class ConfigShape:
    """The config's own shape at the planned world size, as a candidate and its plan, or why
    it cannot run (``error``)."""

    def __init__(self, candidate: Any = None, plan: Any = None, error: str | None = None):
        self.candidate, self.plan, self.error = candidate, plan, error


def config_shape(cfg: RunConfig, profile: Any, world: int, global_batch: int) -> ConfigShape:
    """The config's ``strategy:`` shape (pp, vpp, microbatches, schedule, partition,
    recompute) for ``world`` processes at ``global_batch`` samples."""
    from lightning_pp.layout.rules import PreflightError
    from lightning_pp.planner.search import make_candidate

    s = cfg.get("strategy") or {}
    s = s.get("init_args", s) if "class_path" in s else s
    pp = int(s.get("pp") or 1)
    vpp = None if s.get("vpp") is None else int(s["vpp"])  # None: the schedule's own
    m = int(s.get("microbatches") or pp)
    schedule = s.get("schedule") or ("interleaved" if vpp is not None and vpp > 1 else "1f1b")
    recompute = s.get("recompute")
    if recompute not in (None, "full"):
        return ConfigShape(error=f"recompute={recompute!r}: the planner models None or 'full'")
    partition = s.get("partition") or "uniform"
    if isinstance(partition, str) and partition not in ("uniform", "cost"):
        return ConfigShape(error=f"partition={partition!r}: the planner splits uniform or cost")
    split: Any = partition
    try:
        cand, plan = make_candidate(
            profile,
            world,
            global_batch,
            pp=pp,
            vpp=vpp,
            microbatches=m,
            schedule=schedule,
            split=split,
            recompute=recompute,
        )
    except PreflightError as err:
        return ConfigShape(error=f"the config's shape on {world} processes: {err}")
    return ConfigShape(cand, plan)


def _spec(cfg: RunConfig, batch: Any, cand: Any, args: argparse.Namespace, records: bool) -> Any:
    from lightning_pp.commands.config import instantiate
    from lightning_pp.planner.verify import RunSpec, build_config_model

    return RunSpec.for_candidate(
        functools.partial(
            build_config_model, cfg.get("model"), cfg.get("seed"), instantiate=instantiate
        ),
        batch,
        cand,
        warmup=args.verify_warmup,
        steps=args.verify_steps,
        keep_records=records,
        probe_links=records,  # the calibration run also times the link (bandwidth)
    )


def _short(cand: Any) -> str:
    return (
        f"{cand.shape} m={cand.microbatches} {cand.schedule} {cand.split} "
        f"{'/'.join(map(str, cand.counts))}" + (f" rc={cand.recompute}" if cand.recompute else "")
    )


def _run(
    cfg: RunConfig, batch: Any, cand: Any, args: argparse.Namespace, world: int, records: bool
) -> tuple[Any, str | None]:
    """(Measured or None, the failure's text)."""
    from lightning_pp.planner.profiler import profile_threads
    from lightning_pp.planner.verify import WorldFailure, measure

    try:
        got = measure(
            _spec(cfg, batch, cand, args, records),
            world,
            timeout=args.verify_timeout,
            threads=profile_threads(world),
        )
    except WorldFailure as err:
        return None, str(err)
    return got, None


def calibrate(
    cfg: RunConfig, profile: Any, shape: ConfigShape, args: argparse.Namespace, world: int
) -> tuple[Any, Any, Any]:
    """Run the config's shape once; fit compute scale, overhead and latency from its records
    and take the bandwidth its link probe timed (:func:`~lightning_pp.planner.verify.
    calibrate_from_run`).

    Returns (Calibration or None, the run's Measured or None, the message to print)."""
    from lightning_pp.planner.verify import calibrate_from_run

    if shape.candidate is None:
        return None, None, f"calibrate: skipped ({shape.error})"
    cand, plan = shape.candidate, shape.plan
    batch = config_batch(cfg)
    _log(f"calibrate: running the config's shape {_short(cand)} on {world} processes")
    got, error = _run(cfg, batch, cand, args, world, records=True)
    if got is None:
        return None, None, f"calibrate: the run failed: {error.strip().splitlines()[-1]}"
    cal = calibrate_from_run(
        got, plan, profile.layers(cand.microbatch_size), cand.recompute, profile
    )
    link = (
        f", bandwidth {cal.bandwidth / 1e9:.2f} GB/s (4 MiB ping-pong between pipeline ranks "
        f"0 and 1)"
        if cal.bandwidth
        else ", link not timed (the 4 MiB ping-pong was no slower than the 1 KiB one)"
    )
    msg = (
        f"calibrate: engine overhead {cal.overhead_s * 1e3:.2f} ms per action and layers "
        f"{cal.compute_scale:.2f}x their profiled time (fitted over {cal.actions} actions), hop "
        f"latency {cal.latency_s * 1e6:.0f} us ({cal.hops} hops) of which a receive costs "
        f"{cal.receive_s * 1e6:.0f} us{link}, "
        f"from {len(got.steps_s)} steps of {_short(cand)} ({got.seconds:.1f} s)"
    )
    return cal, got, msg


def verify(
    cfg: RunConfig,
    result: Any,
    shape: ConfigShape,
    args: argparse.Namespace,
    world: int,
    predict_config: Callable[[], Any] | None,
    config_run: Any = None,
) -> str:
    """Run the top ``args.verify`` candidates and the config's shape; return the table.
    ``config_run``: the config shape's measurement when calibration ran it already."""
    from lightning_pp.planner.verify import VerifyRow, format_verify_table

    top = list(enumerate(result.ranked[: max(0, args.verify)]))
    todo: list[tuple[str, Any]] = [(f"#{i + 1}", p) for i, p in top if p.candidate.tp == 1]
    notes = [
        f"#{i + 1} ({_short(p.candidate)}) is not verified: the verify runs the engine without "
        f"tensor parallelism"
        for i, p in top
        if p.candidate.tp > 1
    ]
    if shape.candidate is not None:
        same = [label for label, p in todo if p.candidate == shape.candidate]
        if same:
            notes.append(f"the config's own shape is {same[0]}")
        elif predict_config is not None:
            todo.append(("config", predict_config()))
    else:
        notes.append(f"the config's own shape is not verified: {shape.error}")
    batch = config_batch(cfg)
    rows = []
    for n, (label, pred) in enumerate(todo, 1):
        cand = pred.candidate
        row = VerifyRow(
            label,
            _short(cand),
            pred.step_s,
            [m.activations for m in pred.memory],
            contention_s=pred.contention_s,
        )
        if label == "config" and config_run is not None:
            row.measured = config_run
        else:
            got, error = _run(cfg, batch, cand, args, world, records=False)
            row.measured, row.error = got, error
        if row.measured is not None:
            _log(
                f"verify {n}/{len(todo)}: {label} {row.shape}: measured "
                f"{row.measured.step_s * 1e3:.1f} ms (predicted {pred.step_s * 1e3:.1f} ms, "
                f"{row.step_error:+.1f}%), {row.measured.seconds:.1f} s"
            )
        else:
            _log(f"verify {n}/{len(todo)}: {label} {row.shape}: FAILED: {row.error}")
        rows.append(row)
    ok = [r for r in rows if r.measured is not None]
    out = [
        f"verify: {len(rows)} shapes, {args.verify_warmup} warm-up + {args.verify_steps} timed "
        f"steps each on {world} processes (median step; activation peak: the engine's "
        "saved-bytes meter, heaviest pipeline rank)",
        format_verify_table(rows),
    ]
    if ok:
        errs = sorted(abs(r.step_error) for r in ok)
        acts = sorted(abs(r.act_error) for r in ok)
        best = min(ok, key=lambda r: r.measured.step_s)
        out.append(
            f"step time |error|: median {statistics.median(errs):.1f}%, worst {errs[-1]:.1f}%; "
            f"activation peak |error|: worst {acts[-1]:.1f}%; fastest measured: {best.label} "
            f"({best.measured.step_s * 1e3:.1f} ms)"
        )
        if any(r.contention_s for r in ok):
            from lightning_pp.planner.verify import pct_error

            alone = sorted(
                abs(pct_error(r.predicted_s - r.contention_s, r.measured.step_s)) for r in ok
            )
            out.append(
                f"without the oversubscription term ({world} processes on {os.cpu_count()} "
                f"CPUs): step time |error| median {statistics.median(alone):.1f}%, "
                f"worst {alone[-1]:.1f}%"
            )
    out += notes
    return "\n".join(out)
