"""``zb-auto``: the zero-bubble schedule computed from measured costs (lightning_pp.schedules.auto).

Pure Python (quick tier): every built schedule validates (FIFO, each F with its I and W or B,
no deadlock) and keeps the per-rank memory limit; it is deterministic; the greedy's own makespan
is the simulator's; it is never slower in the simulator than the handcrafted schedules of its
layout that fit the same memory; the acceptance grid of docs/schedules.md; the CLI. The engine
equivalence (zb-auto == unpipelined training, loop and V placement, tied weights, dp=2) is in
the shared 4-rank world at the end.
"""

from __future__ import annotations

import json
import os
import random
import sys

import pytest

from lightning_pp.commands.cli import main
from lightning_pp.schedules import (
    Costs,
    Op,
    build_schedule,
    memory_limits,
    one_f_one_b,
    peak_inflight,
    simulate,
    validate,
    zb_auto,
    zb_h1,
    zbv,
)
from lightning_pp.schedules.auto import POLICIES, _greedy, _Shape, compare, describe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import zb_auto_grid  # noqa: E402

HAND = {"1f1b": one_f_one_b, "zb-h1": zb_h1, "zbv": zbv}


def _random_costs(rng: random.Random, pp: int, vpp: int) -> Costs:
    """Whole-share costs in [0.5, 2), sometimes a slower (rank, chunk), latency, overhead."""
    t_f, t_i, t_w = (rng.uniform(0.5, 2.0) for _ in range(3))
    overrides = {}
    if rng.random() < 0.5:
        r, c = rng.randrange(pp), rng.randrange(vpp)
        k = rng.uniform(1.2, 2.0)
        overrides[(r, c)] = (k * t_f / vpp, k * (t_i + t_w) / vpp, k * t_i / vpp, k * t_w / vpp)
    latency = rng.choice([0.0, 0.0, 0.1])
    overhead = rng.choice([0.0, 0.0, 0.05])
    return Costs(t_f=t_f, t_b=t_i + t_w, t_i=t_i, t_w=t_w, overrides=overrides,
                 latency=latency, overhead=overhead)  # fmt: skip


SHAPES = [(p, m, v) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, p, 2 * p + 1) for v in (1, 2, 3)]


@pytest.mark.quick
@pytest.mark.parametrize("memory", ["1p", "2p", "1f1b"])
def test_valid_within_memory_and_never_worse_than_handcrafted(memory):
    rng = random.Random(36)
    for p, m, v in SHAPES:
        costs = _random_costs(rng, p, v)
        s = zb_auto(p, m, vpp=v, costs=costs, memory=memory)
        validate(s)
        shape = f"p={p} m={m} vpp={v} memory={memory} {costs}"
        assert (s.name, s.pp, s.vpp, s.microbatches) == ("zb-auto", p, v, m), shape
        assert s.placement == ("v" if v == 2 else "loop"), shape
        limits = memory_limits(memory, p, v)
        assert all(a <= b for a, b in zip(peak_inflight(s), limits)), (shape, peak_inflight(s))
        span = simulate(s, costs).makespan
        assert span == pytest.approx(s.meta["makespan"], rel=1e-12), shape
        # the engine's DP sync reduces a weight shared by chunks with chunk 0: its last
        # backward must be the rank's last (DeferredGradSync)
        for actions in s.ranks:
            done = [a for a in actions if a.op in (Op.B, Op.W)]
            assert done[-1].chunk == 0, (shape, done[-3:])
        for name, gen in HAND.items():
            hand = gen(p, m)
            same = hand.vpp == v and hand.placement == s.placement
            fits = all(a <= b for a, b in zip(peak_inflight(hand), limits))
            if same and fits:
                assert span <= simulate(hand, costs).makespan * (1 + 1e-12), (shape, name)
                assert name in s.meta["baselines"], shape


