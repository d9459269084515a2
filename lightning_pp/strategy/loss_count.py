"""``PipelineStrategy(loss_normalization=...)``: a loss counts what it counts.

The single-process loss over a global batch is what the pipelined run must reproduce
(docs/strategy.md, "Loss normalization"). A loss that means over samples combines microbatches
and replicas by sample count, as the engine always did. A loss that means over valid tokens
(a Hugging Face causal LM with padded, prompt-masked labels) must combine them by their valid
targets: each microbatch loss is scaled by ``count_i * dp / global_count``
(:mod:`lightning_pp.runtime.loss_weights`), the count all-reduced over the data-parallel
replicas at the start of the step, and the logged ``train_loss``/``val_loss`` are the same
token-weighted value over the global batch.

Where the count comes from (never guessed):

- the module's ``pipeline_loss_count(batch)`` hook (both APIs): the number of targets the loss of
  that (micro)batch averages over, or ``None``;
- ``split=`` only: the labels of the user's own model call, found by
  :func:`~lightning_pp.autosplit.labels.probe_labels` (a Hugging Face model with its causal-LM
  or masked-LM loss called with ``labels=``).

``loss_normalization``:

- ``"auto"`` (default): by valid targets when a count is found (the hook returns one, or the
  labels of a Hugging Face model call are detected), else by samples;
- ``"tokens"``: by valid targets; an error naming the hook to add if no count is found;
- ``"samples"``: by sample count (each microbatch's loss is a mean over its samples).

Example::

    counts = LossCounts("auto")
    counter = counts.counter(module, split="model.model.layers", hook=lambda mb: ...)
    weights = counts.step_weights(batch, 4, counter, layout, collectives, device)
    engine.train_step(batch, loss_weights=weights)   # None: by samples
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..autosplit.labels import probe_labels
from ..layout.rules import PreflightError
from ..runtime.loss_weights import global_count, token_weights
from ..runtime.microbatch import split_microbatches

if TYPE_CHECKING:
    from ..layout.rank_layout import RankLayout
    from .collectives import Collectives

__all__ = ["LOSS_NORMALIZATIONS", "LossCountError", "LossCounts", "Counter"]

log = logging.getLogger(__name__)

LOSS_NORMALIZATIONS = ("auto", "samples", "tokens")

#: one microbatch -> (count or None, where the count came from / why there is none)
Counter = Callable[[Any], tuple[int | None, str]]


class LossCountError(ValueError):
    """``loss_normalization="tokens"`` and no count of valid targets could be found."""


@contextlib.contextmanager
def _silenced(module: Any) -> Generator[None, None, None]:
    """``self.log`` does nothing while a probe runs the user's hook (the probe stops at the
    model call; what the hook logs belongs to the real run)."""
    had = "log" in module.__dict__
    saved = module.__dict__.get("log")
    module.log = lambda *args, **kwargs: None
    try:
        yield
    finally:
        if had:
            module.log = saved
        else:
            module.__dict__.pop("log", None)


class LossCounts:
    """The strategy's loss normalization (see the module docstring).

    ``source``: where the last step's counts came from (``"samples"`` when it weighted by
    samples), for the start log and the tests.
    """

    def __init__(self, mode: str = "auto") -> None:
        if mode not in LOSS_NORMALIZATIONS:
            raise PreflightError(
                f"loss_normalization={mode!r}: must be one of {LOSS_NORMALIZATIONS} ('auto': "
                f"by valid targets where the count is known, else by samples)",
                key="loss_normalization",
            )
        self.mode = mode
        self.source: str | None = "samples" if mode == "samples" else None
        self._said: set[str] = set()

    @property
    def active(self) -> bool:
        """Whether token weighting may apply (``"auto"`` or ``"tokens"``)."""
        return self.mode != "samples"

    def counter(
        self, module: Any, split: str | None, hook: Callable[[Any], Any] | None = None
    ) -> Counter:
        """Counts of one microbatch: the module's ``pipeline_loss_count``, else (``split=``)
        the labels of the model call in ``hook(microbatch)`` (the user's step)."""
        own = getattr(module, "pipeline_loss_count", None)

        def count(microbatch: Any) -> tuple[int | None, str]:
            if own is not None:
                c = own(microbatch)
                if c is not None:
                    return int(c.item() if isinstance(c, Tensor) else c), "pipeline_loss_count"
            if split is None or hook is None:
                return None, f"{type(module).__name__}.pipeline_loss_count() returns no count"
            with _silenced(module):
                probe = probe_labels(lambda: hook(microbatch), module, split)
            return probe.count, probe.reason

        return count

    def counts(self, microbatches: list[Any], counter: Counter) -> list[int] | None:
        """Every microbatch's count, or ``None`` (weight by samples). Raises
        :class:`LossCountError` under ``"tokens"`` when there is none, before any
        communication (every rank of a replica sees the same batch, so all raise alike)."""
        if not self.active:
            self.source = "samples"
            return None
        found = [counter(mb) for mb in microbatches]
        missing = [reason for c, reason in found if c is None]
        if missing:
            if self.mode == "tokens":
                raise LossCountError(
                    f"loss_normalization='tokens': no count of valid targets for the loss: "
                    f"{missing[0]}. Fix: define pipeline_loss_count(self, batch) on the "
                    f"LightningModule, returning the number of targets the loss of that batch "
                    f"averages over (e.g. int((batch['labels'][:, 1:] != -100).sum()) for a "
                    f"causal LM), or use loss_normalization='samples' for a mean over samples"
                )
            self._say(f"weighting microbatches by samples: {missing[0]}")
            self.source = "samples"
            return None
        self.source = found[0][1]
        self._say(f"weighting microbatches by valid targets ({self.source})")
        return [c for c, _ in found]  # type: ignore[misc]

    def step_weights(
        self,
        batch: Any,
        microbatches: int,
        counter: Counter,
        layout: RankLayout,
        collectives: Collectives,
        device: torch.device,
    ) -> list[float] | None:
        """The engine's ``loss_weights`` for this replica's ``batch``: ``count_i * dp /
        global_count`` with the count summed over the data-parallel replicas (one all-reduce),
        or ``None`` to weight by samples."""
        counts = self.counts(split_microbatches(batch, microbatches), counter)
        if counts is None:
            return None
        topo = layout.need_topology()
        total = global_count(counts, device)
        if topo.dp > 1:
            what = "the step's count of valid targets"
            collectives.all_reduce(total, group=layout.need_groups().dp_group, what=what)
        return token_weights(counts, round(float(total)), topo.dp)

    def _say(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            log.info(f"loss_normalization={self.mode!r}: {line}")


def combine_over_dp(
    values: dict[str, list[Any]],
    layout: RankLayout,
    collectives: Collectives,
    device: torch.device | str = "cpu",
) -> dict[str, list[Any]]:
    """Captured logs ``{name: [weighted sum, weight, args, kwargs]}`` summed over the
    data-parallel replicas, so each logged value is the mean over the GLOBAL batch's targets
    (the replicas' sums and counts added, then divided once). Every replica must log the same
    names (as ``sync_dist=True`` needs under DDP)."""
    topo = layout.need_topology()
    if topo.dp == 1 or not values:
        return values
    names = sorted(values)
    flat = torch.tensor(
        [float(x) for n in names for x in values[n][:2]], dtype=torch.float64, device=device
    )
    group = layout.need_groups().dp_group
    flat = collectives.all_reduce(flat, group=group, what="the logged values' token sums")
    out = {}
    for i, n in enumerate(names):
        out[n] = [float(flat[2 * i]), float(flat[2 * i + 1]), *values[n][2:]]
    return out
