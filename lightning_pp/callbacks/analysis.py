"""Turn the engine's step records into numbers: bubble, expected bubble, memory, trace events.

No Lightning and no ``torch.distributed`` here, so every formula is testable on hand-made
records. The callbacks gather one :class:`~lightning_pp.runtime.records.StepRecord` per rank and
call
these functions.

**Clocks.** Event times are ``time.perf_counter()`` of the recording process. On one Linux host
that clock is system-wide (``CLOCK_MONOTONIC``), across hosts it is not. Every function here
therefore takes ``offsets``: one reference time per record, subtracted from its times. The
gathering helper (:func:`lightning_pp.callbacks.gather.gather_records`) takes the reference as
``perf_counter()`` right after a barrier, i.e. one common instant on every rank (skew: the
barrier's release spread, microseconds on one host), so offsets are taken *per step* and clock
drift between hosts never accumulates. ``offsets=None`` means the times already share a clock.

**Bubble, defined like the simulator's** ``bubble_ratio``. For one pipeline (one record per
pipeline rank) the step window runs from the first rank entering the step (min aligned ``t0``)
to the last action's end, of length ``span``; what follows it (waiting for the last sends, the
loss broadcast) is reported as ``tail``, outside the bubble, since no schedule model has it. A
rank's *compute* is the sum of its actions' durations minus the time they spent blocked on
receives (:attr:`StepEvent.compute`); its *idle* time is ``span - compute`` (waiting on P2P,
ramp-up/drain, entering the step late). Then::

    bubble = sum(idle) / sum(compute)          # idle per unit of useful work, like simulate()
    idle_fraction[r] = idle[r] / span          # share of the step rank r was not computing

The *expected* bubble runs :func:`~lightning_pp.schedules.simulate` on the same schedule and the
same window with MEASURED inputs only, never the measured idle:

- each ``(rank, chunk)`` forward/backward costs its mean measured compute;
- each rank starts when it really started its first action (ranks enter a step a few ms apart:
  a late first rank delays the whole pipeline, a late last rank costs nothing; both numbers
  agree on that);
- a receive costs :func:`receive_overhead` (the mean wait of receives whose data was already
  posted: header, data transfer, waking up) as waiting time at the start of the receiving
  action, and a cross-rank dependency adds :func:`p2p_latency` (the mean delay from the sender
  posting to a blocked receiver having the data, timed with ``StepEvent.send_time``) minus that
  overhead.

Means, not medians: delays add up along the step, and under load their distribution has a long
tail (a process waking up milliseconds late) that a median would drop. Measured minus expected
is then what none of these averages capture: where the slow hops and wake-ups fell (on the
critical path or not), stragglers, clock alignment error across hosts.

**Activation recompute.** A recomputing layer runs its forward again inside its backward (a
fused ``B``, or the ``I`` of a split one), so the measured ``B``/``I`` costs above already hold
that time and the expectation has it; adding a recompute term to them would count it twice. An
expectation built from a cost model instead (no measurement yet) adds it with
``Costs(recompute=...)``: :func:`plan_recompute_costs` gives the ``recompute="auto"`` plan's.

Example:
    >>> from lightning_pp.runtime.records import StepEvent, StepRecord
    >>> from lightning_pp.schedules import build_schedule, simulate
    >>> s = build_schedule("1f1b", pp=2, microbatches=2)
    >>> sim = simulate(s)                     # t_f=1, t_b=2: a perfect "measurement"
    >>> recs = [StepRecord(r, r, s, t0=0.0, t1=sim.makespan,
    ...                    events=[StepEvent(a, t0, t1) for a, t0, t1 in sim.timeline[r]])
    ...         for r in range(2)]
    >>> stats = bubble_stats(recs)
    >>> round(stats.bubble, 4), round(stats.expected_bubble, 4)
    (0.5, 0.5)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..planner.measured import (
    check_pipeline,
    clock_offsets,
    measured_costs,
    p2p_latency,
    receive_overhead,
    split_pipelines,
)
from ..runtime.records import StepEvent, StepRecord
from ..schedules import Action, Costs, Op, Schedule, SimResult, receives, simulate
from ..schedules.simulate import peak_inflight

if TYPE_CHECKING:
    from ..planner.recompute import RecomputePlan

__all__ = [
    "BubbleStats",
    "MemoryStats",
    "RecomputeStats",
    "bubble_stats",
    "measured_costs",
    "measured_timeline",
    "memory_stats",
    "p2p_latency",
    "plan_recompute_costs",
    "receive_overhead",
    "recompute_labels",
    "split_pipelines",
    "trace_events",
]


@dataclass(frozen=True)
class BubbleStats:
    """Measured vs expected bubble of one pipeline for one step (times in seconds).

    Per-rank lists are indexed by pipeline rank. ``bubble`` and ``expected_bubble`` are
    idle/compute ratios over the step window (see the module docstring); ``idle_fraction`` is
    idle/span per rank. ``span``: the window, from the first rank entering the step to the last
    action's end; ``tail``: what the step took after it (final send completion, loss
    broadcast), outside the bubble. ``start_skew`` is how far apart the ranks entered the step
    (max - min aligned ``t0``), ``start`` each rank's first action start in the window (given to
    the simulator). ``latency``: the measured hop latency (:func:`p2p_latency`);
    ``recv_overhead``: :func:`receive_overhead`.
    """

    span: float
    compute: list[float]
    comm_wait: list[float]
    idle: list[float]
    idle_fraction: list[float]
    bubble: float
    expected_bubble: float
    expected_makespan: float
    start_skew: float
    latency: float
    expected: SimResult
    recv_overhead: float = 0.0
    start: tuple[float, ...] = ()
    tail: float = 0.0

    @property
    def total_compute(self) -> float:
        return sum(self.compute)


_CATEGORY = {Op.F: "forward", Op.B: "backward", Op.I: "input-grad", Op.W: "weight-grad"}


def bubble_stats(
    records: Sequence[StepRecord], offsets: Sequence[float] | None = None
) -> BubbleStats:
    """Measured bubble of one pipeline's step and the simulator's expectation for it.

    ``records``: one record per pipeline rank (any order) from the same step; ``offsets``: each
    record's clock reference (see the module docstring).
    """
    schedule = check_pipeline(records)
    offs = clock_offsets(records, offsets)
    order = sorted(range(len(records)), key=lambda i: records[i].pp_rank)
    recs = [records[i] for i in order]
    offs = [offs[i] for i in order]
    t0s = [r.t0 - o for r, o in zip(recs, offs)]
    base = min(t0s)
    ends = [(r.events[-1].end if r.events else r.t0) - o for r, o in zip(recs, offs)]
    span = max(ends) - base
    tail = max(max(r.t1 - o for r, o in zip(recs, offs)), max(ends)) - max(ends)
    first = [(r.events[0].start if r.events else r.t0) - o - base for r, o in zip(recs, offs)]
    compute = [sum(max(e.compute, 0.0) for e in r.events) for r in recs]
    comm_wait = [r.comm_wait for r in recs]
    idle = [max(span - c, 0.0) for c in compute]
    total = sum(compute)
    bubble = sum(idle) / total if total > 0 else 0.0
    latency = p2p_latency(recs, offs)
    overhead = receive_overhead(recs, offs)
    costs = measured_costs(recs)
    # A receiving action costs its compute plus the receive overhead; the hop latency counts
    # from the send being posted, of which the overhead is the part every receive pays.
    overrides: dict[tuple[int, int], tuple[float, ...]] = {}
    for (r, c), measured in costs.overrides.items():
        f_extra = overhead if receives(schedule, r, Action(Op.F, 0, c)) else 0.0
        b_extra = overhead if receives(schedule, r, Action(Op.B, 0, c)) else 0.0
        tf, tb, *split = measured
        if split:  # I receives the gradient (W receives nothing)
            ti, tw = split
            overrides[(r, c)] = (tf + f_extra, tb + b_extra, ti + b_extra, tw)
        else:
            overrides[(r, c)] = (tf + f_extra, tb + b_extra)
    expected = simulate(
        schedule,
        Costs(
            t_f=costs.t_f,
            t_b=costs.t_b,
            overrides=overrides,
            latency=max(latency - overhead, 0.0),
        ),
        start=first,
    )
    # The receive overhead is time blocked on a receive, idle as in the measurement.
    received = [sum(receives(schedule, r, a) for a in schedule.ranks[r]) for r in range(len(recs))]
    busy = [b - overhead * n for b, n in zip(expected.busy, received)]
    expected_idle = sum(expected.makespan - b for b in busy)
    return BubbleStats(
        span=span,
        compute=compute,
        comm_wait=comm_wait,
        idle=idle,
        idle_fraction=[i / span if span > 0 else 0.0 for i in idle],
        bubble=bubble,
        expected_bubble=expected_idle / sum(busy) if sum(busy) > 0 else 0.0,
        expected_makespan=expected.makespan,
        start_skew=max(t0s) - min(t0s),
        latency=latency,
        expected=expected,
        recv_overhead=overhead,
        start=tuple(first),
        tail=tail,
    )


def measured_timeline(
    records: Sequence[StepRecord],
    offsets: Sequence[float] | None = None,
    scale: float = 1.0,
) -> list[list[tuple[Action, float, float]]]:
    """One pipeline's measured timeline in the simulator's format, ordered by pipeline rank.

    Times are relative to the earliest aligned ``t0`` and multiplied by ``scale`` (``1e3`` for
    milliseconds). A step starts where its wait for received data ended (the wait is idle time,
    as in the simulator's timeline). Feed it to :func:`~lightning_pp.schedules.render_gantt`.
    """
    offs = clock_offsets(records, offsets)
    order = sorted(range(len(records)), key=lambda i: records[i].pp_rank)
    base = min(records[i].t0 - offs[i] for i in order)
    return [
        [
            (
                e.action,
                (min(e.start + e.comm_wait, e.end) - offs[i] - base) * scale,
                (e.end - offs[i] - base) * scale,
            )
            for e in records[i].events
        ]
        for i in order
    ]


@dataclass(frozen=True)
class MemoryStats:
    """One rank's activation memory during one step.

    ``saved_bytes``: peak bytes autograd saved for backward over the live stash (the engine's
    ``measure_memory`` storage accounting; 0 when it was off). ``stash_bytes``: peak bytes of the
    stashed (input, output) tensors. ``send_bytes``: peak bytes held by sends not yet completed.
    ``inflight``: peak microbatch-chunks forwarded but not yet backwarded; ``inflight_bound``:
    the schedule's theoretical peak for this rank (:func:`~lightning_pp.schedules.peak_inflight`).
    """

    rank: int
    pp_rank: int
    saved_bytes: int
    stash_bytes: int
    send_bytes: int
    inflight: int
    inflight_bound: int


def memory_stats(record: StepRecord) -> MemoryStats:
    """Peaks of one rank's step record, with the schedule's in-flight bound beside them."""
    return MemoryStats(
        rank=record.rank,
        pp_rank=record.pp_rank,
        saved_bytes=record.peak_saved_bytes,
        stash_bytes=record.peak_stash_bytes,
        send_bytes=max((e.send_bytes for e in record.events), default=0),
        inflight=record.peak_inflight,
        inflight_bound=peak_inflight(record.schedule)[record.pp_rank],
    )


def _event_args(rec: StepRecord, e: StepEvent) -> dict:
    return {
        "mb": e.action.mb,
        "chunk": e.action.chunk,
        "stage": rec.schedule.stage(rec.pp_rank, e.action.chunk),
        "comm_wait_ms": round(e.comm_wait * 1e3, 4),
        "stash_bytes": e.stash_bytes,
        "saved_bytes": e.saved_bytes,
        "inflight": e.inflight,
    }


def trace_events(
    records: Sequence[StepRecord],
    offsets: Sequence[float] | None = None,
    step: int | None = None,
    launches: Sequence[Sequence[Sequence[Any]]] | None = None,
) -> dict:
    """Chrome / Perfetto trace-event JSON object for one step of any number of ranks.

    One process track per global rank (``pid`` = rank, ``tid`` 0, named
    ``rank R (pp P)``); one complete (``"X"``) event per action named like ``F3`` or, with
    interleaving, ``F3.1`` (``ts``/``dur`` in microseconds from the earliest aligned ``t0``, args
    with mb, chunk, stage, comm_wait_ms, stash/saved bytes, in-flight); a nested ``wait`` slice
    covers the part of an action blocked on receives (receives are waited for first). Open the
    file in https://ui.perfetto.dev or ``chrome://tracing``.

    ``launches`` (per record, in the same order): the data-parallel gradient collectives the
    rank started during the step, ``(chunk, bucket, values, time)`` each (the gradient sync's
    ``events``), drawn as instants on a second track, ``data-parallel``, named like
    ``dp reduce c1 b0`` (chunk 1, bucket 0); launches outside the step (an accumulation
    micro-step shows the previous step's) are left out.
    """
    offs = clock_offsets(records, offsets)
    base = min((r.t0 - o for r, o in zip(records, offs)), default=0.0)
    events: list[dict] = []
    for rec, off in sorted(zip(records, offs), key=lambda p: p[0].rank):
        pid = rec.rank
        label = f"rank {rec.rank} (pp {rec.pp_rank})"
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": rec.rank}}
        )
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "pipeline"}}
        )
        show_chunk = rec.schedule.vpp > 1
        for e in rec.events:
            ts = (e.start - off - base) * 1e6
            events.append(
                {
                    "ph": "X",
                    "name": e.action.short(show_chunk),
                    "cat": _CATEGORY[e.action.op],
                    "pid": pid,
                    "tid": 0,
                    "ts": round(ts, 3),
                    "dur": round(max(e.duration, 0.0) * 1e6, 3),
                    "args": _event_args(rec, e),
                }
            )
            if e.comm_wait > 0:
                events.append(
                    {
                        "ph": "X",
                        "name": "wait",
                        "cat": "p2p",
                        "pid": pid,
                        "tid": 0,
                        "ts": round(ts, 3),
                        "dur": round(e.comm_wait * 1e6, 3),
                    }
                )
    for i, (rec, off) in enumerate(zip(records, offs)):
        if launches is None or i >= len(launches) or not launches[i]:
            continue
        end = rec.t1
        name = {"pid": rec.rank, "tid": 1, "args": {"name": "data-parallel"}}
        events.append({"ph": "M", "name": "thread_name", **name})
        for chunk, bucket, values, t in launches[i]:
            if not rec.t0 <= t <= end:
                continue
            events.append(
                {
                    "ph": "i",
                    "s": "t",
                    "name": f"dp reduce c{chunk} b{bucket}",
                    "cat": "dp",
                    "pid": rec.rank,
                    "tid": 1,
                    "ts": round((t - off - base) * 1e6, 3),
                    "args": {"chunk": chunk, "bucket": bucket, "values": values},
                }
            )
    meta = {"step": step} if step is not None else {}
    if records:
        s = records[0].schedule
        meta.update(schedule=s.name, pp=s.pp, vpp=s.vpp, microbatches=s.microbatches)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


# -- activation recompute ------------------------------------------------------------------


def plan_recompute_costs(
    plan: RecomputePlan, schedule: Schedule, *, on: str = "backward"
) -> dict[tuple[int, int], float]:
    """The forward time the ``recompute="auto"`` plan adds to one backward of each
    ``(pp_rank, chunk)``, for ``Costs(recompute=...)`` (seconds per microbatch). ``on="w"``:
    the time its second forwards add to one ``W`` instead (layers recomputed again for ``W``
    under a split backward), for ``Costs(recompute_w=...)``; the backward share then excludes
    them.

    A rank's :attr:`~lightning_pp.planner.recompute.RankPlan.added_s` is its whole step's
    (all microbatches), so one backward adds ``added_s / microbatches``. The plan keeps no time
    per chunk: with ``vpp > 1`` that share is split over the rank's chunks in proportion to the
    layers each recomputes (exact for ``vpp = 1``). Data-parallel replicas of a pipeline rank
    are averaged.

    Example (a hand-made plan: pp_rank 0 recomputes 2 layers of chunk 0 and 1 of chunk 1,
    adding 1.2 s per step of 4 microbatches):
        >>> from lightning_pp.planner.recompute import RankPlan, RecomputePlan
        >>> from lightning_pp.schedules import build_schedule
        >>> s = build_schedule("interleaved", pp=2, vpp=2, microbatches=4)
        >>> r0 = RankPlan(rank=0, pp_rank=0, budget=9, positions=[[0, 1], [1]], layers=[[0, 1],
        ...               [5]], predicted_peak=9, none_peak=20, min_peak=5, added_s=1.2,
        ...               total_layers=4)
        >>> costs = plan_recompute_costs(RecomputePlan(9, s.name, [r0]), s)
        >>> {k: round(v, 9) for k, v in costs.items()}
        {(0, 0): 0.2, (0, 1): 0.1}
        >>> round(simulate(s, Costs(recompute=costs)).busy[0], 9)  # 12 + 4 x (0.2 + 0.1)
        13.2
    """
    if on not in ("backward", "w"):
        raise ValueError(f"on must be 'backward' or 'w', got {on!r}")
    sums: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r in plan.ranks:
        again = [len(a) for a in r.again] if r.again else [0] * len(r.positions)
        if on == "w":
            per_mb = r.again_s / schedule.microbatches
            counts = again
        else:
            per_mb = (r.added_s - r.again_s) / schedule.microbatches
            counts = [len(p) for p in r.positions]
        total = sum(counts)
        for c in range(schedule.vpp):
            n = counts[c] if c < len(counts) else 0
            sums[(r.pp_rank, c)].append(per_mb * n / total if total else 0.0)
    return {key: sum(v) / len(v) for key, v in sorted(sums.items())}


def recompute_labels(chunks: Sequence[Any], targets: Sequence[Sequence[tuple[str, Any]]]) -> list:
    """What a rank recomputes, readable: the original layer index for a whole pipeline layer
    (``3``), ``"<index>.<module>"`` for a module inside one (``"3.fc"``, a selective spec), the
    name inside the chunk otherwise (``"chunk<c>"`` for a chunk recomputed as one unit).
    ``chunks`` and ``targets`` are an engine's ``chunks`` and ``recompute_targets``.

    Example:
        >>> from torch import nn
        >>> from lightning_pp.layout.partition import PipelineChunk
        >>> chunk = PipelineChunk([nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))], [4, 5])
        >>> recompute_labels([chunk], [[("layers.0", None), ("layers.1.0", None)]])
        [4, '5.0']
    """
    out: list[int | str] = []
    for c, (chunk, picked) in enumerate(zip(chunks, targets)):
        indices = getattr(chunk, "layer_indices", None)
        for name, _ in picked:
            head, _, rest = name.partition(".")
            pos, _, sub = rest.partition(".")
            if head == "layers" and pos.isdigit() and indices is not None:
                index = indices[int(pos)]
                out.append(index if not sub else f"{index}.{sub}")
            else:
                out.append(name or f"chunk{c}")
    return out


@dataclass(frozen=True)
class RecomputeStats:
    """One rank's activation recompute in one measured step.

    ``layers``: what it recomputes (:func:`recompute_labels`); ``saved_bytes``: the measured
    peak of saved activation bytes (:attr:`MemoryStats.saved_bytes`); ``predicted_bytes``: the
    ``recompute="auto"`` plan's predicted peak for this rank (``None`` for other specs, which
    have no plan); ``ratio``: measured / predicted.
    """

    rank: int
    pp_rank: int
    layers: tuple[int | str, ...]
    saved_bytes: int
    predicted_bytes: int | None = None

    @property
    def ratio(self) -> float | None:
        if not self.predicted_bytes:
            return None
        return self.saved_bytes / self.predicted_bytes
