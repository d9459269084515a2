"""Zero-bubble schedules (zb-h1, zbv) on the engine == unpipelined training, fp32, relative
<= 1e-6 on the loss and every gradient: pp 2 and 4, m below, at and above p and 2p (not
multiples of p), tuple activations whose sequence length changes every step, a weight tied
across stages (same rank under V placement, two ranks under zb-h1), data parallel dp=2 with the
deferred all-reduce, and stages whose backward cannot be split. One spawned world of 4 runs
every case."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from engine_models import (
    grad_errors,
    mlp_batch,
    mlp_layers,
    mse_loss,
    run_reference,
    tuple_batch,
    tuple_input_fn,
    tuple_layers,
)
from torch import nn

from lightning_pp.layout.partition import PipelineChunk, partition_layers
from lightning_pp.layout.topology import PipelineTopology, build_process_groups
from lightning_pp.runtime.engine import PipelineEngine
from lightning_pp.runtime.grad_sync import DeferredGradSync
from lightning_pp.schedules import Op, build_schedule

WORLD, STEPS, TOL = 4, 3, 1e-6
SEQ_LENS = [5, 7, 3]


def _case(schedule, pp, m, **kw):
    c = dict(schedule=schedule, pp=pp, m=m, model="mlp", static=False, lookahead=None)
    c.update(reduction="mean", dp_sync=False, batch=10)
    c.update(kw)
    c["id"] = (
        f"{c['model']}-{schedule}-pp{pp}-m{m}"
        + ("-static" if c["static"] else "")
        + (f"-L{c['lookahead']}" if c["lookahead"] else "")
        + ("-sum" if c["reduction"] == "sum" else "")
        + ("-dp2" if c["dp_sync"] else "")
    )
    return c


CASES = [
    _case("zb-h1", 2, 4),
    _case("zb-h1", 2, 3),
    _case("zb-h1", 2, 1),
    _case("zb-h1", 4, 8),
    _case("zb-h1", 4, 6),
    _case("zb-h1", 4, 5),
    _case("zb-h1", 4, 2),
    _case("zbv", 2, 4),
    _case("zbv", 2, 5),
    _case("zbv", 2, 3),  # m < 2p
    _case("zbv", 2, 1),
    _case("zbv", 4, 8),
    _case("zbv", 4, 10),
    _case("zbv", 4, 5),  # m < 2p, not a multiple of p
    _case("zbv", 4, 3),  # m < p
    _case("zb-h1", 4, 6, reduction="sum"),
    _case("zbv", 4, 8, static=True),
    _case("zbv", 4, 8, lookahead=1),
    _case("zbv", 4, 8, lookahead=64),
    _case("zb-h1", 4, 8, lookahead=1),
    # tuple activations (hidden + int64 mask), sequence length changing every step
    _case("zb-h1", 4, 5, model="tuple", batch=8),
    _case("zbv", 4, 6, model="tuple", batch=8),
    _case("zbv", 2, 3, model="tuple", batch=8, lookahead=64),
    # a weight tied between the first and the last stage
    _case("zb-h1", 2, 4, model="tied"),
    _case("zbv", 2, 4, model="tied"),
    _case("zbv", 4, 6, model="tied"),
    # data parallel: two replicas of a pp=2 pipeline, deferred all-reduce after the last W
    _case("zb-h1", 2, 4, dp_sync=True),
    _case("zbv", 2, 5, dp_sync=True),
    _case("zbv", 2, 3, model="tied", dp_sync=True),
    # stages that cannot split: a custom autograd.Function, a frozen layer, no parameters
    _case("zbv", 4, 8, model="unsplittable"),
    _case("zb-h1", 4, 4, model="unsplittable"),
]


class TiedIn(nn.Module):
    """x (B, 6) -> tanh(x @ W.T): W (16, 6) is also the output projection of TiedOut."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return torch.tanh(F.linear(x, self.weight))


class TiedOut(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, h):
        return h @ self.weight


