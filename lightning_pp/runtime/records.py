"""What one rank did during one step: plain dataclasses, no torch.distributed.

Times are ``time.perf_counter()`` seconds of the recording process (compare durations, or
offsets from ``StepRecord.t0``, across ranks; absolute values are per-process).

Example:
    >>> from lightning_pp.schedules import Action, Op
    >>> ev = StepEvent(Action(Op.F, 0), start=1.0, end=1.5, comm_wait=0.1)
    >>> round(ev.duration, 3), round(ev.compute, 3)
    (0.5, 0.4)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..schedules import Action, Schedule

__all__ = ["StepEvent", "StepRecord", "StepRecorder"]


@dataclass
class StepEvent:
    """One executed action.

    ``start``/``end``: perf_counter times around the action, including waiting for its
    received inputs/gradients and posting its sends. ``comm_wait``: seconds of that spent blocked
    on receives. ``stash_bytes``: bytes of the (input, output) storages the stash holds after the
    action (output release makes outputs tiny). ``saved_bytes``: bytes of tensors autograd saved
    for backward, summed over live stash entries (only with ``measure_memory=True``, else 0).
    ``send_bytes``: bytes still held by sends not yet known to have completed, after the action.
    ``inflight``: stash entries (microbatch-chunks forwarded, not yet backwarded) after the action.
    ``compute_end``: when the computation finished, just before the sends were posted (``None``
    in records that predate it). ``send_time``: when this action's messages were handed to the
    communicator (equal to ``compute_end``; ``None`` when it sent nothing): a receiver's data
    arrival minus the sender's ``send_time`` is one real hop delay. ``recv_posted_after``: the
    index (in this rank's action list) of the action after which this action's receives were
    posted, ``-1`` before the first action; ``None`` when it received nothing (see the engine's
    ``recv_lookahead``). ``layers``: seconds of it spent inside the chunk's own computation (the
    chunk's forward call; the autograd call of a ``B``, ``I`` or ``W``), so ``compute - layers``
    is the engine's own cost (``None`` in records that predate it).
    """

    action: Action
    start: float
    end: float
    comm_wait: float = 0.0
    stash_bytes: int = 0
    saved_bytes: int = 0
    send_bytes: int = 0
    inflight: int = 0
    compute_end: float | None = None
    send_time: float | None = None
    recv_posted_after: int | None = None
    layers: float | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def compute(self) -> float:
        """Duration minus the time blocked on receives."""
        return self.duration - self.comm_wait


@dataclass
class StepRecord:
    """Everything one rank measured during one ``train_step``/``eval_step``.

    ``schedule`` is the :class:`Schedule` that ran (forward-only for eval); ``events`` follow its
    action order for this rank. ``t0``/``t1``: perf_counter at step start/end (``t1`` after the
    final send completion and the loss broadcast).
    """

    rank: int
    pp_rank: int
    schedule: Schedule
    t0: float
    events: list[StepEvent] = field(default_factory=list)
    peak_stash_bytes: int = 0
    peak_saved_bytes: int = 0
    peak_inflight: int = 0
    t1: float = 0.0

    @property
    def comm_wait(self) -> float:
        return sum(e.comm_wait for e in self.events)

    @property
    def duration(self) -> float:
        return self.t1 - self.t0


class StepRecorder:
    """Writes one step's :class:`StepRecord` as the engine runs it: one event per action, and
    the peaks over them. The engine hands it plain numbers (it keeps its own running totals), so
    recording costs the same for every action, however long the step.

    Example:
        >>> from lightning_pp.schedules import Op, build_schedule
        >>> rec = StepRecorder(0, 0, build_schedule("1f1b", pp=2, microbatches=2), t0=0.0)
        >>> ev = rec.add(Action(Op.F, 0), start=0.0, comm_wait=0.0, compute_end=0.5, sent=True,
        ...              recv_posted_after=None, stash_bytes=64, saved_bytes=0, inflight=1,
        ...              send_bytes=64)
        >>> rec.record.peak_stash_bytes, rec.record.peak_inflight, ev.send_time
        (64, 1, 0.5)
    """

    def __init__(self, rank: int, pp_rank: int, schedule: Schedule, t0: float) -> None:
        self.record = StepRecord(rank, pp_rank, schedule, t0=t0)

    def add(
        self,
        action: Action,
        *,
        start: float,
        comm_wait: float,
        compute_end: float,
        sent: bool,
        recv_posted_after: int | None,
        stash_bytes: int,
        saved_bytes: int,
        inflight: int,
        send_bytes: int,
        layers: float | None = None,
    ) -> StepEvent:
        """Record ``action``, which ends now (``StepEvent`` documents the fields)."""
        event = StepEvent(
            action=action,
            start=start,
            end=time.perf_counter(),
            comm_wait=comm_wait,
            stash_bytes=stash_bytes,
            saved_bytes=saved_bytes,
            send_bytes=send_bytes,
            inflight=inflight,
            compute_end=compute_end,
            send_time=compute_end if sent else None,
            recv_posted_after=recv_posted_after,
            layers=layers,
        )
        record = self.record
        record.events.append(event)
        record.peak_stash_bytes = max(record.peak_stash_bytes, stash_bytes)
        record.peak_saved_bytes = max(record.peak_saved_bytes, saved_bytes)
        record.peak_inflight = max(record.peak_inflight, inflight)
        return event

    def finish(self) -> StepRecord:
        """Close the record (``t1``: now) and return it."""
        self.record.t1 = time.perf_counter()
        return self.record
