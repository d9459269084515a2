"""Unmodified models (GPT-2, Llama untied/tied, a nanoGPT-style GPT) split by module name and
run by ``PipelineEngine`` on real gloo groups: loss and every gradient equal unpipelined
training, each rank holds exactly its stages' share under the model's own keys.

One spawned world of 4 ranks runs every case (pp=2 cases run as two pipelines, dp=2, each on
its own data), so process start-up is paid once.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from byom_models import lm_batch, model_fn, reference_step
from distributed import run_distributed

from lightning_pp.autosplit import EngineStages, StagedModel, meta_build
from lightning_pp.layout.topology import PipelineTopology, build_process_groups
from lightning_pp.runtime.engine import PipelineEngine
from lightning_pp.runtime.microbatch import split_microbatches
from lightning_pp.schedules import build_schedule

pytest.importorskip("transformers")

WORLD = 4
SEED = 11
SEQ_LENS = [9, 5, 7]  # a different sequence length every step
TOL = 1e-6
# Each model once, each shape once: the Trainer-level tests (tests/test_strategy_split.py) run
# the models again at other shapes; here every parameter's gradient is compared (<= 1e-6).
CASES = [
    dict(model=mdl, schedule=s, pp=pp, vpp=vpp, m=4, id=f"{mdl}-{s}-pp{pp}-vpp{vpp}")
    for mdl, (s, pp, vpp) in [
        ("gpt2", ("interleaved", 2, 2)),
        ("llama", ("1f1b", 4, 1)),
        ("llama-tied", ("interleaved", 4, 2)),
        ("nanogpt", ("1f1b", 2, 1)),
    ]
]


def _tied_group(topo: PipelineTopology, cache: dict):
    """A group of the first and last pipeline rank of this rank's pipeline (every rank creates
    every pipeline's group, in the same order)."""
    if topo.pp not in cache:
        mine = None
        for pipeline in topo.all_pipelines():
            ranks = sorted({pipeline[0], pipeline[-1]})
            g = dist.new_group(ranks)
            if topo.rank in ranks:
                mine = g
        cache[topo.pp] = mine
    return cache[topo.pp]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _run_case(rank: int, case: dict, groups_cache: dict, tied_cache: dict) -> dict:
    pp, vpp, m = case["pp"], case["vpp"], case["m"]
    topo = PipelineTopology.from_world(WORLD, rank, pp)
    if pp not in groups_cache:
        groups_cache[pp] = build_process_groups(topo)
    tied_group = _tied_group(topo, tied_cache)
    schedule = build_schedule(case["schedule"], pp=pp, microbatches=m, vpp=vpp)
    stages = schedule.stages_of(topo.pp_rank)
    fn, split, step = model_fn(case["model"])
    torch.manual_seed(SEED)
    plain = fn()
    staged = StagedModel.build(fn, split=split, stages=stages, num_stages=pp * vpp, seed=SEED)
    ref = dict(plain.named_parameters(remove_duplicate=False))
    local = dict(staged.model.named_parameters(remove_duplicate=False))
    out: dict = dict(pp_rank=topo.pp_rank, dp_rank=topo.dp_rank, losses=[], ref_losses=[])
    out["init_equal"] = all(torch.equal(p, ref[n]) for n, p in local.items())
    out["keys"] = list(staged.model.state_dict())
    out["numel"] = sum(p.numel() for p in staged.model.parameters())
    share = {id(ref[n]): ref[n].numel() for n in ref if staged.layout.stage_of(n) in stages}
    out["share"] = sum(share.values())
    es = EngineStages(staged, step)
    engine = PipelineEngine(es.chunks, schedule, topo, groups_cache[pp], **es.engine_kwargs())
    opt = torch.optim.SGD(staged.model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    # forward-only evaluation first, while both hold the initial weights
    batch = lm_batch(SEED + 100 * topo.dp_rank, 8, SEQ_LENS[0])
    res = engine.eval_step(es.prepare(batch))
    with torch.no_grad():
        size = batch[0].shape[0]
        ref_eval = sum(
            step(plain, mb).item() * mb[0].shape[0] / size for mb in split_microbatches(batch, m)
        )
    out["eval"] = (res.loss.item(), ref_eval)
    out["grad_err"], out["worst"] = 0.0, ""
    for i, seq in enumerate(SEQ_LENS):
        batch = lm_batch(SEED + 100 * topo.dp_rank + i, 8, seq)
        res = engine.train_step(es.prepare(batch))
        for tied in staged.tied:  # the sum of every copy's gradient, as TiedParameterSync does
            dist.all_reduce(tied.param.grad, group=tied_group)
        ref_loss = reference_step(plain, step, batch, m)
        out["losses"].append(res.loss.item())
        out["ref_losses"].append(ref_loss.item())
        if i == 0:  # gradients compared where both hold identical weights
            for n, p in local.items():
                e = _rel(p.grad, ref[n].grad)
                if e > out["grad_err"]:
                    out["grad_err"], out["worst"] = e, n
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return out


def _worker(rank: int, world_size: int, cases: list) -> dict:
    groups_cache: dict = {}
    tied_cache: dict = {}
    t0 = time.perf_counter()
    out = {c["id"]: _run_case(rank, c, groups_cache, tied_cache) for c in cases}
    out["seconds"] = time.perf_counter() - t0
    return out


@pytest.fixture(scope="module")
def world4():
    t0 = time.perf_counter()
    results = run_distributed(_worker, WORLD, CASES, timeout=900, pg_timeout=120)
    print(f"\nworld-4 split-model spawn: {time.perf_counter() - t0:.1f}s")
    return results


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_split_model_matches_unpipelined(world4, case):
    for rank, res in enumerate(world4):
        r = res[case["id"]]
        assert r["init_equal"], f"rank {rank}: initial weights differ from the plain build"
        assert r["numel"] == r["share"], f"rank {rank}: {r['numel']} params != share {r['share']}"
        for step, (got, want) in enumerate(zip(r["losses"], r["ref_losses"])):
            assert abs(got - want) <= TOL * abs(want), f"rank {rank} step {step}: {got} != {want}"
        assert len(r["losses"]) == len(SEQ_LENS)
        assert r["grad_err"] <= TOL, (
            f"rank {rank}: grad rel err {r['grad_err']:.3g} at {r['worst']}"
        )
        got, want = r["eval"]
        assert abs(got - want) <= TOL * abs(want), f"rank {rank}: eval {got} != {want}"


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_rank_keys_partition_the_plain_keys(world4, case):
    fn, _, _ = model_fn(case["model"])
    plain_keys = sorted(meta_build(fn).model.state_dict())
    for dp in range(WORLD // case["pp"]):
        keys = [
            k for res in world4 if res[case["id"]]["dp_rank"] == dp for k in res[case["id"]]["keys"]
        ]
        assert sorted(keys) == plain_keys


def test_losses_move(world4):
    """Guard against a vacuous comparison: training changes the loss."""
    r = world4[0][CASES[0]["id"]]
    assert len({round(x, 6) for x in r["losses"]}) == len(SEQ_LENS)
