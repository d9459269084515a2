"""FSDP2 per pipeline chunk (:mod:`lightning_pp.runtime.fsdp_chunks`) at engine level, on real gloo
process groups and a real ``DeviceMesh`` (pp2 x dp2, four ranks of the shared world).

Every schedule (gpipe, 1f1b, interleaved vpp2, zb-h1, zbv) trains like the single-process,
unsharded reference of the same model on the same global batch (both replicas' data): the loss,
every parameter's gradient (the full tensor gathered from its DTensor shards), the global
gradient norm from the local shards, and the parameters after each AdamW step, fp32, relative
<= 1e-6. Also: gradient accumulation over two micro-steps (reduced on the last only), ``W`` through
a retained graph (a stage that cannot split, a frozen layer), ``reshard_after_forward=True`` under
1F1B, the reduce-scatter starting at each chunk's last backward (not at the end of the step),
1/dp parameter bytes per rank, and the gloo trap (pytorch#162338, emulated: the gloo of torch
2.13 averages): where gloo sums for ``ReduceOp.AVG``, FSDP2's own reduce-scatter leaves
gradients ``dp`` times the reference's, and the fix (divide, then SUM) still matches.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from engine_grid import chunks_of
from engine_models import (
    mlp_batch,
    mlp_layers,
    mse_loss,
    rel_err,
    run_reference,
    unsplittable_layers,
)
from torch import nn
from torch.distributed.tensor import DTensor
from worlds import world

from lightning_pp.layout.partition import PipelineChunk
from lightning_pp.layout.topology import PipelineTopology, ProcessGroups
from lightning_pp.runtime.engine import PipelineEngine
from lightning_pp.runtime.fsdp_chunks import (
    FsdpGradSync,
    check_fsdp_supported,
    default_blocks,
    local_param_bytes,
    reshard_chunks,
    shard_chunks,
    sharded_grad_norm_sq,
)
from lightning_pp.schedules import Op, build_schedule

pytestmark = pytest.mark.timeout(400)

WORLD, PP, DP, TOL, BATCH, LR = 4, 2, 2, 1e-6, 8, 1e-2
#: AdamW's eps, well above the fp32 rounding of a gradient element (about 1e-9 here): Adam's
#: first update is lr * g / (|g| + eps), whose sensitivity to a relative error of g peaks at
#: |g| = eps; with the default 1e-8 one near-zero element (|g| = 1.5e-7, off by 2e-9 in either
#: fp32 run) moved a whole weight by 1.2e-6 relative, measuring rounding, not the sync
EPS = 1e-3
#: the data's seed. Two fp32 runs that sum in different orders (microbatches and replicas, or
#: one batch) differ by up to 2e-6 relative on a bias gradient whose terms cancel, for some
#: seeds (measured over six: 4e-7 to 2.1e-6, fp32 or fp64 reference alike); this one keeps every
#: case within 4.2e-7. A real fault is orders larger: the summing variant below is off by 1.0.
SEED = 2024


def case(name: str, schedule: str, m: int = 4, **kw: Any) -> dict:
    c: dict[str, Any] = dict(id=name, schedule=schedule, vpp=None, m=m, steps=2, accumulate=1)
    c.update(model="mlp", reshard_after_forward=False, recompute=None)
    c.update(divide_then_sum=True, gloo_sums_avg=False)
    c.update(kw)
    return c


EVERY_SCHEDULE = [
    case("gpipe", "gpipe", vpp=1),
    case("1f1b", "1f1b", vpp=1),
    case("interleaved-vpp2", "interleaved", vpp=2),
    case("zb-h1", "zb-h1"),
    case("zbv", "zbv"),
]
CASES = EVERY_SCHEDULE + [
    case("1f1b-accumulate2", "1f1b", vpp=1, accumulate=2),
    case("zbv-accumulate2", "zbv", accumulate=2),
    # a custom autograd.Function (fused at I), a frozen layer, a layer without parameters:
    # W through the retained graph instead of the direct path
    case("zbv-retained-graph", "zbv", model="unsplittable"),
    case("1f1b-reshard-after-forward", "1f1b", vpp=1, reshard_after_forward=True),
    # every layer recomputed (non-reentrant checkpoint around each FSDP2 block): in B, or once
    # in I for W
    case("1f1b-recompute", "1f1b", vpp=1, recompute="full"),
    case("zbv-recompute", "zbv", recompute="full"),
    # a gloo that sums where AVG is asked (pytorch#162338, emulated: torch 2.13's gloo averages):
    # the fix does not ask for AVG, so it is immune; FSDP2's own reduce-scatter is dp times off
    case("1f1b-gloo-sums-avg", "1f1b", vpp=1, gloo_sums_avg=True),
    case(
        "1f1b-gloo-sums-avg-unfixed",
        "1f1b",
        vpp=1,
        gloo_sums_avg=True,
        divide_then_sum=False,
        steps=1,
    ),
]


# -- the rank side ------------------------------------------------------------------------------


def _groups(rank: int) -> tuple[Any, PipelineTopology, ProcessGroups]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pipeline_parallel", "data_parallel"))
    topo = PipelineTopology.from_world(WORLD, rank, PP)
    groups = ProcessGroups(
        topology=topo,
        pp_group=mesh.get_group("pipeline_parallel"),
        dp_group=mesh.get_group("data_parallel"),
        mesh=mesh,
    )
    return mesh, topo, groups


def _batches(c: dict) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """[dp rank][step][micro-step] -> that replica's batch (seeded, the same on every rank)."""
    return [
        [
            [mlp_batch(SEED + 1000 * d + 10 * s + k, BATCH) for k in range(c["accumulate"])]
            for s in range(c["steps"])
        ]
        for d in range(DP)
    ]


