"""W without the autograd engine (lightning_pp.runtime.weight_grad_direct): the same gradients, bit
for
bit, as the engine's W; the graph freed at I where every W layer is a Linear or a norm; the
engine's way kept for everything the direct path cannot vouch for."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lightning_pp.runtime.split_backward as sb
from lightning_pp.runtime.split_backward import backward_input, fused_backward

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


class Block(nn.Module):
    """Pre-norm block: LayerNorm, Linear (bias), GELU, Linear (no bias), a residual."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))


class Scaled(nn.Module):
    """A weight dividing elementwise: not a layer the direct path knows (W is an engine call)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return torch.tanh(self.lin(x)) / self.scale


class NormBiasOnly(nn.Module):
    """A norm with a bias and no weight (one affine edge: which one, only the node tells)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.randn(dim))
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return self.lin(torch.nn.functional.layer_norm(x, (x.shape[-1],), None, self.b))


class WeightTimesInput(nn.Module):
    """``W @ x^T``: an mm whose first operand is the weight (not a Linear: the engine's W)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / 3)

    def forward(self, x):
        return torch.tanh((self.w @ x.t()).t())


class RMSNorm(nn.Module):
    """Llama / Qwen2 style: the normalisation in fp32, then ``weight * x`` (or ``x * weight``)."""

    def __init__(self, dim: int = 8, weight_first: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.weight_first = weight_first

    def forward(self, x):
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return self.weight * h if self.weight_first else h * self.weight


MODELS = {
    "linear-2d": (lambda: nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 5)), (4, 8)),
    "blocks-3d": (lambda: nn.Sequential(Block(), Block()), (2, 5, 8)),
    "norm-no-bias": (lambda: nn.Sequential(nn.LayerNorm(8, bias=False), nn.Linear(8, 8)), (3, 8)),
    "frozen-bias": (lambda: _frozen(bias=True), (4, 8)),
    "frozen-weight": (lambda: _frozen(bias=False), (4, 8)),
    "norm-bias-only": (NormBiasOnly, (3, 8)),
    "rmsnorm-mlp": (
        lambda: nn.Sequential(
            RMSNorm(), nn.Linear(8, 16, bias=False), nn.SiLU(), RMSNorm(16, False)
        ),
        (2, 3, 8),
    ),
    "divided": (Scaled, (4, 8)),
    "weight-times-input": (WeightTimesInput, (4, 8)),
}
RETAINED = ("divided", "weight-times-input")  # a W layer the direct path does not know


def _frozen(bias: bool) -> nn.Module:
    """One Linear's bias frozen (no bias edge), or another's weight (no weight edge, and no
    saved input)."""
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    (m[0].bias if bias else m[2].weight).requires_grad_(False)
    return m


def _grads(model: nn.Module, x: torch.Tensor, dy_seed: int, mode: str, autocast: bool = False):
    """Input and weight gradients of one stage backward, run ``mode`` way; plus the WeightWork."""
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = model(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(dy_seed)).to(y.dtype)
    work = None
    if mode == "fused":
        fused_backward((y,), (dy,))
        dx = x.grad
    else:
        old = sb.DIRECT_WEIGHT_GRADS
        sb.DIRECT_WEIGHT_GRADS = mode != "engine"
        try:
            (dx,), work = backward_input((y,), (dy,), (x,), free_graph=mode == "free")
            work.run()
        finally:
            sb.DIRECT_WEIGHT_GRADS = old
    return dx, {n: p.grad for n, p in model.named_parameters()}, work


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_direct_weight_grads_are_the_engines_bit_for_bit(name, autocast):
    """The graph freed at I and W computed directly, against a retained graph and the engine's
    W (and the fused backward, to 1e-6): two microbatches, so the second accumulates into
    existing grads."""
    build, shape = MODELS[name]
    torch.manual_seed(0)
    base = build()
    xs = [torch.randn(*shape), torch.randn(*shape)]
    results = {}
    for mode in ("engine", "free", "fused"):
        model = copy.deepcopy(base)
        dxs = []
        for i, x in enumerate(xs):
            dx, grads, work = _grads(model, x, i, mode, autocast)
            dxs.append(dx)
        results[mode] = (dxs, grads, work)
    ref_dx, ref_grads, _ = results["engine"]
    for mode in ("free",):
        dxs, grads, _ = results[mode]
        for a, b in zip(dxs, ref_dx):
            assert torch.equal(a, b), mode
        for n, g in grads.items():
            if ref_grads[n] is None:
                assert g is None, (mode, n)
            else:
                assert g.dtype == ref_grads[n].dtype and torch.equal(g, ref_grads[n]), (mode, n)
    if not autocast:  # bf16 sums in another order differ from fused by rounding only
        for n, g in results["fused"][1].items():
            if g is not None:
                torch.testing.assert_close(ref_grads[n], g, rtol=1e-6, atol=1e-7, msg=n)
    freed = results["free"][2].graph_freed
    assert freed == (name not in RETAINED), "only a graph whose W layers are Linear/norm frees"


def test_free_graph_keeps_only_what_w_reads():
    """A graph-free I leaves W holding the Linear inputs and the norm's input and statistics
    (storages the forward saved), not what only I's nodes read (the GELU's input); W drops
    them."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(2, 5, 8, requires_grad=True)
    saved: dict[int, int] = {}  # storage -> bytes, of everything autograd saved

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    gelu_in, norm_in = [], []
    for block in model:
        block.up.register_forward_hook(lambda m, a, out: gelu_in.append(out))
        block.ln.register_forward_hook(lambda m, a, out: norm_in.append(a[0]))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    (dx,), work = backward_input((y,), (torch.ones_like(y),), (x,), free_graph=True)
    assert work.graph_freed and work.groups == []
    held = {t.untyped_storage().data_ptr() for t in work.held() if not t.requires_grad}
    kept = held & saved.keys()
    assert kept and sum(saved[k] for k in kept) < sum(saved.values())
    for t in gelu_in:
        assert t.untyped_storage().data_ptr() not in held
    for t in norm_in:
        assert t.untyped_storage().data_ptr() in held
    work.run()
    assert work.held() == []


