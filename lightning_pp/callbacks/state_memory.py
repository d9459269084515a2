"""Model-state memory per rank: parameters, gradients, master weights and optimizer state,
measured from the tensors (the sibling of :class:`~.memory.ActivationMemoryMonitor`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from ..runtime.state_bytes import state_bytes
from .base import PipelineCallback
from .gather import register_extra, unregister_extra

_KEY = "state_bytes"
_FIELDS = ("params", "grads", "master", "optimizer")


def _measure(trainer: pl.Trainer) -> dict[str, int]:
    module = trainer.lightning_module
    held = state_bytes(list(module.parameters()), list(trainer.optimizers))
    return {k: v for k, v in asdict(held).items() if k in _FIELDS}


class ModelStateMemoryMonitor(PipelineCallback):
    """Logs per rank the bytes of its model state after the optimizer step, measured from the
    tensors (:func:`~lightning_pp.runtime.state_bytes.state_bytes`: a DTensor counts its local
    shard, the distributed optimizer's rows and fp32 master copies are found by storage).

    Logged keys, per global rank ``r``: ``pp/rank{r}/param_bytes``, ``pp/rank{r}/grad_bytes``,
    ``pp/rank{r}/master_bytes``, ``pp/rank{r}/optimizer_bytes`` and ``pp/rank{r}/state_bytes``
    (their sum); ``pp/state_bytes_max``, the maximum over ranks. With ``zero=1`` the optimizer
    bytes drop to 1/dp; with ``zero=2`` the gradient bytes too; with ``fsdp=True`` the parameter
    bytes as well (docs/strategy.md "Scaling past one replica's memory").

    Example::

        trainer = L.Trainer(devices=4, strategy=PipelineStrategy(pp=2, zero=1),
                            callbacks=[ModelStateMemoryMonitor(every_n_steps=50)])

    ``last`` holds the latest measurement of every rank (index = global rank), a dict with the
    keys ``params``, ``grads``, ``master`` and ``optimizer``.
    """

    def __init__(self, every_n_steps: int | None = None, prog_bar: bool = False) -> None:
        super().__init__(every_n_steps)
        self.prog_bar = prog_bar
        self.last: list[dict[str, int]] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        register_extra(_KEY, lambda: _measure(trainer))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        unregister_extra(_KEY)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._due(trainer):
            return
        step = self._gather(trainer)
        if step is None:
            return
        self.last = [x[_KEY] for x in step.extras]
        metrics: dict[str, float] = {}
        for r, held in enumerate(self.last):
            for field, name in zip(_FIELDS, ("param", "grad", "master", "optimizer")):
                metrics[f"pp/rank{r}/{name}_bytes"] = held[field]
            metrics[f"pp/rank{r}/state_bytes"] = sum(held[f] for f in _FIELDS)
        metrics["pp/state_bytes_max"] = max(sum(h[f] for f in _FIELDS) for h in self.last)
        shown = {"pp/state_bytes_max"} if self.prog_bar else set()
        self._log(trainer, pl_module, metrics, shown)
