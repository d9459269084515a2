"""Engine equivalence on real gloo process groups: every schedule == unpipelined training.

Every schedule (gpipe, 1f1b, interleaved, zb-h1, zbv) at pp 2 and 4, microbatches below, at and
above pp (and 2pp for zbv), not multiples of it; mean and sum losses, fixed and varying shapes,
output release on and off, receive lookahead 1 to 64, tuple activations whose sequence length
changes every step, a weight tied across stages (two ranks under loop placement, one under V),
data parallel with the deferred all-reduce, stages whose backward cannot be split. fp32, relative
<= 1e-6 on the loss of every step and every gradient. pp=2 cases run as two pipelines (dp=2).

The cases run in the session's shared 4-rank world (:mod:`worlds`): :data:`QUICK` (one case of
each schedule, with data parallel and a tied weight: the quick tier's world) in one world case,
the rest in another. The case runner is :mod:`engine_grid` (also used by the NCCL-emulated grid).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_grid import case, case_problem, chunks_of, groups_check, run_cases, schedule_of
from torch import nn
from worlds import world

from lightning_pp.layout.topology import PipelineTopology, build_process_groups
from lightning_pp.runtime.engine import GLOO_RECV_LOOKAHEAD, PipelineEngine
from lightning_pp.schedules import Op, build_schedule

WORLD = 4

#: the quick tier: every schedule once, pp=2 x dp=2 (DP mean and the deferred sync where asked),
#: a weight tied across two ranks (the strategy's TiedParameterSync) and one shared by V placement
QUICK = [
    case("gpipe", 2, 4, vpp=1),
    case("1f1b", 2, 4, vpp=1, dp_sync=True),
    case("interleaved", 2, 4, vpp=2),
    case("zb-h1", 2, 4, model="tied", steps=3),
    case("zb-h1", 2, 4, dp_sync=True, steps=3),
    case("zbv", 2, 3, model="tied", dp_sync=True, steps=3),
    case("zbv", 2, 5, steps=3),
]

CLASSIC = [
    case("gpipe", 2, 3, vpp=1),
    case("gpipe", 2, 4, vpp=2),
    case("gpipe", 2, 3, vpp=2),
    case("1f1b", 2, 4, vpp=1),
    case("1f1b", 2, 5, vpp=1),
    case("interleaved", 2, 5, vpp=2, group=5),
    case("gpipe", 4, 4, vpp=1),
    case("gpipe", 4, 6, vpp=1),
    case("gpipe", 4, 4, vpp=2),
    case("gpipe", 4, 5, vpp=2),
    case("1f1b", 4, 8, vpp=1),
    case("1f1b", 4, 6, vpp=1),
    case("1f1b", 4, 2, vpp=1),
    case("interleaved", 4, 4, vpp=2),
    case("interleaved", 4, 8, vpp=2),
    case("interleaved", 4, 6, vpp=2, group=6),
    # loss reductions, shape modes, output release off
    case("1f1b", 4, 4, vpp=1, reduction="sum"),
    case("interleaved", 2, 5, vpp=2, reduction="sum", group=5),
    case("1f1b", 4, 4, vpp=1, static=True),
    case("interleaved", 4, 8, vpp=2, static=True),
    case("gpipe", 2, 4, vpp=1, release=False),
    case("gpipe", 4, 4, vpp=1, release=False),
    # tuple activations (hidden + int64 mask), sequence length changing every step
    case("1f1b", 4, 4, vpp=1, model="tuple", batch=8),
    case("interleaved", 2, 5, vpp=2, model="tuple", batch=8, group=5),
    case("gpipe", 4, 4, vpp=2, model="tuple", batch=8),
    # receive lookahead (default None = 8 on gloo): 1 = just in time (what NCCL runs), 64 = every
    # receive as early as it can be posted (headers, static shapes, varying shapes)
    case("1f1b", 4, 8, vpp=1, lookahead=1),
    case("interleaved", 4, 8, vpp=2, lookahead=1),
    case("interleaved", 4, 8, vpp=2, lookahead=2),
    case("gpipe", 2, 4, vpp=1, lookahead=64),
    case("1f1b", 4, 6, vpp=1, lookahead=64),
    case("interleaved", 4, 8, vpp=2, lookahead=64),
    case("interleaved", 4, 8, vpp=2, static=True, lookahead=64),
    case("gpipe", 4, 5, vpp=2, static=True, lookahead=64),
    case("interleaved", 2, 5, vpp=2, model="tuple", batch=8, group=5, lookahead=64),
]

ZERO_BUBBLE = [
    case(name, pp, m, steps=3, **kw)
    for name, pp, m, kw in [
        ("zb-h1", 2, 3, {}),
        ("zb-h1", 2, 1, {}),
        ("zb-h1", 4, 8, {}),
        ("zb-h1", 4, 6, {}),
        ("zb-h1", 4, 5, {}),
        ("zb-h1", 4, 2, {}),
        ("zbv", 2, 4, {}),
        ("zbv", 2, 3, {}),  # m < 2p
        ("zbv", 2, 1, {}),
        ("zbv", 4, 8, {}),
        ("zbv", 4, 10, {}),
        ("zbv", 4, 5, {}),  # m < 2p, not a multiple of p
        ("zbv", 4, 3, {}),  # m < p
        ("zb-h1", 4, 6, {"reduction": "sum"}),
        ("zbv", 4, 8, {"static": True}),
        ("zbv", 4, 8, {"lookahead": 1}),
        ("zbv", 4, 8, {"lookahead": 64}),
        ("zb-h1", 4, 8, {"lookahead": 1}),
        # tuple activations (hidden + int64 mask), sequence length changing every step
        ("zb-h1", 4, 5, {"model": "tuple", "batch": 8}),
        ("zbv", 4, 6, {"model": "tuple", "batch": 8}),
        ("zbv", 2, 3, {"model": "tuple", "batch": 8, "lookahead": 64}),
        # a weight tied between the first and the last stage
        ("zbv", 2, 4, {"model": "tied"}),
        ("zbv", 4, 6, {"model": "tied"}),
        # data parallel: two replicas of a pp=2 pipeline, deferred all-reduce after the last W
        ("zbv", 2, 5, {"dp_sync": True}),
        # stages that cannot split: a custom autograd.Function, a frozen layer, no parameters
        ("zbv", 4, 8, {"model": "unsplittable"}),
        ("zb-h1", 4, 4, {"model": "unsplittable"}),
    ]
]
CASES = CLASSIC + ZERO_BUBBLE
assert len({c["id"] for c in QUICK + CASES}) == len(QUICK) + len(CASES), "case ids must differ"


def _grid(rank, world_size, cases):
    return {"groups": groups_check(rank, world_size), **run_cases(rank, world_size, cases)}


@pytest.fixture(scope="module")
def quick4():
    return world("gloo", WORLD).run(_grid, QUICK, timeout=200)


@pytest.fixture(scope="module")
def world4():
    return world("gloo", WORLD).run(_grid, CASES, timeout=500)


@pytest.fixture(scope="module")
def all4(quick4, world4):
    """Every case's results, per rank."""
    return [{**q, **w} for q, w in zip(quick4, world4)]