def tied_layers(seed: int) -> list[nn.Module]:
    """The MLP with its first weight tied to the output projection (one Parameter object)."""
    torch.manual_seed(seed)
    w = nn.Parameter(torch.randn(16, 6) / 3)
    mid = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)]
    return [TiedIn(w), *mid, TiedOut(w)]


def tied_batch(seed: int, batch: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 6, generator=g), torch.randn(batch, 6, generator=g)


class _CustomScale(torch.autograd.Function):
    """x * w with a hand-written backward: it computes both gradients whatever is asked."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class CustomScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        return _CustomScale.apply(x, self.w)


def unsplittable_layers(seed: int) -> list[nn.Module]:
    layers = mlp_layers(seed)
    layers[2] = nn.Sequential(layers[2], CustomScale())
    layers[3].requires_grad_(False)  # frozen
    layers[4] = nn.Tanh()  # no parameters
    return layers


def _chunks(layers, schedule, pp_rank):
    """This rank's chunks from the schedule's placement. Tied layers keep sharing their weight
    inside one rank (one deepcopy of all local layers)."""
    ranges = partition_layers(len(layers), schedule.pp, schedule.vpp)
    stages = schedule.stages_of(pp_rank)
    local = copy.deepcopy([[layers[i] for i in ranges[s]] for s in stages])
    return [PipelineChunk(ls, ranges[s]) for ls, s in zip(local, stages)]


def _hook_problems(calls, record, actions):
    """on_chunk_grads_ready: once per chunk, during the event of that chunk's LAST W."""
    last = {a.chunk: i for i, a in enumerate(actions) if a.op in (Op.B, Op.W)}
    problems = []
    if sorted(c for c, _ in calls) != sorted(last):
        problems.append(f"hook called for chunks {[c for c, _ in calls]}, expected {sorted(last)}")
    for c, t in calls:
        where = [i for i, ev in enumerate(record.events) if ev.start <= t <= ev.end]
        if where != [last.get(c)]:
            problems.append(f"hook for chunk {c} ran during {where}, expected {last.get(c)}")
    return problems


