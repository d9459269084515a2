"""The planner's check against measurement (issue 16 phase 2): ``--verify``'s error arithmetic
and table, the oversubscription term, the calibration fit on a synthetic record, a failing run
reported (not fatal), one real ``--verify 1`` run of a tiny model on 2 processes, and the
accuracy benchmark's smoke mode.

No wall-time assertion: the real runs check structure (a measured time, a metered peak, the
table), not accuracy (benchmarks/results/planner.md measures that).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from lightning_pp.layout.rules import PreflightError
from lightning_pp.planner import LayerCost, ModelProfile, predict, search
from lightning_pp.planner.search import make_candidate, oversubscribed_seconds, step_costs
from lightning_pp.planner.verify import (
    Measured,
    RunSpec,
    VerifyRow,
    WorldFailure,
    fit_compute,
    fit_links,
    fit_timed,
    format_verify_table,
    measure,
    pct_error,
)
from lightning_pp.runtime.records import StepEvent, StepRecord
from lightning_pp.schedules import Op, build_schedule

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _layer(t: float) -> LayerCost:
    return LayerCost(t, t, t, saved_bytes=8000, param_bytes=4000, params=1000, boundary_bytes=100,
                     input_bytes=100)  # fmt: skip


# ---- error arithmetic and the table -------------------------------------------------------------


def test_pct_error_is_signed_and_relative_to_the_measurement():
    assert pct_error(110.0, 100.0) == pytest.approx(10.0)
    assert pct_error(90.0, 100.0) == pytest.approx(-10.0)
    assert pct_error(0.0, 0.0) == 0.0
    assert math.isinf(pct_error(1.0, 0.0))


def test_verify_row_errors_use_the_heaviest_rank():
    row = VerifyRow("#1", "1x2x1 m=4 1f1b", 0.120, [3000, 1000],
                    Measured(0.100, [0.1, 0.1, 0.1], [2000, 2500]))  # fmt: skip
    assert row.step_error == pytest.approx(20.0)
    assert row.act_error == pytest.approx(20.0)  # max 3000 predicted vs max 2500 measured
    failed = VerifyRow("config", "2x1x1 m=2 1f1b", 0.1, [1], error="rank 1:\nboom\nValueError: x")
    assert failed.step_error is None and failed.act_error is None
    text = format_verify_table([row, failed])
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["#", "shape", "pred"]
    assert "+20.0%" in lines[2] and "120.0" in lines[2] and "100.0" in lines[2]
    assert lines[3].startswith("config") and "FAILED: ValueError: x" in lines[3]


# ---- oversubscription ---------------------------------------------------------------------------


def test_oversubscription_term():
    assert oversubscribed_seconds(1.0, [0.5, 0.5], dp=1, cores=2) == 1.0  # 2 processes, 2 cores
    assert oversubscribed_seconds(1.0, [0.5, 0.5], dp=1, cores=None) == 1.0
    # 4 processes x 0.9 s of work on 2 cores: at least 1.8 s
    assert oversubscribed_seconds(1.0, [0.9, 0.9], dp=2, cores=2) == pytest.approx(1.8)
    # much idle time: the makespan is the bound
    assert oversubscribed_seconds(3.0, [0.9, 0.9], dp=2, cores=2) == 3.0


def test_predict_with_cores_on_a_pure_data_parallel_shape():
    prof = ModelProfile({4: [_layer(1e-3)] * 4}, overhead_s=0.0, latency_s=0.0)
    cand, plan = make_candidate(prof, 4, 16, pp=1, vpp=1, microbatches=1, schedule="1f1b")
    alone = predict(prof, cand, plan)
    shared = predict(prof, cand, plan, cores=2)
    # one replica computes 4 layers x 3 ms = 12 ms; 4 replicas on 2 cores need twice that
    assert alone.makespan_s == pytest.approx(12e-3)
    assert shared.step_s - shared.allreduce_s == pytest.approx(24e-3)
    assert shared.contention_s == pytest.approx(12e-3) and alone.contention_s == 0.0
    # the search passes cores through: pp=1 loses its edge when 4 processes share 2 cores
    ranked = search(prof, 4, 16, cores=2).ranked
    assert all(p.step_s >= p.makespan_s for p in ranked)


def test_make_candidate_refuses_what_the_plan_refuses():
    prof = ModelProfile({4: [_layer(1e-3)] * 4})
    with pytest.raises(PreflightError):
        make_candidate(prof, 3, 16, pp=2, vpp=1, microbatches=2, schedule="1f1b")
    cand, _ = make_candidate(prof, 2, 16, pp=2, vpp=1, microbatches=4, schedule="zb-h1",
                             split=(1, 3))  # fmt: skip
    assert cand.counts == (1, 3) and cand.split == "explicit"


# ---- calibration --------------------------------------------------------------------------------


def test_fit_links_recovers_overhead_and_latency_from_a_synthetic_record():
    """pp=2, one microbatch: F 1 s, B 2 s nominal; every action 0.5 ms over, every hop 0.2 ms."""
    s = build_schedule("gpipe", pp=2, microbatches=1)
    oh, hop = 0.5e-3, 0.2e-3
    f0 = StepEvent(s.ranks[0][0], 0.0, 1.0 + oh, send_time=1.0 + oh)
    wait1 = f0.send_time + hop
    f1 = StepEvent(s.ranks[1][0], 0.0, wait1 + 1.0 + oh, comm_wait=wait1)
    b1 = StepEvent(s.ranks[1][1], f1.end, f1.end + 2.0 + oh, send_time=f1.end + 2.0 + oh)
    wait0 = b1.send_time + hop - f0.end
    b0 = StepEvent(s.ranks[0][1], f0.end, f0.end + wait0 + 2.0 + oh, comm_wait=wait0)
    assert [e.action.op for e in (f0, b0)] == [Op.F, Op.B]
    records = [[StepRecord(0, 0, s, 0.0, [f0, b0])], [StepRecord(1, 1, s, 0.0, [f1, b1])]]
    cal = fit_links(records, lambda r, c, op: 1.0 if op is Op.F else 2.0)
    assert cal.overhead_s == pytest.approx(oh, abs=1e-9)
    assert cal.latency_s == pytest.approx(hop, abs=1e-9)
    assert (cal.actions, cal.hops) == (4, 2)
    assert cal.compute_scale == pytest.approx(1.0, abs=1e-9)


def test_fit_links_separates_the_receive_cost_from_the_hop():
    """Step 1: rank 1's F waits for data still on its way (a hop of 0.9 ms). Step 2: rank 0
    asks for its gradient 5 ms after it was sent and still waits 0.7 ms for it: the receive's
    own cost, which the hop of step 1 holds too."""
    s = build_schedule("gpipe", pp=2, microbatches=1)
    hop, rx = 0.9e-3, 0.7e-3

    def step(late: bool) -> list[list[StepRecord]]:
        f0 = StepEvent(s.ranks[0][0], 0.0, 1.0, send_time=1.0)
        f1 = StepEvent(s.ranks[1][0], 0.0, 1.0 + hop + 1.0, comm_wait=1.0 + hop)
        b1 = StepEvent(s.ranks[1][1], f1.end, f1.end + 2.0, send_time=f1.end + 2.0)
        start = b1.send_time + 5e-3 if late else f0.end
        wait = rx if late else b1.send_time + hop - start
        b0 = StepEvent(s.ranks[0][1], start, start + wait + 2.0, comm_wait=wait)
        return [[StepRecord(0, 0, s, 0.0, [f0, b0])], [StepRecord(1, 1, s, 0.0, [f1, b1])]]

    both = [a + b for a, b in zip(step(False), step(True))]
    cal = fit_links(both, lambda r, c, op: 1.0 if op is Op.F else 2.0)
    assert cal.latency_s == pytest.approx(hop, abs=1e-9)  # three blocked hops, all 0.9 ms
    assert cal.receive_s == pytest.approx(rx, abs=1e-9)
    assert fit_links(step(False), lambda r, c, op: 1.0).receive_s == 0.0  # no late receive


def test_the_receive_cost_is_charged_to_every_receiving_action_and_taken_off_the_hop():
    prof = ModelProfile(
        {4: [_layer(1e-3)] * 8}, overhead_s=0.0, latency_s=1e-3, bandwidth=float("inf")
    )
    rx = 0.4e-3
    for name, vpp in (("1f1b", 1), ("zbv", 2)):
        cand, plan = make_candidate(prof, 2, 16, pp=2, vpp=vpp, microbatches=4, schedule=name)
        base = step_costs(plan, prof.layers(4), None, prof)
        charged = step_costs(plan, prof.layers(4), None, prof.with_links(receive_s=rx))
        assert charged.latency == pytest.approx(base.latency - rx, abs=1e-12)
        last = plan.schedule.num_stages - 1
        for (r, c), costs in charged.overrides.items():
            stage = plan.schedule.stage(r, c)
            extra = [a - b for a, b in zip(costs, base.overrides[(r, c)])]
            f_rx, b_rx = rx if stage > 0 else 0.0, rx if stage < last else 0.0
            # (F, fused B, I, W): W receives nothing
            assert extra == pytest.approx([f_rx, b_rx, b_rx, 0.0], abs=1e-12), (name, stage)
    # one microbatch through gpipe: every receive is on the critical path and blocked, so the
    # hop holds the whole receive cost and the makespan does not move; the busy time does not
    # count it (the bubble is unchanged)
    cand, plan = make_candidate(prof, 2, 16, pp=2, vpp=1, microbatches=1, schedule="gpipe")
    a, b = predict(prof, cand, plan), predict(prof.with_links(receive_s=rx), cand, plan)
    assert b.makespan_s == pytest.approx(a.makespan_s, rel=1e-12)
    assert b.bubble == pytest.approx(a.bubble, rel=1e-9)


def test_fit_links_uses_the_layers_own_time_when_the_engine_recorded_it():
    """Layers 1.3x slower than profiled and 0.4 ms of engine per action, but the forwards
    15 % slower than that and the backwards 10 % faster (one shape's actions on the loaded
    2-core machine drift like this, by op and by rank): with the layers' own time the overhead
    comes back exactly and the scale is the measured one; a line through the action times alone
    reads the drift as a flatter slope and a 1 ms overhead."""
    s = build_schedule("1f1b", pp=1, microbatches=4)
    nominal = {Op.F: 1e-3, Op.B: 2e-3}
    drift = {Op.F: 1.15, Op.B: 0.9}
    events, t = [], 0.0
    for a in s.ranks[0] * 3:
        layers = 1.3 * nominal[a.op] * drift[a.op]
        compute = layers + 0.4e-3
        events.append(StepEvent(a, t, t + compute, layers=layers))
        t += compute
    records = [[StepRecord(0, 0, s, 0.0, events)]]
    cal = fit_links(records, lambda r, c, op: nominal[op])
    total = sum(e.layers for e in events) / sum(nominal[e.action.op] for e in events)
    assert cal.compute_scale == pytest.approx(total, rel=1e-9)
    assert cal.overhead_s == pytest.approx(0.4e-3, abs=1e-12)
    # the same actions without the layers' time: the line is thrown off by the scatter
    plain = [StepEvent(e.action, e.start, e.end) for e in events]
    line = fit_links([[StepRecord(0, 0, s, 0.0, plain)]], lambda r, c, op: nominal[op])
    assert line.overhead_s == pytest.approx(1.05e-3, rel=1e-6), line
    # nothing profiled: scale 1; never a negative overhead
    assert fit_timed([(0.0, 0.0, 1e-4)]) == (1.0, 1e-4)
    assert fit_timed([(1.0, 1.0, 0.9)])[1] == 0.0


def test_fit_compute_separates_a_slower_device_from_a_per_action_overhead():
    """Layers 1.3x slower than profiled plus 0.4 ms per action: a constant alone would call it
    an overhead that grows with the action's cost; the fit recovers both, and a prediction
    with them matches the measured actions."""
    nominal = [1e-3, 2e-3, 5e-3, 1e-2, 2e-2] * 3
    pairs = [(n, 1.3 * n + 0.4e-3) for n in nominal]
    scale, overhead = fit_compute(pairs)
    assert scale == pytest.approx(1.3, rel=1e-9) and overhead == pytest.approx(0.4e-3, abs=1e-12)
    # no spread in the profiled times: no slope can be told apart; scale 1, median excess
    assert fit_compute([(2e-3, 3e-3), (2e-3, 3.2e-3), (2e-3, 2.9e-3)]) == pytest.approx((1.0, 1e-3))
    # a slope outside the trusted bounds (noise) is not used
    assert fit_compute([(1e-3, 9e-3), (2e-3, 30e-3)])[0] == 1.0


def test_the_compute_scale_multiplies_every_layer_time_in_the_prediction():
    # no link cost (an infinite bandwidth): what is left is layer time, all of it scaled
    prof = ModelProfile(
        {4: [_layer(1e-3)] * 4}, overhead_s=0.0, latency_s=0.0, bandwidth=float("inf")
    )
    cand, plan = make_candidate(prof, 2, 16, pp=2, vpp=1, microbatches=4, schedule="1f1b")
    base = predict(prof, cand, plan).makespan_s
    slower = predict(prof.with_links(compute_scale=1.5), cand, plan).makespan_s
    assert slower == pytest.approx(1.5 * base, rel=1e-9)


# ---- real runs ----------------------------------------------------------------------------------


def _broken_builder():
    raise ValueError("this model cannot be built (on purpose)")


@pytest.mark.timeout(120)
def test_a_failing_run_raises_world_failure_and_leaves_no_process():
    spec = RunSpec(_broken_builder, None, pp=2, vpp=1, microbatches=2, schedule="1f1b",
                   counts=(1, 1))  # fmt: skip
    with pytest.raises(WorldFailure, match="on purpose"):
        measure(spec, 2, timeout=90)


def _sleep_builder():
    from lightning_pp.models.virtual_device import SleepLayer
    from lightning_pp.planner.verify import BuiltModel

    torch.manual_seed(0)
    layers = [SleepLayer(8, t_f=2e-3, t_i=3e-3, t_w=4e-3) for _ in range(2)]
    return BuiltModel(layers, lambda mb: mb[0], lambda out, mb: ((out - mb[1]) ** 2).mean())


@pytest.mark.timeout(120)
def test_a_real_run_records_each_actions_layer_time_within_its_compute():
    """The virtual device holds each layer until its deadline, so every recorded ``layers`` is
    at least the configured cost, and never more than the action's compute (which adds the
    engine's own work)."""
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    cost = {Op.F: 2e-3, Op.I: 3e-3, Op.W: 4e-3}
    spec = RunSpec(_sleep_builder, batch, pp=2, vpp=1, microbatches=2, schedule="zb-h1",
                   counts=(1, 1), warmup=1, steps=1, keep_records=True)  # fmt: skip
    got = measure(spec, 2, timeout=90)
    for rank, recs in enumerate(got.records):
        for e in recs[0].events:
            assert e.layers is not None and e.layers <= e.compute, (rank, e)
            # the first stage's input needs no gradient: its I computes nothing
            floor = 0.0 if (rank, e.action.op) == (0, Op.I) else cost[e.action.op]
            assert e.layers >= floor, (rank, e)