@pytest.mark.quick
def test_process_groups_world4(quick4):
    for rank, res in enumerate(quick4):
        g = res["groups"]
        assert g["pipeline"] == [rank % 2, rank % 2 + 2]
        assert g["dp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert g["pp_sum"] == sum(g["pipeline"])
        assert g["dp_sum"] == sum(g["dp"])


def _check(results, c):
    for rank, res in enumerate(results):
        r = res[c["id"]]
        assert len(r["losses"]) == c["steps"]
        problem = case_problem(r)
        assert problem is None, f"rank {rank}: {problem}"
        if not r["is_last"]:
            assert "eval_out_err" not in r


@pytest.mark.quick
@pytest.mark.parametrize("c", QUICK, ids=[c["id"] for c in QUICK])
def test_every_schedule_matches_unpipelined(quick4, c):
    _check(quick4, c)


@pytest.mark.parametrize("c", CASES, ids=[c["id"] for c in CASES])
def test_matches_unpipelined(world4, c):
    _check(world4, c)


@pytest.mark.quick
def test_loss_sequence_moves(quick4):
    """Guard against a vacuous comparison: training actually changes the loss."""
    r = quick4[0][QUICK[0]["id"]]
    assert len(set(round(x, 6) for x in r["losses"])) > 1


@pytest.mark.parametrize("pp", [2, 4])
def test_output_release_lowers_peak_stash(all4, pp):
    on, off = f"mlp-gpipe-pp{pp}-vpp1-m4", f"mlp-gpipe-pp{pp}-vpp1-m4-norelease"
    for rank, res in enumerate(all4):
        a, b = res[on], res[off]
        if a["is_last"]:
            continue  # the last stage sends nothing: nothing to release
        assert a["peak_stash"] < b["peak_stash"], (rank, a["peak_stash"], b["peak_stash"])
        assert a["peak_saved"] > 0


def test_peak_inflight_follows_schedule(world4):
    """1F1B keeps at most pp - r microbatches in flight on rank r; GPipe keeps all m."""
    for res in world4:
        r = res["mlp-1f1b-pp4-vpp1-m8"]
        assert r["peak_inflight"] == min(4 - r["pp_rank"], 8)
        g = res["mlp-gpipe-pp4-vpp1-m4"]
        assert g["peak_inflight"] == 4


def _expected_posted_after(actions, pp, pp_rank, num_stages, lookahead):
    """The posting rule, restated from the engine's docs: after each action, receives are
    posted for the actions up to ``lookahead`` ahead, in order, stopping at a backward whose
    forward has not run yet (its gradient shape is unknown); the next action is always posted.
    Returns, per action, the index it was posted after (None: it receives nothing)."""
    stage = [a.chunk * pp + pp_rank for a in actions]
    receives = [(s > 0) if a.op is Op.F else (s < num_stages - 1) for a, s in zip(actions, stage)]
    forward_at = {(a.mb, a.chunk): i for i, a in enumerate(actions) if a.op is Op.F}
    expected, upto = [None] * len(actions), -1
    for after in range(-1, len(actions) - 1):
        j = upto + 1
        while j <= min(after + lookahead, len(actions) - 1):
            a = actions[j]
            unknown_shape = a.op is Op.B and forward_at[(a.mb, a.chunk)] > after
            if j > after + 1 and receives[j] and unknown_shape:
                break
            if receives[j]:
                expected[j] = after
            j += 1
        upto = j - 1
    return expected


LOOP = [c for c in QUICK + CLASSIC if c["schedule"] in ("gpipe", "1f1b", "interleaved")]


@pytest.mark.parametrize(
    "c", [c for c in LOOP if c["lookahead"] or not c["static"]], ids=lambda c: c["id"]
)
def test_receives_are_posted_lookahead_actions_early(all4, c):
    """Each action's receives were posted where the lookahead rule says (default on gloo: 8)."""
    lookahead = c["lookahead"] or GLOO_RECV_LOOKAHEAD
    schedule = schedule_of(c)
    for rank, res in enumerate(all4):
        r = res[c["id"]]
        actions = schedule.ranks[r["pp_rank"]]
        want = _expected_posted_after(
            actions, c["pp"], r["pp_rank"], schedule.num_stages, lookahead
        )
        assert r["posted_after"] == want, (rank, r["posted_after"], want)


def test_lookahead_posts_gradient_receives_once_their_forward_ran(world4):
    """Hand-worked: GPipe pp=2 m=4, lookahead 64, rank 0 (F0-F3 receive nothing). B_k's gradient
    receive needs F_k's output shape, so it is posted right after F_k (index k); the last
    stage's forward receives all go out before the first action."""
    for res in world4:
        r = res["mlp-gpipe-pp2-vpp1-m4-L64"]
        if r["pp_rank"] == 0:
            assert r["posted_after"] == [None] * 4 + [0, 1, 2, 3]
        else:
            assert r["posted_after"] == [-1] * 4 + [None] * 4


# ---- zero-bubble specifics ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_inflight_counts_until_w(world4, name):
    """The engine's in-flight count (held until W) peaks where the schedule says."""
    from lightning_pp.schedules import peak_inflight

    want = peak_inflight(build_schedule(name, pp=4, microbatches=8))
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
        chunks = chunks_of(layers, schedule, topo.pp_rank)
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
    for rank, res in enumerate(world("gloo", 2).run(_autocast_worker, timeout=120)):
        for name in ("1f1b", "zb-h1"):
            seen, graph_free = res[name]
            assert seen == [("B", False), ("F", True)], (rank, name, seen)
        assert res["zb-h1"][1] == [rank == 1], rank  # stage 0's I is a no-op: nothing to free
