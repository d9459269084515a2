"""Cut an ordered list of layers into ``pp * vpp`` contiguous chunks and place them on ranks.

Virtual stage ``s`` holds one contiguous range of layers; stage ``s`` lives on rank ``s % pp`` as
its local chunk ``s // pp`` (loop placement: rank r holds stages r, r+pp, r+2pp, ...).

Example:
    >>> ranges = partition_layers(16, pp=4, vpp=2)
    >>> local_layer_indices(ranges, rank=0, pp=4, vpp=2)
    [range(0, 2), range(8, 10)]
    >>> partition_layers(5, pp=2, vpp=1)
    [range(0, 2), range(2, 5)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..schedules import check_positive

__all__ = [
    "PipelineChunk",
    "format_split",
    "local_layer_indices",
    "partition_layers",
    "stage_of",
]


def stage_of(rank: int, chunk: int, pp: int) -> int:
    """Virtual stage run by local ``chunk`` of ``rank``: ``chunk * pp + rank``."""
    return chunk * pp + rank


def format_split(counts: Sequence[int | float]) -> str:
    """Short text of a per-stage split for error messages, e.g. ``s0=2 s1=3``."""
    return " ".join(f"s{i}={c}" for i, c in enumerate(counts))


def _ranges(counts: Sequence[int]) -> list[range]:
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def _balanced_counts(weights: Sequence[float], k: int) -> list[int]:
    """Contiguous split of ``weights`` into ``k`` non-empty parts, as balanced as possible.

    Two exact dynamic programmes, O(k * n^2) each (layer counts are small): first the smallest
    achievable heaviest part ``M``; then, among splits whose parts all weigh at most ``M``, the
    one with the smallest sum of squared part weights, so the non-bottleneck stages are
    balanced too (minimising the maximum alone leaves them arbitrary).
    """
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")

    def solve(score, limit: float) -> list[int]:
        best = [[inf] * (n + 1) for _ in range(k + 1)]
        cut = [[0] * (n + 1) for _ in range(k + 1)]
        best[0][0] = 0.0
        for j in range(1, k + 1):
            for i in range(j, n - (k - j) + 1):
                for p in range(j - 1, i):  # the last part is layers [p, i)
                    part = prefix[i] - prefix[p]
                    if part > limit or best[j - 1][p] == inf:
                        continue
                    cand = score(best[j - 1][p], part)
                    if cand < best[j][i]:
                        best[j][i], cut[j][i] = cand, p
        counts, i = [], n
        for j in range(k, 0, -1):
            p = cut[j][i]
            counts.append(i - p)
            i = p
        return counts[::-1]

    first = solve(lambda acc, part: max(acc, part), inf)
    bound, start = 0.0, 0
    for c in first:
        bound = max(bound, prefix[start + c] - prefix[start])
        start += c
    # Small slack: the bound was computed from the same prefix sums, so equality is exact, but
    # keep float noise from excluding the very split that achieved it.
    return solve(lambda acc, part: acc + part * part, bound * (1 + 1e-12) + 1e-12)


def _explicit_fix(num_layers: int, k: int) -> str:
    """The fix for a wrong explicit split: what a valid one looks like for this model."""
    if num_layers < k:
        return f"the model has only {num_layers} layers, fewer than the {k} virtual stages"
    base, rem = divmod(num_layers, k)
    example = [base + (1 if s >= k - rem else 0) for s in range(k)]
    return (
        f"give {k} positive counts summing to {num_layers} (e.g. {example}, what "
        f"partition='uniform' picks), or use partition='uniform'"
    )


def partition_layers(
    num_layers: int,
    pp: int,
    vpp: int = 1,
    method: str | Sequence[int] = "uniform",
    *,
    layer_params: Sequence[int] | None = None,
    layer_costs: Sequence[float] | None = None,
) -> list[range]:
    """One contiguous range of layer indices per virtual stage (``pp * vpp`` of them).

    Methods:

    - ``"uniform"``: ``num_layers // (pp*vpp)`` layers each; the remainder goes one layer each
      to the LAST stages. Early stages hold the most in-flight microbatches under 1F1B (rank r
      stashes up to ``pp - r``), so they get the lighter share.
    - ``"parameters"``: balance ``layer_params`` (parameter count per layer).
    - ``"cost"``: balance ``layer_costs`` (e.g. measured forward+backward time per layer).
    - a sequence of per-virtual-stage layer counts, used as given.

    Balanced methods minimise the heaviest stage exactly (contiguous, every stage non-empty).

    Raises:
        ValueError: fewer layers than stages, counts that do not sum to ``num_layers``,
            a missing or wrongly sized weight list, ... with the numbers and the split.
    """
    check_positive(num_layers=num_layers, pp=pp, vpp=vpp)
    k = pp * vpp
    if not isinstance(method, str):
        counts = [int(c) for c in method]
        if len(counts) != k:
            raise ValueError(
                f"partition={counts}: explicit split has {len(counts)} entries but pp({pp}) * "
                f"vpp({vpp}) = {k} virtual stages: {format_split(counts)}; "
                f"{_explicit_fix(num_layers, k)}"
            )
        if any(c < 1 for c in counts):
            raise ValueError(
                f"partition={counts}: every virtual stage needs at least one layer: "
                f"{format_split(counts)}; "
                f"{_explicit_fix(num_layers, k)}"
            )
        if sum(counts) != num_layers:
            raise ValueError(
                f"partition={counts}: explicit split sums to {sum(counts)} layers but the model "
                f"has num_layers={num_layers}: {format_split(counts)}; "
                f"{_explicit_fix(num_layers, k)}"
            )
        return _ranges(counts)
    if num_layers < k:
        raise ValueError(
            f"cannot split num_layers={num_layers} into pp({pp}) * vpp({vpp}) = {k} non-empty "
            f"chunks; lower pp or vpp, or use a model with at least {k} layers"
        )
    if method == "uniform":
        base, rem = divmod(num_layers, k)
        counts = [base + (1 if s >= k - rem else 0) for s in range(k)]
        return _ranges(counts)
    if method in ("parameters", "cost"):
        weights = layer_params if method == "parameters" else layer_costs
        arg = "layer_params" if method == "parameters" else "layer_costs"
        if weights is None:
            raise ValueError(f"method={method!r} needs {arg} (one number per layer)")
        if len(weights) != num_layers:
            raise ValueError(f"{arg} has {len(weights)} entries but num_layers={num_layers}")
        if any(float(w) < 0 for w in weights):
            raise ValueError(f"{arg} must be non-negative, got {list(weights)}")
        return _ranges(_balanced_counts(weights, k))
    raise ValueError(
        f"unknown partition method {method!r}; use 'uniform', 'parameters', 'cost' "
        f"or a list of {k} per-stage layer counts"
    )


def local_layer_indices(ranges: Sequence[range], rank: int, pp: int, vpp: int) -> list[range]:
    """The layer ranges held by ``rank``, one per local chunk (chunk c = stage c*pp + rank)."""
    if len(ranges) != pp * vpp:
        raise ValueError(f"got {len(ranges)} ranges for pp({pp}) * vpp({vpp}) = {pp * vpp} stages")
    if not 0 <= rank < pp:
        raise ValueError(f"rank({rank}) must lie in [0, pp({pp}))")
    return [ranges[stage_of(rank, c, pp)] for c in range(vpp)]


class PipelineChunk(nn.Module):
    """A run of consecutive pipeline layers executed in order.

    Each layer is called as ``layer(x)`` where ``x`` is exactly what the previous layer returned
    (a tensor or a tuple of tensors; a tuple is passed as ONE argument, not unpacked).

    Example:
        >>> import torch
        >>> layers = [nn.Linear(4, 4) for _ in range(6)]
        >>> chunk = PipelineChunk([layers[i] for i in range(2, 4)], indices=range(2, 4))
        >>> chunk.layer_indices
        [2, 3]
        >>> chunk(torch.zeros(1, 4)).shape
        torch.Size([1, 4])
    """

    def __init__(self, layers: Sequence[nn.Module], indices: Sequence[int] | None = None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        idx = list(range(len(layers))) if indices is None else list(indices)
        if len(idx) != len(self.layers):
            raise ValueError(f"{len(self.layers)} layers but {len(idx)} indices")
        self.layer_indices: list[int] = idx

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x

    def extra_repr(self) -> str:
        return f"layers={self.layer_indices}"
