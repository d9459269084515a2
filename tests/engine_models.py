"""Tiny models and reference computations shared by the engine tests (no distributed code)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from lightning_pp.layout.partition import PipelineChunk, local_layer_indices, partition_layers

NUM_LAYERS = 8
IN, HID, OUT = 6, 16, 3


def mlp_layers(seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Sequential(nn.Linear(IN, HID), nn.Tanh())]
    layers += [nn.Sequential(nn.Linear(HID, HID), nn.Tanh()) for _ in range(NUM_LAYERS - 2)]
    layers.append(nn.Linear(HID, OUT))
    return layers


def mlp_batch(seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, IN, generator=g), torch.randn(batch, OUT, generator=g)


def mse_loss(reduction: str):
    def fn(out, mb):
        return F.mse_loss(out, mb[1], reduction=reduction)

    return fn


class Embed(nn.Module):
    """(ids, mask) -> (hidden, mask): the first layer of the tuple-activation model."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)

    def forward(self, x):
        ids, mask = x
        return self.emb(ids), mask


class Block(nn.Module):
    """Masked residual MLP block; passes the int64 mask through untouched."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        h, mask = x
        return h + torch.tanh(self.lin(h)) * mask.unsqueeze(-1).to(h.dtype), mask


class Head(nn.Module):
    """Masked mean pool + linear: (hidden, mask) -> (B, OUT)."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, OUT)

    def forward(self, x):
        h, mask = x
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.lin(pooled)


VOCAB, DIM = 11, 8


def tuple_layers(seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Embed(VOCAB, DIM)] + [Block(DIM) for _ in range(NUM_LAYERS - 2)] + [Head(DIM)]


def tuple_batch(seed: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    y = torch.randn(batch, OUT, generator=g)
    return (ids, mask), y


def tuple_input_fn(mb):
    return mb[0]


def run_reference(layers: list[nn.Module], batch, loss_fn, input_fn=lambda b: b[0]):
    """Unpipelined forward+backward of the whole batch: returns the loss (grads in .grad)."""
    x = input_fn(batch)
    for layer in layers:
        x = layer(x)
    loss = loss_fn(x, batch)
    loss.backward()
    return loss.detach()


def make_chunks(layers: list[nn.Module], pp: int, vpp: int, pp_rank: int):
    """This rank's chunks, as deep copies of the reference layers (same init)."""
    ranges = partition_layers(len(layers), pp, vpp)
    return [
        PipelineChunk([copy.deepcopy(layers[i]) for i in r], r)
        for r in local_layer_indices(ranges, pp_rank, pp, vpp)
    ]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def grad_errors(chunks, ref_layers) -> dict[str, float]:
    """Relative error of every local parameter's gradient against the reference layer's."""
    errs = {}
    for chunk in chunks:
        for layer, idx in zip(chunk.layers, chunk.layer_indices):
            ref = dict(ref_layers[idx].named_parameters())
            for name, p in layer.named_parameters():
                r = ref[name]
                if p.grad is None or r.grad is None:
                    errs[f"{idx}.{name}"] = (
                        float("inf") if (p.grad is None) != (r.grad is None) else 0.0
                    )
                else:
                    errs[f"{idx}.{name}"] = rel_err(p.grad, r.grad)
    return errs


# -- a weight tied across stages, and stages whose backward cannot be split --------------


class TiedIn(nn.Module):
    """x (B, 6) -> tanh(x @ W.T): W (16, 6) is also the output projection of TiedOut."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return torch.tanh(F.linear(x, self.weight))


class TiedOut(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, h):
        return h @ self.weight


def tied_layers(seed: int) -> list[nn.Module]:
    """The MLP with its first weight tied to the output projection (one Parameter object)."""
    torch.manual_seed(seed)
    w = nn.Parameter(torch.randn(16, 6) / 3)
    mid = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)]
    return [TiedIn(w), *mid, TiedOut(w)]


def tied_batch(seed: int, batch: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 6, generator=g), torch.randn(batch, 6, generator=g)


class _CustomScale(torch.autograd.Function):
    """x * w with a hand-written backward: it computes both gradients whatever is asked."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class CustomScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        return _CustomScale.apply(x, self.w)


def unsplittable_layers(seed: int) -> list[nn.Module]:
    layers = mlp_layers(seed)
    layers[2] = nn.Sequential(layers[2], CustomScale())
    layers[3].requires_grad_(False)  # frozen
    layers[4] = nn.Tanh()  # no parameters
    return layers
