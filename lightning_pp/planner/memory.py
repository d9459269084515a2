"""Predicted peak memory of one pipeline rank, from a profile and a schedule.

Per rank::

    params + grads + master weights + optimizer state
        + peak in-flight saved activations + message buffers

- **params / grads / master weights / optimizer state**: the training state of the rank's
  layers, by :func:`~lightning_pp.planner.sharding.rank_state_bytes`, which states every
  formula. Unsharded (``zero=0``, no ``fsdp``): a parameter and a gradient of the same dtype
  each, an fp32 master copy only for 16-bit parameters (``StateBytes.master``), and
  :data:`OPTIMIZER_BYTES` per parameter (Adam/AdamW: two fp32 moments, 8 bytes; SGD with
  momentum 4; plain SGD 0; an assumption, chosen with ``optimizer=``). Under ``zero=1``
  the master weights and the optimizer state are sharded over the ``dp`` replicas (each
  gradient bucket padded to a multiple of ``dp``), under ``zero=2`` the gradients too between
  steps, under ``fsdp`` the parameters too; the numbers here are the step's *peak*, where
  ``zero=2`` and ``fsdp`` still hold full gradients and ``fsdp`` the gathered parameters
  (:class:`~lightning_pp.planner.sharding.ShardedState` also has the optimizer step's).
  A tied parameter held by two ranks counts on both.
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
    >>> z = rank_memory(s, 0, [[layer, layer]], sharding=Sharding(zero=1, dp=4))
    >>> (z.params, z.grads, z.master, z.optimizer)   # Adam's 8 bytes x (3 + 3) rows
    (80, 80, 0, 48)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..schedules import Schedule
from .profile import LayerCost
from .recompute import inflight_profile
from .sharding import (
    OPTIMIZER_STATES,
    LayerTensors,
    ShardedState,
    Sharding,
    StateBytes,
    TiedTensor,
    rank_state_bytes,
)

__all__ = [
    "OPTIMIZER_BYTES",
    "RankMemory",
    "ShardedState",
    "Sharding",
    "StateBytes",
    "chunk_held_bytes",
    "chunk_refilled_bytes",
    "chunk_saved_bytes",
    "chunk_w_bytes",
    "chunk_w_refilled_bytes",
    "cost_tensors",
    "peak_activation_bytes",
    "profile_state_bytes",
    "rank_memory",
    "with_states",
]

#: optimizer state bytes per parameter (fp32 states): adam/adamw 8, sgd-momentum 4, sgd 0
OPTIMIZER_BYTES: dict[str, int] = {name: 4 * n for name, n in OPTIMIZER_STATES.items()}


def cost_tensors(cost: LayerCost) -> LayerTensors:
    """A profiled layer's parameters as :func:`~lightning_pp.planner.sharding.rank_state_bytes`
    takes them: one count, its tied members (``cost.tied``) apart, so that a rank holding two
    members of one group counts that tensor once.

    Example:
        >>> cost_tensors(LayerCost(0, 0, 0, params=10, tied=((0, 6),)))
        [4, TiedTensor(spec=6, group=0)]
    """
    if not cost.tied:
        return cost.params
    rest = cost.params - sum(n for _, n in cost.tied)
    return [rest, *(TiedTensor(n, g) for g, n in cost.tied)]


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
    """One rank's predicted peak, by part (bytes): ``params``, ``grads``, ``master`` (fp32
    master weights), ``optimizer`` (optimizer state) at the step's peak under the rank's
    sharding, ``activations``, ``buffers``. ``state``: the training-state breakdown they come
    from (shard sizes, padding, the optimizer step's bytes), when computed.

    :attr:`total` is the larger of the forward/backward peak (the parts' sum) and the
    optimizer step's states: under ``zero=1`` the step adds the rows' gradients to the full
    ones, which a rank with few activations feels more than their release."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    master: int = 0
    state: ShardedState | None = field(default=None, compare=False, repr=False)

    @property
    def forward_backward(self) -> int:
        """The parts' sum: the peak during forward and backward."""
        return (
            self.params
            + self.grads
            + self.master
            + self.optimizer
            + self.activations
            + self.buffers
        )

    @property
    def at_optimizer_step(self) -> int:
        """The training states at the optimizer step (0 when not computed)."""
        return self.state.total_at_step if self.state is not None else 0

    @property
    def total(self) -> int:
        """The peak: the larger of :attr:`forward_backward` and :attr:`at_optimizer_step`."""
        return max(self.forward_backward, self.at_optimizer_step)


def with_states(memory: RankMemory, state: ShardedState) -> RankMemory:
    """``memory`` with its training states replaced by ``state`` (activations and buffers
    kept): one activation analysis serves every sharding of a shape.

    Example:
        >>> m = RankMemory(0, params=8, grads=8, optimizer=16, activations=5, buffers=1)
        >>> s = rank_state_bytes([[2]], Sharding(zero=1, dp=2))
        >>> with_states(m, s).total   # 8 + 8 + 8 (Adam: one of the two elements) + 5 + 1
        30
    """
    return dataclasses.replace(
        memory,
        params=state.params,
        grads=state.grads,
        master=state.master,
        optimizer=state.optimizer,
        state=state,
    )


def profile_state_bytes(layers: Sequence[LayerCost], optimizer: str = "adam") -> StateBytes:
    """The per-element state bytes of a profile's layers as measured: parameters and gradients
    of the profiled dtype (``param_bytes / params``, 4 for fp32), no master weight, the
    optimizer's :data:`OPTIMIZER_BYTES`."""
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_BYTES)}")
    count = sum(c.params for c in layers)
    elem = round(sum(c.param_bytes for c in layers) / count) if count else 4
    return StateBytes(param=elem, grad=elem, master=0, optimizer=OPTIMIZER_BYTES[optimizer])


