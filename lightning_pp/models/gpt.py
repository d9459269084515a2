"""A small GPT (nanoGPT-style) written for pipeline parallelism.

The model is a list of pipeline layers::

    layer 0            Embedding: token + position embeddings
    layers 1..n_layer  Block: pre-norm causal self-attention + MLP
    layer n_layer+1    Head: final LayerNorm + linear head, weight tied to the token embedding

Each layer takes the previous layer's output (``(B, T)`` token ids for the first, ``(B, T, C)``
activations after that), which is all a pipeline needs to cut it anywhere. It trains the same way
under a plain ``Trainer`` and under ``PipelineStrategy``.

Example:
    >>> model = GPT(vocab_size=32, n_layer=2, n_head=2, n_embd=16, block_size=8)
    >>> model.configure_model()
    >>> x = torch.randint(0, 32, (2, 8))
    >>> model.pipeline_forward((x, x)).shape
    torch.Size([2, 8, 32])
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.functional.classification import multiclass_accuracy

from ..strategy.model import PipelineLayers, PipelineMixin

__all__ = ["GPT", "Block", "Embedding", "Head"]


class Embedding(nn.Module):
    """Token + learned position embeddings: ``(B, T)`` ids -> ``(B, T, C)``."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, n_layer: int) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd({n_embd}) must be divisible by n_head({n_head})")
        self.n_head = n_head
        self.dropout = dropout
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)
        for linear in (self.qkv, self.fc):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer)
        for linear in (self.proj, self.fc_proj):
            nn.init.normal_(linear.weight, std=0.02 / math.sqrt(2 * n_layer))
            nn.init.zeros_(linear.bias)

    def attention(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.drop(self.fc_proj(F.gelu(self.fc(self.ln_2(x)))))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection: ``(B, T, C)`` -> logits ``(B, T, V)``."""

    def __init__(self, vocab_size: int, n_embd: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd)
        # Initialised from the token embedding through the tie (see GPT.configure_model).
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.ln_f(x))


class GPT(PipelineMixin, L.LightningModule):
    """GPT language model; batches are ``(tokens, targets)`` of shape ``(B, T)``.

    Logs ``train_loss``, ``val_loss`` and ``val_acc`` (next-token accuracy, torchmetrics).
    Optimiser: AdamW (weight decay on matrices only) with linear warmup then cosine decay.
    """

    #: the transformer block (a subclass swaps it: :class:`~lightning_pp.models.decoder.DecoderLM`)
    block_class: type[nn.Module] = Block

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
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers: PipelineLayers | None = None

    # -- model ---------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Build the layers (only this rank's, under the pipeline strategy)."""
        if self.layers is not None:
            return
        h = self.hparams
        n = h.n_layer
        builders = [lambda: Embedding(h.vocab_size, h.block_size, h.n_embd, h.dropout)]
        block = self.block_class
        builders += [lambda: block(h.n_embd, h.n_head, h.dropout, n) for _ in range(n)]
        builders += [lambda: Head(h.vocab_size, h.n_embd)]
        self.layers = PipelineLayers(
            builders, seed=h.seed, tied=[("0.wte.weight", f"{n + 1}.head.weight")]
        )

    def pipeline_input(self, batch: Any) -> Tensor:
        return batch[0]

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1).float(), batch[1].flatten())

    def pipeline_eval_step(self, output: Tensor, batch: Any, split: str) -> dict[str, Tensor]:
        preds = output.argmax(dim=-1).flatten()
        acc = multiclass_accuracy(
            preds, batch[1].flatten(), num_classes=self.hparams.vocab_size, average="micro"
        )
        return {f"{split}_loss": self.pipeline_loss(output, batch), f"{split}_acc": acc}

    # -- optimisation --------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        h = self.hparams
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": h.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # A pipeline stage may hold only one kind (e.g. just LayerNorms): skip empty groups.
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=h.lr, betas=h.betas)

        def lr_lambda(step: int) -> float:
            if step < h.warmup_steps:
                return (step + 1) / h.warmup_steps
            progress = min(1.0, (step - h.warmup_steps) / max(1, h.max_steps - h.warmup_steps))
            return h.min_lr_ratio + (1 - h.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
