"""Zero-bubble schedules: the split backward (I / W) in the IR and validator, the ZB-H1 and
ZB-V generators, their closed forms in the simulator, the renderers and the schedule CLI.

The closed forms are derived in docs/schedules.md; here they are checked to 1e-9 over a grid of
pipeline shapes and costs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_pp.commands.cli import main
from lightning_pp.schedules import (
    OP_STYLE,
    Action,
    Costs,
    Op,
    Schedule,
    ScheduleError,
    build_schedule,
    one_f_one_b,
    peak_inflight,
    render_gantt,
    render_grid,
    simulate,
    validate,
    zb_h1,
    zbv,
)
from lightning_pp.schedules.validate import dependencies

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

F, B, I, W = Op.F, Op.B, Op.I, Op.W  # noqa: E741 - the paper's names
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[1]
GRID = [(p, m) for p in range(1, 7) for m in range(1, 17)]


def make(ranks, vpp=1, m=None, placement="loop") -> Schedule:
    ranks = tuple(tuple(Action(op, mb, c) for op, mb, c in r) for r in ranks)
    if m is None:
        m = 1 + max(a.mb for r in ranks for a in r)
    return Schedule("hand", len(ranks), vpp, m, ranks, placement=placement)


# --- IR and validator -------------------------------------------------------------------------


def test_split_backward_pairs_validate_and_mix_with_fused_backward():
    # Rank 0 fuses, rank 1 splits: each F gets one B, or one I and one W.
    s = make([[(F, 0, 0), (F, 1, 0), (B, 0, 0), (B, 1, 0)], [(F, 0, 0), (I, 0, 0), (F, 1, 0)]
              + [(I, 1, 0), (W, 0, 0), (W, 1, 0)]])  # fmt: skip
    validate(s)
    assert s.split_backward and not build_schedule("1f1b", pp=2, microbatches=2).split_backward
    # Rank 0's B0 waits for rank 1's I0 (the op that sends the input gradient), not a B.
    deps = [(0, Action(F, 0)), (1, Action(I, 0))]
    assert dependencies(s, 0, Action(B, 0)) == deps
    assert dependencies(s, 0, Action(B, 0), {(1, 0, 0): I, (1, 1, 0): I}) == deps
    assert dependencies(s, 1, Action(W, 1)) == [(1, Action(I, 1))]


@pytest.mark.parametrize(
    ("ranks", "message", "mark"),
    [
        ([(I, 0, 0), (F, 0, 0), (W, 0, 0)], r"I mb=0 chunk=0 \(step 0\): backward before its", 0),
        ([(F, 0, 0), (W, 0, 0), (I, 0, 0)], r"W mb=0 chunk=0 \(step 1\): W before its I", 1),
        (
            [(F, 0, 0), (F, 1, 0), (I, 1, 0), (W, 1, 0), (I, 0, 0), (W, 0, 0)],
            r"I mb=1 chunk=0 \(step 2\): backwards of chunk 0 must follow its forwards in FIFO "
            r"order: the oldest pending forward is mb=0",
            2,
        ),
        (
            [(F, 0, 0), (F, 1, 0), (I, 0, 0), (I, 1, 0), (W, 1, 0), (W, 0, 0)],
            r"W mb=1 chunk=0 \(step 4\): W's of chunk 0 must follow its I's in FIFO order: the "
            r"oldest I waiting for its W is mb=0",
            4,
        ),
        ([(F, 0, 0), (I, 0, 0), (B, 0, 0)], r"B mb=0 chunk=0 \(step 2\): microbatch has both", 2),
        ([(F, 0, 0), (B, 0, 0), (W, 0, 0)], r"W of a microbatch whose backward is a fused B", 2),
        ([(F, 0, 0), (I, 0, 0), (I, 0, 0)], r"duplicated input-gradient step \(first at step 1", 2),
        ([(F, 0, 0), (I, 0, 0), (W, 0, 0), (W, 0, 0)], r"duplicated weight-gradient step", 3),
        ([(F, 0, 0), (I, 0, 0)], r"rank 0: missing W mb=0 chunk=0 \(its I is step 1\)", 1),
    ],
)
def test_split_backward_rules(ranks, message, mark):
    with pytest.raises(ScheduleError, match=message) as err:
        validate(make([ranks]))
    assert err.value.marks == {0: mark}


def test_w_must_stay_on_its_own_chunk():
    # W of chunk 1 for an I that ran on chunk 0: that W has no I of its own.
    s = make([[(F, 0, 0), (F, 0, 1), (I, 0, 1), (I, 0, 0), (W, 0, 1), (W, 0, 1)]], vpp=2)
    with pytest.raises(ScheduleError, match=r"W mb=0 chunk=1 \(step 5\): duplicated"):
        validate(s)


def test_deadlock_dry_run_covers_input_gradient_steps():
    # Rank 1 holds its I0 back behind F1, which rank 0 sends only after that I0 came back.
    s = make(
        [
            [(F, 0, 0), (I, 0, 0), (F, 1, 0), (I, 1, 0), (W, 0, 0), (W, 1, 0)],
            [(F, 0, 0), (F, 1, 0), (I, 0, 0), (I, 1, 0), (W, 0, 0), (W, 1, 0)],
        ]
    )
    with pytest.raises(ScheduleError, match="deadlock") as err:
        validate(s)
    msg = str(err.value)
    assert "rank 0: I mb=0 chunk=0 (step 1) waits for I mb=0 chunk=0 on rank 1" in msg
    assert "rank 1: F mb=1 chunk=0 (step 1) waits for F mb=1 chunk=0 on rank 0" in msg
    assert err.value.marks == {0: 1, 1: 1}


def test_w_sends_nothing_so_nobody_waits_for_it():
    # Rank 1 defers every W to the very end: rank 0 still proceeds as soon as each I is done.
    s = make(
        [
            [(F, 0, 0), (F, 1, 0), (I, 0, 0), (W, 0, 0), (I, 1, 0), (W, 1, 0)],
            [(F, 0, 0), (I, 0, 0), (F, 1, 0), (I, 1, 0), (W, 0, 0), (W, 1, 0)],
        ]
    )
    r = simulate(s, Costs(t_f=1, t_b=2))  # t_i = t_w = 1
    starts = {(rank, str(a)): st for rank, steps in enumerate(r.timeline) for a, st, _ in steps}
    assert starts[(0, "I0")] == 3.0  # rank 1's I0 ends at 3; its W's come later
    assert starts[(1, "W0")] == 5.0


def test_v_placement_drives_the_dry_run():
    # pp=2 V placement: stages 0,1 go down ranks 0,1; stage 2 is rank 1's chunk 1, stage 3 rank 0's.
    s = zbv(2, 1)
    assert [s.stage(r, c) for r in range(2) for c in range(2)] == [0, 3, 1, 2]
    assert dependencies(s, 1, Action(F, 0, 1)) == [(1, Action(F, 0, 0))]  # stage 2 <- stage 1
    assert dependencies(s, 0, Action(F, 0, 1)) == [(1, Action(F, 0, 1))]  # stage 3 <- stage 2
    assert dependencies(s, 1, Action(I, 0, 1))[1] == (0, Action(I, 0, 1))
    # Latency is charged only across ranks: stage 1 -> 2 stays on rank 1.
    r = simulate(s, Costs(t_f=2, t_b=4, latency=10.0))
    (_, start, _), = [x for x in r.timeline[1] if x[0] == Action(F, 0, 1)]  # fmt: skip
    assert start == 12.0  # F0.0 on rank 0 [0,1], +10 latency, F0.0 on rank 1 [11,12], then F0.1


# --- generators -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_generators_validate_over_the_grid(name):
    for p, m in GRID:
        s = build_schedule(name, pp=p, microbatches=m)
        validate(s)
        assert s.name == name
        for actions in s.ranks:
            assert len(actions) == 3 * m * s.vpp  # F, I and W of every microbatch-chunk
            assert not any(a.op is B for a in actions)


def test_zb_h1_is_1f1b_with_split_backward_and_lagged_weight_gradients():
    for p, m in GRID:
        s, ref = zb_h1(p, m), one_f_one_b(p, m)
        for r in range(p):
            # F and I follow 1F1B's F and B exactly.
            f_i = [(a.op.value, a.mb) for a in s.ranks[r] if a.op is not W]
            assert f_i == [("I" if a.op is B else "F", a.mb) for a in ref.ranks[r]], (p, m, r)
            # W(k - r) right after I(k); the last min(r, m) W's close the step.
            acts = s.ranks[r]
            for k in range(r, m):
                at = acts.index(Action(I, k))
                assert acts[at + 1] == Action(W, k - r), (p, m, r, k)
            tail = acts[len(acts) - min(r, m) :]
            assert tail == tuple(Action(W, j) for j in range(m - min(r, m), m))


def test_zbv_placement_and_phases():
    s = build_schedule("zbv", pp=4, microbatches=8)
    assert (s.vpp, s.placement) == (2, "v")
    assert [s.stages_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    for r, acts in enumerate(s.ranks):
        warm = 2 * (4 - r) - 1
        assert acts[:warm] == tuple(Action(F, i, 0) for i in range(warm))
        assert acts[warm : warm + 2 * r : 2] == tuple(Action(F, i, 1) for i in range(r))
    # m < 2p - 1: the 2p - 1 order with the missing microbatches dropped.
    small = zbv(4, 3)
    full = zbv(4, 7)
    for r in range(4):
        assert small.ranks[r] == tuple(a for a in full.ranks[r] if a.mb < 3)


def test_build_schedule_vpp_rules_for_zero_bubble():
    # zbv: vpp unset (None, every front end's default) means its own 2; a vpp given is taken
    # as given, so an explicit 1 is refused like any other value but 2 (it was once replaced).
    assert build_schedule("zbv", pp=4, microbatches=8).vpp == 2
    assert build_schedule("zbv", pp=4, microbatches=8, vpp=2).vpp == 2
    with pytest.raises(ValueError, match=r"'zbv' runs exactly 2 chunks per rank .* vpp=1 was"):
        build_schedule("zbv", pp=4, microbatches=8, vpp=1)
    with pytest.raises(ValueError, match=r"'zbv' runs exactly 2 chunks per rank .* vpp=3"):
        build_schedule("zbv", pp=4, microbatches=8, vpp=3)
    with pytest.raises(ValueError, match="vpp=1"):
        zbv(4, 8, vpp=1)  # the generator itself is strict
    assert build_schedule("zb-h1", pp=4, microbatches=8).vpp == 1
    with pytest.raises(ValueError, match=r"'zb-h1' runs one chunk per rank but vpp=2"):
        build_schedule("zb-h1", pp=4, microbatches=8, vpp=2)
    with pytest.raises(ValueError, match="group_size applies only to the interleaved"):
        build_schedule("zbv", pp=4, microbatches=8, group_size=4)
    for name in ("zb-h1", "zbv"):
        with pytest.raises(ValueError, match="microbatches must be a positive integer, got 0"):
            build_schedule(name, pp=4, microbatches=0)
        with pytest.raises(ValueError, match="pp must be a positive integer, got -1"):
            build_schedule(name, pp=-1, microbatches=4)
    # Defaults elsewhere are unchanged: interleaved still needs an explicit vpp >= 2.
    with pytest.raises(ValueError, match="vpp=1"):
        build_schedule("interleaved", pp=4, microbatches=8)
    assert build_schedule("1f1b", pp=2, microbatches=2).vpp == 1


def test_forward_only_keeps_the_v_placement():
    s = build_schedule("zbv", pp=3, microbatches=4).forward_only()
    assert s.placement == "v" and all(a.op is F for r in s.ranks for a in r)
    assert s.stages_of(0) == (0, 5)


# --- simulator: costs and closed forms --------------------------------------------------------


def test_costs_split_t_b_evenly_by_default():
    c = Costs()
    assert (c.t_i, c.t_w) == (1.0, 1.0)
    assert (Costs(t_b=3, t_i=2).t_w, Costs(t_b=3, t_w=2).t_i) == (1.0, 1.0)
    both = Costs(t_b=2, t_i=5, t_w=7)
    assert (both.t_b, both.t_i, both.t_w) == (2, 5, 7)  # B keeps t_b
    s = build_schedule("zbv", pp=2, microbatches=2)
    assert both.chunk_costs(s, 0, 1) == {F: 0.5, B: 1.0, I: 2.5, W: 3.5}
    over = Costs(overrides={(0, 0): (1.0, 4.0), (1, 0): (1.0, 4.0, 3.0, 1.5)})
    assert over.chunk_costs(s, 0, 0) == {F: 1.0, B: 4.0, I: 2.0, W: 2.0}
    assert over.chunk_costs(s, 1, 0) == {F: 1.0, B: 4.0, I: 3.0, W: 1.5}
    with pytest.raises(
        ValueError,
        match=r"cost t_w must be >= 0, got -1 \(t_i or t_w larger than t_b\? give both\)",
    ):
        Costs(t_b=1, t_i=2)
    with pytest.raises(ValueError, match=r"must be \(t_f, t_b\) or \(t_f, t_b, t_i, t_w\)"):
        Costs(overrides={(0, 0): (1.0, 2.0, 3.0)})


def zb_h1_idle(p: int, m: int, t_f: float, t_i: float, t_w: float) -> float:
    """Per-rank idle of ZB-H1 when t_w <= min(t_f, t_i): (p-1)(t_f+t_i) - (min(m,p)-1) t_w,
    i.e. the paper's (p-1)(t_f+t_i-t_w) once m >= p."""
    return (p - 1) * (t_f + t_i) - (min(m, p) - 1) * t_w


