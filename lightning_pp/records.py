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

from dataclasses import dataclass, field

from .schedules import Action, Schedule

__all__ = ["StepEvent", "StepRecord"]


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
    ``recv_lookahead``).
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
