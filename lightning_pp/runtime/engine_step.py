"""One step of one rank: the per-step state of :class:`~lightning_pp.runtime.engine.PipelineEngine`.

:class:`StepRun` lives for one ``train_step``/``eval_step``: the microbatches, the stash of
forwards waiting for their backward, the step loss, the pending sends and the receive window.
The engine keeps only what outlives a step (chunks, communicator, settings); its loop drives a
``StepRun`` action by action:

1. ``window.wait(i)``: the receives action ``i`` needs (posted after an earlier action);
2. ``execute``: F runs one local chunk forward, B the backward of that chunk's OLDEST stash entry;
3. ``post``: the action's sends go out with the receives of up to ``recv_lookahead`` later
   actions, then the output release and the chunk's gradients-ready hook;
4. ``record``: one :class:`~lightning_pp.runtime.records.StepEvent`.

Where each chunk sits in the pipeline comes from the schedule's placement once
(:func:`place_chunks`); nothing here has a placement formula of its own.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..layout.topology import PipelineTopology
from ..schedules import Action, Op, Schedule
from .dtensor_state import local_part
from .microbatch import batch_size_of, split_microbatches
from .p2p_order import message_order
from .p2p_wire import ACT, GRAD, Message, PendingRecv, RecvRequest, SendQueue, Spec, format_specs
from .recompute import RecomputeOnce, recompute_active
from .recompute_probe import LayerProbe, measure_chunk
from .records import StepRecorder
from .saved_for_w import SavedForW
from .split_backward import WeightWork, autocast_off, backward_input, fused_backward

if TYPE_CHECKING:
    from torch import nn

    from .numerics import FiniteChecker
    from .p2p import P2PCommunicator
    from .recompute import Targets

__all__ = ["ChunkPlace", "StepEngine", "Stash", "StepReceives", "StepRun", "place_chunks"]


class StepEngine(Protocol):
    """What one step reads of its :class:`~lightning_pp.runtime.engine.PipelineEngine`: the
    settings and parts that outlive the step (the engine satisfies it)."""

    chunks: list[nn.Module]
    schedule: Schedule
    places: list[ChunkPlace]
    device: torch.device
    comm: P2PCommunicator
    recv_lookahead: int
    loss_fn: Callable[[Any, Any], torch.Tensor]
    input_fn: Callable[[Any], Any]
    loss_reduction: str
    release_outputs: bool
    measure_memory: bool
    chunk_gets_microbatch: bool
    on_chunk_grads_ready: Callable[[int], None] | None
    graph_free: list[bool]
    recompute_targets: Targets
    recompute_again: list[nn.Module]
    finite_checker: FiniteChecker | None
    param_storages: set[int]

    @property
    def rank(self) -> int: ...

    @property
    def pp_rank(self) -> int: ...

    def recomputes(self, chunk: int) -> bool: ...


@dataclass(frozen=True)
class ChunkPlace:
    """Where one local chunk sits: its virtual stage and the global ranks of its neighbours
    (``prev_rank``/``next_rank``: ``-1`` on the first/last stage)."""

    stage: int
    first: bool
    last: bool
    prev_rank: int
    next_rank: int


def place_chunks(schedule: Schedule, topology: PipelineTopology) -> list[ChunkPlace]:
    """One :class:`ChunkPlace` per local chunk of this rank, from the schedule's placement
    (the rank holding stage ``s`` is ``topology.global_rank(schedule.locate(s)[0])``).

    Example:
        >>> from lightning_pp.schedules import build_schedule
        >>> topo = PipelineTopology.from_world(4, 1, pp=4)
        >>> place_chunks(build_schedule("interleaved", pp=4, vpp=2, microbatches=8), topo)[1]
        ChunkPlace(stage=5, first=False, last=False, prev_rank=0, next_rank=2)
    """

    def rank_of(stage: int) -> int:
        if not 0 <= stage < schedule.num_stages:
            return -1
        return topology.global_rank(schedule.locate(stage)[0])

    last = schedule.num_stages - 1
    return [
        ChunkPlace(s, s == 0, s == last, rank_of(s - 1), rank_of(s + 1))
        for s in schedule.stages_of(topology.pp_rank)
    ]


_Key = tuple[int, int, torch.dtype]  # (data pointer, elements, dtype): one storage view


@dataclass
class _Entry:
    """One stashed forward: what its backward needs."""

    mb: int
    inputs: tuple[torch.Tensor, ...]  # received leaves (or first-stage inputs)
    outputs: tuple[torch.Tensor, ...]  # outputs that take part in backward (or the scaled loss)
    grad_positions: list[int]  # index of each of ``outputs`` among the floating outputs
    out_specs: list[Spec]  # every floating output's spec
    saved_keys: dict[Any, int] = field(default_factory=dict)  # the meter's storages: bytes
    held: list[tuple[_Key, int]] = field(default_factory=list)  # (key, bytes) of each tensor
    frames: list[RecomputeOnce] = field(default_factory=list)  # recomputed regions (split only)
    kept: SavedForW | None = None  # what the forward saved, trimmed after I (split only)

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd saved for this forward, as the meter counted them."""
        return sum(self.saved_keys.values())


