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

**Split backward.** Given ``t_i`` and ``t_w``, the layer's backward is two autograd nodes: one
computes the input gradient and holds until ``t_i`` after it started, the other computes the
weight and bias gradients and holds ``t_w``. Any runtime that splits a backward through autograd
(``torch.autograd.grad`` with respect to the stage inputs, then with respect to the weights, as
torch's ``ScheduleInterleavedZeroBubble`` / ``ScheduleZBVZeroBubble`` and lightning_pp's ``I`` /
``W`` steps do) therefore sees exactly those costs, and a fused ``backward()`` costs
``t_i + t_w``. The graph is ``y = tanh(z_x + z_w)`` where ``z_x = x @ W.T + b`` differentiates
only into ``x`` and ``z_w`` (zero-valued) only into ``W`` and ``b``, so the value and every
gradient are those of ``tanh(Linear(x))``. A third, untimed node joins the two paths; it only
passes the gradient through (the ``tanh`` derivative is applied inside the timed nodes), so
what it adds is autograd's per-node overhead (a few microseconds). An input that does not require
grad (data into the first stage) has no input gradient: that layer has no ``I`` cost.

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


class _InputPath(torch.autograd.Function):
    """``z = x @ W.T + b`` differentiated into ``x`` only; its backward is the ``I`` part.

    ``weight`` and ``bias`` arrive detached: their gradients come from :class:`_WeightPath`.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, y_box: list, t_i: float):  # type: ignore[override]
        ctx.save_for_backward(weight)
        ctx.y_box, ctx.t_i = y_box, t_i
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        t0 = time.perf_counter()
        (weight,) = ctx.saved_tensors
        y = ctx.y_box[0]
        grad_x = (grad_y * (1 - y * y)) @ weight
        if ctx.t_i > 0:
            hold_until(t0 + ctx.t_i)
        return grad_x, None, None, None, None


class _WeightPath(torch.autograd.Function):
    """A zero tensor whose gradient into ``weight`` and ``bias`` is the linear layer's; its
    backward is the ``W`` part. ``x`` arrives detached: its gradient comes from
    :class:`_InputPath`."""

    @staticmethod
    def forward(ctx, weight, bias, x, y_box: list, t_w: float):  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.y_box, ctx.t_w = y_box, t_w
        return x.new_zeros(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        t0 = time.perf_counter()
        (x,) = ctx.saved_tensors
        y = ctx.y_box[0]
        grad_z = (grad_y * (1 - y * y)).reshape(-1, grad_y.shape[-1])
        grad_w = grad_z.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[0] else None
        grad_b = grad_z.sum(0) if ctx.needs_input_grad[1] else None
        if ctx.t_w > 0:
            hold_until(t0 + ctx.t_w)
        return grad_w, grad_b, None, None, None


class _JoinTanh(torch.autograd.Function):
    """``y = tanh(z_x + z_w)``; its backward hands ``grad_y`` unchanged to both paths, which
    apply the ``tanh`` derivative themselves (inside their timed window)."""

    # Its backward only passes the gradient on (no compute, no side effects), so a split
    # backward may run it in both I and W (see lightning_pp.runtime.split_backward).
    split_backward_safe = True

    @staticmethod
    def forward(ctx, z_x, z_w, y_box: list, deadline: float):  # type: ignore[override]
        y = torch.tanh(z_x + z_w)
        # Both paths need y; a list shared by reference avoids saving it three times. Detached,
        # so the box does not keep this graph alive.
        y_box.append(y.detach())
        hold_until(deadline)
        return y

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        return grad_y, grad_y, None, None


class SleepLayer(nn.Module):
    """``tanh(Linear(width, width))`` costing exactly ``t_f`` forward and ``t_b`` backward, or,
    given ``t_i`` / ``t_w``, ``t_i`` for its input gradient and ``t_w`` for its weight gradients
    as two separate autograd nodes (see the module docstring).

    Give one of ``t_i`` / ``t_w`` and the other is the rest of ``t_b``; give both and ``t_b``
    (if given) must be their sum. Without either, the backward is one fused node (the original
    layer).

    Example:
        >>> import time, torch
        >>> layer = SleepLayer(width=4, t_f=0.005, t_b=0.010)
        >>> t0 = time.perf_counter(); y = layer(torch.randn(3, 4, requires_grad=True))
        >>> time.perf_counter() - t0 >= 0.005
        True
        >>> split = SleepLayer(width=4, t_f=0.001, t_i=0.002, t_w=0.003)
        >>> (split.split, split.t_b)
        (True, 0.005)
    """

    def __init__(
        self,
        width: int = 16,
        t_f: float = 0.01,
        t_b: float | None = None,
        t_i: float | None = None,
        t_w: float | None = None,
    ) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.t_f = float(t_f)
        self.split = t_i is not None or t_w is not None
        if t_i is not None and t_w is not None:
            if t_b is not None and abs(t_b - (t_i + t_w)) > 1e-12:
                raise ValueError(
                    f"SleepLayer: t_b={t_b} must equal t_i + t_w = {t_i} + {t_w} = {t_i + t_w} "
                    f"(leave t_b unset with a split backward)"
                )
            t_b = t_i + t_w
        t_b = 0.02 if t_b is None else float(t_b)
        if t_i is None and t_w is not None:
            t_i = t_b - t_w
        if t_w is None and t_i is not None:
            t_w = t_b - t_i
        self.t_b = t_b
        self.t_i = None if t_i is None else float(t_i)
        self.t_w = None if t_w is None else float(t_w)
        for name, value in (("t_f", self.t_f), ("t_b", t_b), ("t_i", t_i), ("t_w", t_w)):
            if value is not None and not value >= 0:
                raise ValueError(f"SleepLayer: {name} must be >= 0, got {value!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The clock starts here, not inside the autograd Function: entering it costs ~0.1 ms.
        deadline = time.perf_counter() + self.t_f
        w, b = self.linear.weight, self.linear.bias
        if not self.split:
            return _TimedLinearTanh.apply(x, w, b, deadline, self.t_b)
        y_box: list[torch.Tensor] = []
        z_x = _InputPath.apply(x, w.detach(), b.detach(), y_box, self.t_i)
        z_w = _WeightPath.apply(w, b, x.detach(), y_box, self.t_w)
        return _JoinTanh.apply(z_x, z_w, y_box, deadline)


def sleep_layers(
    num_layers: int,
    width: int = 16,
    t_f: float = 0.01,
    t_b: float | None = None,
    t_i: float | None = None,
    t_w: float | None = None,
):
    """Builders for ``num_layers`` sleep layers (one callable per layer, for lazy construction)."""
    return [lambda: SleepLayer(width, t_f, t_b, t_i, t_w) for _ in range(num_layers)]
