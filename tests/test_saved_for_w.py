"""After a split backward's ``I``, only what ``W`` unpacks again stays: the plain forward's saved
tensors (:class:`SavedForW`), a recomputed region's refill (:meth:`RecomputeOnce.trim`) and the
planner's probe (``LayerProbe.w_saved``) follow one rule, and the gradients stay those of a fused
backward. Single process; the pipeline-level figures (measured peak vs the plan) are in
``test_recompute_auto.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_pp.layout.partition import PipelineChunk
from lightning_pp.runtime.recompute import RecomputeOnce
from lightning_pp.runtime.recompute_probe import measure_chunk
from lightning_pp.runtime.saved_for_w import SavedForW
from lightning_pp.runtime.split_backward import backward_input, fused_backward, weight_nodes

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


class MLP(nn.Module):
    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return torch.tanh(self.out(F.gelu(self.fc(x))))


def _key(t: torch.Tensor):
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return out


def _fused(module, x0):
    x = x0.clone().requires_grad_(True)
    y = module(x)
    fused_backward((y,), (torch.ones_like(y),))
    return x.grad, _grads(module)


def test_trim_frees_what_only_input_gradient_nodes_read():
    torch.manual_seed(0)
    mlp, x0 = MLP(), torch.randn(5, 6)
    ref_dx, ref = _fused(mlp, x0)
    x = x0.clone().requires_grad_(True)
    kept = SavedForW(lambda t: None if isinstance(t, nn.Parameter) else _key(t))
    with kept.hooks():
        y = mlp(x)
    before = kept.counted()
    dx, work = backward_input((y,), (torch.ones_like(y),), (x,))
    names = sorted(type(n).__name__ for n in work.nodes())
    assert names.count("AddmmBackward0") == 2 and "GeluBackward0" not in names, names
    # the GELU's input (fc's output) and tanh's output: read only by I's nodes
    assert kept.trim(work.nodes()) == 2
    after = kept.counted()
    assert set(after) < set(before)
    gone = sum(before.values()) - sum(after.values())
    assert gone == 5 * 24 * 4 + 5 * 6 * 4, (before, after)  # fc's output, tanh's output (fp32)
    work.run()
    assert torch.equal(dx[0], ref_dx)
    for n, g in _grads(mlp).items():
        assert torch.equal(g, ref[n]), n


def test_shared_weight_group_keeps_the_path_between_its_roots():
    """One Linear used twice: W's engine call runs from both uses to the weight, through the
    input-path nodes between them, whose saved tensors must survive the trim."""
    torch.manual_seed(1)
    lin, other = nn.Linear(6, 6), nn.Linear(6, 6)
    both = nn.ModuleList([lin, other])

    def f(x):
        h = F.gelu(lin(x))
        h = torch.tanh(other(h)) * h
        return torch.sigmoid(lin(h))

    x0 = torch.randn(3, 6)
    x = x0.clone().requires_grad_(True)
    y = f(x)
    fused_backward((y,), (torch.ones_like(y),))
    ref_dx, ref = x.grad, _grads(both)
    x = x0.clone().requires_grad_(True)
    kept = SavedForW()
    with kept.hooks():
        y = f(x)
    dx, work = backward_input((y,), (torch.ones_like(y),), (x,))
    names = {type(n).__name__ for n in work.nodes()}
    assert {"GeluBackward0", "MulBackward0", "TanhBackward0"} <= names
    assert kept.trim(work.nodes()) == 1  # only the sigmoid's output
    work.run()
    assert torch.equal(dx[0], ref_dx)
    for n, g in _grads(both).items():
        assert torch.equal(g, ref[n]), n


def test_static_weight_nodes_match_what_w_runs():
    torch.manual_seed(2)
    mlp = MLP()
    x = torch.randn(4, 6, requires_grad=True)
    y = mlp(x)
    static = weight_nodes((y,), (x,))
    _, work = backward_input((y,), (torch.ones_like(y),), (x,))
    assert static is not None and {id(n) for n in static} == {id(n) for n in work.nodes()}
    work.run()
    assert work.nodes() == set()  # nothing left to run


def test_recompute_once_keeps_only_what_w_reads_and_recomputes_once():
    torch.manual_seed(3)
    mlp, x0 = MLP(), torch.randn(5, 6)
    ref_dx, ref = _fused(mlp, x0)
    x = x0.clone().requires_grad_(True)
    frame = RecomputeOnce(mlp)
    y = frame(x)
    dx, work = backward_input((y,), (torch.ones_like(y),), (x,))
    held = len([t for t in frame.held() if not isinstance(t, nn.Parameter)])
    assert frame.trim(work.nodes()) == 2
    assert len([t for t in frame.held() if not isinstance(t, nn.Parameter)]) == held - 2
    work.run()
    assert frame.recomputes == 1  # W found everything it reads
    assert torch.equal(dx[0], ref_dx)
    for n, g in _grads(mlp).items():
        assert torch.equal(g, ref[n]), n


def test_outer_trim_keeps_a_recomputed_regions_inputs():
    """A region that recomputes again for W reads its saved inputs inside I (pinned), so the
    chunk-level trim around it must not free them."""
    torch.manual_seed(4)
    first, mlp = nn.Linear(6, 6), MLP()
    model = nn.Sequential(first, nn.ReLU(), mlp)
    x0 = torch.randn(5, 6)
    ref_dx, ref = _fused(model, x0)
    x = x0.clone().requires_grad_(True)
    kept = SavedForW()
    frame = RecomputeOnce(mlp, again=True)
    with kept.hooks():
        y = frame(torch.relu(first(x)))
    dx, work = backward_input((y,), (torch.ones_like(y),), (x,))
    kept.trim(work.nodes())
    frame.release()
    work.run()
    assert frame.recomputes == 2
    assert torch.equal(dx[0], ref_dx)
    for n, g in _grads(model).items():
        assert torch.equal(g, ref[n]), n


def test_probe_reports_what_w_keeps_per_layer():
    torch.manual_seed(5)
    chunk = PipelineChunk([MLP(), MLP()], range(2, 4))
    x = torch.randn(5, 6, requires_grad=True)

    def key(t):
        return None if isinstance(t, nn.Parameter) else _key(t)

    _, plain = measure_chunk(chunk, (x,), key)
    _, split = measure_chunk(chunk, (x,), key, split=True)
    for p, s in zip(plain, split):
        assert p.w_saved is None and s.w_saved is not None
        assert set(s.w_saved) < set(s.saved)  # fc's output and tanh's output are not for W
        assert sum(s.saved.values()) - sum(s.w_saved.values()) == 5 * 24 * 4 + 5 * 6 * 4
    # the first stage (an input without grad): W runs the whole backward, nothing trimmed
    _, first = measure_chunk(chunk, (torch.randn(5, 6),), key, split=True)
    assert all(p.w_saved is None and p.kept_for_w == p.saved for p in first)
