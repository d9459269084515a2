"""``lightning-pp schedule``: print a schedule's grid and predicted metrics, or its JSON.

Example::

    lightning-pp schedule --schedule interleaved --pp 4 --vpp 2 --microbatches 8
    lightning-pp schedule --schedule 1f1b --pp 4 --microbatches 8 --format json
    lightning-pp schedule --schedule 1f1b --pp 4 --microbatches 8 --png 1f1b.png
"""

from __future__ import annotations

import argparse
import sys

from lightning_pp.layout.plan import PipelinePlan
from lightning_pp.schedules import SCHEDULES, render_gantt, render_grid, simulate


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
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--png", default=None, metavar="FILE", help="also write a Gantt chart PNG")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"lightning-pp schedule: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
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
        result = simulate(schedule)
    except ValueError as exc:  # PreflightError, ScheduleError
        return _fail(str(exc))

    if args.format == "json":
        print(
            schedule.to_json(
                group_size=schedule.group_size,
                bubble_ratio=result.bubble_ratio,
                makespan=result.makespan,
                peak_inflight=result.peak_inflight,
            )
        )
    else:
        group = f" group_size={schedule.group_size}" if schedule.group_size else ""
        print(
            f"{schedule.name}: pp={schedule.pp} vpp={schedule.vpp} "
            f"microbatches={schedule.microbatches}{group}"
        )
        print(render_grid(result))

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
