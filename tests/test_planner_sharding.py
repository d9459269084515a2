"""Predicted memory under data-parallel sharding (``zero=1``, ``zero=2``, ``fsdp``).

The state formulas on small numbers worked by hand (bucket padding included), the bounds that
hold for any model (``zero=1``'s optimizer state is ``1/dp`` of the unsharded one plus less
than one element per bucket and replica; ``fsdp`` parameters ``1/dp`` at the optimizer step),
the bucket rule against the runtime's, the meta-device activation measurement against the real
profiler, the search's sharded candidates and their communication model, the ``planner``
config section, and the 70B template's dry run through ``lightning-pp plan``.

No process is started and no large tensor allocated: the 70B model exists on the meta device.
"""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pp.commands.config import ConfigError, load_config
from lightning_pp.layout.plan import PipelinePlan
from lightning_pp.planner import LayerCost, ModelProfile, SearchSpace, chosen_config, search
from lightning_pp.planner.memory import rank_memory
from lightning_pp.planner.plan_memory import compare_shardings
from lightning_pp.planner.report import format_sharding_table, format_table
from lightning_pp.planner.search import (
    Prediction,
    allreduce_seconds,
    dp_comm_seconds,
    make_candidate,
)
from lightning_pp.planner.sharding import (
    LayerTensors,
    Sharding,
    StateBytes,
    TiedTensor,
    bucket_numels,
    rank_state_bytes,
    shard_rows,
    sharded_state_bytes,
)
from lightning_pp.schedules import build_schedule

ROOT = Path(__file__).resolve().parents[1]
GPT_70B = str(ROOT / "configs" / "gpt_70b_pp8.yaml")
BF16 = StateBytes(param=2, grad=2, master=4, optimizer=8)

# ---- the formulas, by hand ----------------------------------------------------------------------


def test_state_bytes_follow_the_precision():
    assert StateBytes.for_precision("bf16-true") == BF16
    assert StateBytes.for_precision("16-true", "adamw").per_param == 16
    assert StateBytes.for_precision("bf16-mixed") == StateBytes(4, 4, 0, 8)  # fp32 parameters
    assert StateBytes.for_precision(None, "sgd-momentum") == StateBytes(4, 4, 0, 4)
    assert StateBytes.for_precision("64-true") == StateBytes(8, 8, 0, 16)
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        StateBytes.for_precision("bf16-true", "lion")


def test_each_sharding_on_small_exact_numbers():
    # one chunk: a layer of a (5, 3) matrix and a 6-vector, a layer of a 5-vector; dp=4 cuts
    # each into ceil(rows / 4)-row pieces: (2, 2, 1, 0) rows of 3, (2, 2, 2, 0), (2, 2, 1, 0)
    chunks: list[list[LayerTensors]] = [[[(5, 3), 6], [5]]]
    N = 15 + 6 + 5
    rows = {0: 6 + 2 + 2, 1: 6 + 2 + 2, 2: 3 + 2 + 1, 3: 0}
    none = rank_state_bytes(chunks, Sharding(dp=4), BF16)
    assert (none.params, none.grads, none.master, none.optimizer) == (2 * N, 2 * N, 4 * N, 8 * N)
    assert none.total == 16 * N and none.total_at_step == 16 * N and none.shard_numel == N

    for d, S in rows.items():
        z1 = rank_state_bytes(chunks, Sharding(zero=1, dp=4), BF16, dp_rank=d)
        z2 = rank_state_bytes(chunks, Sharding(zero=2, dp=4), BF16, dp_rank=d)
        fsdp = rank_state_bytes(chunks, Sharding(fsdp=True, dp=4), BF16, dp_rank=d)
        assert z1.shard_numel == z2.shard_numel == fsdp.shard_numel == S, d
        # padding of the flat buffers: (8 - 5) x 3 + (8 - 6) + (8 - 5) rows, on every replica
        assert z1.padding == fsdp.padding == 9 + 2 + 3
        # zero: full bf16 parameters and gradients at the peak; fp32 master and moments rows
        assert (z1.params, z1.grads, z1.master, z1.optimizer) == (2 * N, 2 * N, 4 * S, 8 * S)
        # at the step zero=1 holds the full gradients and the rows' fp32 gradients, zero=2 the
        # rows' alone
        assert (z1.params_at_step, z1.grads_at_step) == (2 * N, 2 * N + 4 * S)
        assert (z2.grads, z2.grads_at_step, z2.optimizer) == (2 * N, 4 * S, 8 * S)
        # fsdp: its shard and the gathered chunk at the peak; 1/dp of everything at the step
        assert fsdp.params == 2 * (S + N) and fsdp.grads == 2 * N
        assert (fsdp.params_at_step, fsdp.grads_at_step) == (2 * S, 2 * S)
        assert (fsdp.master, fsdp.optimizer, fsdp.total_at_step) == (4 * S, 8 * S, 16 * S)
    assert sum(rows.values()) == N  # the replicas' rows are the whole, nothing twice
    z1 = rank_state_bytes(chunks, Sharding(zero=1, dp=4), BF16)
    assert z1.buckets == 1  # 26 elements in one 25 MiB bucket
    fp32 = rank_state_bytes(chunks, Sharding(zero=1, dp=4))  # the rows are views: no master
    assert (fp32.master, fp32.grads_at_step) == (0, 4 * N + 4 * 10)