# Cost triples (t_f, t_i, t_w) with t_w <= min(t_f, t_i), including both boundaries and t_w = 0.
ZB_H1_COSTS = [
    (1.0, 1.0, 1.0),
    (2.0, 1.0, 1.0),
    (1.0, 2.0, 1.0),
    (2.0, 3.0, 2.0),
    (3.0, 2.0, 2.0),
    (1.5, 2.0, 0.5),
    (3.0, 0.5, 0.5),
    (0.5, 3.0, 0.25),
    (0.75, 1.25, 0.6),
    (1.0, 1.0, 0.0),
]


def test_zb_h1_idle_closed_form():
    for t_f, t_i, t_w in ZB_H1_COSTS:
        costs = Costs(t_f=t_f, t_b=t_i + t_w, t_i=t_i, t_w=t_w)
        for p, m in GRID:
            r = simulate(zb_h1(p, m), costs)
            want = zb_h1_idle(p, m, t_f, t_i, t_w)
            assert r.idle == pytest.approx([want] * p, abs=1e-9), (t_f, t_i, t_w, p, m)
            if m >= p:
                assert want == pytest.approx((p - 1) * (t_f + t_i - t_w), abs=1e-9)


def test_zb_h1_closed_form_needs_t_w_at_most_t_f_and_t_i():
    # Outside the condition the deferred W's no longer fit the gaps they were meant to fill.
    for t_f, t_i, t_w in [(1.0, 1.0, 1.5), (1.0, 2.0, 1.5), (2.0, 1.0, 1.5)]:
        r = simulate(zb_h1(4, 8), Costs(t_f=t_f, t_b=t_i + t_w, t_i=t_i, t_w=t_w))
        assert max(r.idle) > zb_h1_idle(4, 8, t_f, t_i, t_w) + 1e-6


