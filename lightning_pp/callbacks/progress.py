"""How a run shows its progress, and how it ends: progress displays, a loss file, a final
validation.

* :class:`PipelineProgressBar`: Lightning's TQDM bar (for terminals) with ``tok/s`` and the
  pipeline bubble;
* :class:`PlainProgress`: plain lines for logs and pipes, at most one per logging interval (a
  redrawn bar written to a file is thousands of carriage-return frames);
* :class:`FinalValidation`: the run ends with a validation, whatever ``val_check_interval`` says;
* :class:`LossFile`: ``step,loss`` per optimizer step.

Both displays show ``tok/s`` (tokens, i.e. elements of the batch's first integer tensor or samples
when it has none, per second over the whole data-parallel world, over the last logging interval
of training batches) and ``pipeline bubble X% (simulated Y%)``: idle / compute summed over every
pipeline rank over the steps since the last measurement, next to the simulator's expectation
for the same steps, as logged by :class:`~lightning_pp.callbacks.summary.RunSummary`.

Example:
    >>> import lightning as L
    >>> trainer = L.Trainer(callbacks=[PipelineProgressBar(print_every=50)])  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ProgressBar, TQDMProgressBar
from typing_extensions import override

from .run_facts import (
    BUBBLE_EXPECTED_KEY,
    BUBBLE_KEY,
    BUBBLE_STEPS_KEY,
    batch_tokens,
    data_parallel_size,
)

__all__ = [
    "FinalValidation",
    "LossFile",
    "PipelineProgressBar",
    "PlainProgress",
    "Throughput",
    "batch_tokens",
    "data_parallel_size",
    "pipeline_bubble",
    "progress_items",
]


class Throughput:
    """Tokens per second over the last ``window`` training batches (validation excluded).

    Example:
        >>> t = Throughput(window=2)
        >>> t.add(0.0, 100); t.add(1.0, 100); t.add(2.0, 100)
        >>> t.rate()
        100.0
    """

    def __init__(self, window: int = 10) -> None:
        self.window = window
        self._marks: deque[tuple[float, int]] = deque(maxlen=window + 1)
        self._pending = 0

    def add(self, now: float, tokens: int) -> None:
        """A batch of ``tokens`` ended at ``now`` (the first mark only starts the clock)."""
        self._marks.append((now, tokens))

    def batch_start(self, now: float, tokens: int) -> None:
        """A training batch of ``tokens`` begins at ``now``: start the clock if it is not
        running (the first batch, or the first after a validation)."""
        self._pending = tokens
        if not self._marks:
            self.add(now, 0)

    def batch_end(self, now: float) -> None:
        """The batch begun by :meth:`batch_start` ended at ``now``."""
        self.add(now, self._pending)

    def restart(self) -> None:
        """Forget the clock (after validation: evaluation time is not training throughput)."""
        self._marks.clear()

    def rate(self) -> float | None:
        if len(self._marks) < 2:
            return None
        elapsed = self._marks[-1][0] - self._marks[0][0]
        tokens = sum(n for _, n in list(self._marks)[1:])
        return tokens / elapsed if elapsed > 0 else None


def pipeline_bubble(trainer: pl.Trainer) -> tuple[float, float] | None:
    """(measured, simulated) pipeline bubble of the last measurement window, or ``None``.

    Logged by :class:`~lightning_pp.callbacks.summary.RunSummary`: idle / compute over every
    pipeline rank
    and every step since the previous measurement, and the simulator's expectation for the same
    steps.
    """
    metrics = trainer.callback_metrics
    if BUBBLE_KEY not in metrics or BUBBLE_EXPECTED_KEY not in metrics:
        return None
    return float(metrics[BUBBLE_KEY]), float(metrics[BUBBLE_EXPECTED_KEY])


def progress_items(
    trainer: pl.Trainer, base: dict[str, Any], throughput: Throughput, validation: bool = True
) -> dict[str, str]:
    """The fields both progress displays show, formatted: logged progress-bar metrics (loss),
    ``tok/s`` over the window, and the pipeline bubble next to the simulator's expectation."""
    items = {
        k: _fmt(v)
        for k, v in base.items()
        if k != "v_num" and (validation or not k.startswith("val"))
    }
    rate = throughput.rate()
    if rate is not None:
        items["tok/s"] = f"{rate:,.0f}"
    bubble = pipeline_bubble(trainer)
    if bubble is not None:
        # The label says what the number is: not one rank's idle share, not one step.
        steps = trainer.callback_metrics.get(BUBBLE_STEPS_KEY)
        over = f", last {int(steps)} steps" if steps is not None else ""
        items["pipeline bubble"] = (
            f"{bubble[0]:.0%} vs simulated {bubble[1]:.0%} (idle/compute, all ranks{over})"
        )
    return items