def _layer_params(chunks: list, ref_layers: list) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """(name, sharded parameter, reference parameter), in the same order on every replica."""
    out = []
    for chunk in chunks:
        for layer, idx in zip(chunk.layers, chunk.layer_indices):
            ref = dict(ref_layers[idx].named_parameters())
            out += [(f"{idx}.{n}", p, ref[n]) for n, p in layer.named_parameters()]
    return out


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor of a DTensor shard (a collective over dp), a plain tensor as is."""
    if t is None:
        return None
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worst(pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]]) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, got, ref in pairs:
        if (got is None) != (ref is None):
            return float("inf"), f"{name}: one gradient is None"
        e = 0.0 if got is None else rel_err(got, ref)
        if e > worst:
            worst, where = e, name
    return worst, where


def _ratio(pairs: list) -> list[float]:
    """|got| / |ref| per tensor (the unfixed variant's factor)."""
    return [got.norm().item() / ref.norm().item() for _, got, ref in pairs if got is not None]


def _dp_mean(x: float, groups: ProcessGroups) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, group=groups.dp_group)
    return t.item() / DP


def _world_sum(x: torch.Tensor) -> float:
    t = x.detach().double().reshape(1).clone()
    dist.all_reduce(t)  # the default group: every rank of pp x dp
    return t.item()


