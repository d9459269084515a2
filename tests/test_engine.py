"""Engine equivalence on real gloo process groups: every schedule == unpipelined training.

One spawned world of 4 ranks runs every case (pp=2 cases run as two independent pipelines,
dp=2, each on its own data), so process start-up is paid once.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from engine_models import (
    grad_errors,
    make_chunks,
    mlp_batch,
    mlp_layers,
    mse_loss,
    run_reference,
    tuple_batch,
    tuple_input_fn,
    tuple_layers,
)

from lightning_pp.layout.topology import PipelineTopology, build_process_groups
from lightning_pp.runtime.engine import GLOO_RECV_LOOKAHEAD, PipelineEngine
from lightning_pp.schedules import Op, build_schedule

WORLD = 4
STEPS = 5
TOL = 1e-6


def _case(schedule, pp, vpp, m, **kw):
    c = dict(schedule=schedule, pp=pp, vpp=vpp, m=m, model="mlp", reduction="mean", group=None)
    c.update(release=True, static=False, batch=10, lookahead=None)
    c.update(kw)
    c["id"] = (
        f"{c['model']}-{schedule}-pp{pp}-vpp{vpp}-m{m}-{c['reduction']}"
        + (f"-N{c['group']}" if c["group"] else "")
        + ("-static" if c["static"] else "")
        + ("" if c["release"] else "-norelease")
        + (f"-L{c['lookahead']}" if c["lookahead"] else "")
    )
    return c


CASES = [
    _case("gpipe", 2, 1, 4),
    _case("gpipe", 2, 1, 3),
    _case("gpipe", 2, 2, 4),
    _case("gpipe", 2, 2, 3),
    _case("1f1b", 2, 1, 4),
    _case("1f1b", 2, 1, 5),
    _case("interleaved", 2, 2, 4),
    _case("interleaved", 2, 2, 5, group=5),
    _case("gpipe", 4, 1, 4),
    _case("gpipe", 4, 1, 6),
    _case("gpipe", 4, 2, 4),
    _case("gpipe", 4, 2, 5),
    _case("1f1b", 4, 1, 8),
    _case("1f1b", 4, 1, 6),
    _case("1f1b", 4, 1, 2),
    _case("interleaved", 4, 2, 4),
    _case("interleaved", 4, 2, 8),
    _case("interleaved", 4, 2, 6, group=6),
    # loss reductions, shape modes, output release off
    _case("1f1b", 4, 1, 4, reduction="sum"),
    _case("interleaved", 2, 2, 5, reduction="sum", group=5),
    _case("1f1b", 4, 1, 4, static=True),
    _case("interleaved", 4, 2, 8, static=True),
    _case("gpipe", 2, 1, 4, release=False),
    _case("gpipe", 4, 1, 4, release=False),
    # tuple activations (hidden + int64 mask), sequence length changing every step
    _case("1f1b", 4, 1, 4, model="tuple", batch=8),
    _case("interleaved", 2, 2, 5, model="tuple", batch=8, group=5),
    _case("gpipe", 4, 2, 4, model="tuple", batch=8),
    # receive lookahead (default None = 8 on gloo): 1 = just in time (what NCCL runs), 64 = every
    # receive as early as it can be posted (headers, static shapes, varying shapes)
    _case("1f1b", 4, 1, 8, lookahead=1),
    _case("interleaved", 4, 2, 8, lookahead=1),
    _case("interleaved", 4, 2, 8, lookahead=2),
    _case("gpipe", 2, 1, 4, lookahead=64),
    _case("1f1b", 4, 1, 6, lookahead=64),
    _case("interleaved", 4, 2, 8, lookahead=64),
    _case("interleaved", 4, 2, 8, static=True, lookahead=64),
    _case("gpipe", 4, 2, 5, static=True, lookahead=64),
    _case("interleaved", 2, 2, 5, model="tuple", batch=8, group=5, lookahead=64),
]
SEQ_LENS = [5, 7, 3, 6, 4]


def _hook_problems(calls, record, schedule, pp_rank):
    """on_chunk_grads_ready: once per chunk, during the event of that chunk's LAST backward."""
    actions = schedule.ranks[pp_rank]
    last = {}
    for i, a in enumerate(actions):
        if a.op is Op.B:
            last[a.chunk] = i
    problems = []
    chunks_called = [c for c, _ in calls]
    if sorted(chunks_called) != sorted(last):
        problems.append(f"hook called for chunks {chunks_called}, expected each of {sorted(last)}")
    for c, t in calls:
        where = [i for i, ev in enumerate(record.events) if ev.start <= t <= ev.end]
        if where != [last.get(c)]:
            problems.append(
                f"hook for chunk {c} ran during event(s) {where}, expected {last.get(c)}"
            )
    return problems


