"""What one layer's forward saves for backward, measured: the facts the recompute planner needs.

:func:`measure_chunk` runs a chunk's forward (gradients on) and returns, per pipeline layer, a
:class:`LayerProbe`: the storages its forward saves (keyed as the engine's saved-bytes meter
keys them), the tensor inputs a checkpoint of it would hold instead, its forward time and, under
a split backward, the part ``W`` unpacks again. The engine's probe step calls it; the planning
on top of these numbers (:func:`~lightning_pp.planner.recompute.plan_auto`) is the planner's.

Example::

    out, probes = measure_chunk(chunk, (x,), key_fn)
    [(p.name, sum(p.saved.values())) for p in probes]   # bytes each layer saves
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .recompute import layer_names
from .split_backward import weight_nodes

__all__ = ["LayerProbe", "measure_chunk"]


@dataclass
class LayerProbe:
    """One layer's forward on one microbatch: ``saved`` and ``inputs`` map a storage key (as the
    engine's meter keys it) to its bytes; ``forward_s`` is the layer's forward time."""

    name: str
    index: int | None
    saved: dict[Any, int] = field(default_factory=dict)
    inputs: dict[Any, int] = field(default_factory=dict)
    forward_s: float = 0.0
    #: under a split backward, the part of ``saved`` that ``W`` unpacks again (a Linear's
    #: input, a LayerNorm's statistics; not a GELU's input): what a recomputed layer still
    #: holds from ``I`` to ``W``. ``None``: all of ``saved``.
    w_saved: dict[Any, int] | None = None

    @property
    def kept_for_w(self) -> dict[Any, int]:
        return self.saved if self.w_saved is None else self.w_saved


def _checkpoint_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a checkpoint of this call holds through the saved-tensor hooks (as
    :mod:`lightning_pp.runtime.recompute` passes them: a single tuple argument is flattened)."""
    if len(args) == 1 and not kwargs and isinstance(args[0], (tuple, list)):
        return [t for t in args[0] if isinstance(t, torch.Tensor)]
    return [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


class _Saved:
    """A tensor the probed forward saved, with the layer and storage key it counts for and the
    nodes that unpacked it during the probe's input-gradient pass."""

    __slots__ = ("counted", "layer", "tensor", "users")

    def __init__(self, t: torch.Tensor, layer: int | None, counted: tuple[Any, int] | None):
        self.tensor, self.layer, self.counted = t, layer, counted
        self.users: list[Any] = []


def _unpack_saved(h: _Saved) -> torch.Tensor:
    node = torch._C._current_autograd_node()
    if node is not None:
        h.users.append(id(node))  # the graph holds every node until the end: ids are unique
    return h.tensor


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _kept_for_w(out: Any, args: tuple[Any, ...], held: list[_Saved], probes: list[LayerProbe]):
    """Run the probe's input gradient (``I``: nothing accumulates into ``.grad``) and note,
    per layer, what ``W`` would unpack again: a tensor some node of ``W`` unpacked, or one no
    node unpacked yet. What :meth:`RecomputeOnce.trim
    <lightning_pp.runtime.recompute.RecomputeOnce.trim>` keeps after ``I``, by the same rule."""
    outs = [t for t in _tensors(out) if t.requires_grad]
    want = [t for t in _tensors(args[0]) if t.requires_grad]
    nodes = weight_nodes(outs, want) if outs and want else None
    if nodes is None:  # first stage (W runs the whole backward) or a fused backward
        return
    torch.autograd.grad(outs, want, [torch.ones_like(t) for t in outs], allow_unused=True)
    ids = {id(n) for n in nodes}
    for p in probes:
        p.w_saved = {}
    for h in held:
        if h.counted is None or h.layer is None:
            continue
        if not h.users or any(u in ids for u in h.users):
            probes[h.layer].w_saved[h.counted[0]] = h.counted[1]  # type: ignore[index]


def measure_chunk(
    chunk: nn.Module,
    args: tuple[Any, ...],
    key_fn: Callable[[torch.Tensor], tuple[Any, int] | None],
    *,
    split: bool = False,
) -> tuple[Any, list[LayerProbe]]:
    """Run ``chunk(*args)`` (gradients on) and measure each pipeline layer: returns the output
    and one :class:`LayerProbe` per layer (positions as :func:`~lightning_pp.runtime.recompute.
    layer_names`). ``key_fn`` keys a tensor's storage like the engine's meter (``None``:
    not counted, e.g. a parameter). ``split`` (a split-backward schedule): also run the
    input gradient of the chunk and fill each probe's ``w_saved``."""
    names = layer_names(chunk)
    modules = [chunk.get_submodule(n) if n else chunk for n, _ in names]
    probes = [LayerProbe(n, i) for n, i in names]
    current: list[int | None] = [None]
    started = [0.0]
    held: list[_Saved] = []

    def pack(t: torch.Tensor) -> Any:
        counted = key_fn(t) if current[0] is not None else None
        if counted is not None:
            probes[current[0]].saved[counted[0]] = counted[1]  # type: ignore[index]
        # A detached alias, never ``t``: an output saved by its own node (a tanh's) would
        # hold that node through its grad_fn, a cycle no garbage collection frees, and the
        # probed graph would outlive the probe.
        if split:
            held.append(_Saved(t.detach(), current[0], counted))
            return held[-1]
        return t.detach()

    def pre(i: int):
        def hook(_m: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
            for t in _checkpoint_args(a, kw):
                counted = key_fn(t)
                if counted is not None:
                    probes[i].inputs[counted[0]] = counted[1]
            current[0] = i
            started[0] = time.perf_counter()

        return hook

    def post(i: int):
        def hook(_m: nn.Module, _a: Any, _kw: Any, _out: Any) -> None:
            probes[i].forward_s += time.perf_counter() - started[0]
            current[0] = None

        return hook

    handles = []
    for i, m in enumerate(modules):
        handles.append(m.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(m.register_forward_hook(post(i), with_kwargs=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(
            pack, _unpack_saved if split else (lambda t: t)
        ):
            out = chunk(*args)
    finally:
        for h in handles:
            h.remove()
    if split:
        _kept_for_w(out, args, held, probes)
    return out, probes