def _fmt(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _log_interval(trainer: pl.Trainer) -> int:
    return max(int(trainer.log_every_n_steps or 1), 1)


class PipelineProgressBar(TQDMProgressBar):
    """TQDM bar (for terminals) showing loss, tokens/s and the pipeline bubble; prints a plain
    line every ``print_every`` steps.

    Args:
        refresh_rate: redraw the bar every this many batches.
        print_every: write a persistent ``step N loss ... tok/s ... bubble ...`` line every this
            many optimizer steps (0 disables; ``None``: the Trainer's ``log_every_n_steps``).

    The bubble shown is the *pipeline's*: idle / compute summed over every pipeline rank over
    the steps since the last measurement, next to the simulator's expectation for those steps
    (:func:`pipeline_bubble`; shown once :class:`~lightning_pp.callbacks.summary.RunSummary`
    measured).

    Example:
        >>> bar = PipelineProgressBar(refresh_rate=5, print_every=25)
        >>> bar.print_every
        25
    """

    def __init__(self, refresh_rate: int = 1, print_every: int | None = 20, **kwargs: Any) -> None:
        super().__init__(refresh_rate=refresh_rate, **kwargs)
        self.print_every = print_every
        self._throughput = Throughput()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        tokens = batch_tokens(batch) * data_parallel_size(trainer)
        self._throughput.batch_start(time.perf_counter(), tokens)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._throughput.batch_end(time.perf_counter())
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = trainer.global_step
        every = self.print_every if self.print_every is not None else _log_interval(trainer)
        if every and step % every == 0 and trainer.is_global_zero:
            self.train_progress_bar.write(self.line(trainer, pl_module))

    def line(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        """``step N/M  key value ...``: the plain progress line."""
        items = progress_items(trainer, super().get_metrics(trainer, pl_module), self._throughput)
        return _line(trainer, items)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        self._throughput.restart()

    @override
    def get_metrics(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> dict[str, int | str | float | dict[str, float]]:
        return dict(
            progress_items(trainer, super().get_metrics(trainer, pl_module), self._throughput)
        )


def _line(trainer: pl.Trainer, items: dict[str, str]) -> str:
    total = trainer.max_steps if trainer.max_steps > 0 else "?"
    text = "  ".join(f"{k} {v}" for k, v in items.items())
    return f"step {trainer.global_step}/{total}  {text}"


class PlainProgress(ProgressBar):
    """Progress for logs and pipes: plain lines, at most one per logging interval.

    A redrawn bar written to a file is thousands of carriage-return frames. This prints, on
    global rank 0, one ``step N/M  train_loss ...  tok/s ...  pipeline bubble ...`` line every
    ``log_every_n_steps`` optimizer steps (and at the last step), and one line after each
    validation. ``lightning-pp fit`` uses it when stdout is not a terminal.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[PlainProgress()])  # doctest: +SKIP
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._throughput = Throughput()
        self._t_start: float | None = None
        self._printed_step = -1

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @property
    @override
    def is_enabled(self) -> bool:
        return self._enabled

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t_start = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        tokens = batch_tokens(batch) * data_parallel_size(trainer)
        self._throughput.batch_start(time.perf_counter(), tokens)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._throughput.batch_end(time.perf_counter())
        step = trainer.global_step
        last = 0 < trainer.max_steps <= step
        if not self._enabled or step == self._printed_step:
            return
        if step % _log_interval(trainer) and not last:
            return
        self._printed_step = step
        # Validation metrics have their own line, printed after each validation.
        metrics = self.get_metrics(trainer, pl_module)
        items = progress_items(trainer, metrics, self._throughput, validation=False)
        if self._t_start is not None:
            items["elapsed"] = _clock(time.perf_counter() - self._t_start)
        print(_line(trainer, items), flush=True)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._throughput.restart()
        if not self._enabled or trainer.sanity_checking:
            return
        metrics = {
            k: _fmt(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith(("val_", "val/")) or k in ("val_loss",)
        }
        text = "  ".join(f"{k} {v}" for k, v in metrics.items())
        print(f"validation at step {trainer.global_step}: {text}", flush=True)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


class FinalValidation(Callback):
    """Make the run end with a validation, whatever ``val_check_interval`` says.

    With ``val_check_interval: 100`` and ``max_steps: 300`` over epochs of 231 batches the
    validations fall on steps 100 and 200 of each epoch, and the run would end showing a loss
    measured 100 steps earlier. On the batch that completes the run (``max_steps`` reached, or
    the last batch of the last epoch) this sets ``trainer.should_stop``, which Lightning's
    training loop answers with a validation run (its early-stopping rule). When that step
    validates anyway, it validates once.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(max_steps=300, val_check_interval=100,
        ...                     callbacks=[FinalValidation()])  # doctest: +SKIP
    """

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not trainer.enable_validation:
            return
        last_step = 0 < trainer.max_steps <= trainer.global_step
        max_epochs = trainer.max_epochs if trainer.max_epochs is not None else -1
        batches = trainer.num_training_batches
        last_epoch_batch = (
            max_epochs > 0
            and trainer.current_epoch + 1 >= max_epochs
            and isinstance(batches, int)
            and batch_idx + 1 >= batches
        )
        if last_step or last_epoch_batch:
            trainer.should_stop = True


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
