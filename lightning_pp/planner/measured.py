"""What a run's step records measured, in the simulator's terms.

Per-action costs (:func:`measured_costs`), the hop latency of a blocked receive
(:func:`p2p_latency`) and the cost of a receive whose data was already posted
(:func:`receive_overhead`), from the engine's :class:`~lightning_pp.runtime.records.StepRecord`
of every pipeline rank. The planner calibrates its predictions with them (``plan --verify``);
the bubble callbacks (:mod:`lightning_pp.callbacks.analysis`) build their expected bubble from
them. Clock offsets: see that module's docstring.

Example:
    >>> from lightning_pp.runtime.records import StepEvent, StepRecord
    >>> from lightning_pp.schedules import build_schedule, simulate
    >>> s = build_schedule("1f1b", pp=2, microbatches=2)
    >>> sim = simulate(s)
    >>> recs = [StepRecord(r, r, s, t0=0.0, t1=sim.makespan,
    ...                    events=[StepEvent(a, t0, t1) for a, t0, t1 in sim.timeline[r]])
    ...         for r in range(2)]
    >>> p2p_latency(recs), measured_costs(recs).overrides[(0, 0)]
    (0.0, (1.0, 2.0))
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ..runtime.records import StepRecord
from ..schedules import Costs, Op, Schedule, receives

__all__ = [
    "check_pipeline",
    "clock_offsets",
    "cross_stage_receives",
    "measured_costs",
    "p2p_latency",
    "receive_overhead",
    "split_pipelines",
]


def clock_offsets(records: Sequence[StepRecord], offsets: Sequence[float] | None) -> list[float]:
    if offsets is None:
        return [0.0] * len(records)
    if len(offsets) != len(records):
        raise ValueError(f"got {len(offsets)} clock offsets for {len(records)} records")
    return [float(o) for o in offsets]


def check_pipeline(records: Sequence[StepRecord]) -> Schedule:
    if not records:
        raise ValueError("need at least one step record")
    schedule = records[0].schedule
    ranks = sorted(r.pp_rank for r in records)
    if ranks != list(range(schedule.pp)):
        raise ValueError(
            f"a pipeline needs one record per pipeline rank 0..{schedule.pp - 1}, got pp_ranks "
            f"{ranks} (global ranks {[r.rank for r in records]})"
        )
    for rec in records:
        expected = len(schedule.ranks[rec.pp_rank])
        if len(rec.events) != expected:
            raise ValueError(
                f"rank {rec.rank} (pp_rank {rec.pp_rank}) recorded {len(rec.events)} events but "
                f"its schedule has {expected} actions: the step did not complete"
            )
    return schedule


def split_pipelines(records: Sequence[StepRecord], pp: int) -> list[list[int]]:
    """Group a world's records (index = position) into pipelines, each in pipeline-rank order.

    Uses the topology's layout ``global_rank = pp_rank * dp + dp_rank``.

    Example:
        >>> from lightning_pp.schedules import build_schedule
        >>> s = build_schedule("1f1b", pp=2, microbatches=2)
        >>> recs = [StepRecord(g, g // 2, s, t0=0.0) for g in range(4)]   # dp=2
        >>> split_pipelines(recs, pp=2)
        [[0, 2], [1, 3]]
    """
    if len(records) % pp:
        raise ValueError(f"{len(records)} records cannot form pipelines of pp={pp}")
    dp = len(records) // pp
    lines: dict[int, dict[int, int]] = defaultdict(dict)
    for i, rec in enumerate(records):
        lines[rec.rank - rec.pp_rank * dp][rec.pp_rank] = i
    return [[line[p] for p in range(pp)] for _, line in sorted(lines.items())]


def measured_costs(records: Sequence[StepRecord]) -> Costs:
    """Mean measured compute of each ``(pp_rank, chunk)`` forward and backward, as a cost model.

    A pair that never ran a backward (a forward-only step) gets backward cost 0. With activation
    recompute the measured backward includes the recomputed forward, so the result has no
    separate recompute term.

    Example:
        >>> from lightning_pp.runtime.records import StepEvent
        >>> from lightning_pp.schedules import build_schedule
        >>> s = build_schedule("1f1b", pp=1, microbatches=2)
        >>> ev = [StepEvent(a, 0.0, 1.0 if a.op is Op.F else 3.0) for a in s.ranks[0]]
        >>> measured_costs([StepRecord(0, 0, s, 0.0, ev)]).overrides
        {(0, 0): (1.0, 3.0)}
    """
    sums: dict[tuple[int, int, Op], list[float]] = defaultdict(list)
    for rec in records:
        for e in rec.events:
            sums[(rec.pp_rank, e.action.chunk, e.action.op)].append(max(e.compute, 0.0))
    keys = sorted({(r, c) for r, c, _ in sums})

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    overrides: dict[tuple[int, int], tuple[float, ...]] = {}
    for r, c in keys:
        tf = mean(sums[(r, c, Op.F)])
        if sums[(r, c, Op.I)] or sums[(r, c, Op.W)]:
            # a split backward: I and W measured apart; a fused B costs their sum
            ti, tw = mean(sums[(r, c, Op.I)]), mean(sums[(r, c, Op.W)])
            overrides[(r, c)] = (tf, ti + tw, ti, tw)
        else:
            overrides[(r, c)] = (tf, mean(sums[(r, c, Op.B)]))
    total = sum(costs[0] + costs[1] for costs in overrides.values())
    if total <= 0:  # all-zero measurement (a mocked clock): keep Costs' own validation happy
        return Costs()
    return Costs(overrides=overrides)


def cross_stage_receives(records: Sequence[StepRecord], offsets: list[float]):
    """Every cross-stage receive: ``(receiver start, receiver comm_wait, sender's send time)``,
    all aligned. The send time is the sender's ``send_time`` (its ``end`` in records without
    one, e.g. simulated timelines, whose dependencies count from the end)."""
    schedule = records[0].schedule
    # (forward?, mb, stage) -> aligned send time; a gradient is sent by a B or an I
    sent: dict[tuple[bool, int, int], float] = {}
    for rec, off in zip(records, offsets):
        for e in rec.events:
            if e.action.op is Op.W:
                continue  # sends nothing
            t = e.send_time if e.send_time is not None else e.end
            key = (e.action.op is Op.F, e.action.mb, schedule.stage(rec.pp_rank, e.action.chunk))
            sent[key] = t - off
    out = []
    for rec, off in zip(records, offsets):
        for e in rec.events:
            if not receives(schedule, rec.pp_rank, e.action):
                continue
            stage = schedule.stage(rec.pp_rank, e.action.chunk)
            forward = e.action.op is Op.F  # from the stage before; a gradient from the one after
            t = sent.get((forward, e.action.mb, stage - 1 if forward else stage + 1))
            if t is not None:
                out.append((e.start - off, e.comm_wait, t))
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def p2p_latency(records: Sequence[StepRecord], offsets: Sequence[float] | None = None) -> float:
    """Mean measured hop delay: from a send being posted to the blocked receiver having it (s).

    A receive whose action started waiting *before* the sender posted the data (its
    ``send_time``) was blocked when the data arrived, so ``start + comm_wait - send_time`` is one
    sample of the real hop (posting, header and data transfer, waking the receiver). Receives
    whose data was already on its way carry no such information (see
    :func:`receive_overhead`). The mean, since delays add up along the step. 0.0 without
    samples; never negative.
    """
    recvs = cross_stage_receives(records, clock_offsets(records, offsets))
    return max(_mean([st + wait - sent for st, wait, sent in recvs if st < sent]), 0.0)


def receive_overhead(
    records: Sequence[StepRecord], offsets: Sequence[float] | None = None
) -> float:
    """Mean time a receive blocks although its data was posted before it asked (s).

    The engine's receive is not free: the header must be read, the data receive posted and the
    transfer completed. Receives that started waiting *after* the sender posted show that cost
    alone. The expectation charges it to every receiving action (as waiting time, like the
    measurement) and takes it off the hop latency, so both regimes match the simulator.
    """
    recvs = cross_stage_receives(records, clock_offsets(records, offsets))
    return max(_mean([wait for st, wait, sent in recvs if st >= sent]), 0.0)