def _run_case(rank: int, c: dict, mesh: Any, topo: PipelineTopology, groups: ProcessGroups) -> dict:
    schedule = build_schedule(
        c["schedule"], pp=PP, microbatches=c["m"], **({"vpp": c["vpp"]} if c["vpp"] else {})
    )
    layers = mlp_layers(1234) if c["model"] == "mlp" else unsplittable_layers(1234)
    ref_layers = copy.deepcopy(layers)
    chunks = chunks_of(layers, schedule, topo.pp_rank)
    full_bytes = local_param_bytes(chunks)
    chunks = shard_chunks(
        chunks,
        mesh["data_parallel"],
        reshard_after_forward=c["reshard_after_forward"],
        schedule=schedule,
    )
    out: dict[str, Any] = dict(bytes=(local_param_bytes(chunks), full_bytes), pp_rank=topo.pp_rank)
    out["param_shapes"] = [
        (tuple(p.shape), tuple(p.to_local().shape)) for ch in chunks for p in ch.parameters()
    ]
    sync = FsdpGradSync(chunks, divide_then_sum=c["divide_then_sum"])
    calls: list[tuple[int, float]] = []

    def on_ready(chunk: int) -> None:
        calls.append((chunk, time.perf_counter()))
        sync.on_chunk_grads_ready(chunk)

    loss_fn = mse_loss("mean")
    engine = PipelineEngine(
        chunks,
        schedule,
        topo,
        groups,
        loss_fn=loss_fn,
        on_chunk_grads_ready=on_ready,
        recompute=c["recompute"],
    )
    pairs = _layer_params(chunks, ref_layers)
    params = [p for _, p, _ in pairs]
    opt = torch.optim.AdamW([p for p in params if p.requires_grad], lr=LR, eps=EPS)
    ref_params = [r for layer in ref_layers for r in layer.parameters() if r.requires_grad]
    ref_opt = torch.optim.AdamW(ref_params, lr=LR, eps=EPS)
    batches = _batches(c)
    out.update(losses=[], grad_err=[], param_err=[], norms=[], launches=[], ratios=[])
    out.update(gathered_after=[])
    for s in range(c["steps"]):
        calls.clear()
        loss = 0.0
        for k in range(c["accumulate"]):
            sync.enabled = k == c["accumulate"] - 1
            before = list(sync.events)
            res = engine.train_step(batches[topo.dp_rank][s][k])
            loss += res.loss.item()
            # per chunk: whether its modules hold the gathered parameters (plain tensors) or the
            # shards (DTensors) after this micro-step
            out["gathered_after"].append((k, [_gathered(ch) for ch in chunks]))
            if not sync.enabled:  # the hook fired, and started nothing
                out["launched_while_accumulating"] = (len(calls), sync.events != before)
        sync.wait()
        ref_loss = 0.0
        for k in range(c["accumulate"]):
            whole = tuple(torch.cat(t) for t in zip(*(batches[d][s][k] for d in range(DP))))
            ref_loss += run_reference(ref_layers, whole, loss_fn).item()
        out["losses"].append((_dp_mean(loss, groups), ref_loss))
        grads = [(n, _full(p.grad), r.grad) for n, p, r in pairs]
        out["grad_err"].append(_worst(grads))
        out["ratios"].append(_ratio(grads))
        got_sq = _world_sum(sharded_grad_norm_sq(params))
        ref_sq = sum(r.grad.double().pow(2).sum().item() for r in ref_params if r.grad is not None)
        out["norms"].append((got_sq**0.5, ref_sq**0.5))
        out["launches"].append(_launches(sync, calls, res.record, schedule.ranks[topo.pp_rank]))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        out["param_err"].append(_worst([(n, _full(p), r) for n, p, r in pairs]))
    out["eval"] = _eval(engine, chunks, ref_layers, batches[topo.dp_rank][0][0], loss_fn)
    out["graph_free"] = [
        (place.first, free) for place, free in zip(engine.places, engine.graph_free)
    ]
    out["num_buckets"] = sync.num_buckets
    return out


def _eval(engine: PipelineEngine, chunks: list, ref_layers: list, batch: Any, loss_fn: Any) -> dict:
    """A forward-only step on the trained shards (gathered anew after the last optimizer step),
    and what it leaves gathered before and after :func:`reshard_chunks`."""
    got = engine.eval_step(batch).loss.item()
    with torch.no_grad():
        x = batch[0]
        for layer in ref_layers:
            x = layer(x)
        ref = loss_fn(x, batch).item()
    gathered = [_gathered(ch) for ch in chunks]
    reshard_chunks(chunks)
    return dict(loss=(got, ref), gathered=gathered, after=[_gathered(ch) for ch in chunks])


def _gathered(chunk: nn.Module) -> bool:
    kinds = {isinstance(p, DTensor) for p in chunk.parameters()}
    assert len(kinds) == 1, "some units gathered, some not"
    return kinds == {False}


def _launches(sync: FsdpGradSync, calls: list, record: Any, actions: list) -> dict:
    """Where each chunk's reduce-scatters started, against the engine's record of the step."""
    last = {a.chunk: i for i, a in enumerate(actions) if a.op in (Op.B, Op.W)}
    events = [(e.chunk, e.time) for e in sync.events]
    return dict(
        events=events,
        hook=[c for c, _ in calls],
        # per event: the index of the action whose [start, end] holds it
        during=[
            [i for i, ev in enumerate(record.events) if ev.start <= t <= ev.end] for _, t in events
        ],
        last_backward=last,
        last_action_start=record.events[-1].start,
        last_action=len(record.events) - 1,
        step_end=record.t1,
    )


