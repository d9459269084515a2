"""``self.log`` from hooks that run on one pipeline stage only.

Lightning's logging assumes every rank runs the same hooks: ``self.log(..., sync_dist=True)``
all-reduces across ranks at the call (or at the epoch's end), and monitors
(``ModelCheckpoint(monitor=...)``, ``EarlyStopping``) read ``callback_metrics`` on every rank.
Under :class:`~lightning_pp.strategy.PipelineStrategy` some user hooks run where one stage is:

* ``pipeline_eval_step`` runs once per batch on the rank holding the last stage. What it logs is
  **captured** there (:func:`capture_logs`), travels to every rank of the pipeline with the
  evaluation values, and is **replayed** on every rank (:func:`replay_logs`), in the same order,
  so every rank logs the same names and values and ``sync_dist`` collectives match up.
* ``pipeline_input`` (first stage) and ``pipeline_loss`` (last stage) run inside the schedule,
  once per microbatch, while the other ranks are busy with their own actions: a log there is
  **refused** (:func:`refuse_logs`) with an error naming the hook and where to log instead. Had
  it reached Lightning, the other ranks would miss the value, and ``sync_dist=True`` would hang
  them.

Example::

    with capture_logs(module, "pipeline_eval_step", rank=1) as calls:
        values = module.pipeline_eval_step(output, batch, "val")
    # ... calls travel to every rank with the values ...
    replay_logs(module, calls, dp_group, device)
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["LogCall", "capture_logs", "refuse_logs", "replay_logs"]

# Where the refusal sends the user: the hooks whose logs reach every rank.
_INSTEAD = (
    "log evaluation metrics from pipeline_eval_step(output, batch, split) (the strategy logs "
    "them on every rank) and training values from pipeline_log_train_loss(loss) (it runs on "
    "every rank with the batch loss)"
)


@dataclass(frozen=True)
class LogCall:
    """One ``self.log`` call: the name, the value (a CPU tensor or a number) and the other
    arguments by name (``prog_bar``, ``on_epoch``, ``sync_dist``, ``reduce_fx``, ...)."""

    name: str
    value: Any
    kwargs: dict[str, Any]


def _log_arguments(name: str, value: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's other arguments by name, as ``LightningModule.log`` would bind them."""
    import lightning.pytorch as pl

    bound = inspect.signature(pl.LightningModule.log).bind(None, name, value, *args, **kwargs)
    return {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}


@contextmanager
def _shadow_log(module: Any, log: Any) -> Iterator[None]:
    # An instance attribute wins over the class method for ``self.log(...)`` and for the
    # ``self.log`` calls inside ``log_dict``; the previous state comes back on exit.
    state = vars(module)
    had, previous = "log" in state, state.get("log")
    state["log"] = log
    try:
        yield
    finally:
        if had:
            state["log"] = previous
        else:
            del state["log"]


@contextmanager
def capture_logs(module: Any, hook: str, rank: int) -> Iterator[list[LogCall]]:
    """Record ``module.log``/``log_dict`` calls made inside the block instead of logging them.

    Values must be scalars (tensors or numbers): they are copied to the CPU so they can travel to
    the other ranks. Raises ``TypeError``/``ValueError`` naming ``rank`` and ``hook`` for what
    cannot be replayed elsewhere: a torchmetrics ``Metric`` object (its state lives on this rank
    only) and an explicit ``sync_dist_group`` (a process group of this rank).
    """
    calls: list[LogCall] = []

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        kw = _log_arguments(name, value, args, kwargs)
        if isinstance(value, Tensor):
            value = value.detach().cpu()
        elif not isinstance(value, (int, float, bool)):
            raise TypeError(
                f"rank {rank}: self.log({name!r}, <{type(value).__name__}>) in {hook}(): under "
                f"PipelineStrategy {hook} runs on the last stage only and its logs are replayed on "
                f"every rank, which needs a value, not an object living on this rank. Log the "
                f"batch value instead (e.g. self.log({name!r}, metric(preds, target)) or a "
                f"torchmetrics.functional result)"
            )
        if kw.get("sync_dist_group") is not None:
            raise ValueError(
                f"rank {rank}: self.log({name!r}, sync_dist_group=...) in {hook}(): under "
                f"PipelineStrategy the strategy chooses the group (the data-parallel replicas of "
                f"each stage); drop sync_dist_group"
            )
        calls.append(LogCall(name, value, kw))

    with _shadow_log(module, log):
        yield calls


def replay_logs(module: Any, calls: list[LogCall], dp_group: Any, device: torch.device) -> None:
    """``module.log`` every captured call, on this rank.

    Every rank of the pipeline replays the same calls with the same values. ``sync_dist=True``
    then reduces over ``dp_group`` (this stage's data-parallel replicas, which saw different
    data): over all ranks, a ``"sum"`` would count every value once per pipeline stage.
    """
    for call in calls:
        kwargs = dict(call.kwargs)
        if kwargs.get("sync_dist"):
            kwargs["sync_dist_group"] = dp_group
        value = call.value.to(device) if isinstance(call.value, Tensor) else call.value
        module.log(call.name, value, **kwargs)


@contextmanager
def refuse_logs(module: Any, hook: str, rank: int) -> Iterator[None]:
    """Inside the block, ``module.log`` raises an error naming ``rank``, ``hook`` and where to
    log instead (see the module docstring for why)."""

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"rank {rank}: self.log({name!r}) inside {hook}() is not supported under "
            f"PipelineStrategy: {hook} runs on one pipeline stage only, once per microbatch, so "
            f"the other ranks would never log {name!r} (and sync_dist=True would leave them "
            f"waiting). Instead, {_INSTEAD}"
        )

    with _shadow_log(module, log):
        yield
