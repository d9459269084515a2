"""Activation memory: what each rank holds for backward, against the schedule's in-flight bound."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from ..layout.recompute_spec import format_bytes
from .analysis import MemoryStats, RecomputeStats, memory_stats, recompute_labels
from .base import PipelineCallback, is_global_zero
from .gather import register_extra, unregister_extra

log = logging.getLogger("lightning_pp")

_CUDA_KEY = "cuda_max_allocated"
_RECOMPUTE_KEY = "recompute"


def _cuda_peak() -> int | None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return None


def _recompute_extra(trainer: pl.Trainer) -> dict[str, Any] | None:
    """This rank's recompute, sent along with its record: the labels of what its engine
    recomputes and, under ``recompute="auto"``, the plan's predicted peak for it. ``None`` when
    recompute is off (or not a pipeline run)."""
    strategy = trainer.strategy
    engine = getattr(strategy, "engine", None)
    targets = getattr(engine, "recompute_targets", None)
    if getattr(strategy, "recompute", None) is None or targets is None:
        return None
    plan = getattr(strategy, "recompute_plan", None)
    predicted = None if plan is None else int(plan.mine(trainer.global_rank).predicted_peak)
    return {"layers": recompute_labels(engine.chunks, targets), "predicted": predicted}


class ActivationMemoryMonitor(PipelineCallback):
    """Logs per rank the peak activation memory of a training step and its in-flight bound.

    Turns on the engine's ``measure_memory`` (autograd ``saved_tensors_hooks`` counting the
    storages saved for backward, parameters excluded) for the measured steps only, so the other
    steps pay nothing. On CUDA it also resets ``torch.cuda`` peak statistics before each
    measured step and reports ``max_memory_allocated``.

    Logged keys, per global rank ``r`` (bytes / counts): ``pp/rank{r}/saved_bytes`` (peak bytes
    saved for backward), ``pp/rank{r}/stash_bytes`` (peak stashed inputs/outputs),
    ``pp/rank{r}/send_bytes`` (peak held by pending sends), ``pp/rank{r}/inflight`` (peak
    microbatch-chunks between forward and backward), ``pp/rank{r}/inflight_bound`` (the
    schedule's theoretical peak), ``pp/rank{r}/cuda_max_allocated_bytes`` (CUDA only); and
    ``pp/saved_bytes_max`` / ``pp/inflight_max``, the maxima over ranks.

    With activation recompute on (``PipelineStrategy(recompute=...)``), also per rank:
    ``pp/rank{r}/recompute_layers`` (how many layers, or modules inside layers for a selective
    spec, it recomputes) and, under ``recompute="auto"``, ``pp/rank{r}/saved_bytes_predicted``
    (the plan's predicted peak of saved bytes for the rank,
    :attr:`~lightning_pp.planner.recompute.RankPlan.predicted_peak`) and
    ``pp/rank{r}/saved_bytes_ratio`` (measured ``saved_bytes`` / predicted). Which layers each
    rank recomputes is logged once per fit on global rank 0 (logger ``lightning_pp``, INFO).

    Example::

        trainer = L.Trainer(devices=4, strategy=PipelineStrategy(pp=4, microbatches=8),
                            callbacks=[ActivationMemoryMonitor(every_n_steps=10)])

    ``last_stats`` holds the latest :class:`MemoryStats` of every rank (index = global rank);
    ``last_recompute`` the latest :class:`RecomputeStats` of every rank when recompute is on
    (each with its ``layers``: original layer indices, ``"<index>.<module>"`` inside a layer),
    else ``[]``.
    """

    def __init__(self, every_n_steps: int | None = None, prog_bar: bool = False) -> None:
        super().__init__(every_n_steps)
        self.prog_bar = prog_bar
        self.last_stats: list[MemoryStats] = []
        self.last_cuda: list[int | None] = []
        self.last_recompute: list[RecomputeStats] = []
        self._recompute_logged = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        register_extra(_CUDA_KEY, _cuda_peak)
        register_extra(_RECOMPUTE_KEY, lambda: _recompute_extra(trainer))
        self._recompute_logged = False

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        unregister_extra(_CUDA_KEY)
        unregister_extra(_RECOMPUTE_KEY)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int
    ) -> None:
        due = self._due(trainer)
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None and hasattr(engine, "measure_memory"):
            engine.measure_memory = due
        if due and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if not self._due(trainer):
            return
        step = self._gather(trainer)
        if step is None:
            return
        self.last_stats = [memory_stats(r) for r in step.records]
        self.last_cuda = [x.get(_CUDA_KEY) for x in step.extras]
        metrics: dict[str, float] = {}
        for s, cuda in zip(self.last_stats, self.last_cuda):
            key = f"pp/rank{s.rank}"
            metrics[f"{key}/saved_bytes"] = s.saved_bytes
            metrics[f"{key}/stash_bytes"] = s.stash_bytes
            metrics[f"{key}/send_bytes"] = s.send_bytes
            metrics[f"{key}/inflight"] = s.inflight
            metrics[f"{key}/inflight_bound"] = s.inflight_bound
            if cuda is not None:
                metrics[f"{key}/cuda_max_allocated_bytes"] = cuda
        metrics["pp/saved_bytes_max"] = max(s.saved_bytes for s in self.last_stats)
        metrics["pp/inflight_max"] = max(s.inflight for s in self.last_stats)
        metrics.update(
            self._recompute_metrics(trainer, [x.get(_RECOMPUTE_KEY) for x in step.extras])
        )
        shown = {"pp/saved_bytes_max"} if self.prog_bar else set()
        self._log(trainer, pl_module, metrics, shown)

    def _recompute_metrics(
        self, trainer: pl.Trainer, extras: list[dict[str, Any] | None]
    ) -> dict[str, float]:
        """The recompute keys from every rank's extra (all ``None``: recompute is off)."""
        if all(x is None for x in extras):
            self.last_recompute = []
            return {}
        self.last_recompute = [
            RecomputeStats(
                rank=s.rank,
                pp_rank=s.pp_rank,
                layers=tuple(x["layers"]) if x else (),
                saved_bytes=s.saved_bytes,
                predicted_bytes=x["predicted"] if x else None,
            )
            for s, x in zip(self.last_stats, extras)
        ]
        metrics: dict[str, float] = {}
        for r in self.last_recompute:
            metrics[f"pp/rank{r.rank}/recompute_layers"] = len(r.layers)
            if r.predicted_bytes is not None:
                metrics[f"pp/rank{r.rank}/saved_bytes_predicted"] = r.predicted_bytes
            if r.ratio is not None:
                metrics[f"pp/rank{r.rank}/saved_bytes_ratio"] = r.ratio
        if not self._recompute_logged and is_global_zero(trainer):
            self._recompute_logged = True
            for line in describe_recompute(self.last_recompute):
                log.info(line)
        return metrics


def describe_recompute(stats: list[RecomputeStats]) -> list[str]:
    """Human lines: per rank what it recomputes and its measured (and predicted) saved peak.

    Example:
        >>> for line in describe_recompute([RecomputeStats(0, 0, (1, 2), 2048, 2000)]):
        ...     print(line)
        recomputed layers per rank (measured peak of saved activations):
          rank 0 (pp_rank 0): 2 [1, 2]; saved 2.00 KiB, predicted 1.95 KiB (ratio 1.024)
    """
    lines = ["recomputed layers per rank (measured peak of saved activations):"]
    for r in stats:
        what = ", ".join(str(x) for x in r.layers) or "none"
        line = f"  rank {r.rank} (pp_rank {r.pp_rank}): {len(r.layers)} [{what}]; saved "
        line += format_bytes(r.saved_bytes)
        if r.predicted_bytes is not None:
            line += f", predicted {format_bytes(r.predicted_bytes)}"
            if r.ratio is not None:
                line += f" (ratio {r.ratio:.3f})"
        lines.append(line)
    return lines
