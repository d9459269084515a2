"""The simulator's timeline, compiled once per schedule and re-timed for many cost models.

:func:`~lightning_pp.schedules.simulate` checks a schedule's structure and walks its
dependencies every time it is called (milliseconds for a few hundred actions). The planner
times each schedule under a dozen cost models (layer splits, recompute), so it walks once: the
dependencies come from the same :func:`~lightning_pp.schedules.validate.dependencies`, the
per-action costs from the same :meth:`Costs.chunk_costs
<lightning_pp.schedules.simulate.Costs.chunk_costs>`, and the evaluation order from the same
event-driven rule (a step starts at ``max(rank free, each dependency's end + latency if on
another rank)``), so the makespan equals ``simulate``'s (tests/test_planner.py checks it on every
schedule).

Example:
    >>> from lightning_pp.schedules import Costs, build_schedule, simulate
    >>> s = build_schedule("1f1b", pp=4, microbatches=8)
    >>> compiled = CompiledSchedule(s)
    >>> costs = Costs(t_f=1, t_b=2, latency=0.1)
    >>> compiled.run(costs)[0] == simulate(s, costs).makespan
    True
"""

from __future__ import annotations

from ..schedules import Costs, Op, Schedule, validate
from ..schedules.validate import _backward_ops, dependencies

__all__ = ["CompiledSchedule"]

_OPS = (Op.F, Op.B, Op.I, Op.W)


class CompiledSchedule:
    """A schedule's actions in an order where every dependency comes first, each with the
    indices of its dependencies and whether they cross ranks. A schedule that would deadlock
    raises :class:`~lightning_pp.schedules.ScheduleError` (the validator's message)."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        backward_ops = _backward_ops(schedule)
        pp = schedule.pp
        deps_of = {
            (r, a): dependencies(schedule, r, a, backward_ops)
            for r, actions in enumerate(schedule.ranks)
            for a in actions
        }
        # The event-driven order of execute(): advance every rank as far as its dependencies
        # allow, round-robin. It depends on the structure only, never on the durations.
        order: list[tuple[int, object]] = []
        done: set[tuple[int, object]] = set()
        pos = [0] * pp
        remaining = sum(len(a) for a in schedule.ranks)
        while remaining:
            before = remaining
            for r, actions in enumerate(schedule.ranks):
                while pos[r] < len(actions):
                    a = actions[pos[r]]
                    if any(d not in done for d in deps_of[(r, a)]):
                        break
                    order.append((r, a))
                    done.add((r, a))
                    pos[r] += 1
                    remaining -= 1
            if remaining == before:
                validate(schedule)  # raises the simulator's ScheduleError, with the grid
                raise AssertionError(f"{schedule.name}: no rank can progress")  # unreachable
        index = {key: i for i, key in enumerate(order)}
        self.ranks = [r for r, _ in order]
        self.slots = [
            (r * schedule.vpp + a.chunk) * len(_OPS) + _OPS.index(a.op)  # type: ignore[attr-defined]
            for r, a in order
        ]
        self.deps = [
            tuple((index[d], d[0] != r) for d in deps_of[(r, a)])  # type: ignore[index]
            for r, a in order
        ]

    def run(self, costs: Costs) -> tuple[float, list[float]]:
        """``(makespan, busy seconds per rank)`` under ``costs`` (its ``latency`` included)."""
        s = self.schedule
        table = [
            costs.chunk_costs(s, r, c)[op] for r in range(s.pp) for c in range(s.vpp) for op in _OPS
        ]
        latency = costs.latency
        end = [0.0] * len(self.ranks)
        free = [0.0] * s.pp
        busy = [0.0] * s.pp
        for i, (r, slot, deps) in enumerate(zip(self.ranks, self.slots, self.deps)):
            begin = free[r]
            for d, cross in deps:
                t = end[d] + latency if cross else end[d]
                if t > begin:
                    begin = t
            took = table[slot]
            end[i] = free[r] = begin + took
            busy[r] += took
        return max(free, default=0.0), busy