def _tiny_args(tmp_path: Path) -> list[str]:
    prof = ModelProfile({n: [_layer(1e-4 * n)] * 4 for n in (1, 2, 4, 8)}, tokens_per_sample=16)
    path = tmp_path / "prof.json"
    prof.save(path)
    return [
        "plan",
        str(ROOT / "configs" / "demo_cpu.yaml"),
        "model.init_args.n_layer=2",
        "model.init_args.n_embd=32",
        "model.init_args.n_head=2",
        "data.init_args.block_size=16",
        "data.init_args.batch_size=4",
        "data.init_args.max_chars=20000",
        "strategy.pp=2",
        "strategy.microbatches=2",
        "trainer.devices=2",
        "--search",
        "--devices",
        "2",
        "--profile",
        str(path),
        "--top",
        "3",
    ]


@pytest.mark.timeout(180)
def test_cli_verify_one_candidate_on_two_processes(tmp_path, capsys):
    from lightning_pp.commands.cli import main

    args = [*_tiny_args(tmp_path), "--verify", "1", "--verify-steps", "1", "--verify-warmup", "1"]
    args += ["--verify-timeout", "120", "--calibrate"]
    assert main(args) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert "verify: " in out and "FAILED" not in out, out + err
    # the calibration run fitted the engine numbers and timed the link between the two ranks
    cal = next(line for line in (out + err).splitlines() if "calibrate: engine overhead" in line)
    bandwidth = float(cal.split("bandwidth ")[1].split(" GB/s")[0])
    assert bandwidth > 0 and "4 MiB ping-pong" in cal, cal
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if "measured ms" in line and "pred act" in line)
    rows = [line for line in lines[head + 2 :] if line.startswith(("#1", "config"))]
    assert rows and rows[0].startswith("#1"), out
    assert "step time |error|: median" in out
    assert "verify 1/" in err  # a progress line per run


