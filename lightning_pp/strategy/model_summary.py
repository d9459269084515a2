"""The model summary of the whole pipeline, not of one stage.

Lightning's ``ModelSummary`` (or ``RichModelSummary``) callback summarises the module of the
process it runs in and prints on global rank 0. Under the pipeline every rank holds one stage's
layers, so the table showed stage 0's rows and counts only (about half of a two-stage model).
:func:`with_pipeline_summary` gives such a callback an ``on_fit_start`` that summarises each
stage, gathers the summaries over the pipeline group and prints one table on global rank 0:

* one row per module and stage, with a ``Stage`` column (the virtual stages the rank holds);
* totals for the whole model, a tied weight's copies on other stages counted once (as in the
  unpipelined model, where it is one tensor).

Printing stays the callback's own (``summarize``: a plain log or a rich table), and so do its
``max_depth`` and options.

Example::

    callback = with_pipeline_summary(ModelSummary(max_depth=2), gather, StageInfo("1", 0))
    # callback.on_fit_start(trainer, module) gathers (a collective) and prints on rank 0
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelSummary
from lightning.pytorch.utilities.model_summary import get_human_readable_count, summarize
from typing_extensions import override

from .. import _lightning_compat as compat

if TYPE_CHECKING:
    from ..layout.rank_layout import RankLayout
    from ..runtime.grad_sync import TiedParameterSync
    from .collectives import Collectives

__all__ = [
    "PipelineSummary",
    "StageInfo",
    "StageSummary",
    "merge_summaries",
    "restore_summaries",
    "stage_summary",
    "use_pipeline_summaries",
    "use_stage_summaries",
    "with_pipeline_summary",
]


@dataclass(frozen=True)
class StageInfo:
    """What the summary says about this rank: ``label`` names the virtual stages it holds
    (``"0"``, or ``"0,2"`` interleaved); ``tied_copies`` is the number of parameter elements
    that are copies of a tied weight owned by another rank (counted there)."""

    label: str
    tied_copies: int


@dataclass(frozen=True)
class StageSummary:
    """One rank's summary rows and totals (picklable: it travels to global rank 0)."""

    label: str
    names: list[str]
    types: list[str]
    params: list[int]
    modes: list[bool]
    total: int
    trainable: int
    tied_copies: int
    model_size: float
    train_modules: int
    eval_modules: int
    flops: int


def stage_summary(module: pl.LightningModule, max_depth: int, info: StageInfo) -> StageSummary:
    """Summarise this rank's part of ``module`` (Lightning's ``summarize``)."""
    s = summarize(module, max_depth=max_depth)
    modes = s.total_training_modes
    return StageSummary(
        label=info.label,
        names=list(s.layer_names),
        types=list(s.layer_types),
        params=list(s.param_nums),
        modes=list(s.training_modes),
        total=s.total_parameters,
        trainable=s.trainable_parameters,
        tied_copies=info.tied_copies,
        model_size=s.model_size,
        train_modules=modes["train"],
        eval_modules=modes["eval"],
        flops=s.total_flops,
    )


def merge_summaries(stages: list[StageSummary]) -> tuple[Any, ...]:
    """The arguments of ``ModelSummary.summarize`` for the whole pipeline, stages in order:
    ``(columns, total, trainable, model_size, training_modes, flops)``."""
    rows = [(s, i) for s in stages for i in range(len(s.names))]
    columns = [
        (" ", [str(n) for n in range(len(rows))]),
        ("Name", [s.names[i] for s, i in rows]),
        ("Stage", [s.label for s, _ in rows]),
        ("Type", [s.types[i] for s, i in rows]),
        ("Params", [get_human_readable_count(s.params[i]) for s, i in rows]),
        ("Mode", ["train" if s.modes[i] else "eval" for s, i in rows]),
    ]
    tied = sum(s.tied_copies for s in stages)
    total = sum(s.total for s in stages) - tied
    trainable = sum(s.trainable for s in stages) - tied
    # Lightning's size is parameters x bytes per parameter; drop the tied copies' share.
    size = sum(s.model_size * (s.total - s.tied_copies) / s.total for s in stages if s.total)
    modes = {
        "train": sum(s.train_modules for s in stages),
        "eval": sum(s.eval_modules for s in stages),
    }
    return columns, total, trainable, size, modes, sum(s.flops for s in stages)


class PipelineSummary(ModelSummary):
    """Placed before a summary callback's class by :func:`with_pipeline_summary`.

    ``gather`` is a collective over the pipeline group returning every stage's summary in stage
    order (it runs on every rank: ``on_fit_start`` runs on every rank); ``info`` describes this
    rank; ``original`` is the callback this one stands for.
    """

    gather: Callable[[StageSummary], list[StageSummary]]
    info: StageInfo
    original: ModelSummary

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        max_depth, options = compat.model_summary_settings(self)
        if not max_depth:
            return
        stages = self.gather(stage_summary(pl_module, max_depth, self.info))
        if trainer.is_global_zero:
            columns, total, trainable, size, modes, flops = merge_summaries(stages)
            self.summarize(columns, total, trainable, size, modes, total_flops=flops, **options)


@functools.cache
def _summary_class(base: type[ModelSummary]) -> type[ModelSummary]:
    return type(f"Pipeline{base.__name__}", (PipelineSummary, base), {})


def with_pipeline_summary(
    callback: ModelSummary,
    gather: Callable[[StageSummary], list[StageSummary]],
    info: StageInfo,
) -> ModelSummary:
    """A copy of ``callback`` (an instance of a subclass of its class) that summarises the
    whole pipeline; ``callback`` itself is not modified."""
    base = callback.original if isinstance(callback, PipelineSummary) else callback
    wrapped = object.__new__(_summary_class(type(base)))
    wrapped.__dict__.update(vars(base))
    wrapped.gather, wrapped.info, wrapped.original = gather, info, base
    return wrapped


def use_pipeline_summaries(
    callbacks: list[Callback],
    gather: Callable[[StageSummary], list[StageSummary]],
    info: StageInfo,
) -> None:
    """Replace, in place, every model summary callback of ``callbacks`` by its pipeline copy."""
    for i, callback in enumerate(callbacks):
        if isinstance(callback, ModelSummary):
            callbacks[i] = with_pipeline_summary(callback, gather, info)


def use_stage_summaries(
    callbacks: list[Callback],
    layout: RankLayout,
    module: Any,
    tied_sync: TiedParameterSync,
    collectives: Collectives,
) -> None:
    """:func:`use_pipeline_summaries` for this rank (at fit start): its line names its virtual
    stages and the size of its tied copies; the summaries are gathered over its pipeline
    group."""
    plan, topo, groups = layout.need_plan(), layout.need_topology(), layout.need_groups()
    stages = plan.schedule.stages_of(topo.pp_rank)
    copies = tied_sync.non_owner_params()
    tied = sum(p.numel() for p in module.parameters() if id(p) in copies)

    def gather(obj: Any) -> list[Any]:
        # One watched broadcast per stage (runs once, at fit start): all_gather_object has no
        # async_op, so it could not honour the watchdog.
        what = "the model summary"
        ranks = [topo.global_rank(r) for r in range(topo.pp)]
        return [collectives.broadcast_object(obj, src, groups.pp_group, what) for src in ranks]

    use_pipeline_summaries(callbacks, gather, StageInfo(",".join(map(str, stages)), tied))


def restore_summaries(callbacks: list[Callback]) -> None:
    """Undo :func:`use_pipeline_summaries`: the user's callbacks are back in the list."""
    for i, callback in enumerate(callbacks):
        if isinstance(callback, PipelineSummary):
            callbacks[i] = callback.original
