"""Activation recompute on the engine: gradients equal the run without recompute.

One spawned world of 4 ranks (pp=2 cases: two pipelines, dp=2, each on its own data) runs every
case. Each case trains the same model twice on each rank, without and with recompute, from the
same weights and the same RNG seed before every step, so dropout draws the same masks: the loss
and every gradient must agree to fp32 rounding (relative <= 1e-6; in practice bitwise, since
checkpoint restores the RNG state for the recompute). The model has tuple activations
(hidden, int64 mask), dropout and a weight tied between two blocks.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from engine_models import VOCAB, Embed, Head, mse_loss, rel_err, tuple_batch, tuple_input_fn
from torch import nn

from lightning_pp.layout.partition import PipelineChunk, partition_layers
from lightning_pp.layout.recompute_spec import Selective, parse_bytes, parse_recompute
from lightning_pp.layout.topology import PipelineTopology, build_process_groups
from lightning_pp.planner.recompute import plan_auto
from lightning_pp.runtime.engine import PipelineEngine
from lightning_pp.runtime.recompute import RecomputeOnce
from lightning_pp.schedules import build_schedule

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

WORLD = 4
DIM = 8
TOL = 1e-6
STEPS = 1


class Attn(nn.Module):
    """Stands in for attention: the 'selective' recompute target."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.2)

    def forward(self, h):
        return self.drop(torch.softmax(self.proj(h), dim=-1) * h)


