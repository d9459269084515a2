"""The callbacks' maths on step records built from simulated timelines (no processes, no Lightning).

A simulated timeline is a perfect measurement: the analysis must give back the simulator's own
numbers, whatever clock each rank used, and must see extra delays the model does not know about.
"""

from __future__ import annotations

import json

import pytest

from lightning_pp.callbacks.analysis import (
    RecomputeStats,
    bubble_stats,
    measured_costs,
    measured_timeline,
    memory_stats,
    plan_recompute_costs,
    recompute_labels,
    split_pipelines,
    trace_events,
)
from lightning_pp.callbacks.gather import _pack, _unpack, gather_records
from lightning_pp.runtime.records import StepEvent, StepRecord
from lightning_pp.schedules import Costs, Op, build_schedule, render_gantt, simulate

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

SHAPES = [("gpipe", 1, 8), ("1f1b", 1, 8), ("1f1b", 1, 5), ("interleaved", 2, 8)]


def records_from_sim(sim, clock_shift=(), wait_as_comm=True, rank_base=0, dp=1, dp_rank=0):
    """One record per rank from a simulated run.

    With ``wait_as_comm`` each action starts where the previous one ended and the gap becomes
    its ``comm_wait`` (how the engine records a receive it blocked on). ``clock_shift[r]`` is
    added to every time of rank r (a process-local clock).
    """
    recs = []
    for r, steps in enumerate(sim.timeline):
        shift = clock_shift[r] if clock_shift else 0.0
        events, prev = [], 0.0
        for a, start, end in steps:
            begin = prev if wait_as_comm else start
            events.append(StepEvent(a, begin + shift, end + shift, comm_wait=start - begin))
            prev = end
        recs.append(
            StepRecord(
                r * dp + dp_rank, r, sim.schedule, t0=shift, t1=sim.makespan + shift, events=events
            )
        )
    return recs


@pytest.mark.parametrize("name,vpp,m", SHAPES)
def test_perfect_measurement_reproduces_simulator(name, vpp, m):
    s = build_schedule(name, pp=4, vpp=vpp, microbatches=m)
    sim = simulate(s, Costs(t_f=3.0, t_b=5.0))
    stats = bubble_stats(records_from_sim(sim))
    assert stats.bubble == pytest.approx(sim.bubble_ratio, rel=1e-12)
    assert stats.expected_bubble == pytest.approx(sim.bubble_ratio, rel=1e-12)
    assert stats.span == pytest.approx(sim.makespan)
    assert stats.compute == pytest.approx(sim.busy)
    assert [i / stats.span for i in sim.idle] == pytest.approx(stats.idle_fraction)
    assert sum(stats.comm_wait) > 0  # the gaps were recorded as waits and excluded from compute


def test_uneven_measured_costs_feed_the_expectation():
    s = build_schedule("1f1b", pp=4, microbatches=8)
    overrides = {(0, 0): (1.0, 2.0), (1, 0): (2.0, 4.0), (2, 0): (1.0, 2.0), (3, 0): (1.5, 2.0)}
    sim = simulate(s, Costs(overrides=overrides))
    recs = records_from_sim(sim)
    measured = measured_costs(recs).overrides
    assert measured.keys() == overrides.keys()
    for key, costs in overrides.items():  # approx does not compare nested containers
        assert measured[key] == pytest.approx(costs), key
    stats = bubble_stats(recs)
    assert stats.expected_bubble == pytest.approx(sim.bubble_ratio)
    # A uniform cost model would predict the textbook (p-1)/m, not what this partition does.
    assert stats.expected_bubble != pytest.approx(3 / 8)
    assert stats.bubble == pytest.approx(sim.bubble_ratio)