# ---- the accuracy benchmark's smoke mode --------------------------------------------------------


@pytest.mark.timeout(240)
def test_bench_planner_quick(tmp_path):
    from benchmarks import bench_planner

    out = tmp_path / "planner.md"
    argv = ["--quick", "--rounds", "2", "--out", str(out), "--timeout", "180"]
    summary = bench_planner.main(argv)
    assert summary["measured"] == summary["shapes"] >= 2
    assert summary["step_worst"] is not None and summary["act_worst"] is not None
    text = out.read_text()
    assert "## Summary" in text and "| pp | vpp |" in text
    assert "the fastest of 2 runs, one per round" in text
    rows = [json.loads(line) for line in (tmp_path / "planner.jsonl").read_text().splitlines()]
    for row in rows[:-1]:  # every shape measured in both rounds, the faster one kept
        assert len(row["rounds_s"]) == 2 and row["measured_s"] == min(row["rounds_s"]), row
    cal = rows[-1]["meta"]["calibration"]
    assert cal["step_s"] == min(cal["round_steps_s"]) and len(cal["round_steps_s"]) == 2
    assert (tmp_path / "planner.png").stat().st_size > 0  # predicted vs measured


_PLANNER_SESSION = """
import os, sys, time
from pathlib import Path
from lightning_pp.planner.verify import run_world


def sleeper(rank, world, where):
    Path(where, f"rank{{rank}}").write_text(str(os.getpid()))
    time.sleep(600)


if __name__ == "__main__":
    run_world(sleeper, 2, {where!r}, timeout=600)
"""


@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_killed_planner_takes_its_measuring_world_along(tmp_path):
    """``lightning-pp plan --verify`` killed outright (SIGKILL: no clean-up of its own runs)
    while its ranks compute: they lead process groups of their own (so the planner can kill
    each with what it started), and before, they kept computing, or waited in a collective
    until the group's timeout. Now each kills its group once the planner's end of the owner
    pipe closes."""
    import subprocess
    import time

    from distributed import kill_all, kill_and_expect_gone

    from lightning_pp.runtime.local_process import is_gone

    script = tmp_path / "planner_session.py"
    script.write_text(_PLANNER_SESSION.format(where=str(tmp_path)))
    proc = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        files = [tmp_path / "rank0", tmp_path / "rank1"]
        while not all(f.exists() and f.read_text() for f in files):
            assert proc.poll() is None, f"the planner session ended early ({proc.returncode})"
            assert time.monotonic() < deadline, "the world did not start within 120 s"
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in files]
        assert not any(map(is_gone, pids)), pids
        assert not kill_and_expect_gone(proc, pids), f"ranks left running: {pids}"
    finally:
        kill_all([proc.pid, *pids])
        proc.wait(timeout=30)
