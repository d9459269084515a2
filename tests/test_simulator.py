"""Validator, simulator and renderers: closed forms, hand-computed timelines, broken schedules."""

from __future__ import annotations

import pytest

from lightning_pp.schedules import (
    Action,
    Costs,
    Op,
    Schedule,
    ScheduleError,
    build_schedule,
    render_gantt,
    render_grid,
    simulate,
    validate,
)

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

F, B = Op.F, Op.B
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make(ranks, vpp=1, m=None, name="hand") -> Schedule:
    ranks = tuple(tuple(Action(op, mb, c) for op, mb, c in r) for r in ranks)
    if m is None:
        m = 1 + max(a.mb for r in ranks for a in r)
    return Schedule(name, len(ranks), vpp, m, ranks)


# --- closed forms -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_is_p_minus_1_over_m(name):
    for pp in range(1, 7):
        for m in range(1, 13):
            r = simulate(build_schedule(name, pp=pp, microbatches=m))
            assert r.bubble_ratio == pytest.approx((pp - 1) / m, abs=1e-9), (pp, m)


def test_interleaved_bubble_is_p_minus_1_over_vm():
    for pp in range(2, 6):
        for vpp in range(2, 5):
            for m in range(pp, 4 * pp + 1, pp):
                r = simulate(build_schedule("interleaved", pp=pp, vpp=vpp, microbatches=m))
                assert r.bubble_ratio == pytest.approx((pp - 1) / (vpp * m), abs=1e-9), (
                    pp,
                    vpp,
                    m,
                )


def test_known_makespans():
    one = simulate(build_schedule("1f1b", pp=4, microbatches=8), Costs(t_f=1.0, t_b=2.0))
    assert one.makespan == pytest.approx(33.0, abs=1e-9)
    inter = simulate(build_schedule("interleaved", pp=4, vpp=2, microbatches=8))
    assert inter.makespan == pytest.approx(28.5, abs=1e-9)  # chunk costs 0.5 / 1.0
    assert one.busy == [24.0] * 4 and inter.busy == [24.0] * 4


def test_peak_inflight_formulas():
    for pp in range(1, 6):
        for m in range(1, 11):
            one = simulate(build_schedule("1f1b", pp=pp, microbatches=m))
            assert one.peak_inflight == [min(pp - r, m) for r in range(pp)]
            for vpp in (1, 2, 3):
                g = simulate(build_schedule("gpipe", pp=pp, vpp=vpp, microbatches=m))
                assert g.peak_inflight == [m * vpp] * pp
            if pp < 2:
                continue
            for vpp in (2, 3):
                if m < pp or 0 < m % pp < pp:
                    continue  # shapes Megatron rejects with the default N = pp
                s = build_schedule("interleaved", pp=pp, vpp=vpp, microbatches=m)
                warmup = [2 * (pp - r - 1) + (vpp - 1) * pp for r in range(pp)]
                assert simulate(s).peak_inflight == [min(w + 1, m * vpp) for w in warmup]


# --- hand-computed timelines --------------------------------------------------------------


def test_latency_is_charged_on_cross_rank_dependencies():
    # F0 r0 [0,1]; +0.5 -> F0 r1 [1.5,2.5]; B0 r1 [2.5,4.5]; +0.5 -> B0 r0 [5,7].
    r = simulate(build_schedule("1f1b", pp=2, microbatches=1), Costs(latency=0.5))
    assert [(s, e) for _, s, e in r.timeline[0]] == [(0.0, 1.0), (5.0, 7.0)]
    assert [(s, e) for _, s, e in r.timeline[1]] == [(1.5, 2.5), (2.5, 4.5)]
    assert r.makespan == 7.0
    assert r.idle == [4.0, 4.0]


def test_per_chunk_overrides_and_default_chunk_split():
    slow = Costs(overrides={(1, 0): (3.0, 4.0)})
    r = simulate(build_schedule("1f1b", pp=2, microbatches=1), slow)
    assert r.makespan == 10.0  # 1 + 3 + 4 + 2
    # One rank, two chunks: each chunk costs t/vpp (0.5 forward, 1.0 backward), no latency.
    g = simulate(build_schedule("gpipe", pp=1, vpp=2, microbatches=1), Costs(latency=9.0))
    assert [(str(a), s, e) for a, s, e in g.timeline[0]] == [
        ("F0", 0.0, 0.5),
        ("F0.1", 0.5, 1.0),
        ("B0.1", 1.0, 2.0),
        ("B0", 2.0, 3.0),
    ]


