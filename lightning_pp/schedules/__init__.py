"""Pure-Python pipeline schedules: what runs when. Imports nothing distributed.

Example:
    >>> from lightning_pp.schedules import build_schedule, simulate, validate
    >>> s = build_schedule("interleaved", pp=4, vpp=2, microbatches=8)
    >>> validate(s)
    >>> simulate(s).bubble_ratio
    0.1875
"""

from .actions import Action, Op, Schedule
from .generators import (
    SCHEDULES,
    build_schedule,
    check_interleaved,
    check_positive,
    check_schedule_name,
    gpipe,
    interleaved,
    interleaved_table,
    interleaved_warmup,
    one_f_one_b,
)
from .render import render_gantt, render_grid
from .simulate import Costs, SimResult, peak_inflight, simulate
from .validate import ScheduleError, Timeline, check_structure, execute, format_grid, validate

__all__ = [
    "SCHEDULES",
    "Action",
    "Costs",
    "Op",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "Timeline",
    "build_schedule",
    "check_positive",
    "check_interleaved",
    "check_schedule_name",
    "check_structure",
    "execute",
    "format_grid",
    "gpipe",
    "interleaved",
    "interleaved_table",
    "interleaved_warmup",
    "one_f_one_b",
    "peak_inflight",
    "render_gantt",
    "render_grid",
    "simulate",
    "validate",
]