@pytest.mark.quick
def test_greedy_makespan_is_the_simulators():
    """Why the generator may skip simulating its candidates: the list scheduler times every
    action by the simulator's own rule, so its makespan is the simulator's, for every policy."""
    rng = random.Random(7)
    for p, m, v in [(2, 5, 2), (4, 8, 2), (4, 6, 1), (3, 7, 3), (5, 10, 2)]:
        costs = _random_costs(rng, p, v)
        shape = _Shape(p, v, m, "v" if v == 2 else "loop")
        dur = [[costs.chunk_costs(shape.shell, r, c) for c in range(v)] for r in range(p)]
        for policy in POLICIES:
            out = _greedy(shape, dur, costs.latency, memory_limits("1p", p, v), policy)
            if out is None:
                continue
            s = build_schedule("zb-auto", p, m, vpp=v)  # a shell with the right shape
            s = type(s)("x", p, v, m, tuple(map(tuple, out[0])), placement=s.placement)
            assert simulate(s, costs).makespan == pytest.approx(out[1], rel=1e-12), policy


@pytest.mark.quick
def test_deterministic():
    costs = Costs(t_f=1.0, t_i=1.5, t_w=0.5, latency=0.05, overhead=0.02)
    a = zb_auto(4, 8, costs=costs)
    b = zb_auto(4, 8, costs=Costs(t_f=1.0, t_i=1.5, t_w=0.5, latency=0.05, overhead=0.02))
    assert a.ranks == b.ranks and a.meta == b.meta


@pytest.mark.quick
def test_beats_zbv_where_the_handcrafted_order_is_off_its_design_point():
    # m = p: ZB-V's V never fills; the computed order does (simulator, equal costs)
    s = zb_auto(4, 4)
    assert simulate(s).makespan == 13.5 and simulate(zbv(4, 4)).makespan == 15.0
    assert s.meta["source"] not in HAND
    # unequal split: 1 : 1.5 : 0.5
    c = Costs(t_f=1, t_i=1.5, t_w=0.5)
    assert simulate(zb_auto(4, 8, costs=c), c).makespan < simulate(zbv(4, 8), c).makespan


@pytest.mark.quick
def test_falls_back_to_the_handcrafted_order_at_its_design_point():
    s = zb_auto(4, 8)  # t_f = t_i = t_w, m = 2p: ZB-V is optimal
    assert s.meta["source"] == "zbv" and s.ranks == zbv(4, 8).ranks
    assert s.name == "zb-auto" and s.meta["baselines"] == {"zbv": 25.5}


@pytest.mark.quick
def test_overhead_is_charged_per_action_and_fuses_backwards():
    # per-action overhead: 1F1B at p=1, m=2 runs 4 actions
    base = simulate(one_f_one_b(1, 2)).makespan
    assert simulate(one_f_one_b(1, 2), Costs(overhead=0.5)).makespan == base + 4 * 0.5
    assert Costs().overhead == 0.0
    # with an overhead the generator fuses I+W into B where the gradient is not awaited
    costs = Costs(t_f=1.0, t_b=1.5, t_i=1.0, t_w=0.5, overhead=0.2)
    s = zb_auto(4, 8, vpp=1, costs=costs)
    assert any(a.op is Op.B for r in s.ranks for a in r)
    assert any(a.op is Op.I for r in s.ranks for a in r)
    assert s.meta["makespan"] < min(s.meta["baselines"].values())


@pytest.mark.quick
def test_memory_limits_and_errors():
    assert memory_limits("1p", 4, 2) == (8,) * 4
    assert memory_limits("2p", 2, 1) == (4, 4)
    assert memory_limits("1f1b", 4, 1) == (4, 3, 2, 1)
    assert memory_limits([3, 2], 2, 1) == (3, 2)
    with pytest.raises(ValueError, match=r"rank 1 is 1 microbatch-chunks.*vpp=2.*at least 2"):
        memory_limits([4, 1], 2, 2)
    with pytest.raises(ValueError, match="memory must be one of"):
        memory_limits("3p", 2, 1)
    with pytest.raises(ValueError, match="2 per-rank limits for pp=3"):
        memory_limits([4, 4], 3, 1)
    # the 1F1B bound (p - r) holds for the computed order too, counted until W
    s = zb_auto(4, 8, vpp=1, costs=Costs(t_f=1, t_i=1.5, t_w=0.5), memory="1f1b")
    assert all(a <= b for a, b in zip(peak_inflight(s), [4, 3, 2, 1])), peak_inflight(s)


