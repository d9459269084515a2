"""Microbatch loss weights for a loss that means over what it counts (valid tokens, say).

A token-mean loss over a batch is ``sum of per-token losses / number of valid tokens``. A
pipeline computes it per microbatch, and data parallelism per replica; averaging those means by
sample count (the engine's ``loss_reduction="mean"``, DDP's mean over replicas) weights every
microbatch alike however many of its tokens are padding or masked prompt, which is not the
single-process loss (Megatron's ``calculate_per_token_loss``, torchtitan's global token count
and Hugging Face's ``num_items_in_batch`` exist for this).

Here each microbatch loss ``mean_i`` (a mean over its ``count_i`` targets) is scaled by
``w_i = count_i * dp / global_count`` before its backward, where ``global_count`` sums the counts
of every microbatch of every data-parallel replica. The gradient all-reduce then divides by
``dp`` as it always does (DDP-style, and so do ZeRO's and FSDP's reduce-scatters here), which
leaves ``sum over all microbatches and replicas of sum_i / global_count``: exactly the gradient
of the single-process loss over the global batch. The counts must be known before the first
backward (1F1B starts backward before the last forward), so they are counted from the batch's
labels when the step starts; every rank of a pipeline holds the batch.

Example:
    >>> import torch
    >>> labels = torch.tensor([[5, 6, -100, -100], [7, 8, 9, -100]])
    >>> valid_targets(labels, shift=True)   # a causal LM predicts labels[:, 1:]
    3
    >>> token_weights([1, 2], global_count=6, dp=2)   # this replica holds 3 of 6 targets
    [0.3333333333333333, 0.6666666666666666]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["global_count", "token_weights", "valid_targets"]


def valid_targets(labels: Tensor, *, ignore_index: int = -100, shift: bool = False) -> int:
    """How many targets of ``labels`` a loss counts: those ``!= ignore_index``, after dropping
    each row's first label when the model shifts (a causal LM compares position ``t``'s logits
    with label ``t + 1``, so label 0 of every row is never a target)."""
    if shift:
        labels = labels[..., 1:]
    return int((labels != ignore_index).sum())


def token_weights(counts: Sequence[int], global_count: int, dp: int) -> list[float]:
    """Per microbatch, ``count_i * dp / global_count``: the factor that makes a mean over the
    microbatch's targets, summed over microbatches and averaged over ``dp`` replicas, the mean
    over all ``global_count`` targets of the global batch.

    Raises:
        ValueError: the global batch has no valid target (its token mean is 0/0: every label
            is masked), naming the counts.
    """
    if global_count <= 0:
        raise ValueError(
            f"the global batch has no valid target (counts of this replica's microbatches: "
            f"{list(counts)}, all replicas together: {global_count}); a mean over no token is "
            f"undefined: check the labels' masking (ignore index) or drop such batches"
        )
    return [c * dp / global_count for c in counts]


def global_count(counts: Sequence[int], device: torch.device) -> Tensor:
    """This replica's total as a float64 tensor, ready for a SUM all-reduce over dp."""
    return torch.tensor(float(sum(counts)), dtype=torch.float64, device=device)