def test_offsets_align_process_local_clocks():
    s = build_schedule("interleaved", pp=4, vpp=2, microbatches=8)
    sim = simulate(s)
    shifts = [1000.0, -3.5, 42.0, 7e6]
    shifted = records_from_sim(sim, clock_shift=shifts)
    aligned = bubble_stats(shifted, offsets=shifts)
    assert aligned.bubble == pytest.approx(sim.bubble_ratio)
    assert aligned.start_skew == pytest.approx(0.0, abs=1e-6)
    # Without the offsets the same records look like a very different (wrong) step.
    assert bubble_stats(shifted).bubble > 100 * sim.bubble_ratio
    # Waits recorded inside the actions are idle time: bars start where the wait ended.
    timeline = measured_timeline(shifted, shifts)
    for got, want in zip(timeline, sim.timeline):
        assert [(a, round(t0, 6), round(t1, 6)) for a, t0, t1 in got] == [
            (a, round(t0, 6), round(t1, 6)) for a, t0, t1 in want
        ]


def test_measured_latency_enters_the_expectation():
    s = build_schedule("1f1b", pp=4, microbatches=8)
    real = simulate(s, Costs(t_f=1.0, t_b=2.0, latency=0.25))  # what "happened"
    stats = bubble_stats(records_from_sim(real))
    assert stats.latency == pytest.approx(0.25)  # recovered from blocked receives
    assert stats.bubble == pytest.approx(real.bubble_ratio)
    assert stats.expected_bubble == pytest.approx(real.bubble_ratio)
    assert stats.bubble > simulate(s).bubble_ratio + 0.05  # the latency-free model would miss it


def test_straggling_start_shows_as_extra_bubble_in_both():
    s = build_schedule("1f1b", pp=4, microbatches=8)
    sim = simulate(s)
    recs = records_from_sim(simulate(s, start=[1.5, 0.0, 0.0, 0.0]))  # rank 0 entered 1.5 late
    recs[0].t0 = recs[0].events[0].start = 1.5
    recs[0].events[0].comm_wait = 0.0
    stats = bubble_stats(recs)
    assert stats.start_skew == pytest.approx(1.5)
    assert stats.start == pytest.approx((1.5, 0.0, 0.0, 0.0))
    # The whole pipeline waits for rank 0: every rank idles 1.5 more, measured...
    assert stats.bubble == pytest.approx((sum(sim.idle) + 4 * 1.5) / sum(sim.busy))
    # ...and expected: the entry times are an input of the expectation, like the costs.
    assert stats.expected_bubble == pytest.approx(stats.bubble)
    assert stats.expected_bubble > sim.bubble_ratio + 0.05


def test_late_last_rank_start_costs_nothing():
    # Rank 3 waits for three forwards anyway: entering 1.5 late changes neither number.
    s = build_schedule("1f1b", pp=4, microbatches=8)
    sim = simulate(s)
    recs = records_from_sim(sim)
    recs[3].t0 = 1.5
    recs[3].events[0].comm_wait -= 1.5
    recs[3].events[0].start += 1.5
    stats = bubble_stats(recs)
    assert stats.start_skew == pytest.approx(1.5)
    assert stats.bubble == pytest.approx(sim.bubble_ratio)
    assert stats.expected_bubble == pytest.approx(sim.bubble_ratio)


def test_step_tail_is_reported_outside_the_bubble():
    s = build_schedule("1f1b", pp=2, microbatches=4)
    sim = simulate(s)
    recs = records_from_sim(sim)
    recs[1].t1 += 2.0  # rank 1 ends its step 2 time units after the last action (loss broadcast)
    stats = bubble_stats(recs)
    assert stats.span == pytest.approx(sim.makespan)
    assert stats.tail == pytest.approx(2.0)
    assert stats.bubble == pytest.approx(sim.bubble_ratio)


def test_hop_latency_counts_from_the_send_not_the_action_end():
    # The engine stamps an action's end after its sends were posted and its bookkeeping done;
    # the hop runs from the post. Here every send is posted 0.1 before the end and the data
    # arrives 0.3 after the post: the latency is 0.3, not 0.2.
    s = build_schedule("1f1b", pp=4, microbatches=8)
    real = simulate(s, Costs(t_f=1.0, t_b=2.0, latency=0.2))
    recs = records_from_sim(real)
    for rec in recs:
        for e in rec.events:
            e.send_time = e.end - 0.1
    stats = bubble_stats(recs)
    assert stats.latency == pytest.approx(0.3)
    assert stats.recv_overhead == pytest.approx(0.0)


