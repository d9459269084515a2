"""What a LightningModule must provide for :class:`~lightning_pp.strategy.PipelineStrategy` to
cut it: the pipeline hooks, layers built where the strategy expects, no parameter outside them,
no gradient scaler; and which of its own steps the strategy never calls.

The shape rules (sizes, world, partition, batch) live in :mod:`lightning_pp.layout.rules`;
these are the rules that need the module, and so Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..layout.rules import PreflightError

_HOOKS = ("pipeline_layers", "pipeline_input", "pipeline_loss")


def check_module(module: Any, *, configured: bool = True) -> None:
    """The module can be cut: pipeline hooks implemented, layers built where the strategy expects.

    ``configured=False`` (before ``configure_model`` ran): the module must either define
    ``configure_model`` (the place to build its
    :class:`~lightning_pp.strategy.model.PipelineLayers`, so
    each rank materialises only its own layers) or already hold them.
    ``configured=True``: ``pipeline_layers()`` must return a non-empty ``PipelineLayers``.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from ..strategy.model import PipelineLayers, PipelineMixin

    name = type(module).__name__
    missing = [h for h in _HOOKS if not callable(getattr(module, h, None))]
    if missing:
        raise PreflightError(
            f"{name} lacks {', '.join(h + '()' for h in missing)}: the pipeline cannot cut it. "
            f"Subclass lightning_pp.PipelineMixin, build self.layers = PipelineLayers([...]) in "
            f"configure_model(), and implement pipeline_input(batch) and "
            f"pipeline_loss(output, batch)"
        )
    for hook in ("pipeline_input", "pipeline_loss"):
        if not is_overridden(hook, module, parent=PipelineMixin):
            args = "batch" if hook == "pipeline_input" else "output, batch"
            raise PreflightError(f"{name} must implement {hook}({args}) for the pipeline")
    if not configured:
        layers = getattr(module, "layers", None)
        own_configure = is_overridden("configure_model", module, parent=pl.LightningModule)
        custom_layers = is_overridden("pipeline_layers", module, parent=PipelineMixin)
        if not own_configure and not isinstance(layers, PipelineLayers) and not custom_layers:
            raise PreflightError(
                f"{name} defines no configure_model() and holds no PipelineLayers: the strategy "
                f"builds each rank's layers inside configure_model(); add\n"
                f"    def configure_model(self):\n"
                f"        if getattr(self, 'layers', None) is not None:\n"
                f"            return  # built already: Lightning calls this in every fit/validate\n"
                f"        self.layers = PipelineLayers([lambda: Block() for _ in range(n)])"
            )
        return
    try:
        layers = module.pipeline_layers()
    except (TypeError, AttributeError) as e:
        raise PreflightError(f"{name} has no pipeline layers after configure_model(): {e}") from e
    if not isinstance(layers, PipelineLayers):
        raise PreflightError(
            f"{name}.pipeline_layers() returned {type(layers).__name__}, not PipelineLayers"
        )
    if layers.num_layers == 0:  # pragma: no cover - PipelineLayers rejects 0 builders itself
        raise PreflightError(f"{name} has a PipelineLayers with no layers")


def check_pipeline_hooks(module: Any) -> None:
    """At the strategy's setup: the module has the hooks the explicit-layers path calls."""
    for hook in _HOOKS:
        if not callable(getattr(module, hook, None)):
            raise TypeError(
                f"{type(module).__name__} lacks {hook}(); subclass "
                f"lightning_pp.PipelineMixin, or pass PipelineStrategy(split=...)"
            )


def check_built_module(module: Any, layers: Any, precision_plugin: Any) -> None:
    """After ``configure_model``: every parameter lies in a layer (the pipeline trains only
    those), and no gradient scaler is in use."""
    inside = {id(p) for p in layers.parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in inside]
    if outside:
        raise ValueError(
            f"parameters outside the PipelineLayers would never be trained by the pipeline: "
            f"{outside[:5]}{' ...' if len(outside) > 5 else ''}; move them into a layer"
        )
    check_no_scaler(precision_plugin)


def check_no_scaler(precision_plugin: Any) -> None:
    """A gradient scaler (``precision='16-mixed'``) would need its inf checks and loss scale
    agreed across stages; the strategy does not do that, so it refuses one."""
    if getattr(precision_plugin, "scaler", None) is not None:
        raise ValueError(
            "PipelineStrategy does not support a gradient scaler (precision='16-mixed'); "
            "use precision='bf16-mixed' or '32-true'"
        )


#: LightningModule steps the strategy never calls (it runs the pipeline itself), and what it calls
#: instead. A module's own override of one of them is silently skipped under the strategy.
STRATEGY_STEPS = {
    "training_step": "pipeline_loss(output, batch) for the loss (and pipeline_log_train_loss(loss)"
    " to log it)",
    "validation_step": "pipeline_eval_step(output, batch, split) for metrics (what it returns or"
    " self.log()s reaches every rank)",
    "test_step": "pipeline_eval_step(output, batch, split) (split='test')",
    "predict_step": "nothing: trainer.predict returns the last layer's output per batch; "
    "post-process the returned predictions",
}


def ignored_step_overrides(module: Any) -> list[str]:
    """The step methods in :data:`STRATEGY_STEPS` that ``module`` defines itself.

    :class:`~lightning_pp.strategy.model.PipelineMixin` supplies these steps for the plain path;
    only a
    module's own override (of the mixin's, or of Lightning's when the module does not use the
    mixin) is reported. A torchmetrics ``Metric`` updated in such a ``validation_step`` would stay
    at its initial value under the strategy, without any error.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from ..strategy.model import PipelineMixin

    parent = PipelineMixin if isinstance(module, PipelineMixin) else pl.LightningModule
    return [step for step in STRATEGY_STEPS if is_overridden(step, module, parent=parent)]


def ignored_steps_message(module: Any, steps: Sequence[str]) -> str:
    """The warning for :func:`ignored_step_overrides`: each step and the hook to use instead."""
    lines = [f"  {step}: use {STRATEGY_STEPS[step]}" for step in steps]
    return (
        f"{type(module).__name__} overrides {', '.join(steps)}, which PipelineStrategy does not "
        f"call (it runs the pipeline and calls the pipeline_* hooks instead); code there, e.g. a "
        f"torchmetrics Metric update, never runs under the strategy:\n" + "\n".join(lines)
    )
