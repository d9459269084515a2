"""Whole tensors loaded into sharded ones: a checkpoint's plain tensor becomes a ``DTensor`` laid
out as the parameter (or optimizer state) it replaces.

Checkpoints store every tensor whole, by name (DCP reads a ``DTensor``'s shards into one plain
tensor). FSDP2's parameters and their optimizer state are ``DTensor`` s, and neither
``Module.load_state_dict`` nor ``Optimizer.load_state_dict`` takes a plain tensor for one
("mixed torch.Tensor and DTensor"). :func:`like` cuts the whole tensor into this rank's shard
without communication (every rank holds the whole tensor already).

Example::

    module.load_state_dict(module_state_like(module, loaded))     # FSDP2 chunks included
    DTensorOptimizer(optimizer).load_state_dict(positional_state)  # moments become shards
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = [
    "DTensorOptimizer",
    "counted_once",
    "like",
    "local_part",
    "match_grad_placements",
    "module_state_like",
]


def local_part(t: Tensor) -> Tensor:
    """A ``DTensor``'s local shard (what this rank holds and allocates), else ``t`` itself;
    outside autograd, so the shard can be read and written in place."""
    to_local = getattr(t, "to_local", None)
    if not callable(to_local):
        return t
    with torch.no_grad():
        return to_local()


def match_grad_placements(params: Any) -> None:
    """Lay each ``DTensor`` parameter's gradient out as the parameter itself.

    DTensor's backward rules choose the gradient's placements, not the parameter's: a
    vocabulary-parallel embedding (weight ``Shard(0)``) gets a ``Replicate`` gradient, the whole
    table on every tensor-parallel rank. Everything after the backward reads local parts and
    expects them to match the parameter's shard: the data-parallel buckets, the tied-weight sum
    across stages (the embedding's local part must be the same rows as the head's) and the
    global norm, which would count a replicated gradient once per tp rank. ``Replicate`` or
    ``Shard`` to ``Shard`` is a local slice (no communication); a ``Partial`` gradient is
    reduced over the mesh here, on every rank of it alike (same parameters, same order)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in params:
            g = p.grad
            if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)


def counted_once(param: Tensor, coordinate: Mapping[str, int]) -> bool:
    """Whether this rank's local part of ``param`` counts in a sum over the world (a global
    norm), so that every value counts once. ``coordinate``: this rank's place on the mesh dims
    that may replicate a parameter, by name (``{"data_parallel": 1, "tensor_parallel": 0}``).

    A ``DTensor``'s local part is distinct along the mesh dims it is sharded over and the same
    along every other (a ``Replicate`` placement, or a dim its mesh lacks); a plain tensor is the
    same everywhere. It counts where this rank sits at 0 on each dim that replicates it: a
    LayerNorm's weight on tp rank 0 (torchtitan#596 counted it tp times), a tensor-parallel
    shard on every tp rank of data-parallel replica 0, an FSDP2 shard of it (sharded over both
    dims) everywhere.

    Example:
        >>> import torch
        >>> counted_once(torch.ones(2), {"data_parallel": 0, "tensor_parallel": 1})
        False
    """
    from torch.distributed.tensor import DTensor

    sharded: set[str] = set()
    if isinstance(param, DTensor):
        names = param.device_mesh.mesh_dim_names
        if names is None:
            raise ValueError(
                f"a DTensor parameter of shape {tuple(param.shape)} on an unnamed mesh of shape "
                f"{tuple(param.device_mesh.shape)}: its placements {param.placements} cannot be "
                f"matched to the data- and tensor-parallel dims {sorted(coordinate)}"
            )
        # not ``is_shard()``: FSDP2 over a tensor-parallel dim 0 gives ``_StridedShard``, which
        # is no ``Shard`` in torch 2.13 (it answers False) yet splits the tensor all the same
        sharded = {name for name, pl in zip(names, param.placements) if not pl.is_replicate()}
    return all(at == 0 for dim, at in coordinate.items() if dim not in sharded)


def like(current: Any, value: Any) -> Any:
    """``value`` laid out as ``current``: a plain tensor of a ``DTensor``'s global shape becomes
    a ``DTensor`` of the same mesh and placements (this rank's part, cut locally); anything
    else is returned as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if (
        isinstance(current, DTensor)
        and isinstance(value, Tensor)
        and not isinstance(value, DTensor)
        and tuple(value.shape) == tuple(current.shape)
    ):
        return distribute_tensor(
            value.to(device=current.to_local().device),
            current.device_mesh,
            current.placements,
            src_data_rank=None,  # every rank holds the whole tensor: no scatter
        )
    return value


def module_state_like(module: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` for ``module.load_state_dict``: each entry laid out as the module's own."""
    current = module.state_dict()
    return {k: like(current.get(k), v) for k, v in state.items()}


class DTensorOptimizer:
    """An optimizer seen by a checkpoint loader: ``load_state_dict`` lays each state tensor of
    a ``DTensor`` parameter out as that parameter (:func:`like`); ``state_dict`` and
    ``param_groups`` are the optimizer's own (``DTensor`` moments save as shards).

    Example::

        DTensorOptimizer(optimizer).load_state_dict(saved)   # saved: whole tensors
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def state_request(
        self, param: Tensor, shape: tuple[int, ...], dtype: torch.dtype
    ) -> Tensor | None:
        """What a checkpoint loader reads a saved state of ``param`` into: for a moment
        of a sharded ``DTensor`` parameter (its shape), an empty ``DTensor`` laid out as the
        parameter, so that DCP reads only this rank's shard from the files; ``None`` for
        anything else (read whole, then laid out by :func:`like`)."""
        from torch.distributed.tensor import DTensor

        if not isinstance(param, DTensor) or tuple(shape) != tuple(param.shape):
            return None
        if not any(pl.is_shard() for pl in param.placements):
            return None
        local = param.to_local()
        return DTensor.from_local(
            torch.empty(local.shape, dtype=dtype, device=local.device),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = {
            i: {k: like(params[i], v) for k, v in entry.items()}
            for i, entry in state_dict["state"].items()
        }
        self.optimizer.load_state_dict({**state_dict, "state": state})