def test_zb_h1_beats_1f1b_by_2_p_minus_1_weight_gradients():
    for p, m in GRID:
        if m < p:
            continue
        zb = simulate(zb_h1(p, m))
        one = simulate(one_f_one_b(p, m))
        assert one.makespan - zb.makespan == pytest.approx(2 * (p - 1) * 1.0, abs=1e-9)
        assert zb.bubble_ratio == pytest.approx((p - 1) / (3 * m), abs=1e-9)


def zbv_makespan(p: int, m: int, t: float) -> float:
    """ZB-V's makespan when t_f = t_i = t_w = t per stage (t/2 per chunk):
    3·m·t + (t/2)·max(p-1, 4p-2-2m); for m >= 2p that is 3·m·t + (p-1)·t/2."""
    return 3 * m * t + t / 2 * max(p - 1, 4 * p - 2 - 2 * m)


def test_zbv_makespan_closed_form():
    for t in (0.5, 1.0, 2.5):
        costs = Costs(t_f=t, t_b=2 * t)  # t_i = t_w = t
        for p, m in GRID:
            r = simulate(zbv(p, m), costs)
            assert r.makespan == pytest.approx(zbv_makespan(p, m, t), abs=1e-9), (t, p, m)
            assert r.busy == pytest.approx([3 * m * t] * p, abs=1e-9)
            if m >= 2 * p:
                assert r.makespan == pytest.approx(3 * m * t + (p - 1) * t / 2, abs=1e-9)
                assert r.idle == pytest.approx([(p - 1) * t / 2] * p, abs=1e-9)
                assert r.bubble_ratio == pytest.approx((p - 1) / (6 * m), abs=1e-9)


