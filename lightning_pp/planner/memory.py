"""Predicted peak memory of one pipeline rank, from a profile and a schedule.

Per rank::

    params + grads + optimizer state + peak in-flight saved activations + message buffers

- **params / grads**: the bytes of the rank's layers' parameters, once each (a gradient per
  parameter, same dtype). A tied parameter held by two ranks counts on both.
- **optimizer state**: :data:`OPTIMIZER_BYTES` per parameter (Adam/AdamW: two fp32 moments,
  8 bytes; SGD with momentum 4; plain SGD 0). An assumption, chosen with ``optimizer=``.
- **activations**: the schedule's in-flight profile
  (:func:`~lightning_pp.planner.recompute.inflight_profile`: after every action, how many
  microbatches of each local chunk hold their activations) times the bytes one microbatch of
  that chunk saves, at the worst action. One chunk's bytes are its layers' saved bytes, a
  storage two neighbouring layers both save counted once (``LayerCost.shared_bytes``). With
  ``recompute="full"`` every layer is checkpointed: until its backward a microbatch holds only
  each layer's input; under a split backward, from ``I`` (which recomputes) to ``W`` it holds
  what ``W`` reads of what the forward saved as well (the first stage's ``I`` is a no-op, so it
  keeps only the inputs). Without recompute, from ``I`` to ``W`` a microbatch outside the first
  stage holds only what ``W`` reads (``LayerCost.w_saved_bytes``; the engine frees the rest at
  ``I``).
  This is the quantity the engine's saved-bytes meter measures (``peak_saved_bytes``).
- **buffers**: one forward activation and one gradient message in flight each way per chunk
  (receive and send of the chunk's input and output boundary): ``2 x (input + output)``
  boundary bytes, the first stage's input (the batch) and the last stage's output (the loss
  gradient) excluded. The stash holds a chunk's received input, which its first layer saves:
  it is inside ``activations`` already (released outputs hold no storage).

Not counted: the loss computation of the last stage, the data loader's batch, the allocator's
fragmentation and the framework's own memory.

Example:
    >>> from lightning_pp.planner.profile import LayerCost
    >>> from lightning_pp.schedules import build_schedule
    >>> layer = LayerCost(0, 0, 0, saved_bytes=100, param_bytes=40, params=10,
    ...                   boundary_bytes=8, input_bytes=8)
    >>> s = build_schedule("1f1b", pp=2, microbatches=4)
    >>> m = rank_memory(s, 0, [[layer, layer]])
    >>> (m.activations, m.params, m.optimizer)   # rank 0 holds 2 microbatches of 200 bytes
    (400, 80, 160)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..schedules import Schedule
from .profile import LayerCost
from .recompute import inflight_profile

__all__ = [
    "OPTIMIZER_BYTES",
    "RankMemory",
    "chunk_held_bytes",
    "chunk_refilled_bytes",
    "chunk_saved_bytes",
    "chunk_w_bytes",
    "chunk_w_refilled_bytes",
    "peak_activation_bytes",
    "rank_memory",
]

#: optimizer state bytes per parameter (fp32 states)
OPTIMIZER_BYTES: dict[str, int] = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}


def chunk_saved_bytes(layers: Sequence[LayerCost]) -> int:
    """Bytes one microbatch of a chunk saves for backward (no recompute)."""
    return sum(c.saved_bytes for c in layers) - sum(c.shared_bytes for c in layers[1:])


def chunk_held_bytes(layers: Sequence[LayerCost]) -> int:
    """Bytes one microbatch of a fully recomputed chunk holds until its backward: each
    checkpointed layer keeps its input (a tensor passed through from the previous layer's
    input, e.g. a mask, once)."""
    return sum(c.input_bytes for c in layers) - sum(c.input_shared_bytes for c in layers[1:])


def chunk_refilled_bytes(layers: Sequence[LayerCost]) -> int:
    """Bytes one microbatch of a fully recomputed chunk holds between a split backward's ``I``
    (which recomputed the forward) and its ``W``: the inputs the checkpoints hold and what the
    recompute saved, a storage in both counted once."""
    if not layers:
        return 0
    overlap = layers[0].input_self_saved_bytes + sum(c.input_saved_bytes for c in layers[1:])
    return chunk_saved_bytes(layers) + chunk_held_bytes(layers) - overlap


def chunk_w_bytes(layers: Sequence[LayerCost]) -> int:
    """Bytes one microbatch of a chunk (not the first stage) keeps from a split backward's
    ``I`` to its ``W``, no recompute: what ``W``'s nodes read again."""
    return sum(c.w_kept[0] for c in layers) - sum(c.w_kept[1] for c in layers[1:])