@pytest.mark.quick
def test_build_schedule_and_describe():
    s = build_schedule("zb-auto", 4, 8)
    assert (s.vpp, s.placement) == (2, "v")
    assert build_schedule("zb-auto", 4, 8, vpp=1).placement == "loop"
    assert build_schedule("zb-auto", 4, 8, vpp=3).stages_of(1) == (1, 5, 9)
    with pytest.raises(ValueError, match="costs and memory are what schedule 'zb-auto'"):
        build_schedule("zbv", 4, 8, costs=Costs())
    c = Costs(t_f=1, t_i=1.5, t_w=0.5)
    s = build_schedule("zb-auto", 4, 8, costs=c, memory="2p")
    assert s.meta["memory"] == [16] * 4
    spans = compare(s, c)
    assert set(spans) == {"zb-auto", "1f1b", "zb-h1", "zbv"}
    text = describe(s, c)
    assert "V placement" in text and "zbv 27" in text and "memory limit 16" in text


@pytest.mark.quick
@pytest.mark.quick
def test_measured_costs_are_each_ops_typical_action_not_its_mean():
    """The strategy's rebuild reads one step's actions per (pp rank, chunk, op): a single slow
    one (a cold cache, a descheduled process) must not move the cost zb-auto is built from."""
    from lightning_pp.runtime.records import StepEvent, StepRecord
    from lightning_pp.strategy.auto_schedule import measured_auto_costs

    s = build_schedule("zb-h1", pp=1, microbatches=4)
    t = {Op.F: 1.0, Op.I: 2.0, Op.W: 3.0}
    events, slow = [], True
    for a in s.ranks[0]:
        took = 9.0 if (a.op == Op.F and slow) else t[a.op]
        slow = slow and a.op != Op.F
        events.append(StepEvent(a, 0.0, took + 0.5, layers=took))
    costs = measured_auto_costs([StepRecord(0, 0, s, 0.0, events)])
    assert costs.overrides[(0, 0)] == (1.0, 5.0, 2.0, 3.0)  # the mean F would be 3.0
    assert costs.overhead == 0.5


