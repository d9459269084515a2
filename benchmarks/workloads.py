"""The two benchmark workloads, as ordered layer lists both pipeline implementations cut alike.

* ``sleep``: :class:`~lightning_pp.models.virtual_device.SleepLayer` "virtual devices". Each
  rank's share costs ``t_f`` forward and ``t_b`` backward whatever ``vpp`` is (the per-layer
  costs are ``t_f / layers_per_rank``), so the ideal step time is the simulator's makespan with
  :class:`~lightning_pp.schedules.simulate.Costs` ``(t_f, t_b)``.
* ``transformer``: a small pre-norm transformer block stack doing real compute, trained to
  regress a fixed random target (MSE). Float input, so every stage boundary carries one
  ``(microbatch, seq, dim)`` activation tensor.

The model is always ``layers_per_rank * pp`` layers, with ``layers_per_rank`` a multiple of
every ``vpp`` benchmarked (2), so 1F1B (1 chunk of 2 layers per rank) and interleaved (2 chunks
of 1 layer) run the very same layers, split the same way into virtual stages.

Example:
    >>> w = Workload("sleep", t_f=0.002, t_b=0.004)
    >>> layers = w.build_layers(pp=2)
    >>> len(layers), w.batch(microbatches=4)[0].shape
    (4, torch.Size([16, 32]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from lightning_pp.models.virtual_device import SleepLayer


class Block(nn.Module):
    """Pre-norm transformer block (causal self-attention + 4x MLP), written out in full."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


@dataclass(frozen=True)
class Workload:
    """One benchmark model and its data. ``name`` is ``"sleep"`` or ``"transformer"``.

    ``t_f``/``t_b``: sleep costs of one rank's whole share, in seconds (sleep workload).
    ``dim``/``heads``/``seq``: transformer shape. ``mb_size``: rows per microbatch.
    """

    name: str
    layers_per_rank: int = 2
    t_f: float = 0.020
    t_b: float = 0.040
    width: int = 32
    dim: int = 128
    heads: int = 4
    seq: int = 64
    mb_size: int = 4
    seed: int = 1234
    #: sleep: split each layer's backward into an input-gradient (``t_i``) and a weight-gradient
    #: (``t_w``) autograd node (rank share, like ``t_f``); ``t_b`` is then ``t_i + t_w``
    t_i: float | None = None
    t_w: float | None = None
    #: the costs ``zb-auto`` is built from (keyword arguments of the simulator's ``Costs``, per
    #: rank share: t_f, t_b, t_i, t_w, latency, overhead), as a tuple of pairs (picklable,
    #: hashable); ``None``: zb-auto's defaults (t_f = t_i = t_w)
    schedule_costs: tuple[tuple[str, float], ...] | None = None

    def __post_init__(self) -> None:
        if self.name not in ("sleep", "transformer"):
            raise ValueError(f"unknown workload {self.name!r}; choose 'sleep' or 'transformer'")

    def build_layers(self, pp: int) -> list[nn.Module]:
        """All ``layers_per_rank * pp`` layers, with the same weights on every rank and call."""
        torch.manual_seed(self.seed)
        n = self.layers_per_rank * pp
        if self.name == "sleep":
            k = self.layers_per_rank
            tf, tb = self.t_f / k, self.t_b / k
            if self.t_i is not None and self.t_w is not None:
                ti, tw = self.t_i / k, self.t_w / k
                return [SleepLayer(self.width, tf, t_i=ti, t_w=tw) for _ in range(n)]
            return [SleepLayer(self.width, tf, tb) for _ in range(n)]
        return [Block(self.dim, self.heads) for _ in range(n)]

    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one microbatch's activation at any stage boundary."""
        if self.name == "sleep":
            return (self.mb_size, self.width)
        return (self.mb_size, self.seq, self.dim)

    def batch(self, microbatches: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, target) of one global batch of ``microbatches * mb_size`` rows."""
        g = torch.Generator().manual_seed(self.seed + 1 + step)
        shape = (microbatches * self.mb_size, *self.sample_shape()[1:])
        return torch.randn(shape, generator=g), torch.randn(shape, generator=g)

    @staticmethod
    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per-microbatch mean squared error (both pipelines average it over microbatches)."""
        return F.mse_loss(output, target)

    def flops_note(self) -> str:
        if self.name == "sleep":
            split = (
                f" (t_i={self.t_i * 1e3:g} ms t_w={self.t_w * 1e3:g} ms)"
                if self.t_i is not None and self.t_w is not None
                else ""
            )
            return f"sleep t_f={self.t_f * 1e3:g} ms t_b={self.t_b * 1e3:g} ms{split} per rank"
        params = 12 * self.dim * self.dim
        return (
            f"transformer dim={self.dim} heads={self.heads} seq={self.seq} "
            f"mb={self.mb_size} (~{params / 1e6:.2f} M params/block, "
            f"{math.prod(self.sample_shape())} floats/boundary)"
        )
