"""A GPT whose layers tensor parallelism can shard: separate q/k/v projections, a hook that
parallelizes each layer.

:class:`~lightning_pp.models.gpt.GPT` computes q, k and v with one fused ``qkv`` Linear. A
column-wise shard of that weight would give rank 0 all of q and half of k, so it cannot be cut by
heads without reordering its rows (and a checkpoint would then hold them reordered). This model
keeps GPT's embedding, head, loss, metrics and optimizer, and uses blocks with one Linear per
projection, the layout Megatron, torchtitan and Hugging Face's Llama shard:

* ``q``, ``k``, ``v``, ``fc``: column-wise (each rank computes ``n_head / tp`` heads and
  ``4C / tp`` hidden units);
* ``proj``, ``fc_proj``: row-wise (the partial sums are all-reduced: the block's output is
  replicated over the tp ranks, which is what a stage sends to the next);
* ``wte``: vocabulary-parallel (row-wise ``nn.Embedding``), the tied ``head`` column-wise with
  its logits gathered, so both copies of the tied weight are cut the same way (``Shard(0)``);
* LayerNorms and the position embedding stay whole on every rank.

With ``DecoderLM(sequence_parallel=True)`` (Megatron's sequence parallelism) the activations
between those regions (the residual stream, the LayerNorms, the stage boundary) are cut along
the sequence over the tp ranks instead of replicated: each holds ``T / tp`` positions, so every
P2P message and the boundary activations a stage keeps shrink by ``tp``; the all-reduce after
each row-wise projection becomes a reduce-scatter, and each norm's output is all-gathered once;
the projections reading it keep only ``T / tp`` positions of it for backward and gather them
again there (:mod:`~lightning_pp.models.sequence_parallel`).

Example:
    >>> import torch
    >>> model = DecoderLM(vocab_size=32, n_layer=2, n_head=2, n_embd=16, block_size=8)
    >>> model.configure_model()
    >>> x = torch.randint(0, 32, (2, 8))
    >>> model.pipeline_forward((x, x)).shape
    torch.Size([2, 8, 32])
"""

from __future__ import annotations

import math
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from .gpt import GPT, Embedding, Head

__all__ = ["DecoderBlock", "DecoderLM"]