def _run_case(rank, case, groups_cache):
    pp, vpp, m = case["pp"], case["vpp"], case["m"]
    topo = PipelineTopology.from_world(WORLD, rank, pp)
    if pp not in groups_cache:  # every rank walks the same case list: same creation order
        groups_cache[pp] = build_process_groups(topo)
    groups = groups_cache[pp]
    schedule = build_schedule(
        case["schedule"], pp=pp, microbatches=m, vpp=vpp, group_size=case["group"]
    )
    seed = 1234
    if case["model"] == "mlp":
        layers = mlp_layers(seed)
        input_fn = None
        batches = [mlp_batch(seed + 100 * topo.dp_rank + s, case["batch"]) for s in range(STEPS)]
    else:
        layers = tuple_layers(seed)
        input_fn = tuple_input_fn
        batches = [
            tuple_batch(seed + 100 * topo.dp_rank + s, case["batch"], SEQ_LENS[s])
            for s in range(STEPS)
        ]
    loss_fn = mse_loss(case["reduction"])
    ref_layers = copy.deepcopy(layers)
    chunks = make_chunks(layers, pp, vpp, topo.pp_rank)
    calls = []
    engine = PipelineEngine(
        chunks,
        schedule,
        topo,
        groups,
        loss_fn=loss_fn,
        input_fn=input_fn,
        loss_reduction=case["reduction"],
        release_outputs=case["release"],
        static_shapes=case["static"],
        recv_lookahead=case["lookahead"],
        measure_memory=True,
        on_chunk_grads_ready=lambda c: calls.append((c, time.perf_counter())),
    )
    params = [p for c in chunks for p in c.parameters()]
    ref_params = [p for layer in ref_layers for p in layer.parameters()]
    # A summed loss has batch*OUT times larger gradients: scale lr so training stays stable
    # (an unstable run amplifies fp32 rounding past any fixed tolerance).
    lr = 0.05 if case["reduction"] == "mean" else 0.05 / (case["batch"] * 3)
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_params, lr=lr, momentum=0.9)
    out = dict(losses=[], ref_losses=[], grad_err=0.0, worst="", hook=[], peak_stash=0)
    ref_input = input_fn or (lambda b: b[0])
    # forward-only evaluation first, while both models hold the same initial weights
    batch = batches[0]
    res = engine.eval_step(batch, collect_outputs=True)
    with torch.no_grad():
        x = ref_input(batch)
        for layer in ref_layers:
            x = layer(x)
        ref_eval = loss_fn(x, batch).item()
    out["eval"] = (res.loss.item(), ref_eval)
    if res.outputs is not None:
        got = torch.cat(res.outputs)
        out["eval_out_err"] = (got - x).abs().max().item()
    for step, batch in enumerate(batches):
        calls.clear()
        res = engine.train_step(batch)
        ref_loss = run_reference(ref_layers, batch, loss_fn, ref_input)
        out["losses"].append(res.loss.item())
        out["ref_losses"].append(ref_loss.item())
        if step == 0:
            # Gradients are compared where both models hold identical weights. Later steps
            # compare the loss: the weights then differ by fp32 rounding (order of summation),
            # which the optimizer carries forward.
            for name, e in grad_errors(chunks, ref_layers).items():
                if e > out["grad_err"]:
                    out["grad_err"], out["worst"] = e, f"layer {name}"
        out["hook"] += [
            f"step {step}: {p}" for p in _hook_problems(calls, res.record, schedule, topo.pp_rank)
        ]
        out["posted_after"] = [ev.recv_posted_after for ev in res.record.events]
        out["peak_stash"] = max(out["peak_stash"], res.record.peak_stash_bytes)
        out["peak_saved"] = res.record.peak_saved_bytes
        out["peak_inflight"] = res.record.peak_inflight
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["is_last"] = topo.is_last_stage
    out["pp_rank"] = topo.pp_rank
    return out


def _groups_check(rank):
    """pp outermost: world 4 / pp 2 has pipelines {0, 2}, {1, 3} and dp groups {0, 1}, {2, 3}."""
    topo = PipelineTopology.from_world(WORLD, rank, 2)
    groups = build_process_groups(topo)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=groups.pp_group)
    u = torch.tensor([float(rank)])
    dist.all_reduce(u, group=groups.dp_group)
    return dict(pp_sum=t.item(), dp_sum=u.item(), pipeline=topo.pipeline_ranks, dp=topo.dp_ranks)


