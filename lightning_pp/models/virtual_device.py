"""A "virtual device" layer: fixed, known forward and backward costs, whatever the CPU does.

Each layer is ``tanh(Linear(x))`` whose forward takes exactly ``t_f`` seconds and whose backward
takes exactly ``t_b``, counted from the moment the layer starts: the layer computes, then holds
until its deadline (sleep, then a short spin, because ``time.sleep`` wakes 0.1-0.2 ms late).
Sleeping processes use no CPU, so 4 pipeline ranks on a 2-core machine behave like 4 devices
whose step time the simulator predicts exactly. Used by the bubble-measurement tests and by
``benchmarks/``.

Why a deadline and not ``sleep(t)`` after the compute: the compute, the autograd calls and the
sleep's late wake-up made each call 0.36 ms (forward) to 0.58 ms (backward) longer than its
nominal cost, so the "device" itself ran about 3 % slower than the ideal it was meant to
define, for any pipeline implementation. What remains is outside the layer (about 0.06 ms to
return from a forward; about 0.3 ms for the autograd engine to enter and leave a backward) and
is measured by ``benchmarks/profile_overhead.py --device-overshoot``.

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
from torch.nn import functional as F

# The last stretch before a deadline is spun, not slept: time.sleep's wake-up is 0.07-0.18 ms
# late on an idle Linux machine (measured here), longer under load.
_SPIN_S = 0.1e-3


def hold_until(deadline: float) -> None:
    """Return at ``time.perf_counter() >= deadline``: sleep most of the way, spin the rest."""
    remaining = deadline - time.perf_counter()
    if remaining > _SPIN_S:
        time.sleep(remaining - _SPIN_S)
    while time.perf_counter() < deadline:
        pass


class _TimedLinearTanh(torch.autograd.Function):
    """``tanh(x @ W.T + b)`` as ONE autograd node, so one deadline covers the whole layer."""

    @staticmethod
    def forward(ctx, x, weight, bias, deadline: float, t_b: float):  # type: ignore[override]
        y = torch.tanh(F.linear(x, weight, bias))
        ctx.save_for_backward(x, weight, y)
        ctx.t_b = t_b
        hold_until(deadline)
        return y

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        t0 = time.perf_counter()
        x, weight, y = ctx.saved_tensors
        grad_z = grad_y * (1 - y * y)
        grad_x = grad_z @ weight if ctx.needs_input_grad[0] else None
        flat_z = grad_z.reshape(-1, grad_z.shape[-1])
        grad_w = flat_z.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = flat_z.sum(0) if ctx.needs_input_grad[2] else None
        if ctx.t_b > 0:
            hold_until(t0 + ctx.t_b)
        return grad_x, grad_w, grad_b, None, None


class SleepLayer(nn.Module):
    """``tanh(Linear(width, width))`` costing exactly ``t_f`` forward and ``t_b`` backward.

    Example:
        >>> import time, torch
        >>> layer = SleepLayer(width=4, t_f=0.005, t_b=0.010)
        >>> t0 = time.perf_counter(); y = layer(torch.randn(3, 4, requires_grad=True))
        >>> time.perf_counter() - t0 >= 0.005
        True
    """

    def __init__(self, width: int = 16, t_f: float = 0.01, t_b: float = 0.02) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.t_f = float(t_f)
        self.t_b = float(t_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The clock starts here, not inside the autograd Function: entering it costs ~0.1 ms.
        deadline = time.perf_counter() + self.t_f
        return _TimedLinearTanh.apply(x, self.linear.weight, self.linear.bias, deadline, self.t_b)


def sleep_layers(num_layers: int, width: int = 16, t_f: float = 0.01, t_b: float = 0.02):
    """Builders for ``num_layers`` sleep layers (one callable per layer, for lazy construction)."""
    return [lambda: SleepLayer(width, t_f, t_b) for _ in range(num_layers)]