def _run_case(rank, case, cache):
    pp, m = case["pp"], case["m"]
    topo = PipelineTopology.from_world(WORLD, rank, pp)
    if pp not in cache:  # every rank walks the same case list: same creation order
        cache[pp] = build_process_groups(topo)
    groups = cache[pp]
    schedule = build_schedule(case["schedule"], pp=pp, microbatches=m)
    # the seed of tests/test_engine.py: its data keeps microbatched fp32 summation within 1e-6
    seed, model = 1234, case["model"]
    # dp_sync: both replicas must end with the gradient of the union of their batches

    def data_seed(dp, s):
        return seed + 100 * dp + s

    input_fn = None
    if model == "tuple":
        layers, input_fn = tuple_layers(seed), tuple_input_fn

        def make(dp, s):
            return tuple_batch(data_seed(dp, s), case["batch"], SEQ_LENS[s])
    elif model == "tied":
        layers = tied_layers(seed)

        def make(dp, s):
            return tied_batch(data_seed(dp, s), case["batch"])
    else:
        layers = mlp_layers(seed) if model == "mlp" else unsplittable_layers(seed)

        def make(dp, s):
            return mlp_batch(data_seed(dp, s), case["batch"])

    batches = [make(topo.dp_rank, s) for s in range(STEPS)]
    loss_fn = mse_loss(case["reduction"])
    ref_layers = copy.deepcopy(layers)
    chunks = _chunks(layers, schedule, topo.pp_rank)
    params = list({id(p): p for c in chunks for p in c.parameters()}.values())
    sync = None
    if case["dp_sync"]:
        sync = DeferredGradSync([list(c.parameters()) for c in chunks], groups.dp_group, topo.dp)
    calls = []

    def on_ready(c):
        calls.append((c, time.perf_counter()))
        if sync is not None:
            sync.on_chunk_grads_ready(c)

    engine = PipelineEngine(
        chunks,
        schedule,
        topo,
        groups,
        loss_fn=loss_fn,
        input_fn=input_fn,
        loss_reduction=case["reduction"],
        static_shapes=case["static"],
        recv_lookahead=case["lookahead"],
        measure_memory=True,
        on_chunk_grads_ready=on_ready,
    )
    ref_params = list({id(p): p for layer in ref_layers for p in layer.parameters()}.values())
    lr = 0.05 if case["reduction"] == "mean" else 0.05 / (case["batch"] * 3)
    trainable = [p for p in params if p.requires_grad] or [nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD(trainable, lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref_params if p.requires_grad], lr=lr, momentum=0.9)
    ref_input = input_fn or (lambda b: b[0])
    out = dict(losses=[], refs=[], grad_err=0.0, worst="", hook=[], pp_rank=topo.pp_rank)
    res = engine.eval_step(batches[0])
    with torch.no_grad():
        x = ref_input(batches[0])
        for layer in ref_layers:
            x = layer(x)
        out["eval"] = (res.loss.item(), loss_fn(x, batches[0]).item())
    tied_group = groups.pp_group if model == "tied" and schedule.placement == "loop" else None
    for s, batch in enumerate(batches):
        calls.clear()
        res = engine.train_step(batch)
        if sync is not None:
            sync.wait()
        if tied_group is not None:
            # the tied weight's copies (first and last stage, two ranks) sum their gradients
            w = chunks[0].layers[0].weight if topo.pp_rank == 0 else chunks[-1].layers[-1].weight
            dist.all_reduce(w.grad, group=tied_group)
        if case["dp_sync"]:
            # the reference sees both replicas' data: a mean over the concatenated batch
            other = make(1 - topo.dp_rank, s)
            both = [batch, other] if topo.dp_rank == 0 else [other, batch]
            run_reference(ref_layers, tuple(torch.cat(p) for p in zip(*both)), loss_fn, ref_input)
            out["losses"].append(res.loss.item())
            out["refs"].append(run_loss(ref_layers, batch, loss_fn))  # this replica's loss
        else:
            ref_loss = run_reference(ref_layers, batch, loss_fn, ref_input)
            out["losses"].append(res.loss.item())
            out["refs"].append(ref_loss.item())
        if s == 0:
            for name, e in grad_errors(chunks, ref_layers).items():
                if e > out["grad_err"]:
                    out["grad_err"], out["worst"] = e, f"layer {name}"
        out["hook"] += [
            f"step {s}: {p}"
            for p in _hook_problems(calls, res.record, engine.schedule.ranks[topo.pp_rank])
        ]
        out["peak_inflight"] = res.record.peak_inflight
        # per local chunk: (holds stage 0, its I freed the graph)
        out["graph_free"] = [
            (engine.places[c].first, engine.graph_free[c]) for c in range(len(chunks))
        ]
        out["peak_saved"] = res.record.peak_saved_bytes
        out["inflight"] = [ev.inflight for ev in res.record.events]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return out


def run_loss(layers, batch, loss_fn):
    """The reference model's loss on ``batch`` (no gradient)."""
    with torch.no_grad():
        x = batch[0]
        for layer in layers:
            x = layer(x)
        return loss_fn(x, batch).item()


def _worker(rank, world_size, cases):
    cache = {}
    out = {}
    t0 = time.perf_counter()
    for case in cases:
        out[case["id"]] = _run_case(rank, case, cache)
    out["seconds"] = time.perf_counter() - t0
    return out


