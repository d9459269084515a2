"""Megatron's second sequence-parallel saving (``lightning_pp.models.sequence_parallel``): a
column-wise projection keeps the rank's ``T / tp`` positions of its gathered input and
all-gathers them again in backward.

One ``DecoderBlock`` (fp32) at tp2 on gloo, in the shared 2-rank world, against the same block
unsharded in one process, on the same batch:

* the output, the input gradient and every weight gradient equal the unsharded block's
  (relative 1e-6), under a fused backward and under the split backward (``I`` then ``W``, as the
  zero-bubble schedules run it);
* what autograd saves, counted from the storages as the engine's meter counts them, is what
  torch's ``ColwiseParallel`` saved (the same block built with it) less the two gathered norm
  outputs but for the rank's part: ``2 x B x T x C x 4 x (1 - 1 / tp)`` bytes;
* the regather costs one all-gather per norm, in ``W`` (none in ``I``), and one per norm in a
  fused backward: q, k and v share theirs;
* a block whose norm output is not tagged falls back to ``ColwiseParallel``'s computation and
  says so once.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from worlds import world

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))  # pp_common

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick (a 2-rank world, seconds)

B, T, C, HEADS = 2, 8, 16, 4
TP = 2
TOL = 1e-6


def _block_case(rank: int, size: int, backward: str, style: str) -> dict:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from benchmarks.bench_tp import torch_colwise
    from lightning_pp.models.decoder import DecoderBlock, _sequence_parallel
    from lightning_pp.runtime.split_backward import backward_input

    torch.manual_seed(0)
    ref = DecoderBlock(C, HEADS, 0.0, 2)
    block = copy.deepcopy(ref)
    mesh = DeviceMesh("cpu", list(range(size)))
    with torch_colwise(style == "torch"):  # torch's own column-wise style, for its bytes
        _sequence_parallel(block, 1, mesh)
    x = torch.randn(B, T, C)
    g = torch.randn(B, T, C)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(g)

    part = slice(rank * T // size, (rank + 1) * T // size)
    x_local = x[:, part].clone().requires_grad_()
    saved: dict[int, int] = {}  # storage: bytes, parameters left out (the engine's meter)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = {local(p).untyped_storage().data_ptr() for p in block.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    gathers = {"I": 0, "W": 0}
    phase = ["F"]
    original = funcol.all_gather_tensor

    def counted(*args, **kwargs):
        if phase[0] in gathers:
            gathers[phase[0]] += 1
        return original(*args, **kwargs)

    funcol.all_gather_tensor = counted
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block(x_local)
        g_local = g[:, part]
        if backward == "fused":
            phase[0] = "W"
            y.backward(g_local)
        else:
            phase[0] = "I"
            dx, work = backward_input((y,), (g_local,), (x_local,))
            assert not work.fused, work.reason
            x_local.grad = dx[0]
            phase[0] = "W"
            work.run()
    finally:
        funcol.all_gather_tensor = original

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()

    errors = {
        "out": rel(y, y_ref[:, part].detach()),
        "dx": rel(x_local.grad, x_ref.grad[:, part]),
    }
    for (name, p), (_, p_ref) in zip(block.named_parameters(), ref.named_parameters()):
        if name == "k.bias":  # its gradient is zero up to rounding (softmax is shift-invariant)
            continue
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        errors[name] = rel(grad, p_ref.grad)
    return {"errors": errors, "saved": sum(saved.values()), "gathers": gathers}


@pytest.fixture(scope="module")
def blocks() -> dict[tuple[str, str], list[dict]]:
    w = world("gloo", TP)
    return {
        (backward, style): w.run(_block_case, backward, style)
        for backward in ("fused", "split")
        for style in ("ours", "torch")
    }


@pytest.mark.parametrize("backward", ["fused", "split"])
@pytest.mark.parametrize("style", ["ours", "torch"])
def test_the_block_equals_the_unsharded_block(blocks, backward, style):
    for rank, r in enumerate(blocks[(backward, style)]):
        bad = {k: e for k, e in r["errors"].items() if e > TOL}
        assert not bad, (rank, backward, style, bad)
        assert len(r["errors"]) == 2 + 15, sorted(r["errors"])  # every parameter but k.bias


@pytest.mark.parametrize("backward", ["fused", "split"])
def test_each_projection_keeps_the_ranks_part_of_its_input(blocks, backward):
    whole = B * T * C * 4  # one gathered norm output, fp32
    for ours, torch_style in zip(blocks[(backward, "ours")], blocks[(backward, "torch")]):
        assert torch_style["saved"] - ours["saved"] == 2 * whole * (1 - 1 / TP), (
            ours["saved"],
            torch_style["saved"],
        )


def test_the_regather_is_one_all_gather_per_norm_in_w(blocks):
    for r in blocks[("split", "ours")]:
        assert r["gathers"] == {"I": 0, "W": 2}
    for r in blocks[("fused", "ours")]:
        assert r["gathers"] == {"I": 0, "W": 2}
    for r in blocks[("split", "torch")]:  # torch's style gathers in forward only
        assert r["gathers"] == {"I": 0, "W": 0}


def _untagged_case(rank: int, size: int) -> float:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_pp.models.sequence_parallel import TAG, ColwiseFromSequence

    torch.manual_seed(0)
    ref = torch.nn.Linear(C, 2 * C)
    lin = copy.deepcopy(ref)
    mesh = DeviceMesh("cpu", list(range(size)))
    parallelize_module(lin, mesh, ColwiseFromSequence())
    x = torch.randn(B, T, C)
    xd = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    assert not hasattr(xd, TAG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = lin(xd)  # a local shard of the output columns
        lin(xd)  # said once per projection
        with torch.no_grad():  # nothing saved for backward: nothing to say
            lin(xd)
    cols = slice(rank * C, (rank + 1) * C)
    return (y - ref(x)[..., cols]).abs().max().item(), [str(w.message) for w in caught]


def test_an_untagged_input_is_computed_as_colwise_parallel_and_said_once():
    for err, said in world("gloo", TP).run(_untagged_case):
        assert err <= 1e-6
        assert len(said) == 1 and "carries no GatherSequence tag" in said[0], said
        assert "Linear(16, 32)" in said[0] and "(2, 8, 16)" in said[0], said


def _collectives_case(rank: int, size: int) -> dict:
    """Each layer of a sequence-parallel DecoderLM at tp2 through one forward and a fused
    backward, counting the functional collectives DTensor and the regather launch (the outer
    call only: all_gather_tensor calls all_gather_single) and the whole bytes each moves."""
    import torch.distributed._functional_collectives as funcol
    from pp_common import MODEL_KW
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_pp.models.decoder import DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(**MODEL_KW, sequence_parallel=True)
    model.configure_model()
    pipeline = model.pipeline_layers()
    layers = [pipeline[i] for i in range(pipeline.num_layers)]
    mesh = DeviceMesh("cpu", list(range(size)))
    for i, layer in enumerate(layers):
        model.pipeline_tensor_parallel(layer, i, mesh)
    phase, depth = ["F"], [0]
    counted: dict[str, list[int]] = {"F": [], "B": []}
    names = ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor")
    names += ("reduce_scatter_single",)
    real = {n: getattr(funcol, n) for n in names}

    def wrap(name: str):
        def call(t, *args, **kwargs):
            if depth[0]:
                return real[name](t, *args, **kwargs)
            depth[0] += 1
            try:
                out = real[name](t, *args, **kwargs)
            finally:
                depth[0] -= 1
            whole = t.numel() * t.element_size() * (size if "gather" in name else 1)
            # in halves: an all-gather or a reduce-scatter is one, an all-reduce two
            counted[phase[0]] += [whole] * (2 if name == "all_reduce" else 1)
            return out

        return call

    for n in names:
        setattr(funcol, n, wrap(n))
    out = []
    try:
        x = torch.randint(0, MODEL_KW["vocab_size"], (2, MODEL_KW["block_size"]))
        for layer in layers:
            counted["F"], counted["B"] = [], []
            phase[0] = "F"
            y = layer(x)
            phase[0] = "B"
            y.backward(torch.ones_like(y))
            out.append({"F": sorted(counted["F"]), "B": sorted(counted["B"])})
            x = y.detach().requires_grad_()
    finally:
        for n in names:
            setattr(funcol, n, real[n])
    return {"layers": out}


def test_the_planners_collectives_are_the_ones_a_sequence_parallel_layer_runs():
    """The planner's tp collectives of each DecoderLM layer under sequence parallelism
    (``tensor_parallel.tp_layers``, in halves: an all-gather or a reduce-scatter one, an
    all-reduce two, each of its whole bytes) against what one forward and backward of the
    real layer at tp2 launch: the same halves of the same bytes, forward and backward (per
    block 2 + 2 and 4 + 2; before, the planner counted an all-reduce per projection), the
    position table's gradient gathered once per microbatch, whatever the batch."""
    from pp_common import MODEL_KW

    from lightning_pp.models.decoder import DecoderLM
    from lightning_pp.planner.meta_profile import meta_layers
    from lightning_pp.planner.tensor_parallel import record_tp_styles, tp_layers

    with torch.device("meta"):
        model = DecoderLM(**MODEL_KW, sequence_parallel=True)
        model.configure_model()
    layers = meta_layers(model)
    styles = record_tp_styles(model, layers, TP)
    assert styles is not None
    x0 = torch.zeros(1, MODEL_KW["block_size"], dtype=torch.long, device="meta")
    shares = tp_layers(layers, styles, x0, TP)
    measured = world("gloo", TP).run(_collectives_case)[0]["layers"]
    assert len(measured) == len(shares) == MODEL_KW["n_layer"] + 2  # embedding, blocks, head

    def halves(all_reduce: tuple[int, ...], half: tuple[int, ...], fixed=()) -> list[int]:
        # per sample in the plan (the measured batch has 2 samples), ``fixed`` per microbatch
        return sorted([*(2 * b for b in [*all_reduce, *all_reduce, *half]), *fixed])

    for i, (share, got) in enumerate(zip(shares, measured)):
        assert halves(share.fwd_all_reduce, share.all_gather) == got["F"], (i, share, got)
        bwd = halves(share.bwd_all_reduce, share.bwd_all_gather, share.bwd_all_gather_fixed)
        assert bwd == got["B"], (i, share, got)
    assert len(measured[1]["F"]) == 4 and len(measured[1]["B"]) == 6, measured[1]