def test_fsdp_reshard_after_forward_gathers_one_chunk_at_a_time():
    chunks = [[100], [60, 40], [10]]  # chunks of 100, 100 and 10 elements (1-D)
    keep = rank_state_bytes(chunks, Sharding(fsdp=True, dp=2), BF16)
    reshard = rank_state_bytes(chunks, Sharding(fsdp=True, dp=2, reshard_after_forward=True), BF16)
    # shards 50 + 30 + 20 + 5; gathered: every chunk (210), or the largest alone (100)
    assert keep.params == 2 * (105 + 210) and reshard.params == 2 * (105 + 100)
    assert Sharding(fsdp=True, dp=2, reshard_after_forward=True).label == "fsdp+reshard"


def test_buckets_follow_the_runtime_rule():
    from lightning_pp.runtime.grad_sync import _buckets

    rng = random.Random(0)
    for _ in range(50):
        numels = [rng.choice([1, 3, 7, 64, 500, 4096]) for _ in range(rng.randint(1, 12))]
        cap = rng.choice([16, 256, 4000, 10**6])
        params = [nn.Parameter(torch.empty(n)) for n in numels]
        runtime = [sum(p.numel() for p in b) for b in _buckets(params, cap)]
        assert bucket_numels(numels, cap, 4) == runtime, (numels, cap)


def test_shards_are_the_runtime_rows():
    """The rows each replica holds are ``runtime.shard_layout``'s (and FSDP2's Shard(0)):
    torch.chunk along the first dim."""
    from lightning_pp.runtime.shard_layout import BucketLayout

    rng = random.Random(1)
    for _ in range(30):
        shapes = [
            tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 3)))
            for _ in range(rng.randint(1, 5))
        ]
        params = [nn.Parameter(torch.empty(s)) for s in shapes]
        dp = rng.randint(2, 5)
        for d in range(dp):
            layout = BucketLayout.build(params, dp, d)
            want = sum(m.local_numel for m in layout.members)
            got = rank_state_bytes([[shapes]], Sharding(zero=1, dp=dp), dp_rank=d)
            assert got.shard_numel == want, (shapes, dp, d)
            assert got.padding == layout.padding_numel, (shapes, dp)
            assert [shard_rows(m.rows, dp, d) for m in layout.members] == [
                m.hi - m.lo for m in layout.members
            ]