def test_receive_overhead_is_charged_to_every_receive():
    # Every receive costs 0.05 of waiting even when its data is long there (header, data
    # transfer): the expectation must include it on every receiving action.
    s = build_schedule("interleaved", pp=4, vpp=2, microbatches=8)
    o = 0.05
    base = simulate(s, Costs(t_f=1.0, t_b=2.0))
    overrides = {}
    for r in range(4):
        for c in range(2):
            stage = s.stage(r, c)
            overrides[(r, c)] = (
                0.5 + (o if stage > 0 else 0.0),
                1.0 + (o if stage < s.num_stages - 1 else 0.0),
            )
    real = simulate(s, Costs(overrides=overrides))  # the overhead is inside each action...
    recs = records_from_sim(real)
    for rec in recs:  # ...and recorded as waiting at its beginning
        for e in rec.events:
            stage = s.stage(rec.pp_rank, e.action.chunk)
            recv = stage > 0 if e.action.op is Op.F else stage < s.num_stages - 1
            if recv:
                e.comm_wait += o
    stats = bubble_stats(recs)
    assert stats.recv_overhead == pytest.approx(o)
    assert stats.compute == pytest.approx(base.busy)
    assert stats.bubble > base.bubble_ratio + 0.01  # the overhead is visible as bubble...
    assert stats.expected_bubble == pytest.approx(stats.bubble)  # ...and expected


def test_bad_records_are_rejected_with_numbers():
    s = build_schedule("1f1b", pp=4, microbatches=4)
    recs = records_from_sim(simulate(s))
    with pytest.raises(ValueError, match=r"pp_ranks \[0, 1, 2\]"):
        bubble_stats(recs[:3])
    recs[2].events.pop()
    with pytest.raises(ValueError, match=r"rank 2 .* recorded 7 events .* 8 actions"):
        bubble_stats(recs)
    with pytest.raises(ValueError, match="3 clock offsets for 4 records"):
        bubble_stats(records_from_sim(simulate(s)), offsets=[0.0] * 3)


def test_split_pipelines_follows_topology_layout():
    s = build_schedule("1f1b", pp=2, microbatches=4)
    sim = simulate(s)
    world = []
    for d in range(3):
        world += records_from_sim(sim, dp=3, dp_rank=d)
    world.sort(key=lambda r: r.rank)
    lines = split_pipelines(world, pp=2)
    assert lines == [[0, 3], [1, 4], [2, 5]]
    for line in lines:
        assert [world[i].pp_rank for i in line] == [0, 1]
        assert bubble_stats([world[i] for i in line]).bubble == pytest.approx(sim.bubble_ratio)


@pytest.mark.parametrize("name,vpp,m", SHAPES)
def test_memory_stats_report_peaks_and_schedule_bound(name, vpp, m):
    s = build_schedule(name, pp=4, vpp=vpp, microbatches=m)
    bound = simulate(s).peak_inflight
    for r, actions in enumerate(s.ranks):
        live, events = 0, []
        for a in actions:
            live += 1 if a.op is Op.F else -1
            events.append(
                StepEvent(
                    a,
                    0,
                    0,
                    stash_bytes=10 * live,
                    saved_bytes=100 * live,
                    send_bytes=7,
                    inflight=live,
                )
            )
        rec = StepRecord(
            r,
            r,
            s,
            t0=0.0,
            events=events,
            peak_stash_bytes=10 * bound[r],
            peak_saved_bytes=100 * bound[r],
            peak_inflight=bound[r],
        )
        st = memory_stats(rec)
        assert (st.inflight, st.inflight_bound) == (bound[r], bound[r])
        assert (st.saved_bytes, st.stash_bytes, st.send_bytes) == (100 * bound[r], 10 * bound[r], 7)


