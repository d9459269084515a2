"""The virtual-device layer: the gradients of tanh(Linear) and at least its nominal costs."""

from __future__ import annotations

import time

import pytest
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


# --- split backward: separately timed input-gradient (I) and weight-gradient (W) nodes ---------


def test_split_layer_values_and_gradients_match_tanh_linear():
    torch.manual_seed(0)
    layer = SleepLayer(width=5, t_f=0.0, t_i=0.0, t_w=0.0).double()
    assert layer.split
    x = torch.randn(3, 7, 5, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    ref = torch.tanh(layer.linear(x))
    assert torch.allclose(y, ref, rtol=0, atol=1e-14)
    g = torch.randn_like(y)
    params = (layer.linear.weight, layer.linear.bias)
    want = torch.autograd.grad(ref, (x, *params), g)
    # Fused: one pass for everything.
    got = torch.autograd.grad(y, (x, *params), g, retain_graph=True)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    # Split the way zero-bubble runtimes do: input gradient first, weights later.
    (gx,) = torch.autograd.grad(y, x, g, retain_graph=True)
    gw, gb = torch.autograd.grad(y, params, g)
    for a, b in zip((gx, gw, gb), want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda t: layer(t), (x[:1, :2].detach().requires_grad_(),), eps=1e-6
    )


def test_split_layer_charges_t_i_to_the_input_pass_and_t_w_to_the_weight_pass():
    """Lower bounds for both passes; the I pass must not pay for W, which is made long (0.25 s)
    so that "did not pay" holds with a wide margin even on a loaded machine."""
    t_i, t_w = 0.004, 0.25
    layer = SleepLayer(width=4, t_f=0.002, t_i=t_i, t_w=t_w)
    x = torch.randn(2, 4, requires_grad=True)
    y = layer(x)
    g = torch.ones_like(y)
    t0 = time.perf_counter()
    torch.autograd.grad(y, x, g, retain_graph=True)
    t1 = time.perf_counter()
    torch.autograd.grad(y, (layer.linear.weight, layer.linear.bias), g)
    t2 = time.perf_counter()
    assert t1 - t0 >= t_i
    assert t1 - t0 < t_w
    assert t2 - t1 >= t_w


def test_split_layer_fused_backward_costs_t_i_plus_t_w():
    layer = SleepLayer(width=4, t_f=0.0, t_i=0.003, t_w=0.005)
    assert layer.t_b == 0.008
    x = torch.randn(2, 4, requires_grad=True)
    y = layer(x)
    t0 = time.perf_counter()
    y.sum().backward()
    assert time.perf_counter() - t0 >= 0.008
    assert x.grad is not None and layer.linear.weight.grad is not None


def test_split_layer_without_input_grad_has_no_input_pass():
    # Data into the first stage: only the W node is in the graph, and only it is charged.
    layer = SleepLayer(width=4, t_f=0.0, t_i=0.25, t_w=0.002)
    y = layer(torch.randn(2, 4))
    t0 = time.perf_counter()
    y.sum().backward()
    assert time.perf_counter() - t0 < 0.25
    assert layer.linear.weight.grad is not None and layer.linear.bias.grad is not None


def test_split_costs_resolve_like_the_simulator():
    assert (SleepLayer(t_f=0.0, t_b=0.01, t_i=0.004).t_w) == pytest.approx(0.006)
    assert (SleepLayer(t_f=0.0, t_b=0.01, t_w=0.004).t_i) == pytest.approx(0.006)
    fused = SleepLayer(t_f=0.01)
    assert not fused.split and fused.t_b == 0.02 and fused.t_i is None
    with pytest.raises(ValueError, match=r"t_b=0.5 must equal t_i \+ t_w = 0.1 \+ 0.2"):
        SleepLayer(t_b=0.5, t_i=0.1, t_w=0.2)
    with pytest.raises(ValueError, match="t_w must be >= 0"):
        SleepLayer(t_b=0.01, t_i=0.02)
