"""``PipelineStrategy(schedule="zb-auto")``: the schedule rebuilt from measured costs.

The strategy starts with ``zb-auto`` built from default costs (``t_f = t_i = t_w``), the only
costs known before anything ran. Its second training step (:data:`PROFILE_STEP`) is the
profiling step: every rank's engine records each action's time, split into the layers' own
computation and the engine's cost around it. Not the first: that one pays one-time costs
(gloo's lazy pair connections, first allocations and caches). Measured
(``benchmarks/first_step_costs.py``, zbv p=4 m=8, results in
``benchmarks/results/first_step_costs.md``): on the virtual device the first step read a
per-action overhead 1.2-1.3x and a hop latency 1.2-2x the later steps'; with per-op means (before
the median below) the 2-core transformer's first stage read a forward of 13.9 ms against
1.9-5.6 ms later, and the virtual device an overhead 1.4-1.6x and a hop latency 1.8-2.4x.
After the profiling step
:func:`rebuild_from_step` gathers the records of the whole world, turns them into the
simulator's costs (:func:`measured_auto_costs`: per ``(pp rank, chunk)`` ``t_f``, ``t_i``,
``t_w``, the hop latency, the per-action overhead), builds ``zb-auto`` from them with the same
chunks and placement (so the layers stay where they are), and hands it to the engine for every
later step. Every rank computes the same schedule from the same gathered numbers (the build is
deterministic), which the data-parallel sync needs: all replicas must run one order.

The bubble monitor compares the measured steps against the schedule in each step's record, so
after the rebuild it compares against this one.

Example (what the strategy does after its profiling step)::

    info = rebuild_from_step(engine, layout, record)
    info.schedule, info.text   # the schedule now in the engine; the line that was logged
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..planner.measured import p2p_latency
from ..runtime.records import StepRecord
from ..schedules import Costs, Op, Schedule, render_grid, simulate, zb_auto
from ..schedules.auto import describe

log = logging.getLogger("lightning_pp.strategy")

__all__ = ["PROFILE_STEP", "AutoScheduleInfo", "measured_auto_costs", "rebuild_from_step"]


#: the training step (counting from 1) whose measured costs zb-auto is rebuilt from: the
#: first warms up (see the module notes)
PROFILE_STEP = 2


@dataclass(frozen=True)
class AutoScheduleInfo:
    """What the rebuild did: the ``schedule`` now in the engine, the ``costs`` it was built
    from, ``text`` (the logged summary: build source, simulated bubble, the handcrafted
    schedules' simulated steps under the same costs) and ``step``, the training step (from 1)
    whose costs were measured."""

    schedule: Schedule
    costs: Costs
    text: str
    step: int = PROFILE_STEP


def measured_auto_costs(records: Sequence[StepRecord]) -> Costs:
    """The simulator's costs from one step's records of any number of ranks (replicas are
    averaged per ``(pp rank, chunk)``).

    * ``overrides[(r, c)] = (t_f, t_i + t_w, t_i, t_w)``: the median over the microbatches of
      the time inside the chunk's own computation (``StepEvent.layers``; the whole ``compute``
      in records without it) per op, so one slow action (a cold cache, a descheduled process)
      does not move it; a pair measured only as a fused ``B`` splits it in halves;
    * ``overhead``: the median engine cost around one action (``compute - layers``): what a
      fused ``B`` saves over an ``I`` and a ``W``;
    * ``latency``: the hop delay of the first complete pipeline among the records
      (:func:`~lightning_pp.planner.measured.p2p_latency`), 0 when it cannot be told.

    Example:
        >>> from lightning_pp.runtime.records import StepEvent
        >>> from lightning_pp.schedules import build_schedule
        >>> s = build_schedule("zb-h1", pp=1, microbatches=2)
        >>> t = {Op.F: 1.0, Op.I: 2.0, Op.W: 3.0}
        >>> ev = [StepEvent(a, 0.0, t[a.op] + 0.5, layers=t[a.op]) for a in s.ranks[0]]
        >>> c = measured_auto_costs([StepRecord(0, 0, s, 0.0, ev)])
        >>> c.overrides[(0, 0)], c.overhead
        ((1.0, 5.0, 2.0, 3.0), 0.5)
    """
    times: dict[tuple[int, int, Op], list[float]] = defaultdict(list)
    engine_cost: list[float] = []
    for rec in records:
        for e in rec.events:
            layers = getattr(e, "layers", None)
            inside = e.compute if layers is None else layers
            times[(rec.pp_rank, e.action.chunk, e.action.op)].append(max(inside, 0.0))
            if layers is not None:
                engine_cost.append(max(e.compute - layers, 0.0))

    def typical(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    overrides: dict[tuple[int, int], tuple[float, ...]] = {}
    for r, c in sorted({(r, c) for r, c, _ in times}):
        t_f = typical(times[(r, c, Op.F)])
        if times[(r, c, Op.I)] or times[(r, c, Op.W)]:
            t_i, t_w = typical(times[(r, c, Op.I)]), typical(times[(r, c, Op.W)])
        else:
            t_i = t_w = typical(times[(r, c, Op.B)]) / 2
        overrides[(r, c)] = (t_f, t_i + t_w, t_i, t_w)
    overhead = statistics.median(engine_cost) if engine_cost else 0.0
    latency = 0.0
    first: dict[int, StepRecord] = {}
    for rec in sorted(records, key=lambda x: x.rank):
        first.setdefault(rec.pp_rank, rec)
    try:
        latency = p2p_latency([first[r] for r in sorted(first)])
    except (ValueError, KeyError):  # not one complete pipeline: no hop measured
        latency = 0.0
    if sum(x[0] + x[1] for x in overrides.values()) <= 0:  # nothing measured (a mocked clock)
        return Costs(latency=latency, overhead=overhead)
    return Costs(overrides=overrides, latency=latency, overhead=overhead)


def _gather(record: StepRecord) -> list[StepRecord]:
    """Every rank's record of the same step (this rank's alone without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [record]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, record)
    return [r for r in out if r is not None]


def rebuild_from_step(
    engine: Any,
    layout: Any,
    record: StepRecord,
    memory: str | int | Sequence[int] = "1p",
    step: int = PROFILE_STEP,
) -> AutoScheduleInfo:
    """Build ``zb-auto`` from the costs measured in ``record``'s step (training step ``step``,
    counting from 1) on every rank and give it to ``engine`` (and to ``layout.plan``). A
    collective: every rank must call it after the same step. Logs the grid, the simulated
    bubble and the comparison on global rank 0.

    Example::

        info = rebuild_from_step(strategy.engine, strategy.layout, strategy.last_record)
    """
    records = _gather(record)
    costs = measured_auto_costs(records)
    current: Schedule = engine.schedule
    schedule = zb_auto(
        current.pp,
        current.microbatches,
        vpp=current.vpp,
        costs=costs,
        memory=memory,
        placement=current.placement,
    )
    engine.schedule = schedule
    if getattr(layout, "plan", None) is not None:
        layout.plan = dataclasses.replace(layout.plan, schedule=schedule)
    text = describe(schedule, costs)
    if record.rank == 0:
        log.info(
            "schedule zb-auto rebuilt from training step %d's measured costs (per action: "
            "overhead %.3g ms, hop latency %.3g ms): %s\n%s",
            step,
            costs.overhead * 1e3,
            costs.latency * 1e3,
            text,
            render_grid(simulate(schedule, costs)),
        )
    return AutoScheduleInfo(schedule, costs, text, step)