def _held_elsewhere(t: torch.Tensor) -> bool:
    """Whether a reference other than its Python object holds ``t``'s tensor: an autograd
    node that saved it as an input (a Linear of the same chunk reading the chunk's output), a
    view's base link. Swapping ``t``'s storage would change what that holder reads, so the
    output release leaves such a tensor alone. A node that saved ``t`` as its own output (a
    ``tanh``) keeps a shallow copy instead and does not count; neither does the send, which
    holds a detached alias. ``False`` where this torch has no ``_use_count``."""
    use_count = getattr(t, "_use_count", None)
    return use_count is not None and use_count() > 1


class Stash:
    """Per local chunk, the FIFO of forwards waiting for their backward, with running totals
    for the step record: ``inflight`` entries, ``nbytes`` of their (deduplicated) inputs and
    outputs, ``saved_bytes`` autograd saved for them. Kept incrementally so that recording an
    action does not re-scan the stash.

    Example:
        >>> stash = Stash(chunks=1)
        >>> x = torch.ones(4)
        >>> stash.push(0, _Entry(0, (x,), (x * 2,), [0], []))
        >>> stash.inflight, stash.nbytes
        (1, 32)
        >>> stash.pop(0).mb, stash.nbytes
        (0, 0)
    """

    def __init__(self, chunks: int) -> None:
        self.queues: list[deque[_Entry]] = [deque() for _ in range(chunks)]
        # Per chunk, the I's whose W has not run (FIFO): (mb, saved bytes, what W needs).
        self.deferred: list[deque[tuple[int, int, WeightWork]]] = [deque() for _ in range(chunks)]
        self.inflight = 0
        self.nbytes = 0
        self.saved_bytes = 0
        self._refs: dict[_Key, int] = {}  # entries' tensors per storage view (shared: once)

    def push(self, chunk: int, entry: _Entry) -> None:
        self.queues[chunk].append(entry)
        self.inflight += 1
        self.saved_bytes += entry.saved_bytes
        entry.held = [self._hold(t) for t in (*entry.inputs, *entry.outputs)]

    def pop(self, chunk: int) -> _Entry:
        entry = self.queues[chunk].popleft()
        self.inflight -= 1
        self.saved_bytes -= entry.saved_bytes
        self._drop(entry.held)
        return entry

    def defer(self, chunk: int, entry: _Entry, work: WeightWork, *, saved: int) -> None:
        """After ``I`` popped ``entry``: it stays in flight, holding ``saved`` bytes (what its
        forward saved, plus what a recompute at ``I`` refilled), until its ``W`` (the retained
        graph holds the activations until then); its stashed inputs and outputs are no longer
        held here."""
        self.deferred[chunk].append((entry.mb, saved, work))
        self.inflight += 1
        self.saved_bytes += saved

    def pop_deferred(self, action: Action, rank: int) -> WeightWork:
        """The oldest ``I`` of ``action``'s chunk, which ``action`` (a ``W``) must match."""
        q = self.deferred[action.chunk]
        if not q or q[0][0] != action.mb:
            raise RuntimeError(
                f"rank {rank}: {action.describe()}: W order does not match I order: the oldest "
                f"I of chunk {action.chunk} without its W is "
                f"{f'mb={q[0][0]}' if q else 'none'} (pending {[e[0] for e in q]})"
            )
        _, saved, work = q.popleft()
        self.inflight -= 1
        self.saved_bytes -= saved
        return work

    def release_outputs(self, chunk: int) -> None:
        """Drop the newest entry's hold on its sent outputs' storage (the send keeps its own
        alias). Only an output's ``grad_fn`` is needed for backward (Megatron's
        ``deallocate_output_tensor``). Skipped for views (their storage belongs to another
        tensor), for leaves (an input passed straight through) and for an output something
        else holds (:func:`_held_elsewhere`: typically a layer of the same chunk that also read
        it and saved it for its backward, which would then read a 1-element tensor)."""
        entry = self.queues[chunk][-1]
        n_in = len(entry.inputs)
        self._drop(entry.held[n_in:])
        input_ptrs = {t.data_ptr() for t in entry.inputs}
        for t in entry.outputs:
            if (
                t._base is None
                and t.grad_fn is not None
                and t.data_ptr() not in input_ptrs
                and not _held_elsewhere(t)
            ):
                t.data = torch.empty(1, dtype=t.dtype, device=t.device)
        entry.held[n_in:] = [self._hold(t) for t in entry.outputs]

    def _hold(self, t: torch.Tensor) -> tuple[_Key, int]:
        key, nbytes = (t.data_ptr(), t.numel(), t.dtype), t.numel() * t.element_size()
        count = self._refs.get(key, 0)
        if not count:
            self.nbytes += nbytes
        self._refs[key] = count + 1
        return key, nbytes

    def _drop(self, held: Sequence[tuple[_Key, int]]) -> None:
        for key, nbytes in held:
            count = self._refs[key] - 1
            if count:
                self._refs[key] = count
            else:
                del self._refs[key]
                self.nbytes -= nbytes

    def check_fifo(self, action: Action, rank: int) -> _Entry:
        """The entry ``action`` (a backward) pairs with: the oldest of its chunk, or an error."""
        q = self.queues[action.chunk]
        head = q[0] if q else None
        if head is None or head.mb != action.mb:
            raise RuntimeError(
                f"rank {rank}: {action.describe()}: backward order does not match forward "
                f"order: the oldest stashed forward of chunk {action.chunk} is "
                f"{'none' if head is None else f'mb={head.mb}'} (stash {[e.mb for e in q]}); "
                f"backward must pair FIFO with forward or the gradient would be silently wrong"
            )
        return head

    def find(self, chunk: int, mb: int) -> _Entry | None:
        return next((e for e in self.queues[chunk] if e.mb == mb), None)


