"""Predict a schedule's timeline from per-step costs: makespan, bubble, peak in-flight.

The simulator times the validator's dry run (:func:`lightning_pp.schedules.validate.execute`):
event-driven on the real dependencies, not lock-step, so a rank that waits shows up as idle time
exactly where a real pipeline would stall.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .actions import Action, Op, Schedule
from .validate import Timeline, execute


@dataclass(frozen=True)
class Costs:
    """Cost model of one pipeline step.

    ``t_f`` / ``t_b`` are the forward / backward times of a rank's *whole* share of the model
    (all its chunks). With ``vpp`` chunks per rank each chunk costs ``t_f / vpp`` and
    ``t_b / vpp``, so interleaving changes the order, not the total work. ``overrides`` sets the
    absolute per-chunk ``(t_f, t_b)`` of chosen ``(rank, chunk)`` pairs (an uneven partition).
    ``latency`` is added on every dependency that crosses ranks (a send/receive).

    Example:
        >>> from lightning_pp.schedules import build_schedule, simulate
        >>> simulate(build_schedule("1f1b", pp=4, microbatches=8), Costs(t_f=1, t_b=2)).makespan
        33.0
    """

    t_f: float = 1.0
    t_b: float = 2.0
    overrides: Mapping[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    latency: float = 0.0

    def __post_init__(self) -> None:
        values = {"t_f": self.t_f, "t_b": self.t_b, "latency": self.latency}
        for key, (tf, tb) in self.overrides.items():
            values[f"overrides[{key}]"] = min(tf, tb)
        for name, value in values.items():
            if not value >= 0:  # also rejects NaN
                raise ValueError(f"cost {name} must be >= 0, got {value!r}")
        if self.t_f + self.t_b <= 0:
            raise ValueError(f"t_f + t_b must be > 0, got t_f={self.t_f}, t_b={self.t_b}")

    def duration(self, schedule: Schedule, rank: int, action: Action) -> float:
        """Time ``action`` takes on ``rank`` under this cost model."""
        if (rank, action.chunk) in self.overrides:
            tf, tb = self.overrides[(rank, action.chunk)]
        else:
            tf, tb = self.t_f / schedule.vpp, self.t_b / schedule.vpp
        return float(tf if action.op is Op.F else tb)


@dataclass(frozen=True)
class SimResult:
    """A simulated (or measured) run of one schedule step.

    ``bubble_ratio`` is total idle / total compute over all ranks, where a rank's idle time is
    ``makespan - busy``: (p-1)/m for GPipe and 1F1B, (p-1)/(v·m) for interleaved (m a multiple
    of p) at uniform costs. ``peak_inflight[r]`` is the largest number of microbatch-chunks whose
    forward ran on rank r and whose backward has not: the activations it must hold at once.
    """

    schedule: Schedule
    costs: Costs
    timeline: Timeline
    makespan: float
    busy: list[float]
    idle: list[float]
    bubble_ratio: float
    peak_inflight: list[int]

    @property
    def total_compute(self) -> float:
        return sum(self.busy)

    @property
    def total_idle(self) -> float:
        return sum(self.idle)


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per rank, the most microbatch-chunks forwarded but not yet backwarded at any moment.

    It only changes at the rank's own steps, so it follows from the order alone, not the timing.
    """
    peaks = []
    for actions in schedule.ranks:
        live = peak = 0
        for a in actions:
            live += 1 if a.op is Op.F else -1 if a.op is Op.B else 0
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def simulate(
    schedule: Schedule, costs: Costs | None = None, start: Sequence[float] | None = None
) -> SimResult:
    """Time ``schedule`` under ``costs`` (default :class:`Costs`: t_f=1, t_b=2, no latency).

    ``start[r]``: when rank r may begin (default 0 for all); times, ``makespan`` and ``idle``
    count from 0, so a late start is idle time of that rank.

    Raises :class:`~lightning_pp.schedules.validate.ScheduleError` if it is malformed or would
    deadlock.

    Example:
        >>> from lightning_pp.schedules import build_schedule
        >>> r = simulate(build_schedule("interleaved", pp=4, vpp=2, microbatches=8))
        >>> r.makespan, r.bubble_ratio, r.peak_inflight
        (28.5, 0.1875, [11, 9, 7, 5])
    """
    costs = costs or Costs()
    timeline = execute(
        schedule, lambda rank, action: costs.duration(schedule, rank, action), costs.latency, start
    )
    makespan = max((steps[-1][2] for steps in timeline if steps), default=0.0)
    busy = [sum(end - start for _, start, end in steps) for steps in timeline]
    idle = [makespan - b for b in busy]
    compute = sum(busy)
    bubble = sum(idle) / compute if compute > 0 else 0.0
    return SimResult(
        schedule=schedule,
        costs=costs,
        timeline=timeline,
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_ratio=bubble,
        peak_inflight=peak_inflight(schedule),
    )
