"""Smoke test of benchmarks/: the scripts run end to end and write well-formed output.

Tiny settings (pp=2, two microbatches, millisecond sleeps, one round): seconds, not minutes.
Nothing here asserts a timing; only structure and the cross-implementation loss agreement
(same layers, same data -> the same loss, a correctness property of the comparison itself).
"""

from __future__ import annotations

import json
import math
import os
import sys

import background
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import bench_pipeline, report  # noqa: E402
from benchmarks.workloads import Workload  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def records():
    w = Workload("sleep", t_f=0.002, t_b=0.004, width=8, mb_size=2)
    return bench_pipeline.run(
        w,
        pps=[2],
        microbatches=[2],
        schedules=["gpipe", "1f1b", "interleaved"],
        rounds=2,
        steps=1,
        warmup=1,
        timeout=180,
    )


def test_records_well_formed(records):
    keys = {(r["schedule"], r["impl"]) for r in records}
    assert keys == {(s, i) for s in ("gpipe", "1f1b", "interleaved") for i in ("ours", "torch")}
    for r in records:
        pp = r["pp"]
        assert len(r["step_s"]) == 2  # 2 rounds x 1 measured step, warmup excluded
        assert all(t > 0 for t in r["step_s"])
        for k in ("busy_s", "fwd_s", "bwd_s", "peak_saved_bytes"):
            assert len(r[k]) == pp and all(len(v) == 2 for v in r[k]), k
        assert len(r["chunk_act_bytes"]) == pp
        assert all(len(c) == r["vpp"] for c in r["chunk_act_bytes"])
        assert r["losses"] and all(math.isfinite(v) for v in r["losses"])
        json.dumps(r)  # serialisable


def test_same_loss_both_implementations(records):
    by = {(r["schedule"], r["impl"]): r["losses"] for r in records}
    for s in ("gpipe", "1f1b", "interleaved"):
        ours, theirs = by[(s, "ours")], by[(s, "torch")]
        assert ours == pytest.approx(theirs, rel=1e-6), s


