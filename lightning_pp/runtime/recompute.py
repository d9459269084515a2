"""Activation recompute: which modules of a rank's chunks run under ``torch.utils.checkpoint``.

A recomputed module keeps only its inputs during forward and runs its forward again in backward
(non-reentrant ``torch.utils.checkpoint``). What to recompute (:func:`parse_recompute`):

* ``None``: nothing (default);
* ``"full"``: every pipeline layer (each layer of a :class:`~lightning_pp.layout.partition.
  PipelineChunk`; a chunk of another kind as one unit);
* a list of layer indices (original indices, e.g. ``[0, 1, 5]``): those layers where held;
* :class:`Selective` (a name pattern or predicate for modules INSIDE layers, e.g. only the
  attention: ``Selective("attn")``), also given as the string ``"selective:attn"``;
* ``"auto"``: the planner (:mod:`lightning_pp.planner.recompute`) picks layers per rank from a
  memory budget; the engine then receives the chosen layer indices.

How it is applied: :func:`install_recompute` replaces the ``forward`` of each selected module
with a wrapper (an instance attribute, so parameter names and ``state_dict`` keys stay the same
and the module trains unchanged elsewhere). The wrapper checkpoints ONLY while the engine runs a
training forward with this module in its active set (:func:`recompute_active`), so eval,
forward-only steps, plain (unpipelined) runs and another engine over the same modules run the
plain forward.

Dropout and other RNG: ``preserve_rng_state=True`` makes checkpoint save the CPU RNG state (and
the state of every device the inputs live on) before the forward and restore it around the
recompute, so the recomputed forward draws exactly the same numbers: the dropout masks are
bitwise those of the original forward, and the gradients bitwise those of a run without
recompute (tested in ``tests/test_recompute.py``). The recompute forks the RNG, so the state the
rest of the step sees is untouched.

The memory meter: the checkpoint frame holds the module's tensor inputs until backward. It saves
top-level tensor arguments through the saved-tensor hooks active outside (the engine's meter
sees them), but keeps other arguments by plain reference; so a tuple activation is passed to
checkpoint as separate tensor arguments and re-packed inside.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_pp.layout.partition import PipelineChunk
    >>> chunk = PipelineChunk([nn.Linear(4, 4), nn.Tanh()], indices=[3, 4])
    >>> targets = install_recompute([chunk], [4])
    >>> [[name for name, _ in t] for t in targets]
    [['layers.1']]
    >>> with recompute_active(targets):
    ...     y = chunk(torch.randn(2, 4, requires_grad=True))
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states

from ..layout.recompute_spec import Selective, parse_recompute
from .saved_for_w import drop_unread_by_w, pinned_unpacks

__all__ = [
    "RecomputeOnce",
    "install_recompute",
    "install_targets",
    "layer_names",
    "recompute_active",
    "select_positions",
    "select_targets",
    "selective_matches",
    "selective_units",
]


# -- the targets ---------------------------------------------------------------------------
Targets = list[list[tuple[str, nn.Module]]]  # per chunk: (name inside the chunk, module)


def _layers_of(chunk: nn.Module) -> list[tuple[str, int | None, nn.Module]]:
    """``(name, original layer index or None, layer)`` of each pipeline layer of a chunk."""
    layers = getattr(chunk, "layers", None)
    indices = getattr(chunk, "layer_indices", None)
    if isinstance(layers, nn.ModuleList) and indices is not None:
        return [(f"layers.{i}", idx, m) for i, (idx, m) in enumerate(zip(indices, layers))]
    return [("", None, chunk)]  # an opaque chunk: one unit


def selective_units(chunk: nn.Module) -> list[tuple[str, nn.Module]]:
    """Where a ``Selective`` pattern's names start: each pipeline layer, or each module a
    ``split=`` stage owns (its ``owned`` list: blocks and placed modules), so that
    ``"selective:attn"`` means the same module on both paths."""
    owned = getattr(chunk, "owned", None)
    if getattr(chunk, "layers", None) is None and isinstance(owned, nn.ModuleList):
        return [(f"owned.{k}", m) for k, m in enumerate(owned)]
    return [(name, layer) for name, _, layer in _layers_of(chunk)]


def select_targets(chunks: Sequence[nn.Module], spec: Any) -> Targets:
    """The modules of each chunk that ``spec`` selects (``"auto"`` must be resolved first)."""
    spec = parse_recompute(spec)
    if spec == "auto":
        raise ValueError(
            "recompute='auto' must be resolved to layer indices by the planner "
            "(lightning_pp.planner.recompute) before the engine applies it"
        )
    out: Targets = []
    for chunk in chunks:
        picked: list[tuple[str, nn.Module]] = []
        if isinstance(spec, Selective):
            for name, unit in selective_units(chunk):
                for sub_name, sub in selective_matches(unit, spec):
                    picked.append((f"{name}.{sub_name}" if name else sub_name, sub))
        elif spec is not None:
            for name, index, layer in _layers_of(chunk):
                if spec == "full" or (isinstance(spec, tuple) and index in spec):
                    picked.append((name, layer))
        out.append(picked)
    return out


def selective_matches(unit: nn.Module, spec: Selective) -> list[tuple[str, nn.Module]]:
    """The modules inside ``unit`` (a pipeline layer) that ``spec`` selects, named relative to
    it; a module inside one already selected is skipped (one checkpoint frame covers it). The
    pre-flight (:mod:`lightning_pp.strategy.preflight`) asks the same question of the whole
    model before launch."""
    taken: list[str] = []
    picked: list[tuple[str, nn.Module]] = []
    for sub_name, sub in unit.named_modules():
        if not sub_name or any(sub_name.startswith(t + ".") for t in taken):
            continue
        if spec.matches(sub_name, sub):
            taken.append(sub_name)
            picked.append((sub_name, sub))
    return picked


def layer_names(chunk: nn.Module) -> list[tuple[str, int | None]]:
    """``(name inside the chunk, original layer index or None)`` of each pipeline layer of a
    chunk, in order: the positions :func:`select_positions` takes."""
    return [(name, index) for name, index, _ in _layers_of(chunk)]


def select_positions(chunks: Sequence[nn.Module], positions: Sequence[Sequence[int]]) -> Targets:
    """The layers at the given positions (within each chunk's layer list): the planner's form."""
    out: Targets = []
    for chunk, chosen in zip(chunks, positions, strict=True):
        layers = _layers_of(chunk)
        out.append([(layers[i][0], layers[i][2]) for i in sorted(set(chosen))])
    return out


def install_recompute(chunks: Sequence[nn.Module], spec: Any) -> Targets:
    """Select the modules ``spec`` names in each chunk and give each the checkpointing forward
    wrapper (idempotent). Returns the targets; the wrapper checkpoints only inside
    :func:`recompute_active` with them."""
    return install_targets(select_targets(chunks, spec))


def install_targets(targets: Targets) -> Targets:
    """Give each target module the checkpointing forward wrapper (idempotent)."""
    for picked in targets:
        for _, module in picked:
            if not isinstance(module.__dict__.get("forward"), _CheckpointedForward):
                module.forward = _CheckpointedForward(module)  # type: ignore[method-assign]
    return targets


@dataclass
class _Active:
    ids: frozenset[int] = frozenset()
    split: bool = False
    again: frozenset[int] = frozenset()  # split only: modules that recompute again for W
    frames: list[RecomputeOnce] = field(default_factory=list)


# The modules (by id) that checkpoint in the current training forward, whether their recompute
# must serve two backward calls (a split backward: I, then W), and the frames it made.
_ACTIVE: ContextVar[_Active | None] = ContextVar("lightning_pp_recompute", default=None)


@contextlib.contextmanager
def recompute_active(
    targets: Sequence[Sequence[tuple[str, nn.Module]]],
    *,
    split: bool = False,
    again: Sequence[nn.Module] = (),
) -> Iterator[list[RecomputeOnce]]:
    """Inside: the modules in ``targets`` checkpoint (the engine enters it for training
    forwards only). ``split``: the backward of this forward runs in two calls, ``I`` then
    ``W`` (zero-bubble schedules); each region then recomputes once and keeps the result for
    ``W`` (:class:`RecomputeOnce`) instead of using ``torch.utils.checkpoint``. Yields the list
    of :class:`RecomputeOnce` frames the forward creates (empty unless ``split``). ``again``:
    modules whose frame drops its recompute after ``I`` and recomputes again for ``W``
    (:meth:`RecomputeOnce.release`; the planner's choice where ``W`` lags far behind ``I``)."""
    state = _Active(
        frozenset(id(m) for picked in targets for _, m in picked),
        split,
        frozenset(id(m) for m in again),
    )
    token = _ACTIVE.set(state)
    try:
        yield state.frames
    finally:
        _ACTIVE.reset(token)


class _CheckpointedForward:
    """A module's ``forward`` that runs under non-reentrant checkpoint when active."""

    def __init__(self, module: nn.Module) -> None:
        # The class's forward, bound: the instance attribute shadows it, so call it explicitly.
        self._forward = type(module).forward.__get__(module)
        self._id = id(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        active = _ACTIVE.get()
        if active is None or self._id not in active.ids or not torch.is_grad_enabled():
            return self._forward(*args, **kwargs)
        if active.split:
            frame = RecomputeOnce(self._forward, again=self._id in active.again)
            active.frames.append(frame)
            return frame(*args, **kwargs)
        if len(args) == 1 and not kwargs and isinstance(args[0], (tuple, list)):
            # A tuple activation: its tensors as top-level arguments, so the frame saves them
            # through the saved-tensor hooks (the meter sees them) instead of by reference.
            kind, items = type(args[0]), list(args[0])
            return checkpoint(
                self._call_packed,
                kind,
                *items,
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=_recompute_contexts,
            )
        return checkpoint(
            self._forward,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=_recompute_contexts,
            **kwargs,
        )

    def _call_packed(self, kind: type, *items: Any) -> Any:
        return self._forward(kind(items))


def _recompute_contexts() -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn``: nothing around the forward, and
    :func:`collectives_waited` around the recompute."""
    return contextlib.nullcontext(), collectives_waited()


@contextlib.contextmanager
def collectives_waited() -> Iterator[None]:
    """Wait, on the way out, for every functional collective launched inside (what DTensor
    issues under tensor parallelism, ``async_op=True`` for the styles' outputs).

    A recompute runs a region's forward only up to the last tensor it saved (torch's
    checkpoint and :class:`RecomputeOnce` both stop there) and throws its outputs away, so a
    collective launched before that point (a vocabulary-parallel embedding's all-reduce, a
    head's all-gather) may have no consumer to wait for it. torch keeps every unwaited
    collective in its work registry (with its output) until the process ends: 4 more per
    step of a pp2 x tp2 run with recompute, "40 unwaited collective calls" at its exit. The
    collectives are found where torch wraps their outputs (``_maybe_wrap_tensor``); without
    that function (another torch) nothing is tracked."""
    import torch.distributed._functional_collectives as funcol

    real = getattr(funcol, "_maybe_wrap_tensor", None)
    if real is None:
        yield
        return
    launched: list[torch.Tensor] = []

    def wrap(t: torch.Tensor) -> torch.Tensor:
        out = real(t)
        launched.append(out)
        return out

    funcol._maybe_wrap_tensor = wrap
    try:
        yield
    finally:
        funcol._maybe_wrap_tensor = real
        for out in launched:
            if isinstance(out, funcol.AsyncCollectiveTensor):
                out.trigger_wait()  # a no-op where a consumer already waited


# -- recompute once for a split backward ----------------------------------------------------
class _StopRecompute(Exception):
    """Raised by the recompute once the last tensor the forward saved is refilled: the rest of
    the region's forward is not needed (``torch.utils.checkpoint``'s early stop, likewise)."""


class _Slot:
    """One tensor the region's forward saved for backward: what autograd keeps in the graph in
    its place. Empty until the recompute fills it; then it holds the tensor for every backward
    call that unpacks it (``I`` and ``W``), until the graph is freed, or until
    :meth:`RecomputeOnce.trim` finds that ``W`` will not unpack it. ``users``: the ids of the
    autograd nodes that unpacked it so far (during ``I``)."""

    __slots__ = ("__weakref__", "spec", "users", "value")

    def __init__(self, spec: tuple[Any, ...]) -> None:
        self.spec = spec
        self.value: torch.Tensor | None = None
        self.users: list[Any] = []


class _SaveInputs(torch.autograd.Function):
    """Keeps a region's tensor inputs through the saved-tensor hooks active OUTSIDE the region,
    as ``torch.utils.checkpoint`` does, so the engine's memory meter counts what a recomputed
    region holds between forward and backward. Its output joins no graph: nothing calls its
    backward."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - never reached
        return (None,) * (1 + len(ctx.saved_tensors))


def _spec(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.dtype, t.device


def _autocast_state(device_types: Sequence[str]) -> list[tuple[str, bool, torch.dtype]]:
    return [
        (dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
        for dt in device_types
        if torch.amp.is_autocast_available(dt)
    ]


class RecomputeOnce:
    """One recomputed region under a split backward: recomputed ONCE, at the first backward call
    that needs it (``I``), and kept for the second (``W``).

    Why not ``torch.utils.checkpoint`` here: its non-reentrant frame recomputes per backward
    call (keyed by the autograd graph task) and frees each recomputed tensor once unpacked, so
    ``I`` then ``W`` run the region's forward twice (what pytorch#136766 and torchtitan#773
    report for torch's zero-bubble schedules); under ``torch.utils.checkpoint.GraphExecGroup``
    (recompute at most once) the second unpack of a tensor that ``I`` and ``W`` both need (a
    Linear's backward node runs in both) raises ``CheckpointError`` instead. This frame uses
    the same mechanism as that checkpoint (``saved_tensors_hooks``: the forward saves an empty
    :class:`_Slot` per tensor, the recompute refills the slots in order, with the forward's RNG
    and autocast state restored) but a filled slot serves every later unpack, and is freed with
    the graph, after ``W``.

    ``again=True`` (with :meth:`release` after ``I``): recompute again for ``W`` instead, so the
    region holds only its inputs from ``F`` to ``W``; the ``"auto"`` planner picks that for a
    layer only where ``W`` lags so far behind ``I`` that keeping the recompute exceeds the
    budget (zb-h1's last ranks).

    RNG: the CPU RNG state, and that of every device the inputs live on, is saved before the
    forward and set for the recompute inside ``torch.random.fork_rng``: dropout draws bitwise
    the same masks, and the RNG the rest of the step sees is untouched.

    Example:
        >>> lin = nn.Linear(3, 3)
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> frame = RecomputeOnce(lambda t: torch.tanh(lin(t)))
        >>> y = frame(x)
        >>> y.sum().backward(retain_graph=True); y.sum().backward()
        >>> frame.recomputes  # two backward calls, one recompute
        1
    """

    def __init__(self, fn: Callable[..., Any], *, again: bool = False) -> None:
        self.fn = fn
        self.again = again
        self.slots: list[weakref.ReferenceType[_Slot]] = []
        self.recomputes = 0
        self._saver: Any = None
        self._layout: list[Any] = []
        self._kwargs: dict[str, Any] = {}

    # -- forward ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors: list[torch.Tensor] = []
        # Top-level tensors, and those of a top-level tuple/list (a tuple activation), are kept
        # through the outer hooks; anything else by reference (as checkpoint does).
        for a in args:
            if isinstance(a, torch.Tensor):
                self._layout.append(("t", len(tensors)))
                tensors.append(a)
            elif isinstance(a, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in a):
                items = []
                for x in a:
                    if isinstance(x, torch.Tensor):
                        items.append(("t", len(tensors)))
                        tensors.append(x)
                    else:
                        items.append(("v", x))
                self._layout.append(("seq", type(a), items))
            else:
                self._layout.append(("v", a))
        self._kwargs = kwargs
        anchor = torch.empty(0, requires_grad=True)
        self._saver = _SaveInputs.apply(anchor, *tensors).grad_fn
        self._device_type = next((t.device.type for t in tensors if t.device.type != "cpu"), None)
        self._cpu_rng = torch.get_rng_state()
        self._devices, self._device_rng = get_device_states(*tensors)
        self._autocast = _autocast_state(
            ["cpu", self._device_type] if self._device_type else ["cpu"]
        )
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.fn(*args, **kwargs)

    def _pack(self, t: torch.Tensor) -> _Slot:
        slot = _Slot(_spec(t))
        self.slots.append(weakref.ref(slot))
        return slot

    # -- backward --------------------------------------------------------------------------
    def _unpack(self, slot: _Slot) -> torch.Tensor:
        if slot.value is None:
            self._recompute()
        if slot.value is None:
            raise RuntimeError(
                "lightning_pp recompute: a saved tensor is still empty after the region was "
                "recomputed (was it unpacked after its graph was freed?)"
            )
        # Which node unpacks it: trim() keeps, after I, only what W's nodes will unpack again.
        # By id: see lightning_pp.runtime.saved_for_w (a node object here would make a cycle through
        # the graph that outlives W).
        node = torch._C._current_autograd_node()
        if node is not None:
            slot.users.append(id(node))
        return slot.value

    def trim(self, weight_nodes: set[Any]) -> int:
        """After ``I``: drop each recomputed tensor that only nodes ``W`` will not run have
        unpacked (``weight_nodes``: :meth:`WeightWork.nodes
        <lightning_pp.runtime.split_backward.WeightWork.nodes>`). A Linear's backward runs in both
        ``I`` and ``W`` and keeps its input; an activation's (GELU, softmax, dropout) runs only
        in ``I``, so what it saved is freed here rather than held until ``W``. A tensor no node
        unpacked yet (one a weight-only node below the input path saved) is kept. Should ``W``
        unpack a dropped tensor after all, the region is recomputed again: correct, and slower
        (``recomputes`` counts it). Returns the number of tensors dropped."""
        return drop_unread_by_w(self.slots, weight_nodes)

    def release(self) -> None:
        """Drop what the recompute filled: the next backward call that needs it (``W``)
        recomputes again. Between ``I`` and ``W`` the region then holds only its inputs, at the
        cost of a second forward (what torch's checkpoint always does)."""
        for ref in self.slots:
            slot = ref()
            if slot is not None:
                slot.value = None
                slot.users = []

    def _inputs(self) -> tuple[list[Any], dict[str, Any]]:
        # Pinned: read from inside I, needed again should W recompute (an outer SavedForW
        # must not free them after I).
        with pinned_unpacks():
            held = self._saver.saved_tensors
        saved = [t.detach().requires_grad_(t.requires_grad) for t in held]

        def value(item: Any) -> Any:
            return saved[item[1]] if item[0] == "t" else item[1]

        args = []
        for item in self._layout:
            if item[0] == "seq":
                args.append(item[1](value(x) for x in item[2]))
            else:
                args.append(value(item))
        return args, self._kwargs

    def _recompute(self) -> None:
        self.recomputes += 1
        args, kwargs = self._inputs()
        filled = [0]

        def fill(t: torch.Tensor) -> None:
            # What this returns is what the recomputed forward's own graph keeps, and nothing
            # ever runs that graph's backward: keep nothing. Returning ``t`` leaked every
            # recompute: a node that saves its own output (tanh, softmax) then holds the
            # output, whose grad_fn is that node, a cycle through C++ that no garbage
            # collection frees, and through this hook the frame, its inputs and its graph
            # (tests/test_recompute.py, test_nothing_outlives_the_step).
            i = filled[0]
            filled[0] += 1
            if i >= len(self.slots):
                raise RuntimeError(
                    f"lightning_pp recompute: the recomputed forward saved more tensors than "
                    f"the original ({len(self.slots)}): the region's forward must do the same "
                    f"work when run again (no data-dependent branching on state it changes)"
                )
            slot = self.slots[i]()
            if slot is not None:
                if _spec(t) != slot.spec:
                    raise RuntimeError(
                        f"lightning_pp recompute: saved tensor {i} was {slot.spec[0]} "
                        f"{slot.spec[1]} in the forward but {tuple(t.shape)} {t.dtype} when "
                        f"recomputed: the region's forward must be deterministic in shape"
                    )
                slot.value = t.detach() if t.requires_grad else t
            if filled[0] == len(self.slots):
                raise _StopRecompute

        device_type = self._device_type or "cuda"
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                torch.random.fork_rng(devices=self._devices, device_type=device_type)
            )
            torch.set_rng_state(self._cpu_rng)
            if self._devices:
                set_device_states(self._devices, self._device_rng, device_type=device_type)
            for dt, enabled, dtype in self._autocast:
                stack.enter_context(torch.autocast(dt, enabled=enabled, dtype=dtype))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(fill, lambda t: t))
            stack.enter_context(collectives_waited())
            try:
                self.fn(*args, **kwargs)
            except _StopRecompute:
                pass
        if filled[0] < len(self.slots):
            raise RuntimeError(
                f"lightning_pp recompute: the recomputed forward saved {filled[0]} tensors, the "
                f"original {len(self.slots)}"
            )

    def held(self) -> list[torch.Tensor]:
        """The recomputed tensors this frame holds now (for the memory meter)."""
        out = []
        for ref in self.slots:
            slot = ref()
            if slot is not None and slot.value is not None:
                out.append(slot.value)
        return out
