"""A "virtual device" layer: fixed, known forward and backward costs, whatever the CPU does.

Each layer sleeps ``t_f`` seconds in forward and ``t_b`` in backward around a tiny linear map.
Sleeping processes use no CPU, so 4 pipeline ranks on a 2-core machine behave like 4 devices
whose step time the simulator predicts exactly. Used by the bubble-measurement tests and by
``benchmarks/``.

Example:
    >>> import torch
    >>> layer = SleepLayer(width=8, t_f=0.001, t_b=0.002)
    >>> layer(torch.randn(2, 8)).shape
    torch.Size([2, 8])
"""

from __future__ import annotations

import time

import torch
from torch import nn


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``t_f`` and whose backward sleeps ``t_b``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, t_f: float, t_b: float) -> torch.Tensor:  # type: ignore[override]
        ctx.t_b = t_b
        if t_f > 0:
            time.sleep(t_f)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.t_b > 0:
            time.sleep(ctx.t_b)
        return grad, None, None


class SleepLayer(nn.Module):
    """``Linear(width, width)`` followed by a sleep of ``t_f`` (forward) / ``t_b`` (backward)."""

    def __init__(self, width: int = 16, t_f: float = 0.01, t_b: float = 0.02) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.t_f = float(t_f)
        self.t_b = float(t_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(torch.tanh(self.linear(x)), self.t_f, self.t_b)


def sleep_layers(num_layers: int, width: int = 16, t_f: float = 0.01, t_b: float = 0.02):
    """Builders for ``num_layers`` sleep layers (one callable per layer, for lazy construction)."""
    return [lambda: SleepLayer(width, t_f, t_b) for _ in range(num_layers)]