def chunk_w_refilled_bytes(layers: Sequence[LayerCost]) -> int:
    """:func:`chunk_refilled_bytes` under the trim after ``I``: the checkpoints' inputs and
    what ``W`` reads of the recompute, a storage in both counted once."""
    if not layers:
        return 0
    overlap = layers[0].w_kept[3] + sum(c.w_kept[2] for c in layers[1:])
    return chunk_w_bytes(layers) + chunk_held_bytes(layers) - overlap


def peak_activation_bytes(
    schedule: Schedule,
    rank: int,
    chunks: Sequence[Sequence[LayerCost]],
    recompute: str | None = None,
    inflight: Sequence[tuple[tuple[int, int], ...]] | None = None,
) -> int:
    """The worst moment's saved-activation bytes of ``rank`` (see the module notes).
    ``inflight``: ``inflight_profile(schedule, rank)`` when computed already."""
    if recompute not in (None, "full"):
        raise ValueError(f"the memory model knows recompute None or 'full', got {recompute!r}")
    saved = [chunk_saved_bytes(c) for c in chunks]
    # The first stage's I is a no-op: from I to W it still holds what F left.
    first = [schedule.stage(rank, c) == 0 for c in range(len(chunks))]
    if recompute is None:
        before = saved
        after = [s if f else chunk_w_bytes(c) for s, c, f in zip(saved, chunks, first)]
    else:
        before = [chunk_held_bytes(c) for c in chunks]
        after = [b if f else chunk_w_refilled_bytes(c) for b, c, f in zip(before, chunks, first)]
    return max(
        (
            sum(f * b + w * a for (f, w), b, a in zip(state, before, after))
            for state in (inflight_profile(schedule, rank) if inflight is None else inflight)
        ),
        default=0,
    )


@dataclass(frozen=True)
class RankMemory:
    """One rank's predicted peak, by part (bytes)."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


def rank_memory(
    schedule: Schedule,
    rank: int,
    chunks: Sequence[Sequence[LayerCost]],
    *,
    recompute: str | None = None,
    optimizer: str = "adam",
    inflight: Sequence[tuple[tuple[int, int], ...]] | None = None,
) -> RankMemory:
    """Predicted peak memory of pipeline rank ``rank`` holding ``chunks`` (its local chunks'
    layer costs at the candidate's microbatch size, in local chunk order)."""
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_BYTES)}")
    layers = [c for chunk in chunks for c in chunk]
    param_bytes = sum(c.param_bytes for c in layers)
    last = schedule.num_stages - 1
    buffers = 0
    for local, chunk in enumerate(chunks):
        stage = schedule.stage(rank, local)
        if stage > 0:
            buffers += 2 * chunk[0].input_bytes
        if stage < last:
            buffers += 2 * chunk[-1].boundary_bytes
    return RankMemory(
        rank=rank,
        params=param_bytes,
        grads=param_bytes,
        optimizer=OPTIMIZER_BYTES[optimizer] * sum(c.params for c in layers),
        activations=peak_activation_bytes(schedule, rank, chunks, recompute, inflight),
        buffers=buffers,
    )