@pytest.fixture(scope="module")
def world4():
    t0 = time.perf_counter()
    results = run_distributed(_worker, WORLD, CASES, timeout=400)
    print(f"\nworld-4 zero-bubble engine spawn: {time.perf_counter() - t0:.1f}s")
    return results


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_matches_unpipelined(world4, case):
    for rank, res in enumerate(world4):
        r = res[case["id"]]
        assert len(r["losses"]) == STEPS
        for step, (got, ref) in enumerate(zip(r["losses"], r["refs"])):
            assert _rel(got, ref) <= TOL, f"rank {rank} step {step}: loss {got} != ref {ref}"
        assert r["grad_err"] <= TOL, (
            f"rank {rank}: grad rel err {r['grad_err']:.3g} at {r['worst']}"
        )
        assert not r["hook"], f"rank {rank}: " + "; ".join(r["hook"])
        got, ref = r["eval"]
        assert _rel(got, ref) <= TOL, f"rank {rank}: eval loss {got} != reference {ref}"


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_inflight_counts_until_w(world4, name):
    """The engine's in-flight count (held until W) peaks where the schedule says."""
    from lightning_pp.schedules import peak_inflight

    schedule = build_schedule(name, pp=4, microbatches=8)
    want = peak_inflight(schedule)
    for res in world4:
        r = res[f"mlp-{name}-pp4-m8"]
        assert r["peak_inflight"] == want[r["pp_rank"]], (r["pp_rank"], r["inflight"])
        assert r["peak_saved"] > 0


def test_graph_freed_at_i_where_every_w_layer_is_linear(world4):
    """The MLP's chunks are Linear + Tanh: their I frees the graph (W keeps the Linear inputs
    only); the first stage has no I (its W runs the whole backward), and a chunk with a custom
    autograd.Function or a frozen layer keeps the retained graph. Equivalence for both ways is
    test_matches_unpipelined."""
    for name in ("mlp-zb-h1-pp4-m8", "mlp-zbv-pp4-m8"):
        for res in world4:
            for first, freed in res[name]["graph_free"]:
                assert freed == (not first), (name, res[name]["pp_rank"], first, freed)
    kept = [
        freed
        for res in world4
        for first, freed in res["unsplittable-zbv-pp4-m8"]["graph_free"]
        if not first
    ]
    assert not all(kept), kept


class _AutocastProbe(torch.autograd.Function):
    """Identity that records whether CPU autocast is on in its forward and its backward."""

    seen: list[tuple[str, bool]] = []
    split_backward_safe = True

    @staticmethod
    def forward(ctx, x):
        _AutocastProbe.seen.append(("F", torch.is_autocast_enabled("cpu")))
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _AutocastProbe.seen.append(("B", torch.is_autocast_enabled("cpu")))
        return g


class _Probed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(_AutocastProbe.apply(x)))


def _autocast_worker(rank, world_size):
    topo = PipelineTopology.from_world(world_size, rank, world_size)
    groups = build_process_groups(topo)
    out = {}
    for name in ("1f1b", "zb-h1"):
        torch.manual_seed(0)
        layers = [_Probed() for _ in range(4)]
        schedule = build_schedule(name, pp=world_size, microbatches=2)
        chunks = _chunks(layers, schedule, topo.pp_rank)
        engine = PipelineEngine(
            chunks, schedule, topo, groups, loss_fn=lambda out, mb: F.mse_loss(out, mb[1])
        )
        batch = (torch.randn(4, 8), torch.randn(4, 8))
        _AutocastProbe.seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as bf16-mixed wraps the step
            engine.train_step(batch)
        out[name] = (sorted(set(_AutocastProbe.seen)), list(engine.graph_free))
    return out


def test_backward_runs_with_autocast_off():
    """Under bf16-mixed the precision plugin's autocast wraps the whole step; the forward keeps
    it, every backward (B, I, W) runs without it, as Lightning's own loss.backward() does. A
    split chunk of Linears then frees its graph at I under bf16-mixed too."""
    for rank, res in enumerate(run_distributed(_autocast_worker, 2, timeout=120)):
        for name in ("1f1b", "zb-h1"):
            seen, graph_free = res[name]
            assert seen == [("B", False), ("F", True)], (rank, name, seen)
        assert res["zb-h1"][1] == [rank == 1], rank  # stage 0's I is a no-op: nothing to free
