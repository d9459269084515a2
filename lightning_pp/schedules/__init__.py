"""Pure-Python pipeline schedules: what runs when. Imports nothing distributed.

Example:
    >>> from lightning_pp.schedules import build_schedule, simulate, validate
    >>> s = build_schedule("interleaved", pp=4, vpp=2, microbatches=8)
    >>> validate(s)
    >>> simulate(s).bubble_ratio
    0.1875
    >>> round(simulate(build_schedule("zbv", pp=4, microbatches=8)).bubble_ratio, 4)
    0.0625
"""

from .actions import Action, Op, Schedule
from .auto import MEMORY_PRESETS, memory_limits, zb_auto
from .generators import (
    DEFAULT_VPP,
    SCHEDULES,
    build_schedule,
    check_interleaved,
    check_positive,
    check_schedule_name,
    chunks_per_rank,
    gpipe,
    interleaved,
    interleaved_table,
    interleaved_warmup,
    one_f_one_b,
    zb_h1,
    zbv,
)
from .render import OP_STYLE, render_gantt, render_grid
from .simulate import Costs, SimResult, peak_inflight, simulate
from .validate import (
    ScheduleError,
    Timeline,
    check_structure,
    execute,
    format_grid,
    receives,
    validate,
)

__all__ = [
    "DEFAULT_VPP",
    "MEMORY_PRESETS",
    "memory_limits",
    "zb_auto",
    "chunks_per_rank",
    "OP_STYLE",
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
    "receives",
    "render_gantt",
    "render_grid",
    "simulate",
    "validate",
    "zb_h1",
    "zbv",
]
