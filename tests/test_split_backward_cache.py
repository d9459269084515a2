"""The split backward's analysis is cached per graph shape (``split_backward._PLANS``): every
microbatch of a chunk walks its own graph, and a graph of a shape seen before reuses the
analysis, mapped onto this graph's nodes. A cache that gave the wrong nodes, or reused the
analysis of another shape, would silently give wrong gradients: each case here compares a
split backward with a fused one, microbatch after microbatch, while the shape changes."""

from __future__ import annotations

import copy

import pytest
import torch
from test_split_backward import Block
from torch import nn

from lightning_pp.runtime import split_backward as sb
from lightning_pp.runtime.split_backward import backward_input, fused_backward

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


class Branchy(nn.Module):
    """A forward whose graph depends on the call: which Linear (same shapes: same graph shape,
    other weights), an extra path through a third Linear, a frozen Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.mode = "a"

    def forward(self, x):
        if self.mode == "a":
            h = self.a(x)
        elif self.mode == "b":
            h = self.b(x)
        elif self.mode == "ac":
            h = self.a(x) + self.c(torch.tanh(x))
        else:  # "ca": the same ops as "ac", the other way round
            h = self.c(torch.tanh(x)) + self.a(x)
        return torch.tanh(self.c(torch.relu(h)))


def _split_vs_fused(model: nn.Module, x: torch.Tensor, x_grad: bool = True) -> None:
    """One microbatch: split (I then W) on ``model`` against fused on a copy, bitwise."""
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    x1 = x.clone().requires_grad_(x_grad)
    y = model(x1)
    g = torch.randn_like(y)
    dx, work = backward_input((y,), (g,), (x1,))
    assert not work.fused, work.reason
    assert all(p.grad is None for p in model.parameters()), "I wrote a weight gradient"
    work.run()
    x2 = x.clone().requires_grad_(x_grad)
    fused_backward((ref(x2),), (g,))
    if x_grad:
        assert torch.equal(dx[0], x2.grad)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            assert p.grad is not None, name
            assert torch.equal(p.grad, q.grad), name


def test_same_shape_reuses_the_analysis_on_new_nodes():
    torch.manual_seed(0)
    model = Branchy()
    sb._PLANS.clear()
    for _ in range(3):
        _split_vs_fused(model, torch.randn(4, 8))
    assert len(sb._PLANS) == 1  # three microbatches, one analysis
    # another Linear of the same shape: the same graph shape, the plan's positions now name
    # b's nodes (a cache of nodes rather than positions would send the gradient to a)
    model.mode = "b"
    _split_vs_fused(model, torch.randn(4, 8))
    assert len(sb._PLANS) == 1


@pytest.mark.parametrize(
    "modes", [["a", "ac", "a", "ca", "ac"], ["ac", "ca", "b", "ca"]], ids=["grow", "swap"]
)
def test_shape_changes_between_microbatches(modes):
    torch.manual_seed(0)
    model = Branchy()
    sb._PLANS.clear()
    for mode in modes:
        model.mode = mode
        _split_vs_fused(model, torch.randn(4, 8))
    assert len(sb._PLANS) == len({"b" if m == "a" else m for m in modes})


def test_frozen_weight_and_first_stage_change_the_shape():
    torch.manual_seed(0)
    model = Branchy()
    model.mode = "ac"
    sb._PLANS.clear()
    _split_vs_fused(model, torch.randn(4, 8))
    model.a.requires_grad_(False)  # a's weights leave the graph
    _split_vs_fused(model, torch.randn(4, 8))
    model.a.requires_grad_(True)
    _split_vs_fused(model, torch.randn(4, 8), x_grad=False)  # the first stage: no input path
    _split_vs_fused(model, torch.randn(4, 8))
    assert len(sb._PLANS) == 3


def test_transformer_microbatches_of_varying_sequence_length():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    sb._PLANS.clear()
    for seq in (5, 7, 5, 1, 7):
        _split_vs_fused(model, torch.randn(2, seq, 16))
    assert 1 <= len(sb._PLANS) <= 3


def test_cache_is_bounded_and_holds_no_graph():
    """Only types and positions are cached: dropping the WeightWork frees the graph."""
    import gc
    import weakref

    torch.manual_seed(0)
    sb._PLANS.clear()
    for width in range(1, sb._PLANS_MAX + 5):
        lin = nn.Sequential(*[nn.Linear(2, 2) for _ in range(width)])
        x = torch.randn(1, 2, requires_grad=True)
        y = lin(x)
        _, work = backward_input((y,), (torch.ones_like(y),), (x,))
        work.run()
    assert len(sb._PLANS) == sb._PLANS_MAX
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    saved = []

    def pack(t):
        t = t.detach()
        saved.append(weakref.ref(t))
        return t

    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    _, work = backward_input((y,), (torch.ones_like(y),), (x,))
    del y
    work.run()
    del work
    gc.collect()
    assert saved and all(r() is None for r in saved)