@pytest.mark.parametrize("dp", [2, 3, 8])
def test_zero1_optimizer_state_is_one_dp_th_within_its_padding(dp):
    rng = random.Random(dp)
    for _ in range(20):
        chunks = [
            [[(rng.randint(1, 300), rng.randint(1, 30)) for _ in range(rng.randint(1, 4))]]
            for _ in range(rng.randint(1, 3))
        ]
        none = rank_state_bytes(chunks, Sharding(dp=dp), BF16)
        shards = [
            rank_state_bytes(chunks, Sharding(zero=1, dp=dp), BF16, dp_rank=d) for d in range(dp)
        ]
        assert sum(z.optimizer for z in shards) == none.optimizer  # every row once
        z1 = shards[0]  # replica 0 holds the most: a whole ceil(rows / dp) of every tensor
        assert max(z.optimizer for z in shards) == z1.optimizer
        # each tensor pads fewer than dp rows in the buffer; replica 0 holds at most that
        # much above the even share
        assert none.optimizer / dp <= z1.optimizer <= none.optimizer / dp + 8 * z1.padding
        assert none.master / dp <= z1.master <= none.master / dp + 4 * z1.padding
        assert (z1.params, z1.grads) == (none.params, none.grads)
    one = rank_state_bytes([[[(1000, 64)]]], Sharding(zero=1, dp=dp), BF16)  # one tensor
    assert one.optimizer - 8 * 1000 * 64 / dp < 8 * 64  # under one row's state


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_fsdp_parameters_are_one_dp_th_at_rest(dp):
    tensors = [(4096, 8), (8192,), (12,), (50304, 16), (7, 3), ()]
    s = rank_state_bytes([[tensors]], Sharding(fsdp=True, dp=dp), BF16)
    n = s.numel
    assert 2 * n / dp <= s.params_at_step <= 2 * (n / dp + s.padding)
    assert s.params_at_step == 2 * s.shard_numel and s.params == s.params_at_step + 2 * n
    total = sum(
        rank_state_bytes([[tensors]], Sharding(fsdp=True, dp=dp), BF16, dp_rank=d).params_at_step
        for d in range(dp)
    )
    assert total == 2 * n  # the shards are the parameters, each element once


def test_sharded_state_bytes_reads_the_plan():
    plan = PipelinePlan.build(pp=2, microbatches=4, world_size=8, num_layers=4, bucket_cap_mb=1.0)
    counts = [100, 100, 100, 101]
    s = sharded_state_bytes(plan, counts, 1, zero=1, param_bytes=2)
    assert (s.numel, s.shard_numel, s.master, s.optimizer) == (201, 51, 204, 408)
    last = sharded_state_bytes(plan, counts, 1, zero=1, param_bytes=2, dp_rank=3)
    assert last.shard_numel == 25 + 23
    fp32 = sharded_state_bytes(plan, counts, 1, zero=1)  # fp32: the master is the parameter
    assert fp32.master == 0 and fp32.params == 4 * 201
    # the plan's sharding is the default: fsdp, 25 of each of rank 0's two layers' 100 rows
    planned = PipelinePlan.build(pp=2, microbatches=4, world_size=8, num_layers=4, fsdp=True)
    s = sharded_state_bytes(planned, counts, 0, param_bytes=2)
    assert (s.params_at_step, s.params) == (2 * 50, 2 * (50 + 200))
    with pytest.raises(ValueError, match="dp is not known"):
        sharded_state_bytes(PipelinePlan.build(pp=2, num_layers=4), counts, 0)


def test_rank_memory_sums_the_sharded_states():
    layer = LayerCost(
        0, 0, 0, saved_bytes=100, param_bytes=40, params=10, input_bytes=8, boundary_bytes=8
    )
    schedule = build_schedule("1f1b", pp=2, microbatches=4)
    plain = rank_memory(schedule, 0, [[layer, layer]])
    assert (plain.params, plain.grads, plain.master, plain.optimizer) == (80, 80, 0, 160)
    z1 = rank_memory(
        schedule, 0, [[layer, layer]], sharding=Sharding(zero=1, dp=4), state_bytes=BF16
    )
    # two 1-D layers of 10: 3 + 3 rows on replica 0
    assert (z1.params, z1.grads, z1.master, z1.optimizer) == (40, 40, 6 * 4, 6 * 8)
    assert z1.activations == plain.activations and z1.buffers == plain.buffers
    assert z1.total == 40 + 40 + 24 + 48 + z1.activations + z1.buffers
    assert z1.state is not None and z1.state.shard_numel == 6


