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
