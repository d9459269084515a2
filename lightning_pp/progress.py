"""Progress bar for pipelined runs (loss, tokens/s, measured bubble) and a per-step loss file.

Lightning's :class:`~lightning.pytorch.callbacks.TQDMProgressBar` with three more fields:

* ``tok/s``: tokens (elements of the batch's first integer tensor, or samples when the batch has
  none) per second over the whole data-parallel world, measured between consecutive batch ends;
* ``bubble``: this rank's idle share of the last step, ``1 - compute / step time``, from the
  engine's :class:`~lightning_pp.records.StepRecord` when the strategy exposes one (shown only
  then);
* every ``print_every`` steps a plain line is written above the bar, so the loss curve stays in
  logs and terminals that do not redraw.

Example:
    >>> import lightning as L
    >>> trainer = L.Trainer(callbacks=[PipelineProgressBar(print_every=50)])  # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar

__all__ = ["LossFile", "PipelineProgressBar", "batch_tokens", "last_step_bubble"]


def batch_tokens(batch: Any) -> int:
    """Tokens in one batch: elements of its first integer tensor, else its first dimension."""
    tensors: list[torch.Tensor] = []

    def collect(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                collect(o)
        elif isinstance(obj, dict):
            for o in obj.values():
                collect(o)

    collect(batch)
    for t in tensors:
        if not t.is_floating_point():
            return t.numel()
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 0


def _step_record(strategy: Any) -> Any:
    # The strategy owns the engine; we look for its record by the names it may use rather than
    # reaching into the engine (callbacks read records, they do not drive the engine).
    for name in ("last_step_record", "step_record", "last_record"):
        record = getattr(strategy, name, None)
        if record is not None and not callable(record):
            return record
    return None


def last_step_bubble(strategy: Any) -> float | None:
    """This rank's idle share of its last training step, or ``None`` if not measured."""
    record = _step_record(strategy)
    if record is None:
        return None
    duration = getattr(record, "duration", 0.0)
    events = getattr(record, "events", None)
    if not events or duration <= 0:
        return None
    compute = sum(e.compute for e in events)
    return max(0.0, 1.0 - compute / duration)


def _data_parallel_size(trainer: pl.Trainer) -> int:
    strategy = trainer.strategy
    for name in ("dp_size", "data_parallel_size", "dp"):
        value = getattr(strategy, name, None)
        if isinstance(value, int) and value > 0:
            return value
    topo = getattr(strategy, "topology", None)
    if topo is not None and isinstance(getattr(topo, "dp", None), int):
        return topo.dp
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", trainer.world_size) or 1)


class PipelineProgressBar(TQDMProgressBar):
    """TQDM bar showing loss, tokens/s and the bubble; prints a line every ``print_every`` steps.

    Args:
        refresh_rate: redraw the bar every this many batches.
        print_every: write a persistent ``step N loss ... tok/s ... bubble ...`` line every this
            many optimizer steps (0 disables).

    Example:
        >>> bar = PipelineProgressBar(refresh_rate=5, print_every=25)
        >>> bar.print_every
        25
    """

    def __init__(self, refresh_rate: int = 1, print_every: int = 20, **kwargs: Any) -> None:
        super().__init__(refresh_rate=refresh_rate, **kwargs)
        self.print_every = print_every
        self._t_last: float | None = None
        self._tokens_per_s: float | None = None
        self._tokens = 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._tokens = batch_tokens(batch) * _data_parallel_size(trainer)
        if self._t_last is None:
            self._t_last = time.perf_counter()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        now = time.perf_counter()
        if self._t_last is not None and now > self._t_last:
            self._tokens_per_s = self._tokens / (now - self._t_last)
        self._t_last = now
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = trainer.global_step
        if self.print_every and step % self.print_every == 0 and trainer.is_global_zero:
            items = self.get_metrics(trainer, pl_module)
            items.pop("v_num", None)
            text = "  ".join(f"{k} {self._fmt(v)}" for k, v in items.items())
            total = trainer.max_steps if trainer.max_steps > 0 else "?"
            self.train_progress_bar.write(f"step {step}/{total}  {text}")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        # Evaluation time is not training throughput: restart the clock.
        self._t_last = None

    @staticmethod
    def _fmt(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    def get_metrics(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> dict[str, int | str | float | dict[str, float]]:
        items = super().get_metrics(trainer, pl_module)
        if self._tokens_per_s is not None:
            items["tok/s"] = f"{self._tokens_per_s:,.0f}"
        bubble = last_step_bubble(trainer.strategy)
        if bubble is not None:
            items["bubble"] = f"{100 * bubble:.0f}%"
        return items


class LossFile(Callback):
    """Append ``step,loss`` to a CSV file after every optimizer step (global rank 0 only).

    The loss is the one the module logs as its training loss (``train_loss_name``, default
    ``train_loss``), which under the pipeline strategy is the whole pipeline's loss; else the
    ``loss`` the training step returned. With gradient accumulation, the row is written for the
    batch that completed the step.

    Example:
        >>> cb = LossFile("losses.csv")
        >>> cb.path
        'losses.csv'
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._last_step: int | None = None

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step == 0 or step == self._last_step:
            return
        name = getattr(pl_module, "train_loss_name", "train_loss")
        loss = trainer.callback_metrics.get(name)
        if loss is None and isinstance(outputs, dict):
            loss = outputs.get("loss")
        if loss is None:
            return
        first = self._last_step is None
        with open(self.path, "w" if first else "a") as f:
            if first:
                f.write("step,loss\n")
            f.write(f"{step},{float(loss)!r}\n")
        self._last_step = step