def test_report_table_plot_and_targets(records, tmp_path):
    raw = tmp_path / "raw.jsonl"
    bench_pipeline.write_records(str(raw), records, {"nproc": 2}, {"loadavg": [0, 0, 0]}, "test")
    md_path = tmp_path / "results.md"
    report.main([str(raw), "--md", str(md_path), "--png-dir", str(tmp_path)])
    md = md_path.read_text()
    header = next(line for line in md.splitlines() if line.startswith("| p | schedule"))
    rows = [line for line in md.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 6
    assert all(row.count("|") == header.count("|") for row in rows)
    assert "## Targets" in md
    png = tmp_path / "bench_sleep.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_bound_follows_schedule_order():
    from lightning_pp.schedules import build_schedule

    s = build_schedule("1f1b", pp=4, microbatches=8)
    # rank 0 of 1F1B holds at most pp = 4 microbatches: 4 x 100 bytes
    assert report.memory_bound(s, 0, [100.0]) == 400.0
    assert report.memory_bound(s, 3, [100.0]) == 100.0


def _strategy_overhead_script(tmp_path) -> str:
    """bench_strategy starts a fresh interpreter per run (plain Trainer, then the strategy), so
    it runs in the background while the in-process tests run (tests/background.py)."""
    from benchmarks import bench_strategy

    out = tmp_path / "so.md"
    bench_strategy.main(
        ["--quick", "--rounds", "1", "--steps", "2", "--warmup", "1", "--out", str(out)]
    )
    md = out.read_text()
    assert "| **median over runs** |" in md and "Target 5" in md
    return "report written"


def background_jobs(items, tmp_path_factory) -> dict:
    table = {
        "test_strategy_overhead_script": _strategy_overhead_script,
        "test_split_backward_cost_script": _split_backward_cost_script,
        "test_async_save_script": _async_save_script,
        "test_sharded_script": _sharded_script,
        "test_tp_script": _tp_script,
    }
    return background.jobs_of_tests(items, tmp_path_factory, table)


@pytest.mark.timeout(background.WAIT)
def test_strategy_overhead_script():
    print(background.check("test_strategy_overhead_script"))


def test_ablation_variants_agree_and_render():
    """The ablation's variants (receives just in time, monitor off) change timing only: the
    same losses as torch's runtime, and one table row per configuration with every variant."""
    w = Workload("sleep", t_f=0.001, t_b=0.002, width=8, mb_size=2)
    impls = ("ours", "ours-L1", "ours-nomon", "torch")
    recs = bench_pipeline.run(
        w,
        pps=[2],
        microbatches=[4],
        schedules=["interleaved"],
        impls=impls,
        rounds=2,
        steps=1,
        warmup=1,
        timeout=180,
    )
    by = {r["impl"]: r["losses"] for r in recs}
    assert set(by) == set(impls)
    for impl in impls[:-1]:
        assert by[impl] == pytest.approx(by["torch"], rel=1e-6), impl
    table = report.ablation_table(recs)
    rows = [ln for ln in table.splitlines() if ln.startswith("| sleep")]
    assert len(rows) == 1 and rows[0].count("(") == 3, table  # three variants / torch


def test_recompute_benchmark_runs_and_reports(tmp_path):
    """bench_recompute end to end at toy sizes: every variant has a row, the auto plans'
    predicted peaks match the measured ones (the planner and meter agree, as in
    tests/test_recompute_auto.py), and every variant trains to the same loss."""
    from benchmarks import bench_recompute

    out = tmp_path / "rc.md"
    bench_recompute.main(
        ["--quick", "--pp", "2", "--microbatches", "4", "--schedules", "1f1b", "zb-h1"]
        + ["--out", str(out)]
    )
    md = out.read_text()
    recs = [json.loads(line) for line in (tmp_path / "rc.jsonl").read_text().splitlines()]
    rows = {(r["schedule"], r["variant"]) for r in recs if "error" not in r}
    for s in ("1f1b", "zb-h1"):
        assert {(s, f"ours {m}") for m in ("none", "full", "auto")} <= rows
    assert ("zb-h1", "torch full") in rows and "## Verdicts" in md
    for r in recs:
        if r.get("predicted"):
            for got, want in zip(r["peak_bytes"], r["predicted"]):
                assert abs(got - want) <= 0.10 * want, r
    for s in ("1f1b", "zb-h1"):
        losses = {r["losses"][-1] for r in recs if r["schedule"] == s and r.get("losses")}
        assert losses and max(losses) - min(losses) <= 1e-5 * max(losses), (s, losses)


def _split_backward_cost_script(tmp_path) -> str:
    """benchmarks/split_backward_cost.py: every mode measured (the baseline here is the
    current file), no timing asserted. I makes one engine call. With the graph retained, W
    makes one per weight group (6 per block); a transformer block's W layers are Linears and
    norms, so the engine path frees the graph at I and W makes none (and after its first round
    there is nothing to trim). A subprocess: the script wraps split_backward's functions to
    time them; it runs in the background (tests/background.py)."""
    import subprocess

    out = tmp_path / "cost.json"
    script = os.path.join(ROOT, "benchmarks", "split_backward_cost.py")
    base = os.path.join(ROOT, "lightning_pp", "runtime", "split_backward.py")
    args = ["--iters", "3", "--warmup", "1", "--dim", "8", "--heads", "2", "--seq", "4"]
    subprocess.run(
        [sys.executable, script, *args, "--mb", "1", "--baseline", base, "--json", str(out)],
        check=True,
        timeout=120,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    data = json.loads(out.read_text())
    modes = ["split", "engine", "split-base", "engine-base"]
    measured = [*modes, "torch"]  # torch's stage_backward_input / _weight on the same stage
    assert sorted(data["ratio"]) == sorted(f"{m}.{c}" for m in measured for c in ("wall", "cpu"))
    assert all(r > 0 for r in data["ratio"]["torch.cpu"].values())
    for mode in modes:
        want = 0 if mode.startswith("engine") else 12
        assert data["calls"][mode].get("W.engine", 0) == want, mode
        assert data["calls"][mode]["I.engine"] == 1, mode
        assert all(r > 0 for r in data["ratio"][f"{mode}.cpu"].values())
    assert data["calls"]["engine"].get("I.trim", 0) == 0
    return "every mode measured"


@pytest.mark.timeout(background.WAIT)
def test_split_backward_cost_script():
    print(background.check("test_split_backward_cost_script"))


def test_split_free_ab_script():
    """benchmarks/split_free_ab.py: both ways measured in one world, and they are the two
    paths they claim (the graph freed at I on every chunk with an I, or on none)."""
    from benchmarks import split_free_ab

    out = split_free_ab.main(["--pp", "2", "-m", "2", "--rounds", "2", "--steps", "2"])
    for way in split_free_ab.WAYS:
        assert out[way]["step_ms"] > 0 and out[way]["I_ms"] > 0 and out[way]["W_ms"] > 0, way
    assert out["chunks_freed"]["freed"] and all(out["chunks_freed"]["freed"])
    assert out["chunks_freed"]["retained"] and not any(out["chunks_freed"]["retained"])


def test_first_step_costs_script():
    """benchmarks/first_step_costs.py: each step's zb-auto costs on the virtual device, every
    (pp rank, chunk) of zbv at p=4 measured with its F, I and W."""
    from benchmarks import first_step_costs

    rows = first_step_costs.main(["--workload", "sleep", "--steps", "2"])["sleep"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert len(r["chunks"]) == 4 * 2 and r["overhead_s"] >= 0
        # rank 0's chunk 0 holds stage 0, which has no input gradient: only its W is its work
        assert all(v[0] > 0 and v[3] > 0 for v in r["chunks"].values())


def _bare_worker(rank: int, world: int) -> dict:
    """One step of ours and of the bare executor per schedule, same layers and data: losses and
    every local parameter gradient."""
    from benchmarks.bare import build_bare_step
    from benchmarks.harness import RankStats
    from benchmarks.ours import build_ours_step
    from lightning_pp.schedules import build_schedule

    w = Workload("sleep", t_f=0.0005, t_i=0.0005, t_w=0.0005, width=8, mb_size=2)
    dev = torch.device("cpu")
    out = {}
    for schedule, vpp in (("1f1b", 1), ("zb-h1", 1), ("zbv", 2), ("interleaved", 2)):
        got = {}
        log: list = []
        for impl, build in (("ours", build_ours_step), ("bare", build_bare_step)):
            extra = (log,) if impl == "bare" else ()
            step, params = build(w, schedule, world, vpp, 4, rank, dev, RankStats(), *extra)
            x, y = w.batch(4)
            loss = step(x, y)
            grads = [p.grad.flatten().tolist() for p in params]
            got[impl] = (None if loss is None else float(loss), grads)
        # the bare log (benchmarks/ops_vs_bare.py): one entry per action, in the rank's order
        got["log_ops"] = [op for op, _, _ in log]
        got["log_ok"] = all(d >= b >= 0.0 for _, d, b in log)
        ran = build_schedule(schedule, pp=world, microbatches=4, vpp=vpp).ranks[rank]
        got["actions"] = [a.op.value for a in ran]
        out[schedule] = got
    return out


def test_bare_executor_computes_what_ours_computes():
    """benchmarks/bare.py is a ruler for step time: it must do all the work our engine does
    (the same loss and the same gradient on every parameter), or it would read fast for free.
    Gradients travel as lists: a tensor in the result queue outlives its sender."""
    from distributed import run_distributed

    for rank, res in enumerate(run_distributed(_bare_worker, 2, timeout=120)):
        for schedule, got in res.items():
            assert got["log_ops"] == got["actions"] and got["log_ok"], (rank, schedule, got)
            (l_ours, g_ours), (l_bare, g_bare) = got["ours"], got["bare"]
            assert (l_ours is None) == (l_bare is None), (rank, schedule)
            if l_ours is not None:
                assert l_bare == pytest.approx(l_ours, rel=1e-6), (rank, schedule)
            assert len(g_ours) == len(g_bare) > 0, (rank, schedule)
            for a, b in zip(g_ours, g_bare):
                assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-6, atol=1e-9), (
                    rank,
                    schedule,
                )


def test_ops_vs_bare_script(capsys):
    """benchmarks/ops_vs_bare.py at toy sizes: both executors' rows for every rank, with a
    time for each op the rank runs (structure only, no timing)."""
    from benchmarks import ops_vs_bare

    argv = ["--pp", "2", "--microbatches", "2", "--rounds", "3", "--t", "0.001"]
    ops_vs_bare.main([*argv, "--schedule", "zb-h1", "--variants", "ours-nomon"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| impl | rank | step ms |") and len(rows) == 1 + 3 * 2
    impls = ("ours", "ours-nomon", "bare")
    assert [row.split("|")[1].strip() for row in rows[1:]] == [i for i in impls for _ in "01"]
    for row in rows[1:]:  # zb-h1 splits every backward: no fused B
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[7] == "-" and all(float(c) >= 0 for c in cells[2:7] + cells[8:]), row


def test_poll_latency_script(capsys):
    """benchmarks/poll_latency.py: its stand-in works complete when said, and a row per mode
    and wait (structure only, no timing)."""
    from benchmarks import poll_latency

    for poll_works in (True, False):
        med, worst, cpu = poll_latency.measure(poll_works, 0.001, 2)
        assert 0.0 <= med <= worst and cpu >= 0.0
    poll_latency.main(["--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 2 * len(poll_latency.WAITS_MS)  # the header, a row per wait


def test_zero_bubble_report_renders_targets_and_bare_rows():
    """bench_zero_bubble's tables from records shaped like bench_pipeline's (no processes): the
    targets read ours and torch, the bare executor's rows divide by the simulated makespan and
    ours by bare."""
    from benchmarks import bench_zero_bubble as zb
    from lightning_pp.schedules import Costs

    costs = Costs(t_f=0.01, t_b=0.02, t_i=0.01, t_w=0.01)
    recs = []
    for impl, schedules, scale in (
        ("ours", zb.OURS, 1.10),
        ("torch", zb.TORCH, 1.15),
        ("bare", zb.OURS, 1.05),
    ):
        for s in schedules:
            ideal = zb._ideal_ms(s, 2, 4, costs) or 100.0
            recs.append(
                {
                    "impl": impl,
                    "schedule": s,
                    "pp": 2,
                    "microbatches": 4,
                    "step_s": [ideal * scale / 1e3] * 3,
                    "peak_saved_bytes": [[1024.0], [1024.0]],
                    "chunk_act_bytes": [[512.0, 512.0], [512.0, 512.0]],
                    "losses": [1.0],
                }
            )
    table, med = zb._table(recs, costs)
    assert table.count("| bare |") == len(zb.OURS)
    text = zb._verdicts(med, recs, costs)
    assert "| our zbv / simulated makespan <= 1.08 | 1.100" in text
    assert "| zbv | 1.050 (" in text and f"| {1.10 / 1.05:.3f} |" in text
    assert "| bare zbv / bare 1f1b |" in text


def _async_save_script(tmp_path) -> str:
    """benchmarks/bench_async_save.py --smoke: a tiny GPT under the Trainer (pp2 x dp2, four
    processes), once saving in the background and once synchronously; every step classified,
    every save recorded, and every async checkpoint complete and consolidated. Structure only,
    no timing. A subprocess (it launches its own Trainers); runs in the background."""
    import subprocess

    out = tmp_path / "async_save.json"
    script = os.path.join(ROOT, "benchmarks", "bench_async_save.py")
    proc = subprocess.run(
        [sys.executable, script, "--smoke", "--timeout", "400", "--out", str(out)],
        timeout=900,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["runs"]] == ["async", "sync"]
    for run in data["runs"]:
        assert len(run["ranks"]) == 4 and {r["dp_rank"] for r in run["ranks"]} == {0, 1}
        assert len(run["kinds"]) == len(run["steps_s"]) and all(t > 0 for t in run["steps_s"])
        assert run["saves"] and all(s["call_s"] > 0 for s in run["saves"])
        background = run["mode"] == "async"
        assert all(("staging_s" in s) == background for s in run["saves"]), run["mode"]
    for mode in ("async", "sync"):
        summary = data["summary"][mode]
        assert summary["saves"] >= 1 and summary["normal_ms"] > 0 and summary["ratio"] > 0
    assert data["state_mb"] > 0
    checked = data["verify"]
    assert checked["checkpoints"] and not checked["hidden"]
    assert all(c["complete"] and c["consolidate_rc"] == 0 for c in checked["checkpoints"])
    assert "| async (" in data["markdown"] and "Target:" in data["markdown"]
    return f"{len(checked['checkpoints'])} async checkpoints verified"


@pytest.mark.timeout(background.WAIT)
def test_async_save_script():
    print(background.check("test_async_save_script"))


def _sharded_script(tmp_path) -> str:
    """benchmarks/bench_sharded.py --smoke: every variant (ours unsharded, zero=1 under 1f1b
    and zbv, ours fsdp, torch.distributed.pipelining + FSDP2 under Schedule1F1B and
    ScheduleZBVZeroBubble) on a tiny model, pp2 x dp2 on four processes: each trains like the
    single-process reference (loss, gradient norm from the local shards, loss after one AdamW
    step, 1e-5), holds 1/dp of the optimizer state where it shards it, and has a row. Structure
    only, no timing. A subprocess (four ranks of its own); runs in the background."""
    import subprocess

    out = tmp_path / "sharded.json"
    script = os.path.join(ROOT, "benchmarks", "bench_sharded.py")
    proc = subprocess.run(
        [sys.executable, script, "--smoke", "--unfixed", "--timeout", "400", "--out", str(out)],
        timeout=600,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    from benchmarks.bench_sharded import VARIANTS

    summary = data["summary"]
    assert set(VARIANTS) <= set(summary)
    measured = []
    for name, row in summary.items():
        if row["status"].startswith("not measured") and row["impl"] == "ours":
            # only our FSDP path may be missing (lightning_pp/runtime/fsdp_chunks.py)
            assert row["sharding"] == "fsdp", (name, row)
            continue
        assert row["status"] in ("measured", "check only"), (name, row["status"])
        assert max(row["check"]["rel_err"].values()) <= 1e-5, (name, row["check"])
        nbytes = row["bytes_per_rank"]
        assert len(nbytes) == 4 and all(b["param"] > 0 for b in nbytes), name
        if row["status"] == "measured":
            measured.append(name)
            assert row["step_ms"] > 0 and len(row["phase_ms_per_rank"]) == 4, name
    full = summary["ours-1f1b"]["bytes_per_rank"]
    for name in ("ours-1f1b-zero1", "torch-1f1b-fsdp"):
        for b, f in zip(summary[name]["bytes_per_rank"], full):
            assert b["optimizer"] <= 0.55 * f["optimizer"], (name, b, f)
    assert "zero1_over_unsharded" in data["targets"] and "| target |" in data["markdown"]
    return f"{len(measured)} variants checked and measured"


@pytest.mark.timeout(background.WAIT)
def test_sharded_script():
    print(background.check("test_sharded_script"))


def _tp_script(tmp_path) -> str:
    """benchmarks/bench_tp.py --quick: a tiny DecoderLM at pp4, pp2 x dp2, pp2 x tp2 and pp2 x tp2
    with sequence parallelism (the projections' inputs kept at T / tp, and kept whole) on four
    processes under the Trainer (torchrun), each variant's loss
    equal to the single-process reference; P2P bytes counted equal to the shapes' (plus
    headers; half of tp2's under sequence parallelism), tp collectives only under tp, what
    autograd saved measured on every variant (less under sequence parallelism); both
    send-or-broadcast ways timed. Structure only, no timing. Runs in the background."""
    import subprocess

    out = tmp_path / "tp.json"
    script = os.path.join(ROOT, "benchmarks", "bench_tp.py")
    proc = subprocess.run(
        [sys.executable, script, "--quick", "--timeout", "500", "--out", str(out)],
        timeout=600,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert set(summary) == {"pp4", "pp2-dp2", "pp2-tp2", "pp2-tp2-sp", "pp2-tp2-sp-gathered"}
    for name, row in summary.items():
        assert row["check"] == "ok" and row["step_ms"] > 0, (name, row)
        shapes = row["p2p_bytes_from_shapes"]
        assert shapes <= row["p2p_bytes"] <= 1.1 * shapes, (name, row)  # + the shape headers
        assert (row["tp_coll_calls"] > 0) == (row["tp"] > 1), (name, row)
        assert row["saved_bytes_max_rank"] > 0, (name, row)
    assert (
        summary["pp2-tp2"]["p2p_bytes_from_shapes"]
        == 2 * summary["pp2-dp2"]["p2p_bytes_from_shapes"]
    )  # every tp rank sends the whole activation; dp splits the batch
    sp, tp = summary["pp2-tp2-sp"], summary["pp2-tp2"]
    assert 2 * sp["p2p_bytes_from_shapes"] == tp["p2p_bytes_from_shapes"]  # T / tp positions
    assert sp["saved_bytes_max_rank"] < tp["saved_bytes_max_rank"]
    # the projections' gathered inputs kept whole (torch's ColwiseParallel) save more
    assert sp["saved_bytes_max_rank"] < summary["pp2-tp2-sp-gathered"]["saved_bytes_max_rank"]
    micro = data["micro"]
    assert micro and all(r["every_ms"] > 0 and r["once+bcast_ms"] > 0 for r in micro)
    assert "| pp2-tp2 | 2 x 1 x 2 |" in data["markdown"]
    return f"{len(summary)} variants checked, {len(micro)} message sizes timed both ways"


@pytest.mark.timeout(background.WAIT)
def test_tp_script():
    print(background.check("test_tp_script"))


def test_suite_cpu_reads_the_machines_busy_time_and_ranks_the_files(tmp_path):
    """benchmarks/suite_cpu.py: busy time from /proc/stat's first line (idle and iowait left
    out, guest time not counted twice), a run measured, the table costliest first."""
    from benchmarks import suite_cpu

    stat = tmp_path / "stat"
    hz = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(f"cpu  {3 * hz} {hz} {2 * hz} {50 * hz} {4 * hz} 0 {hz} 0 {7 * hz} 0\n")
    assert suite_cpu.busy_seconds(str(stat)) == 7.0
    stat.write_text("cpu0 1 2 3 4\n")
    with pytest.raises(ValueError, match="not the machine's total"):
        suite_cpu.busy_seconds(str(stat))
    run = suite_cpu.measure("noop", [sys.executable, "-c", "pass"])
    assert run.rc == 0 and run.wall_s > 0 and run.cpu_s >= 0
    rows = [suite_cpu.FileCost("a", 0, 2.0, 1.0), suite_cpu.FileCost("b", 1, 3.0, 3.0)]
    lines = suite_cpu.table(rows).splitlines()
    assert lines[2] == "| b | 3 | 75.0 % | 3 | 1 |" and lines[3] == "| a | 1 | 25.0 % | 2 | 0 |"
    assert lines[-1] == "| **total** (2 runs) | 4 | | 5 | |"
