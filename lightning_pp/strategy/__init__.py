"""Strategy: WHEN Lightning calls it. ``PipelineStrategy`` and the model-author API.

- :mod:`.pipeline_strategy`: :class:`PipelineStrategy`, glue only (which hook does what);
- :mod:`.process_group`: launching, the default process group, watched collectives;
- :mod:`.model`: the model-author API (:class:`PipelineLayers`, :class:`PipelineMixin`);
- :mod:`.module_rules`: what a LightningModule must provide to be cut;
- building: :mod:`.stage_build` (a module's ``PipelineLayers``), :mod:`.split_build`
  (``split=``: an unmodified model), :mod:`.engine_build` (the engine from the settings);
- the steps: :mod:`.train_step`, :mod:`.eval_step`, :mod:`.stage_logging` (``self.log`` from
  one stage), :mod:`.precision` (global-norm clipping), :mod:`.model_summary`;
  :mod:`.collectives` (what the steps need of the process group).

Each collaborator receives the objects it needs (the rank's
:class:`~lightning_pp.layout.rank_layout.RankLayout`, the engine, the module, the collectives),
never the strategy.

May import: everything below it (:mod:`lightning_pp.schedules`, :mod:`lightning_pp.layout`,
:mod:`lightning_pp.runtime`, :mod:`lightning_pp.autosplit`, :mod:`lightning_pp.planner`,
:mod:`lightning_pp._lightning_compat`, :mod:`lightning_pp.checkpoint`). Importing this package
registers ``strategy="pipeline"`` in Lightning's ``StrategyRegistry``.

Example::

    from lightning_pp.strategy import PipelineStrategy

    trainer = L.Trainer(devices=4, strategy=PipelineStrategy(pp=4, microbatches=8))
"""

from .model import PipelineLayers, PipelineMixin, select_layers
from .pipeline_strategy import PipelineStrategy

__all__ = ["PipelineLayers", "PipelineMixin", "PipelineStrategy", "select_layers"]
