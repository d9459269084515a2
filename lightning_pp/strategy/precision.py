"""Gradient clipping by the norm of the WHOLE pipeline, as a precision-plugin subclass.

Lightning clips through the precision plugin (``Trainer(gradient_clip_val=...)`` ->
``precision_plugin.clip_gradients`` -> ``clip_grad_by_norm``), whose default computes the norm
of the local parameters only. Under a pipeline each rank holds a slice of the model, so every
rank would clip by a different, too small norm. Lightning's ``FSDPPrecision`` overrides
``clip_grad_by_norm`` for the same reason (it raises); :func:`with_global_norm_clipping` gives
any precision plugin (``32-true``, ``bf16-mixed``, a user's own) an override that clips by the
global norm instead, and changes nothing else.

Example::

    plugin = with_global_norm_clipping(MixedPrecision("bf16-mixed", "cpu"), clip)
    # plugin is a MixedPrecision; plugin.clip_grad_by_norm(opt, 1.0) calls clip(params, 1.0)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from ..runtime.dtensor_state import local_part
from ..runtime.grad_sync import global_grad_norm

__all__ = [
    "GlobalNormClipping",
    "clip_by_global_norm",
    "clip_sharded_by_global_norm",
    "with_global_norm_clipping",
]

ClipFn = Callable[[Sequence[nn.Parameter], float], Any]


def clip_by_global_norm(
    params: Sequence[nn.Parameter], max_norm: float, group: Any, skip: set[int] | None = None
) -> Tensor:
    """Scale gradients so the L2 norm over every rank of ``group`` is at most ``max_norm``.

    ``skip``: ids of parameters not counted (tied copies counted on their owner). Returns the
    global norm before clipping.
    """
    norm = global_grad_norm(params, group, skip=skip)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            grad = local_part(p.grad)  # a DTensor gradient: its shard
            grad.detach().mul_(coef.to(grad.device))
    return norm


def clip_sharded_by_global_norm(
    params: Sequence[nn.Parameter],
    max_norm: float,
    *,
    skip: set[int] | None = None,
    replicated: set[int] | None = None,
    dp_rank: int = 0,
) -> Tensor:
    """:func:`clip_by_global_norm` when the gradients are shards, distinct on every rank of the
    world (``zero``'s rows, FSDP2's ``DTensor`` s: their local parts): squares are summed over
    the whole world. ``replicated``: ids of parameters every data-parallel replica holds whole
    (a weight FSDP2 leaves out), counted on ``dp_rank`` 0 only; ``skip``: tied copies counted
    on their owner."""
    import torch.distributed as dist

    counted_elsewhere = set(skip or ()) | (set(replicated or ()) if dp_rank != 0 else set())
    return clip_by_global_norm(params, max_norm, dist.group.WORLD, skip=counted_elsewhere)


class GlobalNormClipping(Precision):
    """Mixin placed before a precision plugin's class: ``clip_grad_by_norm`` calls ``clip_fn``.

    Use :func:`with_global_norm_clipping` to build one; ``base_plugin`` is the plugin it wraps.
    """

    clip_fn: ClipFn
    base_plugin: Precision

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.clip_fn(list(self.main_params(optimizer)), float(clip_val))

    def __reduce__(self) -> Any:
        # Pickled (e.g. by a spawn launcher) as the plain plugin it wraps: the strategy wraps it
        # again in setup, where the clipping function (which needs the process groups) exists.
        return (_same, (self.base_plugin,))


def _same(plugin: Precision) -> Precision:
    return plugin


@functools.cache
def _clipping_class(base: type[Precision]) -> type[Precision]:
    return type(f"GlobalNormClipping{base.__name__}", (GlobalNormClipping, base), {})


def with_global_norm_clipping(plugin: Precision, clip_fn: ClipFn) -> Precision:
    """A copy of ``plugin`` whose ``clip_grad_by_norm(optimizer, v)`` is ``clip_fn(params, v)``.

    The copy is an instance of a subclass of ``type(plugin)`` (so ``isinstance`` checks and every
    other method behave as before) sharing the plugin's attribute values; ``plugin`` itself is
    not modified. Wrapping a wrapped plugin replaces its ``clip_fn``.
    """
    base = plugin.base_plugin if isinstance(plugin, GlobalNormClipping) else plugin
    wrapped = object.__new__(_clipping_class(type(base)))
    wrapped.__dict__.update(vars(base))
    wrapped.clip_fn = clip_fn
    wrapped.base_plugin = base
    return wrapped
