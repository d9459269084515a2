"""Sequence parallelism's second saving: a column-wise Linear that keeps ``T / tp`` of its input.

Under Megatron's sequence parallelism (Korthikanti et al., 2022, section 4.2.2) a norm's output
is cut along the sequence and all-gathered just before the column-parallel projections that
read it. With torch's ``ColwiseParallel`` each projection's matmul then saves the gathered,
whole-sequence input for its weight gradient, so ``tp`` times what a rank computed the norm on
stays alive until backward: per block, the inputs of ``q``/``k``/``v`` and of ``fc``, two
``B x T x C`` tensors at every tp size. Megatron keeps the rank's own ``T / tp`` positions
instead and all-gathers them again in backward, right before the weight gradient
(``LinearWithGradAccumulationAndAsyncCommunication`` with ``sequence_parallel``). This module
does the same with torch's styles:

* :class:`GatherSequence` (on the norm) all-gathers its ``Shard(1)`` output to whole, as
  ``PrepareModuleOutput`` does, and tags the gathered ``DTensor`` with a :class:`SequenceShard`:
  the rank's part (the norm's own output, no copy) and a cache for the backward's regather.
* :class:`ColwiseFromSequence` (on the projections) cuts the weight as ``ColwiseParallel`` does
  (``Shard(0)``: checkpoints, FSDP2 and the distributed optimizer see the same parameters),
  and computes ``x @ W.T + b`` as two autograd nodes, like the virtual device's split layer:
  the input path (saves only the weight; its backward is the input gradient, summed over the
  projections and reduce-scattered by the gather's own backward, as before) and the weight
  path (saves the rank's ``T / tp`` part; its backward all-gathers it once per norm and
  computes the weight and bias gradients). A third node joins them and only passes the
  gradient through (``split_backward_safe``), so a split backward's ``I`` runs the input path
  alone (no gather) and its ``W`` the weight path alone: one all-gather per norm per
  microbatch, in ``W`` (or in the fused ``B``), as in Megatron.

An input that carries no tag (a model that copies the gathered tensor before the projection,
or ``torch.no_grad``) is computed as ``ColwiseParallel`` computes it; with gradients on, the
projection says so once (a ``UserWarning``), since it then keeps its whole input.

Example (one process: a one-rank mesh, so the "gather" is the tensor itself)::

    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1,))
    block = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 16))
    parallelize_module(block, mesh, {"0": SequenceParallel(use_local_output=False),
                                     "1": ColwiseFromSequence()})
    parallelize_module(block, mesh, {"0": GatherSequence()})
    block(torch.randn(2, 4, 8)).sum().backward()   # weight gradient from the kept part
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput

__all__ = ["ColwiseFromSequence", "GatherSequence", "SequenceShard"]

#: the attribute of a gathered ``DTensor`` that holds its :class:`SequenceShard`
TAG = "_lightning_pp_sequence_shard"
#: set on a projection once it has warned that its input carried no tag
_WARNED = "_lightning_pp_warned_untagged"


class SequenceShard:
    """What a gathered norm output keeps for its projections' weight gradients: the tp group
    and the sequence dim it was gathered along, the number of weight paths that will read it
    (``readers``) and, during their backward, the regathered whole (``whole``: gathered by the
    first reader, dropped after the last, so one all-gather serves ``q``, ``k`` and ``v``).

    Every tp rank runs the same graph, and autograd runs its ready nodes in the order they
    were created, so the ranks reach the one gather at the same node."""

    __slots__ = ("dim", "group", "readers", "whole")

    def __init__(self, group: dist.ProcessGroup, dim: int) -> None:
        self.group, self.dim = group, dim
        self.readers = 0
        self.whole: Tensor | None = None

    def gather(self, part: Tensor) -> Tensor:
        """The whole sequence from every rank's ``part`` (all-gathered by the first reader)."""
        if self.whole is None:
            # the functional collective DTensor's own gathers use (the benchmarks count these)
            gathered = funcol.all_gather_tensor(part.contiguous(), self.dim, self.group)
            self.whole = funcol.wait_tensor(gathered)
        whole = self.whole
        self.readers -= 1
        if self.readers <= 0:
            self.whole = None
        return whole


