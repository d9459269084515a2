"""Pure-Python pipeline schedules: what runs when. Imports nothing distributed."""

from .actions import Action, Op, Schedule
from .generators import (
    SCHEDULES,
    build_schedule,
    check_schedule_name,
    gpipe,
    interleaved,
    interleaved_table,
    one_f_one_b,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "Op",
    "Schedule",
    "build_schedule",
    "check_schedule_name",
    "gpipe",
    "interleaved",
    "interleaved_table",
    "one_f_one_b",
]