def test_event_driven_not_lockstep():
    # Rank 1 waits only for what it needs: its F0 starts as soon as rank 0's F0 ends, even
    # though rank 0 keeps working.
    r = simulate(build_schedule("gpipe", pp=2, microbatches=3))
    assert r.timeline[1][0][1:] == (1.0, 2.0)
    assert r.timeline[1][1][1:] == (2.0, 3.0)


def test_bad_costs_rejected():
    with pytest.raises(ValueError, match="t_f must be >= 0, got -1"):
        Costs(t_f=-1)
    with pytest.raises(ValueError, match="latency"):
        Costs(latency=float("nan"))


# --- activation recompute: the forward it re-runs lengthens B and I --------------------------


def makespan_1f1b(p: int, m: int, t_f: float, t_b: float) -> float:
    """1F1B makespan at uniform per-stage costs, no latency: (m + p - 1)(t_f + t_b).

    Derivation along the critical path: microbatch 0's forward reaches the last rank after
    (p - 1) t_f. The last rank has no warm-up; it runs F0 B0 F1 B1 ... back to back, m (t_f + t_b)
    without a gap (each forward k was sent by rank p - 2 during the last rank's B(k-1), since
    rank p - 2 is one microbatch ahead). Its last backward then sends the gradient of microbatch
    m - 1 back through the p - 1 earlier ranks, each of which has nothing left but that backward:
    (p - 1) t_b. Total (p - 1) t_f + m (t_f + t_b) + (p - 1) t_b. Recompute re-runs the forward
    inside every backward, so each B lasts t_b + r: substitute t_b -> t_b + r.
    """
    return (m + p - 1) * (t_f + t_b)


def makespan_zb_h1(p: int, m: int, t_f: float, t_i: float, t_w: float) -> float:
    """ZB-H1 makespan: busy m (t_f + t_i + t_w) plus the idle (p - 1)(t_f + t_i) -
    (min(m, p) - 1) t_w of docs/schedules.md (valid when t_w <= t_f and t_w <= t_i: the deferred
    W's then fit in the gaps). A split backward recomputes before I: t_i -> t_i + r, W unchanged.
    """
    return m * (t_f + t_i + t_w) + (p - 1) * (t_f + t_i) - (min(m, p) - 1) * t_w


RECOMPUTE_COSTS = [(1.0, 2.0, 0.7), (0.3, 1.1, 0.45), (1.0, 2.0, 1.0), (2.0, 1.0, 0.5)]


@pytest.mark.parametrize("t_f,t_b,r", RECOMPUTE_COSTS)
def test_recompute_1f1b_makespan_is_closed_form_with_longer_backward(t_f, t_b, r):
    for p in range(1, 7):
        for m in range(1, 13):
            s = build_schedule("1f1b", pp=p, microbatches=m)
            got = simulate(s, Costs(t_f=t_f, t_b=t_b, t_r=r))
            assert got.makespan == pytest.approx(makespan_1f1b(p, m, t_f, t_b + r), abs=1e-9)
            assert got.busy == pytest.approx([m * (t_f + t_b + r)] * p, abs=1e-9)
            # the same through the per-rank and per-chunk forms
            per_rank = Costs(t_f=t_f, t_b=t_b, recompute={q: r for q in range(p)})
            per_chunk = Costs(t_f=t_f, t_b=t_b, recompute={(q, 0): r for q in range(p)})
            assert simulate(s, per_rank).makespan == pytest.approx(got.makespan, abs=1e-9)
            assert simulate(s, per_chunk).makespan == pytest.approx(got.makespan, abs=1e-9)


@pytest.mark.parametrize("t_f,t_i,t_w,r", [(1.0, 1.0, 1.0, 0.5), (1.2, 0.9, 0.6, 0.3)])
def test_recompute_zb_h1_makespan_is_closed_form_with_longer_input_grad(t_f, t_i, t_w, r):
    for p in range(1, 7):
        for m in range(1, 17):
            s = build_schedule("zb-h1", pp=p, microbatches=m)
            got = simulate(s, Costs(t_f=t_f, t_b=t_i + t_w, t_i=t_i, t_w=t_w, t_r=r))
            want = makespan_zb_h1(p, m, t_f, t_i + r, t_w)
            assert got.makespan == pytest.approx(want, abs=1e-9), (p, m)
            # W gets none of it: every W lasts t_w, every I t_i + r
            for steps in got.timeline:
                for a, start, end in steps:
                    if a.op in (Op.I, Op.W):
                        want_d = t_w if a.op is Op.W else t_i + r
                        assert end - start == pytest.approx(want_d, abs=1e-12)


