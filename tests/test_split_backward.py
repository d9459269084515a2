"""Split backward (I then W) == one fused backward, on one process: every gradient, the input
gradient and the weight gradients, for the graph shapes a pipeline stage can have."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_pp.models.virtual_device import SleepLayer
from lightning_pp.runtime.split_backward import backward_input, fused_backward

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


class Block(nn.Module):
    """Pre-norm transformer block (attention + MLP), as in the benchmark workload."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.att = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        a = self.ln1(x)
        x = x + self.att(a, a, a, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Twice(nn.Module):
    """One Linear used twice (a weight shared inside a stage): two intermediates, one group."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class _CustomLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        return torch.tanh(_CustomLinear.apply(x, self.w))


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


class TupleOut(nn.Module):
    """(hidden, mask) out, plus a bias output that does not depend on the input at all."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.pos = nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.tanh(self.lin(x)), (x[:, 0] > 0).long(), self.pos * 2


class ForkOut(nn.Module):
    """Two outputs, the second computed from the first: on the first stage both are roots of
    W's call that share the first Linear's weights, and the first's gradient is its own output
    gradient plus what flows back from the second (a clamp to the former lost the latter)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return h, self.b(torch.tanh(h))


def _compare(model: nn.Module, x: torch.Tensor, *, x_grad: bool = True, expect_fused=False):
    ref = copy.deepcopy(model)
    x1 = x.clone().requires_grad_(x_grad)
    outs = model(x1)
    outs = outs if isinstance(outs, tuple) else (outs,)
    outs = [o for o in outs if o.is_floating_point() and o.requires_grad]
    grads = [torch.randn_like(o) for o in outs]
    dx, work = backward_input(outs, grads, (x1,))
    assert work.fused == expect_fused, work.reason
    if not expect_fused:
        assert all(p.grad is None for p in model.parameters()), "I wrote a weight gradient"
    work.run()
    x2 = x.clone().requires_grad_(x_grad)
    outs2 = ref(x2)
    outs2 = outs2 if isinstance(outs2, tuple) else (outs2,)
    outs2 = [o for o in outs2 if o.is_floating_point() and o.requires_grad]
    fused_backward(outs2, grads)
    if x_grad:
        torch.testing.assert_close(dx[0], x2.grad, rtol=1e-6, atol=1e-7)
    else:
        assert dx == (None,)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
    return work


MODELS = {
    "transformer": (lambda: nn.Sequential(Block(), Block()), (2, 5, 16)),
    "mlp": (lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)), (4, 8)),
    "shared-weight": (Twice, (4, 8)),
    "checkpoint": (Checkpointed, (4, 8)),
    "tuple-out": (TupleOut, (4, 8)),
    "output-feeds-output": (ForkOut, (4, 8)),
    "sleep-split": (
        lambda: nn.Sequential(*[SleepLayer(8, 0, t_i=0, t_w=0) for _ in range(2)]),
        (4, 8),
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("x_grad", [True, False], ids=["stage", "first-stage"])
def test_split_equals_fused(name, x_grad):
    torch.manual_seed(0)
    build, shape = MODELS[name]
    _compare(build(), torch.randn(*shape), x_grad=x_grad)


def test_first_stage_input_gradient_is_a_no_op():
    """No input needs a gradient: I computes nothing, W runs the whole backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    y = model(x)
    dx, work = backward_input((y,), (torch.ones_like(y),), (x,))
    assert dx == (None,) and len(work.groups) == 1
    assert all(p.grad is None for p in model.parameters())
    work.run()
    assert all(p.grad is not None for p in model.parameters())


def test_custom_function_falls_back_to_fused():
    torch.manual_seed(0)
    work = _compare(nn.Sequential(nn.Linear(8, 8), Custom()), torch.randn(4, 8), expect_fused=True)
    assert "_CustomLinear" in work.reason


def test_frozen_and_parameter_free_stages():
    torch.manual_seed(0)
    frozen = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    frozen.requires_grad_(False)
    work = _compare(frozen, torch.randn(4, 8))
    assert not work.groups  # nothing for W
    work = _compare(nn.Tanh(), torch.randn(4, 8))
    assert not work.groups
    half = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    half[0].requires_grad_(False)
    _compare(half, torch.randn(4, 8))


def test_weight_work_releases_the_graph():
    """After W, nothing autograd saved for the microbatch is left alive."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    saved = []

    def pack(t):
        t = t.detach()
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    dx, work = backward_input((y,), (torch.ones_like(y),), (x,))
    del y
    gc.collect()
    assert any(r() is not None for r in saved)  # W still needs them
    work.run()
    del work
    gc.collect()
    assert all(r() is None for r in saved)