@contextlib.contextmanager
def _gloo_sums_avg(on: bool) -> Iterator[None]:
    """Make ``reduce_scatter_single`` SUM where ``ReduceOp.AVG`` is asked, as the gloo builds
    of pytorch#162338 do (torch 2.13's gloo averages; FSDP2 and the fix both call it through
    ``torch.distributed``)."""
    if not on:
        yield
        return
    real = dist.reduce_scatter_single

    def summing(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        op = dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op
        return real(output, input, op=op, group=group, async_op=async_op)

    dist.reduce_scatter_single = summing
    try:
        yield
    finally:
        dist.reduce_scatter_single = real


def _fsdp_world(rank: int, size: int, cases: list[dict]) -> dict:
    assert size == WORLD
    mesh, topo, groups = _groups(rank)
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    for c in cases:
        with _gloo_sums_avg(c["gloo_sums_avg"]):
            out[c["id"]] = _run_case(rank, c, mesh, topo, groups)
    out["seconds"] = time.perf_counter() - t0
    return out


# -- the tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return world("gloo", WORLD).run(_fsdp_world, CASES, timeout=360)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


FIXED = [c for c in CASES if c["divide_then_sum"]]
assert len({c["id"] for c in CASES}) == len(CASES), "case ids must differ"


@pytest.mark.parametrize("c", FIXED, ids=[c["id"] for c in FIXED])
def test_matches_single_process_reference(results, c):
    """Loss (mean over the replicas), every gradient, the global gradient norm and the
    parameters after each AdamW step equal the unsharded single-process run's."""
    for rank, res in enumerate(results):
        r = res[c["id"]]
        for step in range(c["steps"]):
            got, ref = r["losses"][step]
            assert _rel(got, ref) <= TOL, (rank, step, got, ref)
            err, where = r["grad_err"][step]
            assert err <= TOL, f"rank {rank} step {step}: gradient rel err {err:.3g} at {where}"
            got_n, ref_n = r["norms"][step]
            assert _rel(got_n, ref_n) <= TOL, (rank, step, got_n, ref_n)
            err, where = r["param_err"][step]
            assert err <= TOL, f"rank {rank} step {step}: AdamW step rel err {err:.3g} at {where}"


def test_fsdp2_average_on_a_summing_gloo_is_dp_times_off(results):
    """The trap the fix guards against: where gloo sums for ReduceOp.AVG (pytorch#162338), FSDP2's
    own reduce-scatter leaves every gradient dp times the reference's, far outside the
    equivalence test's tolerance; with the fix (``1f1b-gloo-sums-avg`` above) it matches."""
    for rank, res in enumerate(results):
        r = res["1f1b-gloo-sums-avg-unfixed"]
        ratios = r["ratios"][0]
        assert ratios and all(abs(x - DP) <= 1e-5 for x in ratios), (rank, ratios)
        assert r["grad_err"][0][0] > 0.5, (rank, r["grad_err"][0])


def test_direct_w_path_is_exercised(results):
    """Under zb-h1/zbv the MLP's non-first chunks take W without the graph (its weight
    gradients written straight into the gathered parameters' .grad), and still match."""
    for name in ("zb-h1", "zbv"):
        freed = [free for res in results for first, free in res[name]["graph_free"] if not first]
        assert freed and all(freed), (name, freed)
    kept = [
        free
        for res in results
        for first, free in res["zbv-retained-graph"]["graph_free"]
        if not first
    ]
    assert not all(kept), kept


def test_accumulation_reduces_once(results):
    """With accumulation the first micro-step starts no reduce-scatter; the last one reduces
    the sum once (the reference sums both micro-steps' gradients)."""
    for name in ("1f1b-accumulate2", "zbv-accumulate2"):
        for res in results:
            hooks, launched = res[name]["launched_while_accumulating"]
            assert hooks > 0 and not launched


@pytest.mark.parametrize("name", ["1f1b", "zbv", "interleaved-vpp2"])
def test_reduce_scatter_starts_at_each_chunks_last_backward(results, name):
    """Each chunk's reduce-scatters start during the action of its last backward (B, or W), not
    at the end of the step; under zbv and interleaved, the first chunk to finish starts before
    the rank's last action even begins."""
    for rank, res in enumerate(results):
        r = res[name]
        for step, lau in enumerate(r["launches"]):
            assert lau["events"], (rank, step)
            assert sorted(set(lau["hook"])) == sorted(lau["last_backward"])
            for (chunk, t), during in zip(lau["events"], lau["during"]):
                assert during == [lau["last_backward"][chunk]], (rank, step, chunk, during)
                assert t < lau["step_end"]
            if name != "1f1b":
                first = min(t for _, t in lau["events"])
                assert first < lau["last_action_start"], (rank, step, lau)


def test_parameter_bytes_are_sharded(results):
    """After shard_chunks each rank holds its Shard(0) rows of every parameter: the replicas'
    bytes add up to the unsharded ones, each rank holding ceil(rows/dp) or fewer rows; the
    16-row weights and biases split exactly in half."""
    for rank, res in enumerate(results):
        for c in CASES:
            local, full = res[c["id"]]["bytes"]
            assert local < full
        local, full = res["1f1b"]["bytes"]
        partner = results[rank ^ 1]["1f1b"]["bytes"][0]  # the other dp replica of this stage
        assert local + partner == full, (rank, local, partner, full)
        for shape, local_shape in res["1f1b"]["param_shapes"]:
            rows = shape[0]
            assert local_shape[0] in (rows // DP, -(-rows // DP)) or rows < DP, (shape, local_shape)
            if rows % DP == 0:
                assert local_shape == (rows // DP, *shape[1:]), (shape, local_shape)


def test_parameters_stay_gathered_until_the_last_backward(results):
    """The shards are gathered at a chunk's first forward and freed by its reduce-scatter at its
    last backward: after a step that reduced, every chunk holds its shards again; after an
    accumulation micro-step (no reduce) it still holds the gathered parameters, so the next
    micro-step gathers nothing."""
    for rank, res in enumerate(results):
        for c in CASES:
            for k, gathered in res[c["id"]]["gathered_after"]:
                reduced = k == c["accumulate"] - 1
                assert gathered == [not reduced] * len(gathered), (rank, c["id"], k, gathered)


def test_eval_on_the_trained_shards_then_reshard(results):
    """After the steps, a forward-only step gathers the updated shards (its loss is the
    reference's on the updated weights) and leaves them gathered (unless it reshards after
    every forward); reshard_chunks frees them."""
    for rank, res in enumerate(results):
        for c in FIXED:
            ev = res[c["id"]]["eval"]
            assert _rel(*ev["loss"]) <= TOL, (rank, c["id"], ev["loss"])
            kept = not c["reshard_after_forward"]
            assert ev["gathered"] == [kept] * len(ev["gathered"]), (rank, c["id"], ev)
            assert not any(ev["after"]), (rank, c["id"], ev)


def test_num_buckets_one_per_unit(results):
    for res in results:
        # pp=2 x vpp=1: four layers per chunk, each a unit with parameters
        assert res["1f1b"]["num_buckets"] == 4
        assert res["interleaved-vpp2"]["num_buckets"] == 4


# -- without processes --------------------------------------------------------------------------


def test_default_blocks_look_through_containers():
    chunk = PipelineChunk([nn.Linear(2, 2), nn.Tanh(), nn.Sequential(nn.Linear(2, 2))])
    assert [type(b).__name__ for b in default_blocks(chunk)] == ["Linear", "Sequential"]


def test_refuses_a_weight_shared_by_two_chunks():
    w = nn.Linear(3, 3)
    with pytest.raises(
        ValueError, match=r"rank 1: fsdp: parameter 'layers.0.weight'.*chunks 0 and 1"
    ):
        check_fsdp_supported([PipelineChunk([w]), PipelineChunk([w])], rank=1)


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_refuses_reshard_after_forward_under_split_backward(name):
    schedule = build_schedule(name, pp=2, microbatches=4)
    with pytest.raises(
        ValueError,
        match=rf"rank 3: fsdp: reshard_after_forward=True with "
        rf"schedule '{name}' \(pp=2",
    ):
        check_fsdp_supported([nn.Linear(2, 2)], schedule, reshard_after_forward=True, rank=3)
    check_fsdp_supported([nn.Linear(2, 2)], schedule, reshard_after_forward=False, rank=3)
    check_fsdp_supported(
        [nn.Linear(2, 2)], build_schedule("1f1b", pp=2, microbatches=4), reshard_after_forward=True
    )
