"""This rank's :class:`~lightning_pp.runtime.engine.PipelineEngine`, built at setup from the
strategy's settings and the module's hooks, and the run's start log.

The engine knows no Lightning; this is where the module's hooks become the engine's plain
callables. ``pipeline_input`` and ``pipeline_loss`` run inside the schedule on one stage, once per
microbatch, so a ``self.log`` there is refused with an error naming the hook
(:mod:`lightning_pp.strategy.stage_logging` says why).

Example::

    grad_sync = build_grad_sync(chunks, layout, bucket_cap_mb=25.0)
    io = module_io(module, layout.need_topology().rank, loss_scale)
    engine = build_engine(chunks, layout, io, grad_sync, device=device)
    log_start(layout.need_plan(), engine, grad_sync, bucket_cap_mb=25.0)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..layout.plan import PipelinePlan
from ..layout.rank_layout import RankLayout
from ..layout.topology import DP_DIM, TP_DIM
from ..runtime.distributed_optimizer import ShardedGradSync
from ..runtime.fsdp_chunks import FsdpGradSync, shard_chunks, shared_parameters
from ..runtime.grad_sync import DeferredGradSync, TiedParameterSync
from .stage_logging import refuse_logs

if TYPE_CHECKING:
    from ..runtime.engine import PipelineEngine

__all__ = [
    "LossScale",
    "build_engine",
    "build_grad_sync",
    "log_start",
    "module_io",
    "shard_with_fsdp",
]

#: the strategy's logger: the start log reads as the strategy's, as it always has
log = logging.getLogger("lightning_pp.strategy")


@dataclass
class LossScale:
    """The divisor of the running step's microbatch losses: ``accumulate_grad_batches`` while a
    training step runs (as Lightning divides a plain step's loss under accumulation), else 1.
    The training step sets it; the engine's loss function reads it."""

    value: int = 1


def module_io(module: Any, rank: int, loss_scale: LossScale) -> dict[str, Any]:
    """The engine's ``input_fn`` and ``loss_fn`` from the module's ``pipeline_input`` and
    ``pipeline_loss`` (a ``self.log`` inside either is refused, naming the hook)."""

    def loss_fn(output: Any, microbatch: Any) -> Tensor:
        with refuse_logs(module, "pipeline_loss", rank):
            return module.pipeline_loss(output, microbatch) / loss_scale.value

    def input_fn(microbatch: Any) -> Any:
        with refuse_logs(module, "pipeline_input", rank):
            return module.pipeline_input(microbatch)

    return {"loss_fn": loss_fn, "input_fn": input_fn}


def build_grad_sync(
    chunks: Sequence[nn.Module],
    layout: RankLayout,
    bucket_cap_mb: float,
    zero: int = 0,
    tied: TiedParameterSync | None = None,
    fsdp_whole: Sequence[nn.Parameter] | None = None,
    overlap_param_gather: bool = False,
) -> DeferredGradSync | FsdpGradSync:
    """The deferred data-parallel all-reduce of this rank's chunks' gradients (the engine fires
    a chunk's buckets after its last backward); with ``zero`` 1 or 2 the reduce-scatter of the
    distributed optimizer (:class:`~lightning_pp.runtime.distributed_optimizer.ShardedGradSync`,
    which also sums the rows of ``tied`` weights); with ``fsdp_whole`` given (``fsdp=True``),
    FSDP2's reduce-scatter per unit (:class:`~lightning_pp.runtime.fsdp_chunks.FsdpGradSync`)
    and an all-reduce of the parameters it leaves whole."""
    topo, groups = layout.need_topology(), layout.need_groups()
    if fsdp_whole is not None:
        whole = {id(p) for p in fsdp_whole}
        replicated = None
        if whole:
            replicated = DeferredGradSync(
                [[p for p in c.parameters() if id(p) in whole] for c in chunks],
                groups.dp_group,
                topo.dp,
                bucket_cap_mb,
            )
        return FsdpGradSync(chunks, replicated=replicated)
    if zero:
        mesh = None
        if groups.mesh is not None:  # under tp the rows are pieces of tp shards: both dims
            mesh = groups.mesh[(DP_DIM, TP_DIM)] if topo.tp > 1 else groups.mesh[DP_DIM]
        return ShardedGradSync(
            [list(c.parameters()) for c in chunks],
            layout.need_groups().dp_group,
            topo.dp,
            topo.dp_rank,
            zero=zero,
            bucket_cap_mb=bucket_cap_mb,
            tied=tied,
            mesh=mesh,
            overlap_param_gather=overlap_param_gather,
        )
    return DeferredGradSync(
        [list(c.parameters()) for c in chunks],
        layout.need_groups().dp_group,
        layout.need_topology().dp,
        bucket_cap_mb,
    )


def shard_with_fsdp(
    chunks: Sequence[nn.Module],
    layout: RankLayout,
    tied: TiedParameterSync,
    reshard_after_forward: bool,
) -> list[nn.Parameter]:
    """``fsdp=True``: FSDP2 per chunk over the mesh's ``data_parallel`` dim
    (:func:`~lightning_pp.runtime.fsdp_chunks.shard_chunks`), before the optimizer exists.
    A weight two local chunks share (V placement's tied embedding and head) stays whole and is
    returned (it is all-reduced); the tied copies' sync is pointed at the new ``DTensor``
    parameters. Checked first, with the rank in the message (a split backward with
    ``reshard_after_forward``)."""
    groups = layout.need_groups()
    assert groups.mesh is not None, "fsdp needs the job's DeviceMesh (build_process_groups)"
    whole = shared_parameters(chunks)
    homes = {id(g.param): _home(chunks, g.param) for g in tied.groups}
    shard_chunks(
        chunks,
        groups.mesh[DP_DIM],
        reshard_after_forward=reshard_after_forward,
        schedule=layout.need_plan().schedule,
        ignored=whole,
    )
    for g in tied.groups:  # FSDP2 registered new Parameter objects in the same places
        module, name = homes[id(g.param)]
        g.param = module._parameters[name]
    return whole


def _home(chunks: Sequence[nn.Module], param: nn.Parameter) -> tuple[nn.Module, str]:
    """The module and attribute name under which ``param`` is registered in ``chunks``."""
    for chunk in chunks:
        for module in chunk.modules():
            for name, p in module._parameters.items():
                if p is param:
                    return module, name
    raise ValueError(f"parameter of shape {tuple(param.shape)} is in none of this rank's chunks")


def build_engine(
    chunks: Sequence[nn.Module],
    layout: RankLayout,
    io: dict[str, Any],
    grad_sync: DeferredGradSync | FsdpGradSync,
    *,
    device: torch.device,
    release_outputs: bool = True,
    watchdog_timeout: float | None = None,
    check_finite: bool = False,
    recv_lookahead: int | None = None,
    recompute: Any = None,
) -> PipelineEngine:
    """This rank's engine over ``chunks`` with the module's input and loss (``io``: see
    :func:`module_io`, or the ``split=`` path's), the deferred gradient sync and the settings.
    ``recompute="auto"`` is planned on the first batch (the training step), so it starts off."""
    from ..runtime.engine import PipelineEngine  # late import: the engine loads torch.distributed

    return PipelineEngine(
        list(chunks),
        layout.need_plan().schedule,
        layout.need_topology(),
        layout.need_groups(),
        **io,
        loss_reduction="mean",
        release_outputs=release_outputs,
        on_chunk_grads_ready=grad_sync.on_chunk_grads_ready,
        device=device,
        watchdog_timeout=watchdog_timeout,
        check_finite=check_finite,
        recv_lookahead=recv_lookahead,
        recompute=None if recompute == "auto" else recompute,
    )


def log_start(
    plan: PipelinePlan,
    engine: PipelineEngine,
    grad_sync: DeferredGradSync | FsdpGradSync,
    bucket_cap_mb: float,
) -> None:
    """Say the run's decisions once (global rank 0): shape, placement, partition per rank,
    schedule, and what the engine resolved for the transfers."""
    for line in plan.describe():
        log.info(line)
    collective = "reduce-scatter" if plan.zero or plan.fsdp else "all-reduce"
    log.info(
        f"engine: receive lookahead {engine.recv_lookahead} action(s); data-parallel "
        f"{collective} in buckets of {bucket_cap_mb:g} MB "
        f"({grad_sync.num_buckets} on rank 0, dp={plan.dp})"
    )
