"""Non-finite (NaN / inf) detection that names the stage where the values first appeared.

Opt-in (``PipelineEngine(check_finite=True)``, ``PipelineStrategy(check_finite=True)``). With it
on, the engine checks, on every rank and for every microbatch:

* each chunk's forward output before it is sent, and the loss on the last stage;
* each chunk's input gradient before it is sent upstream;
* every parameter gradient of a chunk once its last backward of the step has run.

Checks run where the values are produced, *before* they travel, so the first rank to see a
non-finite value is the one that produced it: it raises :class:`NonFiniteError` naming its rank,
virtual stage, chunk, microbatch and (for activations) the first layer whose output is non-finite,
and the abort channel stops every other rank.

Cost: one elementwise ``isfinite`` pass and a reduction over every activation and input gradient
crossing a stage (small next to the matmuls that produced them), one over all parameter
gradients per chunk and step, and one host synchronisation per check (on a GPU each check waits
for the kernels producing the value: leave it off for throughput runs, turn it on to debug a
divergence). Locating the layer re-runs the failing chunk layer by layer, under ``no_grad`` and
only after a failure; dropout draws different masks on that re-run, which can hide a layer that
overflowed only under its original mask.

Example:
    >>> import torch
    >>> describe_nonfinite([torch.tensor([1.0, float("nan"), float("inf")])])
    '1 NaN and 1 inf among 3 values in tensor 0 (shape (3,))'
    >>> describe_nonfinite([torch.ones(2)]) is None
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..schedules import Action

__all__ = [
    "FiniteChecker",
    "NonFiniteError",
    "all_finite",
    "describe_nonfinite",
    "first_nonfinite_layer",
    "nonfinite_param_grads",
]


class NonFiniteError(RuntimeError):
    """NaN or inf first produced on this rank; the message names the stage (and layer)."""


def _floating(tensors: Sequence[Any]) -> list[torch.Tensor]:
    return [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]


def all_finite(tensors: Sequence[Any]) -> bool:
    """True if every floating-point tensor in ``tensors`` is free of NaN and inf."""
    flags = [torch.isfinite(t).all() for t in _floating(tensors) if t.numel()]
    if not flags:
        return True
    return bool(torch.stack(flags).all().item())  # one host sync for the whole list


def describe_nonfinite(tensors: Sequence[Any]) -> str | None:
    """``'3 NaN and 0 inf among 48 values in tensor 0 (shape (4, 12))'`` or ``None``."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.numel():
            continue
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            nan = int(torch.isnan(t).sum())
            inf = int(bad.sum()) - nan
            return (
                f"{nan} NaN and {inf} inf among {t.numel()} values in tensor {i} "
                f"(shape {tuple(t.shape)})"
            )
    return None


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (tuple, list)) else [x]


@torch.no_grad()
def first_nonfinite_layer(chunk: nn.Module, x: Any) -> tuple[int, str] | None:
    """Re-run ``chunk`` (a :class:`~lightning_pp.layout.partition.PipelineChunk`) on ``x`` layer by
    layer; return ``(original layer index, layer class name)`` of the first non-finite output."""
    layers = getattr(chunk, "layers", None)
    indices = getattr(chunk, "layer_indices", None)
    if layers is None or indices is None:
        return None
    for layer, index in zip(layers, indices):
        x = layer(x)
        if not all_finite(_as_list(x)):
            return index, type(layer).__name__
    return None


def nonfinite_param_grads(chunk: nn.Module, limit: int = 5) -> list[str]:
    """Names (with shapes) of ``chunk``'s parameters whose gradient holds NaN or inf."""
    named = [(n, p, p.grad) for n, p in chunk.named_parameters() if p.grad is not None]
    if not named:
        return []
    flags = torch.stack([torch.isfinite(g).all() for _, _, g in named])
    if bool(flags.all().item()):
        return []
    bad = [f"{n} {tuple(p.shape)}" for (n, p, _), ok in zip(named, flags.tolist()) if not ok]
    return bad[:limit] + ([f"... {len(bad) - limit} more"] if len(bad) > limit else [])


class FiniteChecker:
    """The engine's checks for one rank: each raises :class:`NonFiniteError` naming the
    microbatch, virtual stage, rank, chunk and layers where NaN/inf appeared.

    Args:
        chunks: this rank's local chunks (their ``layer_indices``, if any, name the layers).
        stages: the virtual stage of each local chunk (``Schedule.stages_of(pp_rank)``).
        rank: this rank's global rank.

    Example::

        check = FiniteChecker(chunks, schedule.stages_of(topo.pp_rank), topo.rank)
        out = chunks[action.chunk](x)
        check.forward_output(action, out, x)   # raises if out holds NaN/inf
    """

    def __init__(self, chunks: Sequence[nn.Module], stages: Sequence[int], rank: int) -> None:
        self.chunks = list(chunks)
        self.stages = list(stages)
        self.rank = rank

    def where(self, chunk: int) -> str:
        idx = getattr(self.chunks[chunk], "layer_indices", None)
        layers = f", layers {idx[0]}-{idx[-1]}" if idx else ""
        return f"virtual stage {self.stages[chunk]} (rank {self.rank}, chunk {chunk}{layers})"

    def batch_input(self, action: Action, x: Any) -> None:
        """The first stage's input, straight from the batch."""
        if not all_finite(_as_list(x)):
            self._raise(action, "input (the batch itself)", _as_list(x), None)

    def forward_output(self, action: Action, out: Any, x: Any) -> None:
        """A chunk's output; on failure the chunk re-runs on ``x`` layer by layer to name the
        first layer whose output is non-finite."""
        if not all_finite(_as_list(out)):
            self._raise(action, "forward output", _as_list(out), x)

    def loss(self, action: Action, loss: torch.Tensor) -> None:
        if not all_finite([loss]):
            self._raise(action, "loss (the model output is finite)", [loss], None)

    def input_grads(self, action: Action, grads: Sequence[torch.Tensor]) -> None:
        """The gradients a backward is about to send upstream."""
        if not all_finite(grads):
            self._raise(action, "input gradient (the gradient it received was finite)", grads, None)

    def param_grads(self, action: Action) -> None:
        """Every parameter gradient of ``action``'s chunk (after its last backward of a step)."""
        bad = nonfinite_param_grads(self.chunks[action.chunk])
        if bad:
            raise NonFiniteError(
                f"non-finite parameter gradients at {self.where(action.chunk)} after its last "
                f"backward of the step (inputs and received gradients were finite): "
                + ", ".join(bad)
            )

    def _raise(self, action: Action, what: str, tensors: Sequence[Any], x: Any) -> None:
        detail = describe_nonfinite(tensors) or "non-finite values"
        located = ""
        if x is not None:
            found = first_nonfinite_layer(self.chunks[action.chunk], x)
            located = (
                f"; first non-finite layer output: layer {found[0]} ({found[1]})"
                if found
                else "; re-running the chunk layer by layer gave finite outputs (a random layer "
                "such as dropout?)"
            )
        raise NonFiniteError(
            f"non-finite {what} of mb={action.mb} at {self.where(action.chunk)}: {detail}{located}"
        )
