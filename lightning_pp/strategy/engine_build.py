"""The :class:`~lightning_pp.engine.PipelineEngine` of a :class:`~lightning_pp.strategy.
PipelineStrategy`, built from the strategy's settings at setup, and the run's start log.

The engine knows no Lightning; this is where the module's hooks become the engine's plain
callables. ``pipeline_input`` and ``pipeline_loss`` run inside the schedule on one stage, once per
microbatch, so a ``self.log`` there is refused with an error naming the hook
(:mod:`lightning_pp.stage_logging` says why).

Example::

    strategy.grad_sync = build_grad_sync(strategy)   # at the end of PipelineStrategy.setup
    strategy.engine = build_engine(strategy)
    if strategy.is_global_zero:
        log_start(strategy)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch import Tensor

from .grad_sync import DeferredGradSync
from .stage_logging import refuse_logs

if TYPE_CHECKING:
    from .engine import PipelineEngine
    from .strategy import PipelineStrategy

__all__ = ["build_engine", "build_grad_sync", "log_start"]

#: the strategy's logger: the start log reads as the strategy's, as it always has
log = logging.getLogger("lightning_pp.strategy")


def build_grad_sync(strategy: PipelineStrategy) -> DeferredGradSync:
    """The deferred data-parallel all-reduce of this rank's chunks' gradients (the engine fires
    a chunk's buckets after its last backward)."""
    assert strategy.topology is not None and strategy.groups is not None
    return DeferredGradSync(
        [list(c.parameters()) for c in strategy.chunks],
        strategy.groups.dp_group,
        strategy.topology.dp,
        strategy.bucket_cap_mb,
    )


def build_engine(strategy: PipelineStrategy) -> PipelineEngine:
    """This rank's engine over ``strategy.chunks``, with the module's input and loss hooks (or
    the ``split=`` path's), the deferred gradient sync and the strategy's engine settings."""
    from .engine import PipelineEngine  # late import: the engine loads torch.distributed bits

    module: Any = strategy.lightning_module
    assert strategy.grad_sync is not None and strategy.plan is not None
    assert strategy.topology is not None and strategy.groups is not None
    rank = strategy.global_rank

    def loss_fn(output: Any, microbatch: Any) -> Tensor:
        with refuse_logs(module, "pipeline_loss", rank):
            # Divided like Lightning divides a plain step's loss under gradient accumulation.
            return module.pipeline_loss(output, microbatch) / strategy._loss_scale

    def input_fn(microbatch: Any) -> Any:
        with refuse_logs(module, "pipeline_input", rank):
            return module.pipeline_input(microbatch)

    if strategy.split_pipeline is not None:
        io: dict[str, Any] = strategy.split_pipeline.engine_kwargs(strategy)
    else:
        io = {"loss_fn": loss_fn, "input_fn": input_fn}
    return PipelineEngine(
        strategy.chunks,
        strategy.plan.schedule,
        strategy.topology,
        strategy.groups,
        **io,
        loss_reduction="mean",
        release_outputs=strategy.release_outputs,
        on_chunk_grads_ready=strategy.grad_sync.on_chunk_grads_ready,
        device=strategy.root_device,
        watchdog_timeout=strategy.watchdog_timeout,
        check_finite=strategy.check_finite,
        recv_lookahead=strategy.recv_lookahead,
        # "auto" is planned on the first batch (PipelineStrategy.training_step)
        recompute=None if strategy.recompute == "auto" else strategy.recompute,
    )


def log_start(strategy: PipelineStrategy) -> None:
    """Say the run's decisions once (global rank 0): shape, placement, partition per rank,
    schedule, and what the engine resolved for the transfers."""
    assert strategy.plan is not None and strategy.grad_sync is not None
    for line in strategy.plan.describe():
        log.info(line)
    log.info(
        f"engine: receive lookahead {strategy.engine.recv_lookahead} action(s); data-parallel "
        f"all-reduce in buckets of {strategy.bucket_cap_mb:g} MB "
        f"({strategy.grad_sync.num_buckets} on rank 0, dp={strategy.dp})"
    )