def test_cli_text_and_json(capsys):
    assert main(["schedule", "--schedule", "zb-auto", "--pp", "4", "--microbatches", "8",
                 "--costs", "t_f=1,t_i=1.5,t_w=0.5"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("zb-auto: pp=4 vpp=2 microbatches=8")
    assert "rank 3 |" in out and "handcrafted:" in out and "zbv 27" in out
    assert main(["schedule", "--schedule", "zb-auto", "--pp", "2", "--microbatches", "4",
                 "--costs", "t_f=1,t_i=0.5,t_w=0.5,latency=0.3,overhead=0.2", "--vpp", "1",
                 "--format", "json"]) == 0  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    for key in ("schedule", "pp", "vpp", "microbatches", "placement", "ranks", "bubble_ratio",
                "makespan", "peak_inflight"):  # fmt: skip
        assert key in d
    assert (d["schedule"], d["vpp"], d["placement"]) == ("zb-auto", 1, "loop")
    assert d["makespan"] == pytest.approx(12.7)
    assert {a["op"] for r in d["ranks"] for a in r} >= {"F", "I", "W"}


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--schedule", "zb-h1", "--memory", "2p"], "--memory applies to --schedule zb-auto"),
        (["--schedule", "zb-auto", "--costs", "t_q=1"], "expected KEY=VALUE with KEY one of"),
        (["--schedule", "zb-auto", "--costs", "t_f=x"], "'x' is not a number"),
        (["--schedule", "zb-auto", "--memory", "lots"], "--memory 'lots': expected one of"),
        (["--schedule", "zb-auto", "--memory", "1"], "needs at least 2"),
    ],
)
def test_cli_errors(capsys, argv, message):
    assert main(["schedule", "--pp", "2", "--microbatches", "4", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("memory", ["1p", "2p"])
def test_acceptance_grid(memory):
    """The grid of docs/schedules.md (issue 36): never slower than the best handcrafted
    schedule at the same memory in any case, and >= 5 % faster in every unequal-cost case
    where the lower bound leaves 5 % to win (at 1F1B's peak 11 of 63; at twice it, where the
    interleaved 1F1B fits too, 13). The issue's target, half of them, is out of any schedule's
    reach in this grid at either memory: no other case has that room (docs/schedules.md)."""
    cases = zb_auto_grid.grid(memory)
    assert len(cases) == 72
    worst = max(c.ratio_to_best for c in cases)
    assert worst <= 1 + 1e-9, worst
    unequal = [c for c in cases if c.unequal]
    assert len(unequal) == 63
    room = [c for c in unequal if c.bound <= 0.95 * c.best_hand[1]]
    assert len(room) < len(unequal) / 2, len(room)
    missed = [(c.pp, c.m, c.ratio, c.heavy) for c in room if c.ratio_to_best > 0.95]
    assert not missed, missed
    assert sum(c.ratio_to_best <= 0.95 for c in unequal) == len(room)
    for c in cases:  # the bound is a bound
        assert c.bound <= min(c.auto, *c.hand.values()) * (1 + 1e-9), c


@pytest.mark.quick
def test_the_grids_lower_bound_is_below_every_schedule():
    """zb_auto_grid.lower_bound holds for every order of its layout: the handcrafted ones (fused
    B and split I/W), zb-auto at three memory limits, under random per-(rank, chunk) costs,
    latency and per-action overhead."""
    rng = random.Random(361)
    shapes = [(pp, m, v) for pp in (2, 3, 4) for m in (pp, 2 * pp, 3 * pp + 1) for v in (1, 2)]
    for p, m, v in shapes:
        costs = _random_costs(rng, p, v)
        bound = zb_auto_grid.lower_bound(costs, p, m, v)
        orders = [zb_auto(p, m, vpp=v, costs=costs, memory=mem) for mem in ("1p", "2p", "1f1b")]
        orders += [gen(p, m) for gen in HAND.values()]
        for s in orders:
            if s.vpp == v and s.placement == ("v" if v == 2 else "loop"):
                span = simulate(s, costs).makespan
                assert bound <= span * (1 + 1e-12), (p, m, v, s.name, bound, span, costs)
                # at the schedule's own peak memory the drain's tail counts too
                held = zb_auto_grid.lower_bound(costs, p, m, v, peak_inflight(s))
                assert bound <= held <= span * (1 + 1e-12), (p, m, v, s.name, held, span, costs)


@pytest.mark.quick
def test_the_lower_bound_counts_the_idle_time_before_a_later_chunk():
    """V placement with a heavy last stage (1 : 1 : 1, p = m = 4): rank 0 holds the first and
    the last stage and cannot start the heavy one before the forward has crossed the other
    seven. The bound counts that wait, and ZB-V meets it: no order does better there."""
    costs = zb_auto_grid.costs_for((1, 1, 1), 4, 2, True)
    bound = zb_auto_grid.lower_bound(costs, 4, 4, 2)
    # 3.5 before stage 7 can start; rank 0 owes 4 x 1.5 (chunk 0) + 4 x 3 (chunk 1); only
    # chunk 0's four forwards (2.0) fit before
    assert bound == pytest.approx(3.5 + 18.0 - 2.0)
    assert simulate(zbv(4, 4), costs).makespan == pytest.approx(bound)


@pytest.mark.quick
def test_the_lower_bound_counts_the_drain_the_memory_leaves_idle():
    """One chunk per rank, 1 : 1.5 : 0.5, p = 4, m = 8, at 1F1B's memory: once the last rank
    has run its last input gradient, stages 2, 1 and 0 still owe theirs (1.5 + 1.5 + 2.0),
    and the last rank can hold at most 4 pending W's (2.0) to fill that: it idles 3.0 at
    least. ZB-H1 meets that bound; with unlimited memory the bound drops by the two W's
    more it could defer."""
    costs = zb_auto_grid.costs_for((1, 1.5, 0.5), 4, 1, False)
    bound = zb_auto_grid.lower_bound(costs, 4, 8, 1, "1p")
    # 3.0 before the last stage starts; 8 x (1 + 2) owed; 5.0 of tail less 4 x 0.5 of W's
    assert bound == pytest.approx(3.0 + 24.0 + 3.0)
    assert simulate(zb_h1(4, 8), costs).makespan == pytest.approx(bound)
    assert zb_auto_grid.lower_bound(costs, 4, 8, 1) == pytest.approx(27.0 + 5.0 - 4.0)


def test_build_time_scales():
    """p=16, m=128 builds (counted, not timed: the time is in benchmarks/zb_auto_grid.py
    --timing): the greedy does a bounded amount of work per action and policy."""
    costs = zb_auto_grid.costs_for((1, 1.5, 0.5), 16, 2, True)
    s = zb_auto(16, 128, costs=costs)
    assert sum(len(r) for r in s.ranks) == 16 * 2 * 128 * 3 - sum(
        a.op is Op.B for r in s.ranks for a in r
    )


# --- the engine: zb-auto == unpipelined training ---------------------------------------------

from engine_grid import case, case_problem, run_cases, schedule_of  # noqa: E402
from worlds import world  # noqa: E402

#: costs under which the one-chunk (loop) order differs from zb-h1's and 1f1b's: a hop latency
#: and a per-action overhead (so some backwards are fused B's next to split I/W's)
LOOP_COSTS = {"t_f": 1.0, "t_b": 1.0, "t_i": 0.5, "t_w": 0.5, "latency": 0.3, "overhead": 0.2}

#: pp=2 cases run as two pipelines in the 4-rank world (dp=2, deferred all-reduce); a weight
#: tied between the first and the last stage (two ranks under loop placement, one under V)
ENGINE_CASES = [
    case("zb-auto", 2, 2, model="tied", dp_sync=True, steps=3),  # V; m = p: computed
    case("zb-auto", 2, 4, vpp=1, model="tied", dp_sync=True, steps=3, costs=LOOP_COSTS),
    case("zb-auto", 4, 4, model="tied", steps=3),  # V
    # (the grid's tied weight spans two ranks under loop placement only at pp=2)
    case("zb-auto", 4, 4, vpp=1, steps=3, costs=LOOP_COSTS),
    case("zb-auto", 4, 8, steps=3, costs={"t_f": 1.0, "t_b": 2.0, "t_i": 1.5, "t_w": 0.5}),
]


def _engine_grid(rank, world_size, cases):
    return run_cases(rank, world_size, cases)


@pytest.fixture(scope="module")
def zb_auto_world():
    return world("gloo", 4).run(_engine_grid, ENGINE_CASES, timeout=300)


@pytest.mark.parametrize("c", ENGINE_CASES, ids=[c["id"] for c in ENGINE_CASES])
def test_engine_matches_unpipelined(zb_auto_world, c):
    s = schedule_of(c)
    # a computed order, not a handcrafted one it fell back to (else this would test zbv again)
    assert s.meta["source"] not in HAND, s.meta
    assert s.placement == ("loop" if c["vpp"] == 1 else "v")
    if c.get("costs", {}).get("overhead"):
        ops = {a.op for r in s.ranks for a in r}
        assert {Op.B, Op.I, Op.W} <= ops, ops  # fused and split backwards side by side
    for rank, res in enumerate(zb_auto_world):
        r = res[c["id"]]
        assert len(r["losses"]) == c["steps"]
        problem = case_problem(r)
        assert problem is None, f"rank {rank}: {problem}"
