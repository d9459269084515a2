"""What the progress display and the end-of-run summary both read of a run: the keys the summary
logs its window bubble under, the tokens in a batch and the data-parallel size.

Kept below both (:mod:`.progress` shows what :mod:`.summary` logs), so neither imports the other.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

__all__ = [
    "BUBBLE_EXPECTED_KEY",
    "BUBBLE_KEY",
    "BUBBLE_STEPS_KEY",
    "batch_tokens",
    "data_parallel_size",
]


#: Logged at every measurement: the pipeline bubble over the window of steps since the last one,
#: and the simulator's expectation for the same steps (see :func:`window_bubble`).
BUBBLE_KEY = "pp/bubble_window"


BUBBLE_EXPECTED_KEY = "pp/bubble_window_expected"


BUBBLE_STEPS_KEY = "pp/bubble_window_steps"


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


def data_parallel_size(trainer: pl.Trainer) -> int:
    """Data-parallel replicas of the run (tokens per step = batch tokens x this)."""
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