def _equivalence_worker(rank, world_size, cases):
    groups_cache = {}
    out = {"groups": _groups_check(rank)}
    t0 = time.perf_counter()
    for case in cases:
        out[case["id"]] = _run_case(rank, case, groups_cache)
    out["seconds"] = time.perf_counter() - t0
    return out


@pytest.fixture(scope="module")
def world4():
    t0 = time.perf_counter()
    results = run_distributed(_equivalence_worker, WORLD, CASES, timeout=280)
    print(f"\nworld-4 engine spawn: {time.perf_counter() - t0:.1f}s")
    return results


def test_process_groups_world4(world4):
    for rank, res in enumerate(world4):
        g = res["groups"]
        assert g["pipeline"] == [rank % 2, rank % 2 + 2]
        assert g["dp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert g["pp_sum"] == sum(g["pipeline"])
        assert g["dp_sum"] == sum(g["dp"])


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_matches_unpipelined(world4, case):
    for rank, res in enumerate(world4):
        r = res[case["id"]]
        for step, (got, ref) in enumerate(zip(r["losses"], r["ref_losses"])):
            assert _rel(got, ref) <= TOL, f"rank {rank} step {step}: loss {got} != reference {ref}"
        assert len(r["losses"]) == STEPS
        assert r["grad_err"] <= TOL, (
            f"rank {rank}: grad rel err {r['grad_err']:.3g} at {r['worst']}"
        )
        assert not r["hook"], f"rank {rank}: " + "; ".join(r["hook"])
        got, ref = r["eval"]
        assert _rel(got, ref) <= TOL, f"rank {rank}: eval loss {got} != reference {ref}"
        if r["is_last"]:
            assert r["eval_out_err"] <= 1e-5
        else:
            assert "eval_out_err" not in r


def test_loss_sequence_moves(world4):
    """Guard against a vacuous comparison: training actually changes the loss."""
    r = world4[0][CASES[0]["id"]]
    assert len(set(round(x, 6) for x in r["losses"])) > 1


@pytest.mark.parametrize("pp", [2, 4])
def test_output_release_lowers_peak_stash(world4, pp):
    on = next(c for c in CASES if c["id"] == f"mlp-gpipe-pp{pp}-vpp1-m4-mean")
    off = next(c for c in CASES if c["id"] == f"mlp-gpipe-pp{pp}-vpp1-m4-mean-norelease")
    for rank, res in enumerate(world4):
        a, b = res[on["id"]], res[off["id"]]
        if a["is_last"]:
            continue  # the last stage sends nothing: nothing to release
        assert a["peak_stash"] < b["peak_stash"], (rank, a["peak_stash"], b["peak_stash"])
        assert a["peak_saved"] > 0


def test_peak_inflight_follows_schedule(world4):
    """1F1B keeps at most pp - r microbatches in flight on rank r; GPipe keeps all m."""
    for res in world4:
        r = res["mlp-1f1b-pp4-vpp1-m8-mean"]
        assert r["peak_inflight"] == min(4 - r["pp_rank"], 8)
        g = res["mlp-gpipe-pp4-vpp1-m4-mean"]
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


@pytest.mark.parametrize(
    "case", [c for c in CASES if c["lookahead"] or not c["static"]], ids=lambda c: c["id"]
)
def test_receives_are_posted_lookahead_actions_early(world4, case):
    """Each action's receives were posted where the lookahead rule says (default on gloo: 8)."""
    lookahead = case["lookahead"] or GLOO_RECV_LOOKAHEAD
    schedule = build_schedule(
        case["schedule"],
        pp=case["pp"],
        microbatches=case["m"],
        vpp=case["vpp"],
        group_size=case["group"],
    )
    for rank, res in enumerate(world4):
        r = res[case["id"]]
        actions = schedule.ranks[r["pp_rank"]]
        want = _expected_posted_after(
            actions, case["pp"], r["pp_rank"], schedule.num_stages, lookahead
        )
        assert r["posted_after"] == want, (rank, r["posted_after"], want)


def test_lookahead_posts_gradient_receives_once_their_forward_ran(world4):
    """Hand-worked: GPipe pp=2 m=4, lookahead 64, rank 0 (F0-F3 receive nothing). B_k's gradient
    receive needs F_k's output shape, so it is posted right after F_k (index k); the last
    stage's forward receives all go out before the first action."""
    for res in world4:
        r = res["mlp-gpipe-pp2-vpp1-m4-mean-L64"]
        if r["pp_rank"] == 0:
            assert r["posted_after"] == [None] * 4 + [0, 1, 2, 3]
        else:
            assert r["posted_after"] == [-1] * 4 + [None] * 4