def test_a_tie_held_in_two_chunks_of_one_rank_counts_once():
    """V placement puts the tied embedding (layer 0) and head (layer 3) on pipeline rank 0: one
    tensor there, so its parameter, gradient and optimizer state count once (and FSDP2 leaves
    it whole); under 1f1b each of two ranks holds a copy. Both the exact path (shapes with
    TiedTensor) and the search's per-layer counts (LayerCost.tied)."""
    emb = [TiedTensor((6, 100), 0), (4, 100)]  # 600 tied + 400 own
    layers: list[LayerTensors] = [emb, [(10, 100)], [(10, 100)], [TiedTensor((6, 100), 0)]]
    zbv = PipelinePlan.build(pp=2, schedule="zbv", microbatches=4, world_size=4, num_layers=4)
    one = PipelinePlan.build(pp=2, microbatches=4, world_size=4, num_layers=4)
    assert sharded_state_bytes(zbv, layers, 0, dp=1).numel == 1000  # not 1600
    assert sharded_state_bytes(zbv, layers, 1, dp=1).numel == 2000
    assert sharded_state_bytes(one, layers, 1, dp=1).numel == 1600  # its own copy
    z1 = sharded_state_bytes(zbv, layers, 0, zero=1, dp=2)
    assert (z1.numel, z1.shard_numel) == (1000, 500)
    # fsdp: the tie spans two local chunks, so FSDP2 leaves it whole (600 on each replica)
    fsdp = sharded_state_bytes(zbv, layers, 0, fsdp=True, dp=2)
    assert (fsdp.shard_numel, fsdp.params_at_step) == (200 + 600, 4 * 800)
    assert fsdp.params == 4 * (800 + 400)  # the gathered 400; the whole 600 is never gathered
    # the search's counts: the same rank 0, from each layer's tied elements
    cost = LayerCost(0, 0, 0, param_bytes=4000, params=1000, input_bytes=8, boundary_bytes=8)
    tied = dataclasses.replace(cost, params=1000, tied=((0, 600),))
    head = dataclasses.replace(cost, params=600, param_bytes=2400, tied=((0, 600),))
    mem = rank_memory(zbv.schedule, 0, [[tied], [head]])
    assert mem.params == 4 * 1000
    untied = rank_memory(zbv.schedule, 0, [[dataclasses.replace(tied, tied=())], [head]])
    assert untied.params == 4 * 1600


def test_the_profile_records_each_layers_tied_members():
    from lightning_pp.models import GPT
    from lightning_pp.planner.profiler import tied_members

    model = GPT(vocab_size=32, n_layer=2, n_head=2, n_embd=8, block_size=8)
    model.configure_model()
    layers = model.pipeline_layers()
    got = tied_members([layers[i] for i in range(layers.num_layers)], layers.tied)
    assert got == {0: ((0, 32 * 8),), layers.num_layers - 1: ((0, 32 * 8),)}


def test_compare_shardings_on_a_plan():
    plan = PipelinePlan.build(pp=2, microbatches=4, world_size=8, num_layers=4)
    rows = compare_shardings(plan, [[1000]] * 4, None, BF16)
    assert [r.label for r in rows] == ["none", "zero=1", "zero=2", "fsdp"]
    # no activations: zero=1 peaks at the step (full gradients and the rows' fp32 ones)
    assert [r.heaviest.total for r in rows] == [32000, 16000, 14000, 15000]
    assert [r.fits(20000) for r in rows] == [False, True, True, True]
    table = format_sharding_table(rows, limit=20000, current="zero=1", activations=False)
    assert "zero=1 *" in table and "NO" in table and "n/a" in table
    one = PipelinePlan.build(pp=2, microbatches=4, world_size=2, num_layers=4)
    assert [r.label for r in compare_shardings(one, [5] * 4, None, BF16)] == ["none"]


# ---- activations on the meta device -------------------------------------------------------------