def test_known_zero_bubble_makespans():
    # p=4, m=8, default costs (t_f = t_i = t_w = 1): 1F1B 33, ZB-H1 27, ZB-V 25.5.
    assert simulate(build_schedule("zb-h1", pp=4, microbatches=8)).makespan == 27.0
    assert simulate(build_schedule("zbv", pp=4, microbatches=8)).makespan == 25.5


def test_peak_inflight_figures():
    for p, m in GRID:
        h1 = zb_h1(p, m)
        # Counted until W (the memory held): 1F1B's worst rank, on every rank.
        assert peak_inflight(h1) == [min(p, m)] * p
        # Counted until I (the whole forward graph held): 1F1B's p - r exactly.
        assert peak_inflight(h1, until=I) == [min(p - r, m) for r in range(p)]
        assert simulate(h1).peak_inflight == peak_inflight(h1)
        v = zbv(p, m)
        # Chunk-activations (each half a stage): balanced 2p = p stages' worth once m >= 2p - 1.
        want = [min(2 * p, 2 * m, m + 1 + r) for r in range(p)]
        assert peak_inflight(v) == want == peak_inflight(v, until=I), (p, m)
    with pytest.raises(ValueError, match="until must be Op.I or Op.W"):
        peak_inflight(h1, until=F)


