"""``lightning-pp schedule``: print a schedule's grid and predicted metrics, or its JSON.

Example::

    lightning-pp schedule --schedule interleaved --pp 4 --vpp 2 --microbatches 8
    lightning-pp schedule --schedule 1f1b --pp 4 --microbatches 8 --format json
    lightning-pp schedule --schedule 1f1b --pp 4 --microbatches 8 --png 1f1b.png
    lightning-pp schedule --schedule zb-auto --pp 4 --microbatches 8 --costs t_f=1,t_i=1.4,t_w=0.6
"""

from __future__ import annotations

import argparse
import sys

from lightning_pp.layout.plan import PipelinePlan
from lightning_pp.schedules import (
    SCHEDULES,
    Costs,
    build_schedule,
    render_gantt,
    render_grid,
    simulate,
)
from lightning_pp.schedules.auto import MEMORY_PRESETS, describe

#: the ``--costs`` keys, as the simulator's :class:`~lightning_pp.schedules.Costs` names them
COST_KEYS = ("t_f", "t_b", "t_i", "t_w", "latency", "overhead")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``schedule`` subcommand to the ``lightning-pp`` parser."""
    p = subparsers.add_parser(
        "schedule",
        help="print a pipeline schedule and its predicted bubble / memory",
        description=(
            "Build a pipeline schedule and print its per-rank order over time with the "
            "simulator's default costs (t_f=1, t_b=2 per stage; each of vpp chunks costs t/vpp)."
        ),
    )
    p.add_argument("--schedule", required=True, choices=sorted(SCHEDULES))
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument(
        "--vpp",
        type=int,
        default=None,
        help="model chunks per rank (default: the schedule's own, 2 for zbv, else 1)",
    )
    p.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="interleaved only: microbatches per virtual-stage group N (default pp)",
    )
    p.add_argument(
        "--costs",
        default=None,
        metavar="K=V,...",
        help=(
            "simulate (and build zb-auto) under these costs per rank's whole share: "
            f"{', '.join(COST_KEYS)}; e.g. t_f=1,t_i=1.4,t_w=0.6 (t_b defaults to t_i + t_w). "
            "Default: t_f=1, t_b=2, t_i=t_w=1"
        ),
    )
    p.add_argument(
        "--memory",
        default=None,
        help=(
            f"zb-auto only: in-flight limit per rank, one of {', '.join(MEMORY_PRESETS)} "
            "(default 1p: 1F1B's peak) or a number of microbatch-chunks"
        ),
    )
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--png", default=None, metavar="FILE", help="also write a Gantt chart PNG")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"lightning-pp schedule: error: {message}", file=sys.stderr)
    return 2


def parse_costs(text: str | None) -> Costs | None:
    """``t_f=1,t_i=1.4,t_w=0.6`` -> :class:`Costs` (``t_b = t_i + t_w`` when both halves are
    given and ``t_b`` is not); ``None`` for ``None``. Raises ``ValueError`` naming a bad item.

    >>> parse_costs("t_f=1,t_i=1.4,t_w=0.6").t_b
    2.0
    """
    if text is None:
        return None
    values: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in COST_KEYS:
            raise ValueError(
                f"--costs item {item!r}: expected KEY=VALUE with KEY one of {list(COST_KEYS)}"
            )
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"--costs item {item!r}: {value.strip()!r} is not a number") from None
    if "t_b" not in values and "t_i" in values and "t_w" in values:
        values["t_b"] = values["t_i"] + values["t_w"]
    return Costs(**values)


def _memory(text: str | None) -> str | int | None:
    if text is None or text in MEMORY_PRESETS:
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"--memory {text!r}: expected one of {list(MEMORY_PRESETS)} or a number of "
            f"microbatch-chunks per rank"
        ) from None


def run(args: argparse.Namespace) -> int:
    try:
        costs = parse_costs(args.costs)
        memory = _memory(args.memory)
        if memory is not None and args.schedule != "zb-auto":
            raise ValueError(f"--memory applies to --schedule zb-auto only, not {args.schedule!r}")
        # The plan's rules, as for a run; the bubble warning for microbatches < pp is left out
        # (showing such a schedule is what this command is for).
        schedule = PipelinePlan.build(
            schedule=args.schedule,
            pp=args.pp,
            microbatches=args.microbatches,
            vpp=args.vpp,
            group_size=args.group_size,
            warn=False,
        ).schedule
        if schedule.name == "zb-auto" and (costs is not None or memory is not None):
            # the plan checked the shape; the order is rebuilt from the given costs and memory
            schedule = build_schedule(
                "zb-auto", schedule.pp, schedule.microbatches, schedule.vpp, costs=costs,
                memory=memory,
            )  # fmt: skip
        result = simulate(schedule, costs)
    except ValueError as exc:  # PreflightError, ScheduleError
        return _fail(str(exc))

    if args.format == "json":
        extra = {}
        if schedule.name == "zb-auto":
            extra = {"source": schedule.meta.get("source"), "memory": schedule.meta.get("memory")}
        print(
            schedule.to_json(
                group_size=schedule.group_size,
                bubble_ratio=result.bubble_ratio,
                makespan=result.makespan,
                peak_inflight=result.peak_inflight,
                **extra,
            )
        )
    else:
        group = f" group_size={schedule.group_size}" if schedule.group_size else ""
        print(
            f"{schedule.name}: pp={schedule.pp} vpp={schedule.vpp} "
            f"microbatches={schedule.microbatches}{group}"
        )
        print(render_grid(result))
        if schedule.name == "zb-auto":
            print(describe(schedule, costs))

    if args.png:
        title = (
            f"{schedule.name} pp={schedule.pp} vpp={schedule.vpp} m={schedule.microbatches}  "
            f"bubble={result.bubble_ratio:.3f}"
        )
        try:
            render_gantt(result.timeline, args.png, title=title)
        except (ImportError, OSError) as exc:
            return _fail(str(exc))
        if args.format == "text":
            print(f"wrote {args.png}")
    return 0