def test_meta_measurement_equals_the_profiler_on_a_small_gpt():
    """What the dry run measures on meta is what the profiler measures on real tensors (CPU's
    SDPA takes the flash kernel here, which the meta stand-in imitates)."""
    from lightning_pp.models.gpt import GPT
    from lightning_pp.planner.meta_profile import meta_layer_costs, meta_layers
    from lightning_pp.planner.profiler import profile_layers

    kw: dict[str, Any] = dict(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16)
    real_model = GPT(**kw)
    real_model.configure_model()
    x = torch.randint(0, 64, (3, 16))
    real = profile_layers(
        meta_layers(real_model), lambda n: x[:n].clone(), [3], repeats=1, log=None
    )[3]
    with torch.device("meta"):
        meta_model = GPT(**kw)
        meta_model.configure_model()
    meta = meta_layer_costs(meta_layers(meta_model), x.to("meta"))
    keys = (
        "saved_bytes",
        "shared_bytes",
        "params",
        "param_bytes",
        "input_bytes",
        "boundary_bytes",
        "input_shared_bytes",
        "input_saved_bytes",
        "input_self_saved_bytes",
    )
    for i, (r, m) in enumerate(zip(real, meta)):
        assert {k: getattr(m, k) for k in keys} == {k: getattr(r, k) for k in keys}, i