class DBlock(nn.Module):
    """Residual block with dropout; counts its forward calls (a recompute calls it again)."""

    calls = 0

    def __init__(self, dim: int):
        super().__init__()
        self.attn = Attn(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        DBlock.calls += 1
        h, mask = x
        m = mask.unsqueeze(-1).to(h.dtype)
        h = h + self.attn(h) * m
        h = h + self.drop(self.mlp(h)) * m
        return h, mask


def model_layers(seed: int, blocks: int = 6) -> list[nn.Module]:
    torch.manual_seed(seed)
    layers = [Embed(VOCAB, DIM), *[DBlock(DIM) for _ in range(blocks)], Head(DIM)]
    layers[4].attn.proj.weight = layers[1].attn.proj.weight  # tied (one rank under some shapes)
    return layers


def local_chunks(layers, schedule, pp_rank):
    """This rank's chunks over ONE deep copy of the whole list (ties within the rank survive)."""
    layers = copy.deepcopy(layers)
    ranges = partition_layers(len(layers), schedule.pp, schedule.vpp)
    return [
        PipelineChunk([layers[i] for i in ranges[s]], ranges[s])
        for s in schedule.stages_of(pp_rank)
    ]


def _case(schedule, pp, mode, m=4, vpp=None):
    vpp = vpp or (2 if schedule in ("interleaved", "zbv") else 1)
    return dict(
        id=f"{schedule}-pp{pp}-{mode}-m{m}", schedule=schedule, pp=pp, vpp=vpp, m=m, mode=mode
    )


MODES = {"full": "full", "selective": "selective:attn", "layers": [0, 2, 5, 7], "auto": "auto"}
CASES = [
    _case(s, pp, mode)
    for s in ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
    for pp in (2, 4)
    for mode in ("full", "selective", "auto")
] + [_case("1f1b", 2, "layers"), _case("interleaved", 2, "layers", m=4)]


def _grads(chunks):
    return {
        f"{c}.{n}": p.grad.clone()
        for c, chunk in enumerate(chunks)
        for n, p in chunk.named_parameters()
        if p.grad is not None
    }


def _run(rank, case, groups_cache):
    pp = case["pp"]
    topo = PipelineTopology.from_world(WORLD, rank, pp)
    if pp not in groups_cache:
        groups_cache[pp] = build_process_groups(topo)
    schedule = build_schedule(case["schedule"], pp=pp, microbatches=case["m"], vpp=case["vpp"])
    layers = model_layers(7)
    batches = [tuple_batch(50 + 10 * topo.dp_rank + s, 8, 5) for s in range(STEPS)]
    out = {"pp_rank": topo.pp_rank, "err": 0.0, "worst": "", "missing": []}
    runs = {}
    for mode in (None, MODES[case["mode"]]):
        chunks = local_chunks(layers, schedule, topo.pp_rank)
        engine = PipelineEngine(
            chunks,
            schedule,
            topo,
            groups_cache[pp],
            loss_fn=mse_loss("mean"),
            input_fn=tuple_input_fn,
            measure_memory=True,
            recompute=None if mode == "auto" else mode,
        )
        if mode == "auto":
            # a budget halfway between the least-memory choice and no recompute, on the
            # heaviest rank: every rank fits and the heavy ones recompute
            probes = engine.probe_step(batches[0])
            wide = plan_auto(engine, batches[0], 10**15, probes=probes)
            most = max(r.none_peak for r in wide.ranks)
            least = max(r.min_peak for r in wide.ranks)
            plan_auto(engine, batches[0], (most + least) // 2, probes=probes)
        opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.1)
        losses, grads, peaks, calls = [], [], [], []
        for s, batch in enumerate(batches):
            torch.manual_seed(1000 + 17 * s + rank)
            DBlock.calls = 0
            res = engine.train_step(batch)
            calls.append(DBlock.calls)
            losses.append(res.loss.item())
            grads.append(_grads(chunks))
            peaks.append(res.record.peak_saved_bytes)
            opt.step()
            opt.zero_grad()
        DBlock.calls = 0
        ev = engine.eval_step(batches[0])
        runs[mode is not None] = dict(
            losses=losses,
            grads=grads,
            peak=max(peaks),
            calls=calls,
            eval=ev.loss.item(),
            eval_calls=DBlock.calls,
            targets=[[n for n, _ in t] for t in engine.recompute_targets],
        )
    base, rc = runs[False], runs[True]
    for a, b in zip(rc["losses"], base["losses"]):
        out["err"] = max(out["err"], abs(a - b) / max(abs(b), 1e-12))
    for s, (ga, gb) in enumerate(zip(rc["grads"], base["grads"])):
        if ga.keys() != gb.keys():
            out["missing"].append(f"step {s}: {sorted(ga.keys() ^ gb.keys())}")
        for k in ga.keys() & gb.keys():
            e = rel_err(ga[k], gb[k])
            if e > out["err"]:
                out["err"], out["worst"] = e, f"step {s} {k}"
    # What outlives the steps: no recompute frame (each holds its region's inputs and what it
    # recomputed) and no autograd reference to a weight (a saved tensor or an accumulator of
    # a graph still alive). A frame's recompute hook that kept the recomputed forward's
    # tensors leaked every frame and its graph, every step (about 1 GiB per 1,000 steps of
    # the demo under zbv: benchmarks/memory_creep.py --set strategy.recompute=full).
    del engine
    gc.collect()
    out["frames_alive"] = sum(isinstance(o, RecomputeOnce) for o in gc.get_objects())
    out["weight_refs"] = max(p._use_count() for c in chunks for p in c.parameters())
    out.update(
        peak=(base["peak"], rc["peak"]),
        calls=(base["calls"], rc["calls"]),
        eval=(base["eval"], rc["eval"]),
        eval_calls=(base["eval_calls"], rc["eval_calls"]),
        targets=rc["targets"],
        blocks=sum(
            isinstance(layer, DBlock)
            for c in local_chunks(layers, schedule, topo.pp_rank)
            for layer in c.layers
        ),
    )
    return out


def _worker(rank, world_size, cases):
    groups_cache: dict = {}
    return {case["id"]: _run(rank, case, groups_cache) for case in cases}


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_worker, WORLD, CASES, timeout=240)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_recompute_matches_no_recompute(world4, case):
    for rank, res in enumerate(world4):
        r = res[case["id"]]
        assert not r["missing"], f"rank {rank}: gradients present in one run only: {r['missing']}"
        assert r["err"] <= TOL, f"rank {rank}: relative error {r['err']:.3g} at {r['worst']}"
        assert r["eval"][0] == r["eval"][1], f"rank {rank}: eval loss {r['eval']}"
        # eval never recomputes: the blocks run once per microbatch in both engines
        assert r["eval_calls"][0] == r["eval_calls"][1], f"rank {rank}: {r['eval_calls']}"
        if r["blocks"] and case["mode"] != "auto":  # auto may leave light ranks alone
            assert any(r["targets"]), f"rank {rank}: nothing selected: {r['targets']}"
    if case["mode"] == "auto":
        assert any(any(res[case["id"]]["targets"]) for res in world4), "auto chose nothing"


@pytest.mark.parametrize("case", [c for c in CASES if c["mode"] == "full"], ids=lambda c: c["id"])
def test_full_recompute_runs_each_forward_once_more(world4, case):
    """Once per microbatch, also under a split backward (I then W): never twice."""
    for rank, res in enumerate(world4):
        r = res[case["id"]]
        base, rc = r["calls"]
        assert [2 * b for b in base] == rc, f"rank {rank}: block forwards {base} -> {rc}"
        # Under a split backward the recompute at I is kept until W (RecomputeOnce), so a rank
        # whose W's lag (zb-h1's last ranks) can hold more than without recompute: the inputs
        # of the regions come on top. test_recompute_auto checks the meter against the plan's
        # I/W-aware prediction there.
        split = case["schedule"] in ("zb-h1", "zbv")
        if r["blocks"] and not split:
            assert r["peak"][1] < r["peak"][0], f"rank {rank}: peak saved bytes {r['peak']}"


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_nothing_outlives_the_step(world4, case):
    for rank, res in enumerate(world4):
        r = res[case["id"]]
        assert r["frames_alive"] == 0, f"rank {rank}: {r['frames_alive']} recompute frames alive"
        assert r["weight_refs"] == 1, f"rank {rank}: a weight is referenced {r['weight_refs']}x"


