"""What one rank holds of the model's state, measured from the tensors themselves.

Parameters, gradients, fp32 master weights and optimizer state, in bytes, each tensor counted
once (two views of one storage range count once; a DTensor counts its local shard, what this
rank allocates). Nothing is taken from what the code believes it allocated: the sharded
optimizer's rows, FSDP2's shards and a tied weight held by two chunks are all found by looking.

Example:
    >>> import torch
    >>> layer = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.AdamW(layer.parameters())
    >>> layer(torch.ones(1, 4)).sum().backward(); opt.step()
    >>> held = state_bytes(list(layer.parameters()), [opt])
    >>> (held.params, held.grads, held.master, held.optimizer)   # 10 floats; AdamW: 2 moments
    (40, 40, 0, 80)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn
from torch.optim import Optimizer

from .dtensor_state import local_part

__all__ = ["StateBytes", "state_bytes"]


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one rank's parameters, gradients, master weights and optimizer state."""

    params: int
    grads: int
    master: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer


def _key(t: Tensor) -> tuple[int, int, int]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())


def _bytes(tensors: Iterable[Tensor], seen: set[tuple[int, int, int]]) -> int:
    total = 0
    for t in tensors:
        t = local_part(t)
        if t.numel() == 0 or _key(t) in seen:
            continue
        seen.add(_key(t))
        total += t.numel() * t.element_size()
    return total


def state_bytes(params: Sequence[nn.Parameter], optimizers: Sequence[Optimizer]) -> StateBytes:
    """Measure one rank's state. ``params``: the module's parameters on this rank;
    ``optimizers``: its optimizers, whose own parameters may be other tensors (the distributed
    optimizer's rows): those that share a module parameter's storage are views (no bytes of
    their own), the others are master weights. Optimizer state counts its tensors of one or
    more dims (a step count is a scalar)."""
    seen: set[tuple[int, int, int]] = set()
    param_bytes = _bytes(params, seen)
    storages = {local_part(p).untyped_storage().data_ptr() for p in params}
    opt_params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    masters = [p for p in opt_params if local_part(p).untyped_storage().data_ptr() not in storages]
    master_bytes = _bytes(masters, seen)
    grad_seen: set[tuple[int, int, int]] = set()
    grads = [p.grad for p in [*params, *opt_params] if p.grad is not None]
    grad_bytes = _bytes(grads, grad_seen)
    state = [
        t
        for o in optimizers
        for per_param in o.state.values()
        for t in per_param.values()
        if isinstance(t, Tensor) and t.dim() > 0
    ]
    return StateBytes(param_bytes, grad_bytes, master_bytes, _bytes(state, set()))
