"""Building this rank's stages from a module's :class:`~lightning_pp.strategy.model.
PipelineLayers`.

:class:`LayerBuild` is the explicit-layers path of
:class:`~lightning_pp.strategy.PipelineStrategy`, as
:class:`~lightning_pp.strategy.split_build.SplitPipeline` is the ``split=`` path; the strategy
calls either at the same points, with the rank's
:class:`~lightning_pp.layout.rank_layout.RankLayout` (plan, grid, placement):

- ``build_context(layout, module, device)``: around Lightning's ``configure_model`` call. The
  layer count becomes known when the module constructs its ``PipelineLayers``; the container then
  asks :meth:`LayerBuild.select` which layers to build, which cuts the model into stages (the
  plan's partition, written into the layout) and answers this rank's layers, so no rank
  materialises another's.
- ``stage_module(layout, module, precision_plugin, device)``: at setup. Layers built elsewhere
  (``__init__``) are cut down to this rank's; the module is checked (hooks, parameters outside
  the layers).
- ``chunks`` and ``tied_sync(layout)``: the engine's chunks, and the groups that keep tied
  copies on several ranks equal.

Example::

    build = LayerBuild(partition="uniform")
    with build.build_context(layout, module, device):
        module.configure_model()        # PipelineLayers built here hold this rank's layers only
    build.stage_module(layout, module, precision_plugin, device)
    chunks = build.chunks               # one PipelineChunk per local virtual stage
"""

from __future__ import annotations

import warnings
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from ..layout.partition import PipelineChunk
from ..layout.rank_layout import RankLayout
from ..runtime.grad_sync import TiedParameterSync, tied_parameter_sync
from .model import (
    PipelineLayers,
    partition_weights,
    rebuilt_layers_match,
    replace_submodule,
    select_layers,
)
from .module_rules import (
    check_built_module,
    check_module,
    check_pipeline_hooks,
    ignored_step_overrides,
    ignored_steps_message,
)

__all__ = ["LayerBuild", "built_layers", "keep_built_layers"]


class LayerBuild:
    """How :class:`~lightning_pp.strategy.PipelineStrategy` builds and stages a module written
    with :class:`~lightning_pp.strategy.model.PipelineLayers` (see the module docstring).
    ``partition``: the strategy's partition setting (a method name or per-stage counts)."""

    def __init__(self, partition: Any = "uniform") -> None:
        self.partition = partition
        self._layers: PipelineLayers | None = None
        self._ranges: list[range] = []
        self._warned_steps = False  # about the module's own *_step overrides, once

    @contextmanager
    def build_context(
        self, layout: RankLayout, module: Any, device: torch.device
    ) -> Generator[None, None, None]:
        """Around ``configure_model``: PipelineLayers built here hold this rank's layers only."""
        built = None
        if module is not None:
            check_module(module, configured=False)
            built = built_layers(module)
        with select_layers(lambda layers: self.select(layout, module, layers)):
            yield
        if built is not None:
            keep_built_layers(module, built)

    def select(self, layout: RankLayout, module: Any, layers: PipelineLayers) -> list[int]:
        """Partition the model once its layer count is known (sets the layout's plan and
        placement); return this rank's layers. Errors show the split that would result."""
        params, costs = partition_weights(module, layers, self.partition)
        layout.with_layers(layers.num_layers, layer_params=params, layer_costs=costs)
        return layout.local_layers()

    def stage_module(
        self, layout: RankLayout, module: Any, precision_plugin: Any, device: torch.device
    ) -> None:
        """At setup: this rank's layers only, and a module the pipeline can train."""
        check_pipeline_hooks(module)
        if not self._warned_steps:
            self._warned_steps = True
            steps = ignored_step_overrides(module)
            if steps:
                rank_zero_warn(ignored_steps_message(module, steps))
        layers = module.pipeline_layers()
        self._keep_local_layers(layout, module, layers)
        check_built_module(module, layers, precision_plugin)
        self._layers = layers
        self._ranges = layout.need_plan().stage_layers(layout.need_topology().pp_rank)

    @property
    def chunks(self) -> list[PipelineChunk]:
        """One chunk per local virtual stage, in local chunk order (after ``stage_module``)."""
        layers = self._layers
        assert layers is not None
        return [PipelineChunk([layers[i] for i in r], indices=r) for r in self._ranges]

    def tied_sync(self, layout: RankLayout) -> TiedParameterSync:
        """Collective: the groups of tied weights whose copies live on several pipeline ranks."""
        assert self._layers is not None
        return tied_parameter_sync(
            self._layers, layout.need_placement(), layout.need_topology(), layout.need_groups()
        )

    def _keep_local_layers(self, layout: RankLayout, module: Any, layers: PipelineLayers) -> None:
        """Layers built outside ``configure_model`` (every rank built all): drop the others."""
        if layout.placement is not None:
            if sorted(layers.built_indices) == sorted(layout.local_layers()):
                return  # built in configure_model, as intended
        else:
            warnings.warn(
                "PipelineLayers were built outside configure_model(): every rank built all "
                "layers and now drops the others. Build them in configure_model() so each "
                "rank materialises only its own.",
                stacklevel=4,
            )
        local = self.select(layout, module, layers)
        missing = set(local) - set(layers.built_indices)
        if missing:
            raise RuntimeError(
                f"rank {layout.need_topology().rank}: layers {sorted(missing)} of this stage "
                f"were not built"
            )
        layers.keep_only(local)


def built_layers(module: Any) -> PipelineLayers | None:
    """The module's PipelineLayers if it holds some built layers, else ``None``."""
    try:
        layers = module.pipeline_layers()
    except Exception:  # not built yet: pipeline_layers() says so by raising
        return None
    return layers if isinstance(layers, PipelineLayers) and layers.built_indices else None


def keep_built_layers(module: Any, built: PipelineLayers) -> None:
    """``configure_model`` without an "already built" guard builds fresh layers each time
    Lightning calls it (again in validate/test/predict after fit): keep the built ones.

    Kept rather than replaced because they hold what the user trained (or loaded), and
    ``trainer.validate()`` after ``fit`` must evaluate that model; a rebuild of the same
    architecture is never what a user means. A different architecture is used as built."""
    rebuilt = built_layers(module)
    if rebuilt is None or rebuilt is built:
        return
    name = type(module).__name__
    guard = "if getattr(self, 'layers', None) is not None: return"
    if rebuilt_layers_match(built, rebuilt) and replace_submodule(module, rebuilt, built):
        rank_zero_warn(
            f"{name}.configure_model() built new PipelineLayers although they were already "
            f"built (and possibly trained): Lightning calls configure_model() again in "
            f"validate/test/predict and in every fit. PipelineStrategy keeps the already "
            f"built layers and their weights, and drops the new ones (a plain Trainer would "
            f"use the freshly initialised ones). Start configure_model() with `{guard}`."
        )
    else:
        rank_zero_warn(
            f"{name}.configure_model() replaced its already built (possibly trained) "
            f"PipelineLayers by a different model; PipelineStrategy uses the new, freshly "
            f"initialised layers. If that is not intended, start configure_model() with "
            f"`{guard}`."
        )