def test_recompute_off_changes_nothing():
    for name, vpp in [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("gpipe", 2)]:
        s = build_schedule(name, pp=4, vpp=vpp, microbatches=8)
        overrides = {(1, 0): (3.0, 4.0), (2, 0): (1.0, 2.0, 1.5, 0.5)}
        for costs in (Costs(), Costs(t_f=1.3, t_b=2.1, latency=0.2, overrides=overrides)):
            zero = Costs(
                t_f=costs.t_f,
                t_b=costs.t_b,
                latency=costs.latency,
                overrides=costs.overrides,
                t_r=0.0,
                recompute={(0, 0): 0.0, 3: 0.0},
            )
            assert simulate(s, zero).timeline == simulate(s, costs).timeline


def test_recompute_per_chunk_and_per_rank_precedence():
    s = build_schedule("interleaved", pp=2, vpp=2, microbatches=4)
    costs = Costs(t_r=1.0, recompute={1: 0.4, (1, 1): 0.9}, overrides={(0, 1): (0.5, 1.0)})
    assert costs.recompute_cost(s, 0, 0) == 0.5  # t_r / vpp
    assert costs.recompute_cost(s, 1, 0) == 0.2  # recompute[1] / vpp
    assert costs.recompute_cost(s, 1, 1) == 0.9  # the chunk's own
    assert costs.chunk_costs(s, 0, 1) == {Op.F: 0.5, Op.B: 1.5, Op.I: 1.0, Op.W: 0.5}
    with pytest.raises(ValueError, match=r"cost recompute\[\(1, 1\)\] must be >= 0"):
        Costs(recompute={(1, 1): -0.1})
    with pytest.raises(ValueError, match="rank \\(int\\) or a \\(rank, chunk\\) pair"):
        Costs(recompute={"r0": 1.0})
    with pytest.raises(ValueError, match="t_r must be >= 0"):
        Costs(t_r=-1.0)


def test_recompute_again_for_w_costs_land_on_w():
    s = build_schedule("zb-h1", pp=2, microbatches=4)
    costs = Costs(t_r=0.2, recompute_w={1: 0.3})
    assert costs.chunk_costs(s, 1, 0) == {Op.F: 1.0, Op.B: 2.2, Op.I: 1.2, Op.W: 1.3}
    assert costs.chunk_costs(s, 0, 0)[Op.W] == 1.0
    got, base = simulate(s, costs), simulate(s, Costs(t_r=0.2))
    assert got.busy[1] == pytest.approx(base.busy[1] + 4 * 0.3)
    with pytest.raises(ValueError, match=r"recompute_w\[0\] must be >= 0"):
        Costs(recompute_w={0: -1.0})
    with pytest.raises(ValueError, match="recompute_w keys must be"):
        Costs(recompute_w={"r0": 1.0})


# --- validator ------------------------------------------------------------------------------


def test_generated_schedules_validate():
    for name, kw in [
        ("gpipe", dict(pp=3, vpp=2, microbatches=5)),
        ("1f1b", dict(pp=4, microbatches=2)),
        ("interleaved", dict(pp=3, vpp=3, microbatches=7, group_size=4)),
    ]:
        validate(build_schedule(name, **kw))


def test_swapped_order_deadlocks_with_grid_and_stuck_steps():
    s = make(
        [
            [(F, 0, 0), (B, 0, 0), (F, 1, 0), (B, 1, 0)],
            [(F, 1, 0), (F, 0, 0), (B, 1, 0), (B, 0, 0)],
        ]
    )
    with pytest.raises(ScheduleError) as err:
        validate(s)
    msg = str(err.value)
    assert "deadlock" in msg
    assert "rank 0: B mb=0 chunk=0 (step 1) waits for B mb=0 chunk=0 on rank 1" in msg
    assert "rank 1: F mb=1 chunk=0 (step 0) waits for F mb=1 chunk=0 on rank 0" in msg
    assert "> rank 0:  F0 [B0] F1  B1" in msg
    assert "> rank 1: [F1] F0  B1  B0" in msg
    assert err.value.marks == {0: 1, 1: 0}
    assert isinstance(err.value, ValueError)
    with pytest.raises(ScheduleError):  # the simulator reuses the same dry run
        simulate(s)