# --- renderers --------------------------------------------------------------------------------


def test_grid_shows_input_and_weight_gradient_cells():
    text = render_grid(build_schedule("zb-h1", pp=4, microbatches=8))
    lines = text.splitlines()
    assert lines[0].split("| ")[1].split()[:12] == ["F0", "F1", "F2", "F3"] + ["."] * 3 + [
        "I0",
        "W0",
        "F4",
        "I1",
        "W1",
    ]
    assert lines[3].split("| ")[1].split()[-4:] == ["W4", "W5", "W6", "W7"]
    assert "bubble ratio:   0.1250  (idle 12 / compute 96)" in text
    assert "makespan:       27  (t_f=1, t_i=1, t_w=1 per stage)" in text
    assert "peak in-flight: r0=4 r1=4 r2=4 r3=4" in text
    v = render_grid(build_schedule("zbv", pp=4, microbatches=8))
    assert v.splitlines()[3].split("| ")[1].split()[3:7] == ["F0.0", "F0.1", "F1.0", "F1.1"]
    assert "bubble ratio:   0.0625" in v and "r0=8 r1=8 r2=8 r3=8" in v


def test_gantt_draws_i_and_w_distinctly(tmp_path):
    styles = {(alpha, hatch, edge) for alpha, hatch, edge, _ in OP_STYLE.values()}
    assert len(styles) == len(OP_STYLE) == 4
    assert len({edge for _, _, edge, _ in OP_STYLE.values()}) == 3  # I blue, W red, F/B black
    r = simulate(build_schedule("zbv", pp=4, microbatches=8))
    out = render_gantt(r, tmp_path / "zbv.png", title="zbv")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10000


# --- CLI (commands/schedule.py takes its choices from SCHEDULES) ------------------------------


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["schedule", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("name", "vpp"), [("zb-h1", 1), ("zbv", 2)])
def test_cli_json_contract_for_zero_bubble(capsys, name, vpp):
    code, out, err = run_cli(
        capsys, "--schedule", name, "--pp", "4", "--microbatches", "8", "--format", "json"
    )
    assert code == 0 and err == ""
    d = json.loads(out)
    assert (d["schedule"], d["pp"], d["vpp"], d["microbatches"]) == (name, 4, vpp, 8)
    expected = build_schedule(name, pp=4, microbatches=8)
    assert d["ranks"] == [[a.to_dict() for a in r] for r in expected.ranks]
    assert {a["op"] for r in d["ranks"] for a in r} == {"F", "I", "W"}
    assert d["placement"] == ("v" if name == "zbv" else "loop")
    assert d["bubble_ratio"] == pytest.approx(3 / (24 if name == "zb-h1" else 48), abs=1e-12)
    assert d["peak_inflight"] == [4 * vpp] * 4


def test_cli_rejects_zbv_with_other_vpp(capsys):
    code, out, err = run_cli(
        capsys, "--schedule", "zbv", "--pp", "4", "--vpp", "3", "--microbatches", "8"
    )
    assert code == 2 and out == ""
    assert "'zbv' runs exactly 2 chunks per rank (V placement) but vpp=3" in err


def test_cli_module_entry_point_runs_zero_bubble_text_grid():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "lightning_pp", "schedule", "--schedule", "zbv", "--pp", "2"]
    proc = subprocess.run(
        [*cmd, "--microbatches", "4"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "zbv: pp=2 vpp=2 microbatches=4"
    assert "I0.1" in proc.stdout and "W0.1" in proc.stdout
