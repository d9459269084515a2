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

import functools

from ..schedules import Costs, Op, Schedule, receives, validate
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
        #: whether the schedule splits backward (I / W): a scan of every action, done once
        self.split_backward = schedule.split_backward
        # Steps are numbered once; every later lookup is by number (an Action's dataclass hash
        # is the cost that dominated compiling).
        keys = [(r, a) for r, actions in enumerate(schedule.ranks) for a in actions]
        number = {(r, a.op, a.mb, a.chunk): i for i, (r, a) in enumerate(keys)}
        deps = [
            [
                number[(d[0], d[1].op, d[1].mb, d[1].chunk)]
                for d in dependencies(schedule, r, a, backward_ops)
            ]
            for r, a in keys
        ]
        # Kahn's topological order over both kinds of edge: a step waits for its rank's previous
        # step and for its dependencies. Any such order gives the event-driven times (each
        # step's start is a max over exactly those predecessors), whatever the durations.
        after: list[list[int]] = [[] for _ in keys]
        waiting = [0] * len(keys)
        i = 0
        for actions in schedule.ranks:
            for j in range(len(actions)):
                preds = deps[i] + [i - 1] if j else deps[i]
                for p in preds:
                    after[p].append(i)
                waiting[i] = len(preds)
                i += 1
        ready = [i for i, w in enumerate(waiting) if w == 0]
        order: list[int] = []
        while ready:
            i = ready.pop()
            order.append(i)
            for nxt in after[i]:
                waiting[nxt] -= 1
                if waiting[nxt] == 0:
                    ready.append(nxt)
        if len(order) != len(keys):
            validate(schedule)  # raises the simulator's ScheduleError, with the grid
            raise AssertionError(f"{schedule.name}: dependency cycle")  # unreachable
        position = [0] * len(keys)
        for k, i in enumerate(order):
            position[i] = k
        ops = {op: i for i, op in enumerate(_OPS)}
        vpp = schedule.vpp
        self.ranks = [keys[i][0] for i in order]
        self.slots = [
            (keys[i][0] * vpp + keys[i][1].chunk) * len(_OPS) + ops[keys[i][1].op] for i in order
        ]
        self.deps = [tuple((position[d], keys[d][0] != keys[i][0]) for d in deps[i]) for i in order]

    @functools.cached_property
    def receives(self) -> list[int]:
        """How many actions of each rank receive from another stage (``F`` past the first
        stage, ``B``/``I`` before the last): what a per-receive cost is charged to."""
        s = self.schedule
        return [sum(receives(s, r, a) for a in actions) for r, actions in enumerate(s.ranks)]

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