def test_trace_events_one_track_per_rank():
    s = build_schedule("interleaved", pp=4, vpp=2, microbatches=8)
    sim = simulate(s, Costs(t_f=0.004, t_b=0.008, latency=0.0005))
    shifts = [5.0, 9.0, 1.0, 3.0]
    recs = records_from_sim(sim, clock_shift=shifts)
    trace = json.loads(json.dumps(trace_events(recs, shifts, step=7)))
    assert trace["otherData"] == {
        "step": 7,
        "schedule": s.name,
        "pp": 4,
        "vpp": 2,
        "microbatches": 8,
    }
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r} (pp {r})" for r in range(4)}
    for r in range(4):
        slices = [e for e in events if e["ph"] == "X" and e["pid"] == r and e["name"] != "wait"]
        assert {e["tid"] for e in slices} == {0}
        assert [e["name"] for e in slices] == [a.short(True) for a in s.ranks[r]]
        for e, (a, _start, end) in zip(slices, sim.timeline[r]):
            assert e["ts"] + e["dur"] == pytest.approx(end * 1e6, abs=0.01)  # microseconds
            assert e["args"]["mb"] == a.mb and e["args"]["chunk"] == a.chunk
            assert e["args"]["stage"] == s.stage(r, a.chunk)
        waits = [e for e in events if e["pid"] == r and e["name"] == "wait"]
        assert sum(w["dur"] for w in waits) == pytest.approx(
            sum(e.comm_wait for e in recs[r].events) * 1e6, abs=0.1
        )


def test_measured_timeline_renders_png(tmp_path):
    s = build_schedule("1f1b", pp=4, microbatches=8)
    recs = records_from_sim(simulate(s, Costs(t_f=0.03, t_b=0.06)))
    path = render_gantt(measured_timeline(recs, scale=1e3), tmp_path / "t.png", title="x")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pack_roundtrip_and_single_process_gather():
    s = build_schedule("interleaved", pp=4, vpp=2, microbatches=4)
    rec = records_from_sim(simulate(s))[2]
    rec.peak_saved_bytes, rec.peak_inflight = 123, 4
    assert _unpack(_pack(rec), s) == rec
    step = gather_records(rec, {"x": 1})  # no process group: this rank alone
    assert step.records == [rec] and step.offsets == [0.0] and step.extras == [{"x": 1}]


def test_ranks_sharing_a_clock_are_not_shifted_by_the_barrier():
    from lightning_pp.callbacks.gather import shared_clock_offsets

    # Ranks 0 and 1 read one clock: the barrier released rank 1 2 ms later, which must not move
    # its events; rank 2 (another host) and rank 3 (unknown clock) use their own reference.
    got = shared_clock_offsets([10.0, 10.002, 55.0, 7.0], ["a", "a", "b", None])
    assert got == [10.0, 10.0, 55.0, 7.0]


# --- activation recompute ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,vpp,m", [*SHAPES, ("zb-h1", 1, 8), ("zbv", 2, 8)], ids=lambda x: str(x)
)
def test_recompute_inside_measured_backward_is_in_the_expectation(name, vpp, m):
    # What a recomputing run measures: every B (or I) lasts its recompute longer, uneven over
    # the ranks like an "auto" plan (rank 0 recomputes most). The expectation, built from the
    # measured costs, must give back that run exactly, with no recompute term of its own.
    s = build_schedule(name, pp=4, vpp=vpp, microbatches=m)
    real = simulate(s, Costs(t_f=1.0, t_b=2.0, recompute={0: 0.9, 1: 0.6, 2: 0.3}))
    records = records_from_sim(real)
    stats = bubble_stats(records)
    assert stats.expected_makespan == pytest.approx(real.makespan, rel=1e-12)
    assert stats.expected_bubble == pytest.approx(real.bubble_ratio, rel=1e-12)
    assert stats.bubble == pytest.approx(real.bubble_ratio, rel=1e-12)
    costs = measured_costs(records)
    assert costs.recompute == {} and costs.t_r == 0.0  # already inside the measured B / I
    # and it is a different step than the same run without recompute
    assert real.makespan > simulate(s, Costs(t_f=1.0, t_b=2.0)).makespan


def _rank_plan(rank, pp_rank, positions, added_s):
    from lightning_pp.planner.recompute import RankPlan

    return RankPlan(
        rank=rank,
        pp_rank=pp_rank,
        budget=100,
        positions=positions,
        layers=positions,
        predicted_peak=50,
        none_peak=100,
        min_peak=10,
        added_s=added_s,
        total_layers=4,
    )


