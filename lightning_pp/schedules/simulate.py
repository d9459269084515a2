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

    ``t_f`` / ``t_b`` are the forward / fused-backward times of a rank's *whole* share of the
    model (all its chunks). A split backward costs ``t_i`` (input gradient, ``I``) and ``t_w``
    (weight gradients, ``W``); both default to half of ``t_b`` (give one and the other is the rest
    of ``t_b``; give both and they are used as given, while a fused ``B`` still costs ``t_b``).
    With ``vpp`` chunks per rank each chunk costs ``t / vpp``, so interleaving changes the order,
    not the total work. ``overrides`` sets the absolute per-chunk costs of chosen
    ``(rank, chunk)`` pairs (an uneven partition): ``(t_f, t_b)``, whose ``I`` / ``W`` then cost
    half of that ``t_b`` each, or ``(t_f, t_b, t_i, t_w)``. ``latency`` is added on every
    dependency that crosses ranks (a send/receive).

    Activation recompute: ``t_r`` is the forward time recompute adds to one backward of a rank's
    whole share (``t_r / vpp`` per chunk, like ``t_f``); ``recompute`` sets it per rank
    (``{rank: seconds}``, the rank's whole share, split evenly over its chunks) or per chunk
    (``{(rank, chunk): seconds}``, absolute), the most specific key winning. It is added to a
    fused ``B`` and to an ``I`` (a split backward recomputes the forward before the input
    gradient; ``W`` reuses what ``I`` recomputed and gets none), on top of ``t_b``/``t_i`` and
    of ``overrides``, which are the costs without recompute. Default 0: no change.
    ``recompute_w`` (same keys) is the forward time added to a ``W``: a layer the
    ``"auto"`` planner recomputes again for ``W`` (``RecomputeOnce(again=True)``) runs its
    forward a second time there. Default: none.

    ``overhead`` is the engine's fixed cost of one action (``F``, ``B``, ``I`` or ``W``) beyond
    its layers' compute, added to every step of every rank. It is what makes a fused ``B``
    cheaper than an ``I`` and a ``W`` on a real machine (one dispatch instead of two), which the
    cost-built schedule (:func:`~lightning_pp.schedules.auto.zb_auto`) weighs. Default 0: no
    change.

    Example:
        >>> from lightning_pp.schedules import build_schedule, simulate
        >>> simulate(build_schedule("1f1b", pp=4, microbatches=8), Costs(t_f=1, t_b=2)).makespan
        33.0
        >>> Costs(t_b=3.0, t_i=2.0).t_w
        1.0
        >>> Costs(t_r=0.5).chunk_costs(build_schedule("1f1b", pp=2, microbatches=2), 0, 0)[Op.B]
        2.5
    """

    t_f: float = 1.0
    t_b: float = 2.0
    overrides: Mapping[tuple[int, int], tuple[float, ...]] = field(default_factory=dict)
    latency: float = 0.0
    t_i: float | None = None
    t_w: float | None = None
    t_r: float = 0.0
    recompute: Mapping[int | tuple[int, int], float] = field(default_factory=dict)
    recompute_w: Mapping[int | tuple[int, int], float] = field(default_factory=dict)
    overhead: float = 0.0

    def __post_init__(self) -> None:
        # Resolve the split first so that every field reads as a number afterwards.
        t_i = self.t_b / 2 if self.t_i is None and self.t_w is None else self.t_i
        t_w = self.t_w
        if t_i is None:
            t_i = self.t_b - float(t_w or 0.0)
        if t_w is None:
            t_w = self.t_b - t_i
        object.__setattr__(self, "t_i", float(t_i))
        object.__setattr__(self, "t_w", float(t_w))
        values = {"t_f": self.t_f, "t_b": self.t_b, "t_i": t_i, "t_w": t_w, "latency": self.latency}
        for key, costs in self.overrides.items():
            if len(costs) not in (2, 4):
                raise ValueError(
                    f"cost overrides[{key}] must be (t_f, t_b) or (t_f, t_b, t_i, t_w), "
                    f"got {costs!r}"
                )
            values[f"overrides[{key}]"] = min(costs)
        values["t_r"] = self.t_r
        values["overhead"] = self.overhead
        for name, table in (("recompute", self.recompute), ("recompute_w", self.recompute_w)):
            for where, seconds in table.items():
                ok = isinstance(where, int) or (
                    isinstance(where, tuple)
                    and len(where) == 2
                    and all(isinstance(k, int) for k in where)
                )
                if not ok:
                    raise ValueError(
                        f"{name} keys must be a rank (int) or a (rank, chunk) pair, got {where!r}"
                    )
                values[f"{name}[{where}]"] = seconds
        for name, value in values.items():
            if not value >= 0:  # also rejects NaN
                hint = " (t_i or t_w larger than t_b? give both)" if name in ("t_i", "t_w") else ""
                raise ValueError(f"cost {name} must be >= 0, got {value!r}{hint}")
        if self.t_f + self.t_b <= 0:
            raise ValueError(f"t_f + t_b must be > 0, got t_f={self.t_f}, t_b={self.t_b}")

    def chunk_costs(self, schedule: Schedule, rank: int, chunk: int) -> dict[Op, float]:
        """Per-op cost of one step of ``chunk`` on ``rank``: ``{F, B, I, W}`` -> seconds."""
        costs = self.overrides.get((rank, chunk))
        if costs is None:
            v = schedule.vpp
            tf, tb = self.t_f / v, self.t_b / v
            ti, tw = float(self.t_i or 0.0) / v, float(self.t_w or 0.0) / v  # floats by now
        elif len(costs) == 4:
            tf, tb, ti, tw = costs
        else:
            tf, tb = costs
            ti = tw = tb / 2
        tr = self.recompute_cost(schedule, rank, chunk)
        t_again = _lookup(self.recompute_w, schedule, rank, chunk, 0.0)
        oh = float(self.overhead)
        return {
            Op.F: float(tf) + oh,
            Op.B: float(tb) + tr + oh,
            Op.I: float(ti) + tr + oh,
            Op.W: float(tw) + t_again + oh,
        }

    def recompute_cost(self, schedule: Schedule, rank: int, chunk: int) -> float:
        """The forward time recompute adds to one backward (``B`` or ``I``) of ``chunk`` on
        ``rank``: ``recompute[(rank, chunk)]``, else ``recompute[rank] / vpp``, else
        ``t_r / vpp``."""
        return _lookup(self.recompute, schedule, rank, chunk, self.t_r)

    def duration(self, schedule: Schedule, rank: int, action: Action) -> float:
        """Time ``action`` takes on ``rank`` under this cost model."""
        return self.chunk_costs(schedule, rank, action.chunk)[action.op]


def _lookup(
    table: Mapping[int | tuple[int, int], float],
    schedule: Schedule,
    rank: int,
    chunk: int,
    default: float,
) -> float:
    """``table[(rank, chunk)]``, else ``table[rank] / vpp``, else ``default / vpp``."""
    if (rank, chunk) in table:
        return float(table[(rank, chunk)])
    if rank in table:
        return float(table[rank]) / schedule.vpp
    return float(default) / schedule.vpp


@dataclass(frozen=True)
class SimResult:
    """A simulated (or measured) run of one schedule step.

    ``bubble_ratio`` is total idle / total compute over all ranks, where a rank's idle time is
    ``makespan - busy``: (p-1)/m for GPipe and 1F1B, (p-1)/(v·m) for interleaved (m a multiple
    of p) at uniform costs. ``peak_inflight[r]`` is the largest number of microbatch-chunks whose
    forward ran on rank r and whose backward has not completed (a split backward completes at its
    ``W``): the activations it must hold at once (see :func:`peak_inflight`).
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


def peak_inflight(schedule: Schedule, until: Op = Op.W) -> list[int]:
    """Per rank, the most microbatch-chunks forwarded but not yet backwarded at any moment.

    A fused ``B`` ends a microbatch-chunk's life. With a split backward it lives until its
    ``W`` by default (``until=Op.W``): the weight gradients need the stage's saved inputs, so
    the activation memory is not released at the ``I``. This is the bound the engine's memory
    must respect. ``until=Op.I`` counts only up to the ``I`` instead: the microbatches that still
    hold their *whole* forward graph (what the zero-bubble paper calls in-flight; for ``zb-h1``
    it equals 1F1B's ``p - r``).

    It only changes at the rank's own steps, so it follows from the order alone, not the timing.

    Example:
        >>> from lightning_pp.schedules import build_schedule
        >>> s = build_schedule("zb-h1", pp=4, microbatches=8)
        >>> peak_inflight(s), peak_inflight(s, until=Op.I)
        ([4, 4, 4, 4], [4, 3, 2, 1])
    """
    if until not in (Op.I, Op.W):
        raise ValueError(f"until must be Op.I or Op.W, got {until!r}")
    ends = {Op.B, until}
    peaks = []
    for actions in schedule.ranks:
        live = peak = 0
        for a in actions:
            live += 1 if a.op is Op.F else -1 if a.op in ends else 0
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def simulate(
    schedule: Schedule, costs: Costs | None = None, start: Sequence[float] | None = None
) -> SimResult:
    """Time ``schedule`` under ``costs`` (default :class:`Costs`: t_f=1, t_b=2 (t_i=t_w=1), no
    latency).

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
