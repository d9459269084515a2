"""The training step of :class:`~lightning_pp.strategy.PipelineStrategy`: one pipelined
forward+backward per batch, and what Lightning would have fired around a plain backward.

Lightning runs ``training_step``, then backward, then the optimizer step. Under a pipeline the
backward runs inside the schedule (the engine interleaves it with the forwards), so the strategy
tells the Trainer to skip its own backward (at setup) and :class:`TrainStep` runs the schedule,
then fires zero-grad hooks, ``pre_backward``/``post_backward`` and the loss log. Gradient
clipping goes by the norm of the whole model (:func:`clip_grad_by_global_norm`). The forward-only
steps live in :mod:`lightning_pp.strategy.eval_step`.

Example::

    step = TrainStep(engine, layout, grad_sync, tied_sync, collectives=strategy,
                     loss_scale=loss_scale)
    loss = step.run(module, precision_plugin, (batch, batch_idx), {})   # in training_step
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from .. import _lightning_compat as compat
from ..layout.rank_layout import RankLayout
from ..layout.topology import ProcessGroups
from ..planner.recompute import RecomputePlan, plan_auto
from ..runtime.grad_sync import DeferredGradSync, TiedParameterSync
from ..runtime.microbatch import batch_size_or_none
from .collectives import Collectives
from .engine_build import LossScale
from .loss_count import LossCounts, combine_over_dp
from .precision import clip_by_global_norm

if TYPE_CHECKING:
    from ..runtime.engine import PipelineEngine
    from ..runtime.records import StepRecord
    from .split_build import SplitPipeline

__all__ = ["TrainStep", "clip_grad_by_global_norm", "dp_mean"]


@dataclass
class TrainStep:
    """One rank's training step over its engine (see the module docstring).

    ``activation_budget``: bytes for ``recompute="auto"``, planned on the first batch
    (:attr:`recompute_plan` then holds every rank's choice); ``None``: no planning.
    ``record``: the engine's record of the last step.
    """

    engine: PipelineEngine
    layout: RankLayout
    grad_sync: DeferredGradSync
    tied_sync: TiedParameterSync
    collectives: Collectives
    loss_scale: LossScale
    split: SplitPipeline | None = None
    activation_budget: int | None = None
    recompute_plan: RecomputePlan | None = None
    record: StepRecord | None = None
    #: the loss normalization (``None``: by samples, as before it existed)
    loss_counts: LossCounts | None = None

    def run(
        self, module: Any, precision_plugin: Any, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Tensor:
        """One pipelined forward+backward over the batch; returns the batch loss on every
        rank."""
        trainer = module.trainer
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        rank = self.layout.need_topology().rank
        self.layout.need_plan().check_batch_on_rank(batch_size_or_none(batch), rank)
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            for optimizer in trainer.strategy.optimizers[:1]:  # automatic optimization: one
                compat.call_zero_grad_hooks(trainer, optimizer, batch_idx)
        last_micro_step = not compat.should_accumulate(trainer)
        self.grad_sync.enabled = last_micro_step
        self.loss_scale.value = accumulate
        # Counted before the schedule starts: 1F1B runs the first backward before the last
        # forward, so every microbatch's weight must be known up front.
        weights = self._loss_weights(module, batch, args, kwargs)
        try:
            with precision_plugin.train_step_context():
                if self.split is not None:  # the module's own training_step per stage
                    result = self.split.train_step(
                        self.engine, module, args, kwargs, loss_weights=weights
                    )
                else:
                    if self.activation_budget is not None and self.recompute_plan is None:
                        self.recompute_plan = plan_auto(self.engine, batch, self.activation_budget)
                    result = self.engine.train_step(batch, loss_weights=weights)
        finally:
            self.loss_scale.value = 1
        self.record = result.record
        if last_micro_step:
            self.grad_sync.wait()
            self.tied_sync.all_reduce_grads(skip=self.grad_sync.tied_handled)
        loss = dp_mean(result.loss.detach(), self.layout, self.collectives) * accumulate
        # Backward already ran inside the schedule; fire the hooks users expect around it.
        precision_plugin.pre_backward(loss, module)
        precision_plugin.post_backward(loss, module)
        if self.split is not None:
            self.split.replay_logs(self.layout, module)  # training_step's logs
            self.split.set_log_weights(None, None)
        else:
            module.pipeline_log_train_loss(loss)
        return loss

    def _loss_weights(
        self, module: Any, batch: Any, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> list[float] | None:
        """The engine's per-microbatch loss weights under token normalization (``None``: by
        samples); on the ``split=`` path also how the captured logs are weighted."""
        counts = self.loss_counts
        if counts is None or not counts.active:
            return None
        rest = tuple(args[1:])
        extra = {k: v for k, v in kwargs.items() if k != "batch"}
        split = self.split.split if self.split is not None else None
        counter = counts.counter(module, split, lambda mb: module.training_step(mb, *rest, **extra))
        device = self.engine.device
        weights = counts.step_weights(
            batch, self.engine.schedule.microbatches, counter, self.layout, self.collectives, device
        )
        if self.split is not None and weights is not None:
            layout, collectives = self.layout, self.collectives
            self.split.set_log_weights(
                counter, lambda values: combine_over_dp(values, layout, collectives, device)
            )
        return weights


def dp_mean(value: Tensor, layout: RankLayout, collectives: Collectives) -> Tensor:
    """``value`` averaged over the data-parallel replicas (each saw a different shard)."""
    topo = layout.need_topology()
    if topo.dp == 1:
        return value
    group = layout.need_groups().dp_group
    value = collectives.all_reduce(value.clone(), group=group, what="the step loss")
    return value / topo.dp


def clip_grad_by_global_norm(
    params: Sequence[nn.Parameter],
    max_norm: float,
    groups: ProcessGroups,
    tied_sync: TiedParameterSync,
) -> Tensor:
    """Scale gradients so the norm over the WHOLE model (every stage) is at most ``max_norm``.

    Tied copies count once (on their owner), replicas are not summed twice. Returns the
    norm before clipping. ``gradient_clip_val`` gets here via
    :mod:`lightning_pp.strategy.precision`.
    """
    skip = tied_sync.non_owner_params()
    return clip_by_global_norm(params, max_norm, groups.pp_group, skip=skip)