def test_plan_recompute_costs_per_microbatch_split_by_layers_and_averaged_over_dp():
    from lightning_pp.planner.recompute import RecomputePlan

    s = build_schedule("1f1b", pp=2, microbatches=4)
    plan = RecomputePlan(
        100,
        s.name,
        [  # dp=2: global ranks 0, 1 are pp_rank 0; 2, 3 are pp_rank 1
            _rank_plan(0, 0, [[0, 1]], 0.8),
            _rank_plan(1, 0, [[0, 1]], 1.2),
            _rank_plan(2, 1, [[]], 0.0),
            _rank_plan(3, 1, [[]], 0.0),
        ],
    )
    assert plan_recompute_costs(plan, s) == pytest.approx({(0, 0): 0.25, (1, 0): 0.0})
    got = simulate(s, Costs(t_f=1.0, t_b=2.0, recompute=plan_recompute_costs(plan, s)))
    assert got.busy == pytest.approx([4 * 3.25, 4 * 3.0])

    inter = build_schedule("interleaved", pp=2, vpp=2, microbatches=4)
    plan = RecomputePlan(100, inter.name, [_rank_plan(0, 0, [[0], [0, 1, 2]], 0.8)])
    assert plan_recompute_costs(plan, inter) == pytest.approx({(0, 0): 0.05, (0, 1): 0.15})


def test_plan_recompute_costs_put_second_forwards_on_w():
    """A layer recomputed again for W (zero-bubble "auto") runs its forward at I and at W:
    the plan's added time splits into Costs(recompute=) on I and Costs(recompute_w=) on W."""
    from dataclasses import replace

    from lightning_pp.planner.recompute import RecomputePlan

    s = build_schedule("zb-h1", pp=2, microbatches=4)
    # pp_rank 1 recomputes layers 2, 3 (0.1 s each per microbatch), layer 3 again for W
    r1 = replace(_rank_plan(1, 1, [[2, 3]], 4 * 0.3), again=[[3]], again_s=4 * 0.1)
    plan = RecomputePlan(100, s.name, [_rank_plan(0, 0, [[]], 0.0), r1])
    on_i = plan_recompute_costs(plan, s)
    on_w = plan_recompute_costs(plan, s, on="w")
    assert on_i == pytest.approx({(0, 0): 0.0, (1, 0): 0.2})
    assert on_w == pytest.approx({(0, 0): 0.0, (1, 0): 0.1})
    got = simulate(s, Costs(t_f=1.0, t_b=2.0, recompute=on_i, recompute_w=on_w))
    base = simulate(s, Costs(t_f=1.0, t_b=2.0))
    assert got.busy[1] == pytest.approx(base.busy[1] + 4 * 0.3)
    assert got.busy[0] == pytest.approx(base.busy[0])
    with pytest.raises(ValueError, match="on must be"):
        plan_recompute_costs(plan, s, on="I")


def test_recompute_labels_and_stats():
    from torch import nn

    from lightning_pp.layout.partition import PipelineChunk
    from lightning_pp.runtime.recompute import install_recompute

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.fc_proj = nn.Linear(2, 2)
            self.ln = nn.LayerNorm(2)

        def forward(self, x):
            return self.fc_proj(self.fc(self.ln(x)))

    chunks = [PipelineChunk([Block(), Block()], [1, 2]), PipelineChunk([Block()], [5])]
    assert recompute_labels(chunks, install_recompute(chunks, "full")) == [1, 2, 5]
    assert recompute_labels(chunks, install_recompute(chunks, [2, 5])) == [2, 5]
    assert recompute_labels(chunks, install_recompute(chunks, "selective:fc*")) == [
        "1.fc",
        "1.fc_proj",
        "2.fc",
        "2.fc_proj",
        "5.fc",
        "5.fc_proj",
    ]
    opaque = [nn.Linear(2, 2)]  # not a PipelineChunk: recomputed as one unit
    assert recompute_labels(opaque, install_recompute(opaque, "full")) == ["chunk0"]
    assert RecomputeStats(0, 0, (1,), 110, 100).ratio == pytest.approx(1.1)
    assert RecomputeStats(0, 0, (1,), 110).ratio is None