def test_meta_attention_saves_no_score_matrix():
    import torch.nn.functional as F

    from lightning_pp.planner.meta_profile import FlashAttentionOnMeta

    q = torch.empty(1, 4, 2048, 64, device="meta", requires_grad=True)
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with FlashAttentionOnMeta(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.shape == q.shape and max(saved) < 2048 * 2048  # no T x T scores


# ---- the search ---------------------------------------------------------------------------------


def _layer(params: int = 100_000) -> LayerCost:
    return LayerCost(
        1e-3,
        1e-3,
        1e-3,
        saved_bytes=8000,
        param_bytes=4 * params,
        params=params,
        boundary_bytes=1000,
        input_bytes=1000,
    )


def _profile() -> ModelProfile:
    return ModelProfile(
        {4: [_layer()] * 6}, tokens_per_sample=16, latency_s=1e-4, bandwidth=1e9, overhead_s=1e-4
    )


def test_search_tries_each_sharding_when_dp_is_above_one():
    result = search(_profile(), world=4, global_batch=16, space=SearchSpace(recomputes=(None,)))
    by_dp: dict[int, set[str]] = {}
    for p in result.ranked:
        by_dp.setdefault(p.candidate.dp, set()).add(p.candidate.sharding_label)
    assert by_dp[1] == {"none"}
    assert by_dp[2] == by_dp[4] == {"none", "zero=1", "fsdp"}
    shape = lambda c: (c.dp, c.pp, c.vpp, c.microbatches, c.schedule, c.counts)  # noqa: E731
    groups: dict[tuple, dict[str, Prediction]] = {}
    for p in result.ranked:
        groups.setdefault(shape(p.candidate), {})[p.candidate.sharding_label] = p
    for variants in groups.values():
        if len(variants) == 1:
            continue
        none, z1, fsdp = variants["none"], variants["zero=1"], variants["fsdp"]
        # reduce-scatter + all-gather = an all-reduce's volume: same step, less memory
        assert z1.step_s == pytest.approx(none.step_s) == pytest.approx(fsdp.step_s)
        assert z1.peak_bytes < fsdp.peak_bytes < none.peak_bytes
    table = format_table(result.ranked[:6])
    assert "sharding" in table.splitlines()[0] and "zero=1" in table


def test_a_memory_limit_leaves_the_sharded_candidates():
    space = SearchSpace(recomputes=(None,))
    free = search(_profile(), world=4, global_batch=16, space=space)
    # below every unsharded dp=4 shape: of those, only the sharded ones still fit
    plain = min(
        p.peak_bytes
        for p in free.ranked
        if p.candidate.dp == 4 and not p.candidate.zero and not p.candidate.fsdp
    )
    capped = search(_profile(), world=4, global_batch=16, memory_per_device=plain - 1, space=space)
    dp4 = [p.candidate for p in capped.ranked if p.candidate.dp == 4]
    assert dp4 and {c.sharding_label for c in dp4} <= {"zero=1", "fsdp"}
    assert any(c.sharding_label == "zero=1" for c in dp4)
    sharded = next(p for p in capped.ranked if p.candidate.dp == 4)
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml")
    strategy = chosen_config(cfg.data, sharded, world=4)["strategy"]
    assert (strategy["zero"], strategy["fsdp"]) == (sharded.candidate.zero, sharded.candidate.fsdp)
    no_shard = search(
        _profile(),
        world=4,
        global_batch=16,
        space=SearchSpace(recomputes=(None,), shardings=("none",)),
    )
    assert {p.candidate.sharding_label for p in no_shard.ranked} == {"none"}


def test_dp_communication_model():
    g = p = 8e9
    ar = allreduce_seconds(g, 8, 1e-4, 1e10)
    for sharding in (Sharding(zero=1, dp=8), Sharding(zero=2, dp=8), Sharding(fsdp=True, dp=8)):
        assert dp_comm_seconds(g, p, sharding, 1e-4, 1e10) == pytest.approx(ar)
    # fp32 gradients of bf16 parameters: the all-gather moves half the bytes
    assert dp_comm_seconds(g, p / 2, Sharding(zero=1, dp=8), 0.0, 1e10) == pytest.approx(
        7 / 8 * (g + p / 2) / 1e10
    )
    resharding = Sharding(fsdp=True, dp=8, reshard_after_forward=True)
    assert dp_comm_seconds(g, p, resharding, 0.0, 1e10, microbatches=4) == pytest.approx(
        7 / 8 * (g + 8 * p) / 1e10
    )
    assert dp_comm_seconds(g, p, Sharding(dp=1), 1e-4, 1e10) == 0.0


def test_make_candidate_takes_a_sharding_the_plan_accepts():
    from lightning_pp.layout.rules import PreflightError

    prof = _profile()
    cand, _ = make_candidate(prof, 4, 16, pp=2, vpp=1, microbatches=2, schedule="1f1b", zero=1)
    assert (cand.dp, cand.zero, cand.sharding_label) == (2, 1, "zero=1")
    with pytest.raises(PreflightError):
        make_candidate(prof, 2, 16, pp=2, vpp=1, microbatches=2, schedule="1f1b", fsdp=True)


# ---- the planner config section -----------------------------------------------------------------


def test_planner_section_is_checked(tmp_path):
    cfg = load_config(GPT_70B)
    assert cfg.get("planner.memory_per_device") == "80GiB"
    with pytest.raises(ConfigError, match="planner.memory_per_device"):
        load_config(GPT_70B, ["planner.memory_per_device=lots"])
    with pytest.raises(ConfigError, match="unknown optimizer-state model 'lion'"):
        load_config(GPT_70B, ["planner.optimizer=lion"])
    with pytest.raises(ConfigError, match="planner.budget"):
        load_config(GPT_70B, ["+planner.budget=3"])


# ---- the 70B template's dry run -----------------------------------------------------------------


def _dry_run(capsys, *overrides: str) -> str:
    from lightning_pp.commands.cli import main

    assert main(["plan", GPT_70B, *overrides]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _sharding_rows(out: str) -> dict[str, list[str]]:
    section = out.split("--- data-parallel sharding over dp=8")[1]
    rows = {}
    for line in section.splitlines()[3:]:
        cells = line.split()
        if not cells or cells[0] not in ("none", "zero=1", "zero=2", "fsdp"):
            break
        rows[cells[0]] = cells
    return rows


def test_70b_dry_run_fits_only_when_sharded(capsys):
    out = _dry_run(capsys, "strategy.zero=0")
    assert "69,561,221,120 parameters" in out and "no storage allocated" in out
    assert "pipeline: pp=8 x dp=8 (world 64)" in out
    assert "params 2 + grads 2, fp32 master weights 4 + optimizer 8 = 16 bytes" in out
    assert re.search(r"heaviest: pipeline rank \d, [\d.]+ GiB: does NOT fit in 80.00 GiB", out)
    rows = _sharding_rows(out)
    assert rows["none"][-1] == "NO" and rows["none"][1] == "*"
    assert rows["zero=1"][-1] == "yes" and rows["fsdp"][-1] == "yes"
    assert all(v[-4] == "GiB" for v in rows.values())
    peak = {k: float(v[-5]) for k, v in rows.items()}  # GiB
    assert peak["none"] > 80 > peak["fsdp"] > peak["zero=1"]

    for overrides in (("strategy.zero=1",), ("strategy.zero=0", "strategy.fsdp=true")):
        out = _dry_run(capsys, *overrides)
        assert re.search(r"heaviest: pipeline rank \d, [\d.]+ GiB: fits in 80.00 GiB", out), out
