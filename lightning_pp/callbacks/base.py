"""What the three pipeline callbacks share: when to measure, where the record is, how to log."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from .._lightning_compat import logging_step
from ..runtime.records import StepRecord
from .gather import GatheredStep, gather_cached


class PipelineCallback(Callback):
    """Base class: reads ``trainer.strategy.last_record`` after each training batch.

    ``every_n_steps``: measure every n-th training batch; ``None`` follows the Trainer's
    ``log_every_n_steps`` (the batches whose metrics Lightning writes to the logger). The
    decision depends on the step counter only, so every rank takes part in the same gathers.
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(
                f"every_n_steps must be a positive integer or None, got {every_n_steps!r}"
            )
        self.every_n_steps = every_n_steps

    # -- when -----------------------------------------------------------------------------
    @staticmethod
    def _step(trainer: pl.Trainer) -> int:
        """Lightning's logging step: optimizer steps taken before this batch's."""
        return logging_step(trainer)

    def _due(self, trainer: pl.Trainer) -> bool:
        n = self.every_n_steps if self.every_n_steps is not None else trainer.log_every_n_steps
        return n > 0 and (self._step(trainer) + 1) % n == 0

    # -- what -----------------------------------------------------------------------------
    @staticmethod
    def _record(trainer: pl.Trainer) -> StepRecord | None:
        """This rank's record of the training step that just ran, or ``None`` (not a pipeline)."""
        record = getattr(trainer.strategy, "last_record", None)
        if not isinstance(record, StepRecord):
            return None
        actions = record.schedule.ranks[record.pp_rank]
        if not any(a.op.is_backward for a in actions) or len(record.events) != len(actions):
            return None  # an evaluation record, or an incomplete step
        return record

    def _gather(self, trainer: pl.Trainer) -> GatheredStep | None:
        record = self._record(trainer)
        return gather_cached(record) if record is not None else None

    # -- how ------------------------------------------------------------------------------
    @staticmethod
    def _log(
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        metrics: dict[str, float],
        prog_bar: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        """Send ``metrics`` (identical on every rank: computed from the gathered records) to
        the loggers now, and to ``callback_metrics``/the progress bar through ``pl_module.log``.

        The loggers are called directly, at Lightning's step, so the values are written when
        this callback measured, whatever ``log_every_n_steps`` says; ``pl_module.log`` is used
        with ``logger=False`` so they are not written twice. Loggers write on global rank 0 only
        (their ``log_metrics`` are rank-zero-only); no ``sync_dist`` is needed since every rank
        holds the same numbers.
        """
        step = PipelineCallback._step(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        for key, value in metrics.items():
            pl_module.log(
                key,
                torch.tensor(float(value), dtype=torch.float64),
                on_step=True,
                on_epoch=False,
                prog_bar=key in prog_bar,
                logger=False,
                sync_dist=False,
                batch_size=1,
            )


def is_global_zero(trainer: Any) -> bool:
    return bool(getattr(trainer, "is_global_zero", True))