def _buffer_bytes(schedule: Schedule, rank: int, chunks: Sequence[Sequence[LayerCost]]) -> int:
    """One forward and one gradient message each way per chunk boundary (module notes)."""
    last = schedule.num_stages - 1
    buffers = 0
    for local, chunk in enumerate(chunks):
        stage = schedule.stage(rank, local)
        if stage > 0:
            buffers += 2 * chunk[0].input_bytes
        if stage < last:
            buffers += 2 * chunk[-1].boundary_bytes
    return buffers


def rank_memory(
    schedule: Schedule,
    rank: int,
    chunks: Sequence[Sequence[LayerCost]],
    *,
    recompute: str | None = None,
    optimizer: str = "adam",
    inflight: Sequence[tuple[tuple[int, int], ...]] | None = None,
    sharding: Sharding | None = None,
    state_bytes: StateBytes | None = None,
    chunk_tensors: Sequence[Sequence[LayerTensors]] | None = None,
) -> RankMemory:
    """Predicted peak memory of pipeline rank ``rank`` holding ``chunks`` (its local chunks'
    layer costs at the candidate's microbatch size, in local chunk order).

    ``sharding``: the data-parallel sharding (default none). ``state_bytes``: bytes per element
    of each state (default :func:`profile_state_bytes`: as profiled, no master weight).
    ``chunk_tensors``: per chunk, per layer, the tensors' element counts in parameter order
    (exact bucket padding; default: each layer's ``params`` as one tensor)."""
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_BYTES)}")
    layers = [c for chunk in chunks for c in chunk]
    if chunk_tensors is None:
        chunk_tensors = [[cost_tensors(c) for c in chunk] for chunk in chunks]
    state = rank_state_bytes(
        chunk_tensors, sharding, state_bytes or profile_state_bytes(layers, optimizer)
    )
    return RankMemory(
        rank=rank,
        params=state.params,
        grads=state.grads,
        optimizer=state.optimizer,
        activations=peak_activation_bytes(schedule, rank, chunks, recompute, inflight),
        buffers=_buffer_bytes(schedule, rank, chunks),
        master=state.master,
        state=state,
    )
