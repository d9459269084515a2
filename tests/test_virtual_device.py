"""The virtual-device layer: the gradients of tanh(Linear) and at least its nominal costs."""

from __future__ import annotations

import time

import torch

from lightning_pp.models.virtual_device import SleepLayer, hold_until


def test_gradients_match_tanh_linear():
    torch.manual_seed(0)
    layer = SleepLayer(width=5, t_f=0.0, t_b=0.0).double()
    x = torch.randn(3, 7, 5, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    ref = torch.tanh(layer.linear(x))
    assert torch.allclose(y, ref, rtol=0, atol=1e-14)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, layer.linear.weight, layer.linear.bias), g)
    want = torch.autograd.grad(ref, (x, layer.linear.weight, layer.linear.bias), g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda t: layer(t), (x[:1, :2].detach().requires_grad_(),), eps=1e-6
    )


def test_input_without_grad_gets_no_input_gradient():
    layer = SleepLayer(width=4, t_f=0.0, t_b=0.0)
    layer(torch.randn(2, 4)).sum().backward()
    assert layer.linear.weight.grad is not None and layer.linear.bias.grad is not None


def test_forward_and_backward_take_at_least_their_costs():
    """A lower bound only (a loaded machine may add any delay): the layer never runs short."""
    layer = SleepLayer(width=4, t_f=0.004, t_b=0.008)
    x = torch.randn(2, 4, requires_grad=True)
    t0 = time.perf_counter()
    y = layer(x)
    t1 = time.perf_counter()
    y.sum().backward()
    t2 = time.perf_counter()
    assert t1 - t0 >= 0.004
    assert t2 - t1 >= 0.008


def test_hold_until_returns_at_or_after_the_deadline():
    for delay in (0.0, 0.0001, 0.002):
        deadline = time.perf_counter() + delay
        hold_until(deadline)
        assert time.perf_counter() >= deadline
