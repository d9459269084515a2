"""Activation memory: what each rank holds for backward, against the schedule's in-flight bound."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from .analysis import MemoryStats, memory_stats
from .base import PipelineCallback
from .gather import register_extra, unregister_extra

_CUDA_KEY = "cuda_max_allocated"


def _cuda_peak() -> int | None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return None


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

    Example::

        trainer = L.Trainer(devices=4, strategy=PipelineStrategy(pp=4, microbatches=8),
                            callbacks=[ActivationMemoryMonitor(every_n_steps=10)])

    ``last_stats`` holds the latest :class:`MemoryStats` of every rank (index = global rank).
    """

    def __init__(self, every_n_steps: int | None = None, prog_bar: bool = False) -> None:
        super().__init__(every_n_steps)
        self.prog_bar = prog_bar
        self.last_stats: list[MemoryStats] = []
        self.last_cuda: list[int | None] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        register_extra(_CUDA_KEY, _cuda_peak)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        unregister_extra(_CUDA_KEY)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int
    ) -> None:
        due = self._due(trainer)
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None and hasattr(engine, "measure_memory"):
            engine.measure_memory = due
        if due and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()

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
        shown = {"pp/saved_bytes_max"} if self.prog_bar else set()
        self._log(trainer, pl_module, metrics, shown)
