"""Split a batch into microbatches along dim 0.

Example:
    >>> import torch
    >>> mbs = split_microbatches((torch.arange(5), {"y": torch.ones(5, 2)}, "tag"), 2)
    >>> [mb[0].tolist() for mb in mbs], mbs[1][1]["y"].shape, mbs[1][2]
    ([[0, 1, 2], [3, 4]], torch.Size([2, 2]), 'tag')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["batch_size_of", "batch_size_or_none", "split_microbatches"]


def _tensor_sizes(batch: Any, path: str, out: list[tuple[str, int]]) -> None:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return  # scalars are replicated, like non-tensors
        out.append((path, batch.shape[0]))
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            _tensor_sizes(v, f"{path}[{k!r}]", out)
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            _tensor_sizes(v, f"{path}[{i}]", out)


def batch_size_of(batch: Any) -> int:
    """Dim-0 size shared by every (non-scalar) tensor in ``batch``.

    Raises:
        ValueError: no tensor found, or tensors disagree on dim 0 (each path and size named).
    """
    sizes: list[tuple[str, int]] = []
    _tensor_sizes(batch, "batch", sizes)
    if not sizes:
        raise ValueError("batch contains no tensor with a batch dimension to split")
    distinct = {s for _, s in sizes}
    if len(distinct) > 1:
        listing = ", ".join(f"{p}: {s}" for p, s in sizes)
        raise ValueError(f"tensors in the batch disagree on the dim-0 (batch) size: {listing}")
    return sizes[0][1]


def batch_size_or_none(batch: Any) -> int | None:
    """:func:`batch_size_of`, or ``None`` for a batch it cannot size (no batch dimension, or
    tensors that disagree: the engine reports those with the action that meets them)."""
    try:
        return batch_size_of(batch)
    except ValueError:
        return None


def _split(batch: Any, m: int) -> list[Any]:
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:
        return list(torch.tensor_split(batch, m, dim=0))
    if isinstance(batch, Mapping):
        parts = {k: _split(v, m) for k, v in batch.items()}
        return [type(batch)((k, parts[k][i]) for k in batch) for i in range(m)]  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        parts = [_split(v, m) for v in batch]
        return [type(batch)(*(p[i] for p in parts)) for i in range(m)]
    if isinstance(batch, (list, tuple)):
        parts = [_split(v, m) for v in batch]
        return [type(batch)(p[i] for p in parts) for i in range(m)]
    return [batch] * m  # non-tensors (and 0-d tensors) are replicated


def split_microbatches(batch: Any, m: int) -> list[Any]:
    """Split every tensor in ``batch`` (nested tuples/lists/dicts) into ``m`` dim-0 pieces.

    Uses ``torch.tensor_split``: when the batch size ``B`` is not a multiple of ``m`` the first
    ``B % m`` microbatches get one extra sample. Non-tensors are replicated into every piece.

    Raises:
        ValueError: ``m < 1``, batch size smaller than ``m``, or inconsistent dim-0 sizes.
    """
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ValueError(f"number of microbatches must be a positive integer, got {m!r}")
    size = batch_size_of(batch)
    if size < m:
        raise ValueError(
            f"batch size {size} is smaller than the number of microbatches {m}: every "
            f"microbatch needs at least one sample (lower microbatches or raise the batch size)"
        )
    return _split(batch, m)