class DecoderBlock(nn.Module):
    """Pre-norm transformer block with separate ``q``/``k``/``v`` projections.

    The head count a rank computes is read from its ``q`` output (``-1`` in the view), so the
    same code runs whole and with ``q``/``k``/``v`` sharded column-wise over tp ranks.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, n_layer: int) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd({n_embd}) must be divisible by n_head({n_head})")
        self.n_head, self.head_dim, self.dropout = n_head, n_embd // n_head, dropout
        self.ln_1 = nn.LayerNorm(n_embd)
        self.q, self.k, self.v = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)
        for linear in (self.q, self.k, self.v, self.fc):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer)
        for linear in (self.proj, self.fc_proj):
            nn.init.normal_(linear.weight, std=0.02 / math.sqrt(2 * n_layer))
            nn.init.zeros_(linear.bias)

    def attention(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = (
            lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, -1)))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.drop(self.fc_proj(F.gelu(self.fc(self.ln_2(x)))))


class DecoderLM(GPT):
    """:class:`~lightning_pp.models.gpt.GPT` with :class:`DecoderBlock` s and a
    :meth:`pipeline_tensor_parallel` hook: trains under ``PipelineStrategy(tp=N)`` (and, like
    GPT, unchanged under a plain ``Trainer``). ``n_head`` must be divisible by ``tp``."""

    block_class = DecoderBlock

    def __init__(
        self,
        vocab_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 64,
        block_size: int = 64,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        max_steps: int = 1000,
        min_lr_ratio: float = 0.1,
        seed: int = 0,
        sequence_parallel: bool = False,
    ) -> None:
        """GPT's arguments (spelled out, so that configs are checked against them), and
        ``sequence_parallel``: under ``tp > 1``, keep the activations between the tensor-parallel
        regions cut along the sequence (see the module docstring); no effect at ``tp = 1``."""
        super().__init__(
            vocab_size=vocab_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            block_size=block_size,
            dropout=dropout,
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            warmup_steps=warmup_steps,
            max_steps=max_steps,
            min_lr_ratio=min_lr_ratio,
            seed=seed,
        )
        self.save_hyperparameters()

    def pipeline_tensor_parallel(self, layer: nn.Module, index: int, tp_mesh: Any) -> None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        tp, heads = tp_mesh.size(), self.hparams.n_head
        if heads % tp:
            raise ValueError(
                f"{type(self).__name__}: n_head({heads}) is not divisible by tp({tp}); each "
                f"tensor-parallel rank computes n_head / tp whole heads"
            )
        if self.hparams.get("sequence_parallel", False):
            _sequence_parallel(layer, index, tp_mesh)
            return
        if isinstance(layer, Embedding):
            plan: dict[str, Any] = {"wte": RowwiseParallel(input_layouts=Replicate())}
        elif isinstance(layer, DecoderBlock):
            plan = {name: ColwiseParallel() for name in ("q", "k", "v", "fc")}
            plan.update(proj=RowwiseParallel(), fc_proj=RowwiseParallel())
        elif isinstance(layer, Head):
            plan = {"head": ColwiseParallel(output_layouts=Replicate())}
        else:
            raise TypeError(f"layer {index} is a {type(layer).__name__}: no tensor-parallel plan")
        parallelize_module(layer, tp_mesh, plan)


def check_sequence_length(tokens: Tensor, tp: int) -> None:
    """Sequence parallelism cuts the ``T`` positions of a batch into ``tp`` equal parts; an
    uneven cut makes the tp ranks' collectives disagree on their sizes (gloo aborts on the size
    mismatch, NCCL may hang), so it is refused before the first one, naming the numbers.

    Example:
        >>> import torch
        >>> check_sequence_length(torch.zeros(2, 8, dtype=torch.long), 2)
        >>> check_sequence_length(torch.zeros(2, 7, dtype=torch.long), 2)
        Traceback (most recent call last):
        ...
        ValueError: DecoderLM(sequence_parallel=True) at tp=2: a batch of sequence length 7 ...
    """
    length = tokens.shape[1]
    if length % tp:
        raise ValueError(
            f"DecoderLM(sequence_parallel=True) at tp={tp}: a batch of sequence length {length} "
            f"does not split into {tp} equal parts ({length} % {tp} = {length % tp}); pad or "
            f"crop the batches to a multiple of {tp}, or use sequence_parallel=False"
        )


def _sequence_parallel(layer: nn.Module, index: int, tp_mesh: Any) -> None:
    """Megatron's sequence parallelism on one layer (Korthikanti et al., 2022, "Reducing
    Activation Recomputation in Large Transformer Models", section 4.2.2), with torch's styles.

    Between the tensor-parallel regions (the LayerNorms, the residual stream, the stage
    boundary) each tp rank holds ``T / tp`` positions of the sequence (``Shard(1)``), so those
    activations and every P2P message shrink by ``tp``. Entering a region, the norm's output is
    all-gathered along the sequence once (its ``DTensor`` kept, so the three projections' input
    gradients add up as partial sums and leave through one reduce-scatter); leaving it, the
    row-wise projection reduce-scatters along the sequence instead of all-reducing. The
    column-wise projections (and the head) keep only the rank's ``T / tp`` positions of that
    gathered input for their weight gradients and gather them again in backward (Megatron's
    second saving: :mod:`~lightning_pp.models.sequence_parallel`). The vocabulary-parallel
    embedding reduce-scatters its rows along the sequence too, and the position table's output
    is cut to the same positions; the head all-gathers them back for the logits, which stay
    whole.
    LayerNorm weights are ``Replicate`` over tp: their gradients come out partial (each rank saw
    its positions) and are summed by the strategy before the step.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from .sequence_parallel import ColwiseFromSequence, GatherSequence

    def norm() -> SequenceParallel:
        return SequenceParallel(use_local_output=False)

    if isinstance(layer, Embedding):
        tp = tp_mesh.size()
        if isinstance(tp_mesh, DeviceMesh):  # not the planner's stand-in, which only records
            layer.register_forward_pre_hook(lambda _m, args: check_sequence_length(args[0], tp))
        # the token rows' partial sums reduce-scattered along the sequence (half an
        # all-reduce's bytes), and the position table's rows cut to the same positions
        rows = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(0), use_local_output=True
        )
        plan: dict[str, Any] = {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "wpe": rows,
        }
        parallelize_module(layer, tp_mesh, plan)
    elif isinstance(layer, DecoderBlock):
        plan = {name: ColwiseFromSequence() for name in ("q", "k", "v", "fc")}
        plan.update(
            proj=RowwiseParallel(output_layouts=Shard(1)),
            fc_proj=RowwiseParallel(output_layouts=Shard(1)),
            ln_1=norm(),
            ln_2=norm(),
        )
        parallelize_module(layer, tp_mesh, plan)
        parallelize_module(layer, tp_mesh, {"ln_1": GatherSequence(), "ln_2": GatherSequence()})
    elif isinstance(layer, Head):
        plan = {"ln_f": norm(), "head": ColwiseFromSequence(output_layouts=Replicate())}
        parallelize_module(layer, tp_mesh, plan)
        parallelize_module(layer, tp_mesh, {"ln_f": GatherSequence()})
    else:
        raise TypeError(f"layer {index} is a {type(layer).__name__}: no tensor-parallel plan")