def test_parse_values():
    assert parse_recompute(None) is None
    assert parse_recompute("full") == "full"
    assert parse_recompute("selective:attn*") == Selective("attn*")
    assert parse_recompute([5, 1, 1]) == (1, 5)
    for bad in ("fully", 3, [1.5], [-1], "selective:"):
        with pytest.raises(ValueError, match="recompute"):
            parse_recompute(bad)
    assert parse_bytes("6GiB") == 6 * 2**30
    assert parse_bytes("2 MB") == 2_000_000
    for bad in ("6 GiBs", -1, "0", True, "lots"):
        with pytest.raises(ValueError, match="activation_budget"):
            parse_bytes(bad)


def test_rng_restored_bitwise_on_cpu():
    """checkpoint(preserve_rng_state=True) redraws the same dropout masks in backward."""
    from torch.utils.checkpoint import checkpoint

    block = DBlock(DIM).train()
    h = torch.randn(3, 5, DIM)
    mask = torch.ones(3, 5, dtype=torch.long)
    grads = []
    for use_ckpt in (False, True):
        x = h.clone().requires_grad_()
        torch.manual_seed(3)
        if use_ckpt:
            y = checkpoint(block, (x, mask), use_reentrant=False, preserve_rng_state=True)[0]
        else:
            y = block((x, mask))[0]
        y.square().sum().backward()
        grads.append((x.grad, block.attn.proj.weight.grad.clone()))
        block.zero_grad()
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1], grads[1][1])
    assert dist.is_available()


def test_recompute_once_serves_input_and_weight_backward():
    """A split backward (I, then W) over a recomputed region: one recompute, W really computes
    the weight gradients (not a fused I), and every gradient equals the plain run bitwise, with
    dropout."""
    from lightning_pp.runtime.recompute import RecomputeOnce
    from lightning_pp.runtime.split_backward import backward_input

    torch.manual_seed(0)
    lin1, lin2, drop = nn.Linear(4, 4), nn.Linear(4, 4), nn.Dropout(0.3)
    calls = [0]

    def region(x):
        calls[0] += 1
        return torch.tanh(lin2(drop(torch.relu(lin1(x)))))

    params = [lin1.weight, lin1.bias, lin2.weight, lin2.bias]
    x0 = torch.randn(3, 4)
    x = x0.clone().requires_grad_()
    torch.manual_seed(5)
    region(x).sum().backward()
    want = [x.grad.clone(), *(p.grad.clone() for p in params)]
    for p in params:
        p.grad = None

    calls[0] = 0
    x = x0.clone().requires_grad_()
    torch.manual_seed(5)
    frame = RecomputeOnce(region)
    y = frame(x)
    dx, work = backward_input((y,), (torch.ones_like(y),), (x,))
    assert not work.fused and all(p.grad is None for p in params)
    assert frame.recomputes == 1 and calls[0] == 2 and frame.held()
    work.run()
    assert frame.recomputes == 1 and calls[0] == 2
    got = [dx[0], *(p.grad for p in params)]
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_recompute_again_for_weight_backward():
    """``again``: the frame drops I's recompute (holding only its inputs until W) and W
    recomputes a second time; the gradients stay bitwise equal."""
    from lightning_pp.runtime.recompute import RecomputeOnce
    from lightning_pp.runtime.split_backward import backward_input

    torch.manual_seed(1)
    lin, drop = nn.Linear(4, 4), nn.Dropout(0.5)
    x0 = torch.randn(3, 4)
    x = x0.clone().requires_grad_()
    torch.manual_seed(2)
    torch.tanh(drop(lin(x))).sum().backward()
    want = (x.grad.clone(), lin.weight.grad.clone())
    lin.weight.grad = lin.bias.grad = None
    x = x0.clone().requires_grad_()
    torch.manual_seed(2)
    frame = RecomputeOnce(lambda t: torch.tanh(drop(lin(t))), again=True)
    y = frame(x)
    dx, work = backward_input((y,), (torch.ones_like(y),), (x,))
    assert frame.recomputes == 1 and frame.held()
    frame.release()
    assert not frame.held()
    work.run()
    assert frame.recomputes == 2
    assert torch.equal(dx[0], want[0]) and torch.equal(lin.weight.grad, want[1])
