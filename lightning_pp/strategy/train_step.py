"""The training side of :class:`~lightning_pp.strategy.PipelineStrategy`: one pipelined
forward+backward per batch, and the Lightning setup that lets it stand in for a plain step.

Lightning runs ``training_step``, then backward, then the optimizer step. Under a pipeline the
backward runs inside the schedule (the engine interleaves it with the forwards), so
:func:`setup_training` tells the Trainer to skip its own backward and routes gradient clipping to
the norm of the whole model; :func:`train_step` runs the schedule and then fires what Lightning
would have fired around a plain backward (zero-grad hooks, ``pre_backward``/``post_backward``,
the loss log). :func:`teardown_training` undoes what setup changed. The forward-only steps live in
:mod:`lightning_pp.eval_step`.

Example::

    setup_training(strategy, trainer)     # in PipelineStrategy.setup, before the engine is built
    loss = train_step(strategy, (batch, batch_idx), {})   # PipelineStrategy.training_step
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn

from . import _lightning_compat as compat
from .model_summary import restore_summaries, use_stage_summaries
from .precision import GlobalNormClipping, clip_by_global_norm, with_global_norm_clipping
from .recompute_plan import plan_auto

if TYPE_CHECKING:
    from .strategy import PipelineStrategy

__all__ = [
    "clip_grad_by_global_norm",
    "dp_mean",
    "setup_training",
    "teardown_training",
    "train_step",
]


def setup_training(strategy: PipelineStrategy, trainer: pl.Trainer) -> None:
    """Lightning's optimizer and precision setup, in Lightning's order; when fitting, also what
    the pipeline's training step needs from the Trainer."""
    fitting = trainer.state.fn == TrainerFn.FITTING
    if fitting:
        compat.reset_optimizers_and_schedulers(strategy)
        strategy.setup_optimizers(trainer)
    strategy.setup_precision_plugin()
    if not fitting:
        return
    compat.optimizers_to_device(strategy.optimizers, strategy.root_device)
    # The pipeline runs backward inside training_step; Lightning must not run it again
    # (nor zero the gradients between our backward and the optimizer step).
    compat.set_skip_backward(trainer, True)
    strategy._unclipped_precision = strategy.precision_plugin
    strategy.precision_plugin = with_global_norm_clipping(
        strategy.precision_plugin, functools.partial(clip_grad_by_global_norm, strategy)
    )
    # The model summary (printed at fit start) must count every stage, not rank 0's.
    use_stage_summaries(strategy, trainer.callbacks)


def teardown_training(strategy: PipelineStrategy) -> None:
    """Give the Trainer back its own backward, summaries and precision plugin."""
    trainer = compat.trainer_of(strategy.lightning_module)
    compat.set_skip_backward(trainer, False)
    if trainer is not None:
        restore_summaries(trainer.callbacks)
    if isinstance(strategy.precision_plugin, GlobalNormClipping):
        strategy.precision_plugin = strategy._unclipped_precision
    strategy._unclipped_precision = None


def train_step(strategy: PipelineStrategy, args: Sequence[Any], kwargs: dict[str, Any]) -> Tensor:
    """One pipelined forward+backward over the batch; returns the batch loss on every rank."""
    module = strategy.lightning_module
    trainer = module.trainer
    assert strategy.plan is not None
    batch = args[0] if args else kwargs["batch"]
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    strategy.plan.check_batch_of(batch, strategy.global_rank)
    accumulate = trainer.accumulate_grad_batches
    if batch_idx % accumulate == 0:
        for optimizer in strategy.optimizers[:1]:  # automatic optimization steps optimizer 0
            compat.call_zero_grad_hooks(trainer, optimizer, batch_idx)
    last_micro_step = not compat.should_accumulate(trainer)
    assert strategy.grad_sync is not None
    strategy.grad_sync.enabled = last_micro_step
    # The loss functions divide by it (engine_build), as Lightning divides a plain step's loss.
    strategy._loss_scale = accumulate
    try:
        with strategy.precision_plugin.train_step_context():
            split = strategy.split_pipeline
            if split is not None:  # the module's own training_step per stage
                result = split.train_step(strategy.engine, module, args, kwargs)
            else:
                if strategy.recompute == "auto" and strategy.recompute_plan is None:
                    assert strategy.activation_budget is not None
                    budget = strategy.activation_budget
                    strategy.recompute_plan = plan_auto(strategy.engine, batch, budget)
                result = strategy.engine.train_step(batch)
    finally:
        strategy._loss_scale = 1
    strategy.last_record = result.record
    if last_micro_step:
        strategy.grad_sync.wait()
        strategy.tied_sync.all_reduce_grads()
    loss = dp_mean(strategy, result.loss.detach()) * accumulate
    # Backward already ran inside the schedule; fire the hooks users expect around it.
    strategy.precision_plugin.pre_backward(loss, module)
    strategy.precision_plugin.post_backward(loss, module)
    if strategy.split_pipeline is not None:
        strategy.split_pipeline.replay_logs(strategy, module)  # what training_step logged
    else:
        module.pipeline_log_train_loss(loss)
    return loss


def dp_mean(strategy: PipelineStrategy, value: Tensor) -> Tensor:
    """``value`` averaged over the data-parallel replicas (each saw a different shard)."""
    assert strategy.topology is not None and strategy.groups is not None
    if strategy.topology.dp == 1:
        return value
    value = strategy.all_reduce(value.clone(), group=strategy.groups.dp_group, what="the step loss")
    return value / strategy.topology.dp


def clip_grad_by_global_norm(
    strategy: PipelineStrategy, params: Sequence[nn.Parameter], max_norm: float
) -> Tensor:
    """Scale gradients so the norm over the WHOLE model (every stage) is at most ``max_norm``.

    Tied copies count once (on their owner), replicas are not summed twice. Returns the
    norm before clipping. ``gradient_clip_val`` gets here via :mod:`lightning_pp.precision`.
    """
    assert strategy.groups is not None
    skip = strategy.tied_sync.non_owner_params()
    return clip_by_global_norm(params, max_norm, strategy.groups.pp_group, skip=skip)
