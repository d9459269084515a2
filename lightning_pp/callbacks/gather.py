"""Collect every rank's step record on every rank, with a common clock reference.

No Lightning here: the engine-level tests use it directly, the callbacks through
:func:`gather_cached`, which lets several callbacks share one gather per step.

Example (every rank calls it, after the same engine step)::

    step = gather_records(result.record)
    stats = bubble_stats([step.records[i] for i in pipeline], [step.offsets[i] for i in pipeline])
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.records import StepEvent, StepRecord
from ..schedules import Action, Op, Schedule

__all__ = [
    "GatheredStep",
    "gather_cached",
    "gather_records",
    "register_extra",
    "shared_clock_offsets",
    "unregister_extra",
]


@dataclass
class GatheredStep:
    """Every rank's record (index = global rank), its clock reference, and per-rank extras."""

    records: list[StepRecord]
    offsets: list[float]
    extras: list[dict[str, Any]]


def _pack(record: StepRecord) -> tuple:
    # Plain tuples: a few KB per rank even for long schedules (the schedule itself is not sent:
    # every rank holds the same one and re-attaches it).
    events = [
        (
            e.action.op.value,
            e.action.mb,
            e.action.chunk,
            e.start,
            e.end,
            e.comm_wait,
            e.stash_bytes,
            e.saved_bytes,
            e.send_bytes,
            e.inflight,
            e.compute_end,
            e.send_time,
            e.recv_posted_after,
            e.layers,
        )
        for e in record.events
    ]
    return (
        record.rank,
        record.pp_rank,
        record.t0,
        record.t1,
        record.peak_stash_bytes,
        record.peak_saved_bytes,
        record.peak_inflight,
        events,
    )


def _unpack(packed: tuple, schedule: Schedule) -> StepRecord:
    rank, pp_rank, t0, t1, stash, saved, inflight, events = packed
    return StepRecord(
        rank=rank,
        pp_rank=pp_rank,
        schedule=schedule,
        t0=t0,
        t1=t1,
        peak_stash_bytes=stash,
        peak_saved_bytes=saved,
        peak_inflight=inflight,
        events=[
            StepEvent(
                Action(Op(op), mb, chunk), start, end, wait, st, sv, sd, inf, ce, sent, after, lay
            )
            for op, mb, chunk, start, end, wait, st, sv, sd, inf, ce, sent, after, lay in events
        ],
    )


def gather_records(
    record: StepRecord, extra: dict[str, Any] | None = None, group: Any = None
) -> GatheredStep:
    """All-gather ``record`` (and a small ``extra`` dict) from every rank of ``group``.

    Collective: every rank of ``group`` (default: the world) must call it. A barrier first, then
    each rank reads ``perf_counter()``: that instant is common to all ranks, so subtracting it
    (the returned ``offsets``) puts all records on one clock, even across hosts. Without an
    initialized process group it returns this rank's record alone.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return GatheredStep([record], [0.0], [dict(extra or {})])
    if dist.get_backend(group) == "nccl" and torch.cuda.is_available():
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)
    ref = time.perf_counter()
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, (_pack(record), ref, dict(extra or {}), _clock_id()), group=group)
    return GatheredStep(
        records=[_unpack(p, record.schedule) for p, _, _, _ in out],
        offsets=shared_clock_offsets([o for _, o, _, _ in out], [c for _, _, _, c in out]),
        extras=[x for _, _, x, _ in out],
    )


def _clock_id() -> str | None:
    """Identifies this process's ``perf_counter`` clock: on Linux it is ``CLOCK_MONOTONIC``,
    one clock per booted kernel (shared by containers on it), named by the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return "linux:" + f.read().strip()
    except OSError:
        return None


def shared_clock_offsets(refs: list[float], clocks: list[str | None]) -> list[float]:
    """Clock offsets from the barrier references, exact between ranks that share a clock.

    The barrier's release reaches the ranks at slightly different instants (about a millisecond
    under load: each process must be scheduled to wake up), which would shift their records
    against each other by as much, while the ranks of one host read the same clock anyway. Ranks
    with the same clock id therefore all use the reference of the first of them; only different
    clocks (other hosts) are aligned through the barrier.

    Example:
        >>> shared_clock_offsets([10.0, 10.002, 55.0], ["a", "a", "b"])
        [10.0, 10.0, 55.0]
    """
    first: dict[str, float] = {}
    out = []
    for ref, clock in zip(refs, clocks):
        if clock is None:
            out.append(ref)
        else:
            out.append(first.setdefault(clock, ref))
    return out


# One entry: the record it was gathered for, and the result. Every callback that needs the
# gathered step for the same record reuses it, so three callbacks cost one collective.
_CACHE: dict[str, Any] = {"record": None, "step": None}
# Per-rank values to send along with the record, computed when the gather happens (whichever
# callback gathers first): name -> zero-argument function.
_EXTRAS: dict[str, Callable[[], Any]] = {}


def register_extra(name: str, fn: Callable[[], Any]) -> None:
    """Send ``fn()`` of every rank along with each gathered record, under ``extras[r][name]``."""
    _EXTRAS[name] = fn


def unregister_extra(name: str) -> None:
    _EXTRAS.pop(name, None)


def gather_cached(record: StepRecord) -> GatheredStep:
    """:func:`gather_records` once per record, with the registered extras; later callers for the
    same record (the other callbacks, in the same hook) get the cached result."""
    if _CACHE["record"] is record:
        return _CACHE["step"]
    step = gather_records(record, {name: fn() for name, fn in _EXTRAS.items()})
    _CACHE["record"], _CACHE["step"] = record, step
    return step