def test_backward_out_of_fifo_order_is_rejected():
    # Rank 1 runs B1 before B0 although F0 came first: the engine's FIFO stash would pair
    # microbatch 1's gradient with microbatch 0's activations.
    s = make(
        [[(F, 0, 0), (F, 1, 0), (B, 0, 0), (B, 1, 0)], [(F, 0, 0), (F, 1, 0), (B, 1, 0), (B, 0, 0)]]
    )
    with pytest.raises(ScheduleError, match=r"rank 1: B mb=1 chunk=0 \(step 2\): .*FIFO") as err:
        validate(s)
    assert "oldest pending forward is mb=0" in str(err.value)


def test_missing_backward():
    s = make([[(F, 0, 0), (F, 1, 0), (B, 0, 0)], [(F, 0, 0), (B, 0, 0), (F, 1, 0), (B, 1, 0)]])
    with pytest.raises(ScheduleError, match=r"rank 0: missing B mb=1 chunk=0") as err:
        validate(s)
    assert "> rank 0:  F0 [F1] B0" in str(err.value)


def test_duplicated_forward():
    s = make([[(F, 0, 0), (F, 0, 0), (B, 0, 0)], [(F, 0, 0), (B, 0, 0)]])
    with pytest.raises(ScheduleError, match=r"rank 0: F mb=0 chunk=0 \(step 1\): duplicated") as e:
        validate(s)
    assert "> rank 0:  F0 [F0] B0" in str(e.value)


def test_backward_before_forward():
    s = make([[(F, 0, 0), (B, 0, 0)], [(B, 0, 0), (F, 0, 0)]])
    with pytest.raises(ScheduleError, match="rank 1: B mb=0 chunk=0 \\(step 0\\): backward before"):
        validate(s)


def test_out_of_range_and_unsupported_ops():
    with pytest.raises(ScheduleError, match="chunk 1 out of range"):
        validate(make([[(F, 0, 1), (B, 0, 1)]]))
    with pytest.raises(ScheduleError, match="microbatch 3 out of range"):
        validate(make([[(F, 3, 0), (B, 3, 0)]], m=2))
    with pytest.raises(ScheduleError, match="unknown op 'X'; steps are F, B, I or W"):
        validate(make([[(F, 0, 0), ("X", 0, 0), (B, 0, 0)]]))
    s = build_schedule("1f1b", pp=2, microbatches=2)
    with pytest.raises(ScheduleError, match="1 rank lists but pp=2"):
        validate(Schedule("1f1b", 2, 1, 2, s.ranks[:1]))


# --- renderers ------------------------------------------------------------------------------


def test_render_grid_shows_time_bubbles_and_metrics():
    text = render_grid(build_schedule("1f1b", pp=4, microbatches=8))
    lines = text.splitlines()
    assert [ln.split(" |")[0] for ln in lines[:4]] == [f"rank {r}" for r in range(4)]
    # Rank 0: four warmup forwards, then idle until B0 arrives (6 unit cells at t=4..10).
    assert lines[0].split("| ")[1].split()[:11] == ["F0", "F1", "F2", "F3"] + ["."] * 6 + ["B0"]
    cells = lines[3].split("| ")[1].split()
    assert len(cells) == 33  # makespan / unit, trailing idle included
    assert "bubble ratio:   0.3750" in text and "makespan:       33" in text
    assert "peak in-flight: r0=4 r1=3 r2=2 r3=1" in text


def test_render_grid_shows_chunks_for_interleaved():
    r = simulate(build_schedule("interleaved", pp=2, vpp=2, microbatches=4))
    text = render_grid(r, metrics=False)
    assert text.splitlines()[0].split("| ")[1].split()[:4] == ["F0.0", "F1.0", "F0.1", "F1.1"]
    assert "bubble" not in text


def test_render_gantt_accepts_generic_measured_timeline(tmp_path):
    measured = [
        [(Action(F, 0), 0.0, 0.9), (Action(F, 1), 1.0, 2.1), (Action(B, 0), 3.2, 5.0)],
        [(Action(F, 0), 1.1, 2.0), (Action(B, 0), 2.0, 3.1)],
    ]
    out = render_gantt(measured, tmp_path / "measured.png", title="measured")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000


def test_render_gantt_from_simulation(tmp_path):
    r = simulate(build_schedule("interleaved", pp=4, vpp=2, microbatches=8))
    path = tmp_path / "inter.png"
    render_gantt(r.timeline, path, title="interleaved")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10000