def test_hooked_or_unusual_parameters_keep_the_engines_way():
    """A tensor hook, a non-contiguous weight: no capture; the graph is retained and the hook
    runs once with the engine's gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    seen = []
    model[2].weight.register_hook(lambda g: seen.append(g.clone()))
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    _, grads, work = _grads(model, x, 0, "free")
    assert not work.graph_freed
    _, ref_grads, _ = _grads(ref, x, 0, "engine")
    assert len(seen) == 1 and torch.equal(seen[0], ref_grads["2.weight"])
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n

    odd = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    odd[2].weight = nn.Parameter(torch.randn(8, 8).t())  # a transposed view: not contiguous
    ref = copy.deepcopy(odd)
    _, grads, work = _grads(odd, x, 0, "free")
    assert not work.graph_freed
    _, ref_grads, _ = _grads(ref, x, 0, "engine")
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n


def test_w_under_autocast_computes_as_the_engine_would():
    """A graph-free W run inside an autocast region still computes in the forward's dtypes."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    ref = copy.deepcopy(model)
    x = torch.randn(2, 5, 8, requires_grad=True)
    y = model(x)
    (_,), work = backward_input((y,), (torch.ones_like(y),), (x,), free_graph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        work.run()
    x2 = x.detach().clone().requires_grad_(True)
    y2 = ref(x2)
    (_,), w2 = backward_input((y2,), (torch.ones_like(y2),), (x2,))  # retained, engine W
    old, sb.DIRECT_WEIGHT_GRADS = sb.DIRECT_WEIGHT_GRADS, False
    try:
        w2.run()
    finally:
        sb.DIRECT_WEIGHT_GRADS = old
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad), n


def test_a_released_input_is_named_not_miscomputed():
    """W reads a Linear's input. If that tensor's storage was swapped after the forward (the
    output release of a chunk output that a Linear of the same chunk also reads), W says so
    instead of computing garbage (a fused backward would fail inside the engine's mm)."""
    torch.manual_seed(0)
    lin, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    h = lin(x)  # a chunk output...
    y = lin2(h)  # ...that the chunk also feeds to a Linear
    h.data = torch.empty(1)  # what StepRun's output release does once h is sent
    (_,), work = backward_input((y,), (torch.ones_like(y),), (x,), free_graph=True)
    assert work.graph_freed
    with pytest.raises(RuntimeError, match="release_outputs=False"):
        work.run()


def test_hugging_face_qwen2_layers_free_their_graph():
    """Two unmodified Qwen2 decoder layers (RMSNorm, Linear with and without bias, SiLU-gated
    MLP, rotary attention): the graph is freed at I, and every gradient is bitwise the engine's
    W on a retained graph."""
    pytest.importorskip("transformers")
    from byom_models import model_fn  # the tiny Hugging Face configs of the model-API tests

    torch.manual_seed(0)
    model = model_fn("qwen2-tied")[0]()
    layers, rotary = model.model.layers[:2], model.model.rotary_emb
    x0 = torch.randn(2, 5, model.config.hidden_size)

    def stage(mods, x):
        pos = torch.arange(x.shape[1])[None]
        emb = rotary(x, pos)
        for layer in mods:
            out = layer(x, position_embeddings=emb, attention_mask=None, position_ids=pos)
            x = out[0] if isinstance(out, tuple) else out
        return x

    got = {}
    for mode, mods in (("free", layers), ("engine", copy.deepcopy(layers))):
        x = x0.clone().requires_grad_(True)
        y = stage(mods, x)
        old, sb.DIRECT_WEIGHT_GRADS = sb.DIRECT_WEIGHT_GRADS, mode == "free"
        try:
            (dx,), work = backward_input((y,), (torch.ones_like(y),), (x,), free_graph=True)
            assert work.graph_freed == (mode == "free")
            work.run()
        finally:
            sb.DIRECT_WEIGHT_GRADS = old
        got[mode] = (dx, {n: p.grad for n, p in mods.named_parameters()})
    assert torch.equal(got["free"][0], got["engine"][0])
    for n, g in got["engine"][1].items():
        assert g is not None and torch.equal(got["free"][1][n], g), n