def _as_tuple(x: Any, what: str) -> tuple[tuple[torch.Tensor, ...], bool]:
    if isinstance(x, torch.Tensor):
        return (x,), False
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x), True
    raise TypeError(
        f"{what} must be a tensor or a tuple of tensors to cross a stage boundary, got "
        f"{type(x).__name__}"
        + (f" of {[type(t).__name__ for t in x]}" if isinstance(x, (tuple, list)) else "")
    )


def _detached(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detached(t) for t in out)
    return out


def _storages(batch: Any) -> set[int]:
    """Data pointers of every tensor storage in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return {batch.untyped_storage().data_ptr()}
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)):
        return set().union(*(_storages(b) for b in batch)) if batch else set()
    return set()


class StepReceives:
    """What one step's actions receive, for its
    :class:`~lightning_pp.runtime.receive_window.ReceiveWindow` (the window calls it with
    ``(index, ahead)``). It holds only what the answer reads: the rank's actions, the chunk
    places, the step's stash and the rank; not the :class:`StepRun`, so the run and its window
    form no reference cycle."""

    __slots__ = ("actions", "places", "rank", "stash")

    def __init__(
        self, actions: Sequence[Action], places: Sequence[ChunkPlace], stash: Stash, rank: int
    ) -> None:
        self.actions = actions
        self.places = places
        self.stash = stash
        self.rank = rank

    def __call__(self, index: int, ahead: bool) -> list[RecvRequest] | None:
        return self.needs(self.actions[index], ahead=ahead)

    def needs(self, action: Action, *, ahead: bool = False) -> list[RecvRequest] | None:
        """The receives ``action`` needs. ``ahead``: it is a LATER action than the next one;
        ``None`` then means they cannot be stated yet (a backward whose forward has not run)."""
        place = self.places[action.chunk]
        if action.op is Op.F:
            if place.first:
                return []
            return [RecvRequest(ACT, place.prev_rank, place.stage, action.mb, chunk=action.chunk)]
        if place.last or action.op is Op.W:  # W communicates nothing
            return []
        if ahead:
            # Not necessarily the stash head: backwards before this one pop older entries
            # first (FIFO is checked when this backward runs).
            entry = self.stash.find(action.chunk, action.mb)
            if entry is None:
                return None
        else:
            entry = self.stash.check_fifo(action, self.rank)
        if not entry.out_specs:  # no floating outputs: no gradient travels
            return []
        # the stage names the RECEIVING stage (this one), as the sender's Message does
        specs = entry.out_specs
        return [RecvRequest(GRAD, place.next_rank, place.stage, action.mb, specs, action.chunk)]


class StepRun:
    """One ``train_step``/``eval_step`` of one rank (see the module docstring for the loop).

    Example (what :meth:`PipelineEngine._run_actions` does, less the error handling)::

        step = StepRun(engine, schedule, batch, train=True, collect=False)
        step.window.exchange([], after=-1)
        for i, action in enumerate(step.actions):
            start = time.perf_counter()
            received, waited = step.window.wait(i)
            messages = step.execute(action, received)
            computed = time.perf_counter()
            step.post(i, action, messages)
            step.record(i, action, start, waited, computed, sent=bool(messages))
        step.sends.wait()
    """

    def __init__(
        self,
        engine: StepEngine,
        schedule: Schedule,
        batch: Any,
        *,
        train: bool,
        collect: bool,
        probes: list[list[LayerProbe]] | None = None,
        loss_weights: Sequence[float] | None = None,
    ) -> None:
        self.recorder = StepRecorder(engine.rank, engine.pp_rank, schedule, t0=time.perf_counter())
        self.engine = engine
        self.places = engine.places
        self.actions = schedule.ranks[engine.pp_rank]
        self.train = train
        self.collect = collect
        # A probe step (PipelineEngine.probe_step): forward with gradients, each layer measured
        # into probes[chunk], nothing stashed.
        self.probes = probes
        self.microbatches = split_microbatches(batch, schedule.microbatches)
        self.batch_size = batch_size_of(batch)
        if loss_weights is not None and len(loss_weights) != len(self.microbatches):
            raise ValueError(
                f"rank {engine.rank}: {len(loss_weights)} loss weights for "
                f"{len(self.microbatches)} microbatches (one weight per microbatch)"
            )
        #: per microbatch, the factor of its loss (``None``: by ``engine.loss_reduction``)
        self.loss_weights = None if loss_weights is None else [float(w) for w in loss_weights]
        self._batch_storages = (
            _storages(batch) if engine.measure_memory or probes is not None else set()
        )
        self.stash = Stash(len(engine.chunks))
        #: seconds the current action spent in the chunk's own computation (StepEvent.layers)
        self.layer_s: float | None = None
        self.loss = torch.zeros((), dtype=torch.float32, device=engine.device)
        self.outputs: dict[int, Any] = {}
        self.sends = SendQueue()
        # NCCL: post in the schedule's global message order (one stream per rank; see p2p_order)
        order = message_order(schedule)[engine.pp_rank] if engine.comm.ordered_posting else None
        # The window asks what each action receives through a StepReceives, never through a
        # bound method of this run: a window holding ``self._needs_at`` made run -> window ->
        # method -> run a reference cycle, so each step's run (its microbatches, the last
        # receive buffers, the sends, the record) outlived the step until the cyclic garbage
        # collector ran; the ones promoted to its oldest generation waited for a full
        # collection, which a Trainer's hundreds of thousands of live objects make rare
        # (issue 35: resident memory crept up step after step). Refcounting frees it now.
        self.receives = StepReceives(self.actions, self.places, self.stash, engine.rank)
        self.window = engine.comm.receive_window(
            len(self.actions), engine.recv_lookahead, self.receives, order
        )
        # The action index of each chunk's last backward (B, or W of a split one): its weight
        # gradients are complete there, not at its last I.
        self._last_backward = (
            {a.chunk: i for i, a in enumerate(self.actions) if a.op in (Op.B, Op.W)}
            if train
            else {}
        )

    # -- receives ------------------------------------------------------------------------------
    def needs(self, action: Action, *, ahead: bool = False) -> list[RecvRequest] | None:
        """The receives ``action`` needs (:meth:`StepReceives.needs`)."""
        return self.receives.needs(action, ahead=ahead)

    # -- compute -------------------------------------------------------------------------------
    def execute(self, action: Action, received: Sequence[PendingRecv]) -> list[Message]:
        """Run ``action`` on what it received; return the messages it sends."""
        if action.op is Op.F:
            return self._forward(action, received)
        # Backward with autocast off, as Lightning runs it (outside the precision plugin's
        # forward context, which wraps this whole step): see split_backward.autocast_off.
        # Tested here first: without autocast (fp32) the context manager is pure overhead on
        # every backward action.
        if torch._C._is_any_autocast_enabled():
            with autocast_off():
                return self._any_backward(action, received)
        return self._any_backward(action, received)

    def _any_backward(self, action: Action, received: Sequence[PendingRecv]) -> list[Message]:
        if action.op is Op.W:
            self._weight_backward(action)
            return []
        return self._backward(action, received)

    def _forward(self, action: Action, received: Sequence[PendingRecv]) -> list[Message]:
        engine, c, mb = self.engine, action.chunk, action.mb
        place = self.places[c]
        s = place.stage
        microbatch = self.microbatches[mb]
        grad_inputs = self.train or self.probes is not None
        if place.first:
            x = engine.input_fn(microbatch)
            inputs = _as_tuple(x, f"input_fn(microbatch {mb})")[0] if self.train else ()
        else:
            arrived = received[0]
            inputs = tuple(
                t.requires_grad_(True) if grad_inputs and t.is_floating_point() else t
                for t in arrived.tensors
            )
            x = inputs if arrived.is_tuple else inputs[0]
        saved: dict[Any, int] = {}
        frames: list[RecomputeOnce] = []
        kept: SavedForW | None = None
        args = (x, microbatch) if engine.chunk_gets_microbatch else (x,)
        t0 = time.perf_counter()
        try:
            if self.probes is not None:
                with torch.enable_grad():
                    out, self.probes[c] = measure_chunk(
                        engine.chunks[c],
                        args,
                        self._saved_key,
                        split=engine.schedule.split_backward,
                    )
                out = _detached(out)  # the graph was measured; nothing goes backward
            elif self.train and engine.recomputes(c):
                with recompute_active(
                    engine.recompute_targets,
                    split=engine.schedule.split_backward,
                    again=engine.recompute_again,
                ) as frames:
                    out, kept = self._run_chunk(c, args, saved)
            else:
                out, kept = self._run_chunk(c, args, saved)
        except Exception as e:
            if place.first:
                raise
            p = received[0]
            raise RuntimeError(
                f"forward of chunk {c} (stage {s}) failed on the input received from rank "
                f"{p.request.peer} (stage {s - 1}) for mb={mb}: received "
                f"{'tuple ' if p.is_tuple else ''}{format_specs(p.specs)}: {type(e).__name__}: {e}"
            ) from e
        self.layer_s = time.perf_counter() - t0
        check = engine.finite_checker
        if check is not None:
            if place.first:
                check.batch_input(action, x)
            check.forward_output(action, out, x)
        if place.last:
            self._add_loss(action, out, microbatch, inputs, saved, frames, kept)
            return []
        outs, is_tuple = _as_tuple(out, f"output of chunk {c} (stage {s})")
        if self.train:
            floating = [t for t in outs if t.is_floating_point()]
            grad_idx = [i for i, t in enumerate(floating) if t.requires_grad]
            entry = _Entry(
                mb,
                inputs,
                tuple(floating[i] for i in grad_idx),
                grad_idx,
                [(tuple(t.shape), t.dtype) for t in floating],
                saved_keys=saved,
                frames=frames,
                kept=kept,
            )
            self.stash.push(c, entry)
        return [Message(ACT, place.next_rank, s + 1, mb, outs, is_tuple)]

    def _add_loss(
        self,
        action: Action,
        out: Any,
        microbatch: Any,
        inputs: tuple[torch.Tensor, ...],
        saved: dict[Any, int],
        frames: list[RecomputeOnce],
        kept: SavedForW | None,
    ) -> None:
        """Last stage: the microbatch's loss, scaled into the step loss (and stashed)."""
        engine = self.engine
        loss = engine.loss_fn(out, microbatch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor, got {loss!r}")
        if engine.finite_checker is not None:
            engine.finite_checker.loss(action, loss)
        scale = 1.0
        if self.loss_weights is not None:
            scale = self.loss_weights[action.mb]
            if scale == 0.0:  # no valid target: a mean over none is 0/0, and 0 * NaN is NaN
                loss = torch.nan_to_num(loss, nan=0.0)
        elif engine.loss_reduction == "mean":
            scale = batch_size_of(microbatch) / self.batch_size
        scaled = loss.reshape(()) * scale
        self.loss += scaled.detach().float()
        if self.collect:
            self.outputs[action.mb] = out.detach() if isinstance(out, torch.Tensor) else out
        if self.train:
            self.stash.push(
                action.chunk,
                _Entry(
                    action.mb,
                    inputs,
                    (scaled,),
                    [0],
                    [],
                    saved_keys=saved,
                    frames=frames,
                    kept=kept,
                ),
            )

    def _run_chunk(
        self, c: int, args: tuple[Any, ...], saved: dict[Any, int]
    ) -> tuple[Any, SavedForW | None]:
        """The chunk's forward; under a split backward (not on the first stage, whose ``I``
        is a no-op) with its saved tensors in a :class:`SavedForW`, which ``I`` trims to what
        ``W`` needs, unless the chunk's ``I`` frees the graph (``engine.graph_free``)."""
        engine = self.engine
        chunk = engine.chunks[c]
        if (
            self.train
            and engine.schedule.split_backward
            and not self.places[c].first
            and not engine.graph_free[c]
        ):
            kept = SavedForW(self._saved_key if engine.measure_memory else None)
            with kept.hooks():
                out = chunk(*args)
            saved.update(kept.counted())
            return out, kept
        if engine.measure_memory and self.train:
            with torch.autograd.graph.saved_tensors_hooks(self._pack(saved), lambda t: t):
                return chunk(*args), None
        return chunk(*args), None

    def _saved_key(self, t: torch.Tensor) -> tuple[Any, int] | None:
        """How the memory meter counts a tensor autograd saves: ``(key, bytes)`` of the storage
        it keeps alive (shared storages once per key), ``None`` for a parameter. A ``DTensor``
        (tensor parallelism) keeps its local part alive: its own wrapper has no valid storage
        (reading its data pointer raised mid-forward)."""
        t = local_part(t)
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self._batch_storages:
            # A view of the step's input batch (a tensor_split microbatch): the batch is
            # held by the caller anyway; backward keeps alive only what this view covers.
            return (
                ptr,
                t.storage_offset(),
                tuple(t.shape),
                t.stride(),
            ), t.numel() * t.element_size()
        if ptr in self.engine.param_storages:
            return None
        return ptr, st.nbytes()

    def _pack(self, saved: dict[Any, int]) -> Callable[[torch.Tensor], torch.Tensor]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            counted = self._saved_key(t)
            if counted is not None:
                saved[counted[0]] = counted[1]
            # A detached alias, not ``t`` itself: autograd stores what pack returns, and output
            # release later swaps the storage of the very tensor object it was given.
            return t.detach()

        return pack

    def _backward(self, action: Action, received: Sequence[PendingRecv]) -> list[Message]:
        c, mb = action.chunk, action.mb
        place = self.places[c]
        self.stash.check_fifo(action, self.engine.rank)
        entry = self.stash.pop(c)
        tensors = entry.outputs
        if place.last:
            grads = tuple(torch.ones_like(t) for t in tensors)
        else:
            all_grads = received[0].tensors if received else ()
            grads = tuple(all_grads[i] for i in entry.grad_positions)
        if action.op is Op.I:
            # Input gradient only; what W needs waits in the chunk's W queue (FIFO like I's).
            # Until W the microbatch holds only what W's nodes unpack again (a Linear's input,
            # not a GELU's): what the forward saved is trimmed to that, and a recomputed region
            # (RecomputeOnce), which ran its forward again here, once, keeps only that of it.
            # Where every layer W runs is a Linear or a norm, I frees the graph as it runs and
            # W keeps only their inputs (not with a recomputed region: W may recompute it).
            t0 = time.perf_counter()
            dx, work = backward_input(tensors, grads, entry.inputs, free_graph=not entry.frames)
            self.layer_s = time.perf_counter() - t0
            self.engine.graph_free[c] = work.graph_freed
            if not work.graph_freed and (entry.kept is not None or entry.frames):
                w_nodes = work.nodes()
                if entry.kept is not None:
                    entry.kept.trim(w_nodes)
                for frame in entry.frames:
                    if frame.again:
                        frame.release()
                    else:
                        frame.trim(w_nodes)
            self.stash.defer(c, entry, work, saved=self._held_until_w(entry, work))
            got = [g for t, g in zip(entry.inputs, dx) if t.is_floating_point()]
        else:
            t0 = time.perf_counter()
            fused_backward(tensors, grads)
            self.layer_s = time.perf_counter() - t0
            got = [t.grad for t in entry.inputs if t.is_floating_point()]
        if place.first:
            return []
        floating = [t for t in entry.inputs if t.is_floating_point()]
        in_grads = tuple(g if g is not None else torch.zeros_like(t) for t, g in zip(floating, got))
        if not in_grads:
            return []
        if self.engine.finite_checker is not None:
            self.engine.finite_checker.input_grads(action, in_grads)
        return [Message(GRAD, place.prev_rank, place.stage - 1, mb, in_grads, True)]

    def _held_until_w(self, entry: _Entry, work: WeightWork) -> int:
        """Bytes the entry holds from ``I`` to ``W``, for the memory meter: what its forward
        saved (after the trim) and what its recomputed regions refilled, each storage once; for
        a graph freed at ``I``, what ``W`` captured of it (layer inputs, norm statistics)."""
        if not self.engine.measure_memory:
            return 0
        keys: dict[Any, int]
        if work.graph_freed:  # the graph is gone: only what W captured is held
            keys, held = {}, work.held()
        else:
            keys = entry.kept.counted() if entry.kept is not None else dict(entry.saved_keys)
            held = [t for frame in entry.frames for t in frame.held()]
        for t in held:
            counted = self._saved_key(t)
            if counted is not None:
                keys[counted[0]] = counted[1]
        return sum(keys.values())

    def _weight_backward(self, action: Action) -> None:
        """W: the weight gradients of the chunk's oldest I (FIFO), then its graph is freed."""
        work = self.stash.pop_deferred(action, self.engine.rank)
        t0 = time.perf_counter()
        work.run()
        self.layer_s = time.perf_counter() - t0

    # -- after the compute ---------------------------------------------------------------------
    def post(self, index: int, action: Action, messages: list[Message]) -> None:
        """Send ``messages`` with the lookahead receives; then release the sent output and, after
        a chunk's last backward, check its gradients and call ``on_chunk_grads_ready``."""
        engine = self.engine
        self.sends.add(self.window.exchange(messages, after=index))
        if self.train and action.op is Op.F:
            if engine.release_outputs and not self.places[action.chunk].last:
                self.stash.release_outputs(action.chunk)
        elif self.train and self._last_backward.get(action.chunk) == index:
            if engine.finite_checker is not None:
                engine.finite_checker.param_grads(action)
            if engine.on_chunk_grads_ready:
                engine.on_chunk_grads_ready(action.chunk)
        self.sends.reap()

    def record(
        self,
        index: int,
        action: Action,
        start: float,
        waited: float,
        computed: float,
        *,
        sent: bool,
    ) -> None:
        self.recorder.add(
            action,
            start=start,
            comm_wait=waited,
            compute_end=computed,
            sent=sent,
            recv_posted_after=self.window.posted_after.get(index),
            stash_bytes=self.stash.nbytes,
            saved_bytes=self.stash.saved_bytes,
            inflight=self.stash.inflight,
            send_bytes=self.sends.nbytes,
            layers=self.layer_s,
        )
        self.layer_s = None