class GatherSequence(PrepareModuleOutput):
    """``PrepareModuleOutput(Shard(1) -> Replicate)`` for a norm whose output feeds
    :class:`ColwiseFromSequence` projections: the gathered ``DTensor`` (kept, not made local,
    so the projections' input gradients add up as partial sums and leave through one
    reduce-scatter) is tagged with a :class:`SequenceShard` of the norm's own output."""

    def __init__(self) -> None:
        super().__init__(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False
        )

    def _prepare_out_fn(self, outputs: Any, device_mesh: Any) -> Any:
        whole = super()._prepare_out_fn(outputs, device_mesh)
        if isinstance(outputs, DTensor) and isinstance(whole, DTensor):
            shard = SequenceShard(device_mesh.get_group(), dim=1)
            setattr(whole, TAG, (shard, outputs.to_local().detach()))
        return whole


class ColwiseFromSequence(ColwiseParallel):
    """``ColwiseParallel`` for an ``nn.Linear`` whose input comes from :class:`GatherSequence`:
    the same ``Shard(0)`` weight and bias and the same local output, with only the rank's
    ``T / tp`` positions of the input saved for backward (see the module docstring)."""

    #: read by the planner (``TpStyle.keeps_part``): the saved input counts at ``1 / tp``
    keeps_sequence_part = True

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(
                f"ColwiseFromSequence shards an nn.Linear, not a {type(module).__name__}"
            )
        module = super()._apply(module, device_mesh)
        module.forward = _forward.__get__(module)  # type: ignore[method-assign]
        return module


def _forward(self: nn.Linear, x: Any) -> Any:
    tagged = getattr(x, TAG, None)
    if tagged is None or not torch.is_grad_enabled() or not isinstance(self.weight, DTensor):
        if tagged is None and torch.is_grad_enabled() and not getattr(self, _WARNED, False):
            setattr(self, _WARNED, True)
            warnings.warn(
                f"ColwiseFromSequence on a Linear({self.in_features}, {self.out_features}): its "
                f"input carries no GatherSequence tag (a {type(x).__name__} of shape "
                f"{tuple(x.shape)}; was the norm's gathered output changed or copied before "
                "this projection, or is GatherSequence missing on the norm?), so it is computed "
                "as ColwiseParallel computes it and keeps its whole input for backward",
                stacklevel=2,
            )
        return F.linear(x, self.weight, self.bias)
    shard, part = tagged
    # The input gradients of the projections are partial sums over the tp ranks' heads: the
    # gather's backward (Replicate <- Shard(1)) reduce-scatters their sum once.
    xl = x.to_local(grad_placements=[Partial()])
    weight = self.weight.to_local()
    bias = self.bias.to_local() if self.bias is not None else None
    z = _InputPath.apply(xl, weight.detach(), None if bias is None else bias.detach())
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        shard.readers += 1  # its weight path will run, and read the regathered input once
    zero = _WeightPath.apply(weight, bias, part, shard, z.shape, z.dtype)
    y = _Join.apply(z, zero)
    return DTensor.from_local(y, x.device_mesh, [Shard(-1)], run_check=False)


class _InputPath(torch.autograd.Function):
    """``x @ W.T + b`` differentiated into ``x`` only (``W``, ``b`` arrive detached)."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # type: ignore[override]
        ctx.save_for_backward(weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (weight,) = ctx.saved_tensors
        return (grad @ weight.to(grad.dtype)), None, None


class _WeightPath(torch.autograd.Function):
    """A zero (expanded, no memory) whose gradient into ``W`` and ``b`` is the Linear's: its
    backward regathers the input from the rank's ``part`` (saved: ``T / tp`` positions)."""

    @staticmethod
    def forward(ctx, weight, bias, part, shard, shape, dtype):  # type: ignore[override]
        ctx.save_for_backward(part)
        ctx.shard, ctx.has_bias = shard, bias is not None
        return weight.new_zeros((), dtype=dtype).expand(shape)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (part,) = ctx.saved_tensors
        whole = ctx.shard.gather(part)
        flat = grad.reshape(-1, grad.shape[-1])
        grad_w = flat.T @ whole.reshape(-1, whole.shape[-1]).to(grad.dtype)
        grad_b = flat.sum(0) if ctx.has_bias else None
        return grad_w, grad_b, None, None, None, None


class _Join(torch.autograd.Function):
    """The input path's value; its backward hands the gradient to both paths unchanged."""

    # It only passes the gradient on (no compute, no side effects), so a split backward may
    # run it in both I and W (lightning_pp.runtime.split_backward).
    split_backward_safe = True

    @staticmethod
    def forward(ctx, z, zero):  # type: ignore[override]
        return z.view_as(z)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, grad
