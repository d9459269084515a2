"""``lightning-pp fit`` / ``plan`` end to end: real processes, real Trainer, real gloo groups.

* plan prints the partition and schedule for the demo and the 1B GPU template, and builds the
  1B model without allocating it (meta device; the process's peak RSS stays far below 4 GB);
* the README's demo at toy size under Lightning's own launcher (devices=4), launched once: it ends
  with a final validation, a summary, a loss curve and a timeline PNG, its redirected output is
  plain lines, and rank 0 samples from the merged stages; the same run started by
  ``examples/torchrun_two_nodes.sh loopback`` (two torchrun "nodes" of two processes) writes the
  same per-step losses.

Every subprocess tree is killed on timeout (``jobs.kill_job``: torchrun puts its workers in their
own sessions, so it kills the leader's descendants found in /proc as well as its process group).
"""

from __future__ import annotations

import csv
import functools
import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import background
import pytest
from jobs import free_port, kill_job, start_job

REPO = Path(__file__).resolve().parents[1]
DEMO = "configs/demo_cpu.yaml"
GPU_TEMPLATE = "configs/gpt_1b_pp4_vpp2.yaml"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in list(env):  # a test run inside torchrun/SLURM must not leak its launcher here
        if key.startswith(("TORCHELASTIC_", "SLURM_")) or key in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "NODE_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ):
            env.pop(key)
    return env


def run_all(cmds: list[list[str]], timeout: float, logs: list[Path], cwd: Path = REPO) -> list[int]:
    """Run commands concurrently; on timeout kill every process tree and fail with the logs."""
    procs = []
    for cmd, log in zip(cmds, logs):
        with open(log, "w") as out:
            procs.append(start_job(cmd, cwd=cwd, env=_env(), stdout=out))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            _kill(p)
        tails = "\n".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in logs)
        pytest.fail(f"timed out after {timeout}s: {cmds}\n{tails}")
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
    return [p.returncode for p in procs]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:  # kill_job walks descendants from the pid: only while it is ours
        kill_job(proc.pid)
    proc.wait()


def read_losses(path: Path) -> list[tuple[int, float]]:
    with open(path) as f:
        return [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]


CLI = [sys.executable, "-m", "lightning_pp"]


# ------------------------------------------------------------------------------ plan


def test_plan_demo_shows_partition_and_schedule(capsys):
    from lightning_pp.commands.cli import main

    assert main(["plan", str(REPO / DEMO)]) == 0
    out = capsys.readouterr().out
    assert "pipeline: pp=2 x dp=2 (world 4), vpp=1" in out
    assert "rank 0 chunk 0 (stage 0): layers 0-2 (Embedding, Block x2)" in out
    assert "rank 1 chunk 0 (stage 1): layers 3-5 (Block x2, Head)" in out
    assert "rank 0 | F0 F1" in out and "rank 1 | .  F0 B0" in out
    assert "bubble ratio:   0.2500" in out  # (p-1)/m = 1/4
    # `fit --dry-run` is the same report
    assert (
        main(["fit", str(REPO / DEMO), "--dry-run", "strategy.pp=4", "strategy.microbatches=8"])
        == 0
    )
    out = capsys.readouterr().out
    assert "pp=4 x dp=1" in out and "rank 3 chunk 0 (stage 3)" in out
    assert "bubble ratio:   0.3750" in out  # 3/8


def test_gpu_template_plans_without_allocating_the_model(tmp_path):
    """1.07B parameters would be 4.3 GB in fp32; the planning process must stay far below."""
    script = (
        "import resource, sys\n"
        "from lightning_pp.commands.cli import main\n"
        f"rc = main(['plan', {GPU_TEMPLATE!r}])\n"
        "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
        "sys.exit(rc)\n"
    )
    log = tmp_path / "plan.log"
    assert run_all([[sys.executable, "-c", script]], timeout=240, logs=[log]) == [0], (
        log.read_text()
    )
    out = log.read_text()
    assert "GPT: 1,074,278,400 parameters (1.07B)" in out and "no storage allocated" in out
    assert "pipeline: pp=4 x dp=4 (world 16), vpp=2: 8 virtual stages" in out
    for r in range(4):
        assert f"rank {r} chunk 1 (stage {4 + r})" in out
    assert "F0.0" in out and "bubble ratio:   0.1875" in out  # (p-1)/(v*m) = 3/16
    maxrss_kb = int(out.split("MAXRSS_KB")[1].split()[0])
    assert maxrss_kb < 2_000_000, f"plan used {maxrss_kb / 1e6:.2f} GB: the model was allocated"


def test_meta_model_info_counts_without_storage():
    from lightning_pp.commands._common import meta_model_info
    from lightning_pp.commands.config import load_config

    info = meta_model_info(load_config(REPO / GPU_TEMPLATE))
    assert info.on_meta
    assert info.total_params == 1_074_278_400
    assert info.num_layers == 24 and info.layer_names[0] == "Embedding"
    # tied head weight counted in the head layer too (each holder stores a copy)
    assert sum(info.layer_params) == info.total_params + 50304 * 1920


# ------------------------------------------------------------------------------ fit


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a well-formed PNG's IHDR chunk; fails on anything else."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR", f"{path}: no IHDR chunk first"
    assert data[-8:-4] == b"IEND", f"{path}: truncated (no IEND chunk)"
    return struct.unpack(">II", data[16:24])


# The README's demo at toy size: its shape (pp=2 x dp=2, 4 processes, 1F1B), a tiny model.
TOY = [
    "model.init_args.n_embd=32",
    "model.init_args.n_layer=2",
    "model.init_args.n_head=2",
    "data.init_args.batch_size=8",
    "data.init_args.block_size=32",
    "data.init_args.max_chars=200000",
    "trainer.max_steps=9",
    "trainer.log_every_n_steps=3",
    "trainer.val_check_interval=4",  # validations at 4 and 8; the final one must add step 9
    "trainer.limit_val_batches=2",
]


def _toy_run(tmp: Path) -> list[str]:
    """TOY, with the run's files under ``tmp`` and its losses written to ``tmp/losses.csv``."""
    root = tmp / "run"
    return [
        *TOY,
        f"trainer.default_root_dir={root}",
        f"logger.init_args.save_dir={root}",
        "--losses-out",
        str(tmp / "losses.csv"),
    ]


#: where each background run of this module writes (filled by background_jobs)
_RUN_DIRS: dict[str, Path] = {}


def _demo_single_launcher(tmp: Path) -> str:
    """``lightning-pp fit configs/demo_cpu.yaml`` at toy size under Lightning's own launcher
    (devices=4): its output in ``tmp/log.txt``, its files under ``tmp/run``."""
    log = tmp / "log.txt"
    sample = ["sample.prompt=import", "sample.max_new_tokens=30"]
    cmd = [*CLI, "fit", str(REPO / DEMO), *_toy_run(tmp), *sample]
    assert run_all([cmd], timeout=400, logs=[log], cwd=tmp) == [0], log.read_text()[-4000:]
    return "exit 0"


def _demo_torchrun_two_nodes(tmp: Path) -> str:
    """The same run started by README's ``examples/torchrun_two_nodes.sh loopback CONFIG``:
    two torchrun "nodes" of two processes each on this machine."""
    log = tmp / "log.txt"
    env_path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    cmd = [
        "env", f"PATH={env_path}", f"MASTER_PORT={free_port()}",
        "bash", str(REPO / "examples" / "torchrun_two_nodes.sh"), "loopback",
        str(REPO / DEMO), *_toy_run(tmp), "sample.enabled=false",
    ]  # fmt: skip
    codes = run_all([cmd], timeout=400, logs=[log], cwd=tmp)
    node1 = tmp / "torchrun_node1.log"  # the script's own log of the second "node"
    tails = f"{log.read_text()[-3000:]}\n--- node 1\n" + (
        node1.read_text()[-3000:] if node1.exists() else "(no log)"
    )
    assert codes == [0], tails
    return "exit 0"


_RUNS = {"demo-launcher": _demo_single_launcher, "demo-torchrun": _demo_torchrun_two_nodes}
_RUNS_OF_TEST = {
    "test_demo_at_toy_size_ends_with_validation_summary_and_pngs": ["demo-launcher"],
    "test_sample_merges_both_stages_on_rank_0": ["demo-launcher"],
    "test_torchrun_two_nodes_script_gives_the_single_launchers_losses": [
        "demo-launcher",
        "demo-torchrun",
    ],
}


def background_jobs(items, tmp_path_factory) -> dict:
    """The launched runs this session's selected tests read, started in the background
    (tests/background.py): each test checks its run's verdict, then reads its files."""
    wanted = {run for item in items for run in _RUNS_OF_TEST.get(item.originalname, [])}
    jobs = {}
    for name in sorted(wanted):
        _RUN_DIRS[name] = tmp_path_factory.mktemp(name)
        jobs[name] = functools.partial(_RUNS[name], _RUN_DIRS[name])
    return jobs


def _demo_run(name: str = "demo-launcher") -> SimpleNamespace:
    background.check(name)
    tmp = _RUN_DIRS[name]
    return SimpleNamespace(
        out=(tmp / "log.txt").read_text(), root=tmp / "run", losses=tmp / "losses.csv"
    )


@pytest.mark.timeout(background.WAIT)
def test_demo_at_toy_size_ends_with_validation_summary_and_pngs():
    demo_run = _demo_run()
    out, root = demo_run.out, demo_run.root
    assert "world=4 (num_nodes=1 x devices=4), pp=2" in out

    # Redirected output: plain lines, at most one progress line per logging interval (3 steps)
    assert "\r" not in out, "carriage-return progress frames in a redirected log"
    # (the summary's own "step time ..." line is not a progress line)
    progress = [line for line in out.splitlines() if re.match(r"step \d+/\d+ ", line)]
    assert [line.split()[1] for line in progress] == ["3/9", "6/9", "9/9"], progress
    assert "pipeline bubble" in progress[-1] and "tok/s" in progress[-1]

    # The last step is validated, although val_check_interval does not land on it
    validations = [line for line in out.splitlines() if line.startswith("validation at step")]
    assert [line.split()[3].rstrip(":") for line in validations] == ["4", "8", "9"], validations

    # The summary: printed, and written next to the logs
    assert "lightning-pp: run summary" in out
    jsons = list(root.rglob("summary.json"))
    assert len(jsons) == 1, jsons
    summary = json.loads(jsons[0].read_text())
    assert jsons[0].parent == root / "csv" / "version_0"  # the CSV logger's directory
    assert summary["steps"] == 9
    assert [s for s, _ in summary["train_loss"]] == list(range(1, 10))
    assert summary["val_loss"][-1][0] == 9
    assert summary["tokens"] == 9 * 8 * 32 * 2  # steps x batch x block x dp
    assert summary["schedule"]["name"] == "1f1b" and summary["schedule"]["pp"] == 2
    assert summary["schedule"]["grid"].startswith("rank 0 | F0 F1")
    bubble = summary["bubble"]
    assert bubble["measured_steps"] == 9 and bubble["measured"] > 0 and bubble["expected"] > 0
    assert set(bubble["ranks"]) == {"0", "1", "2", "3"}
    assert all(v["compute_s"] > 0 for v in bubble["ranks"].values())
    memory = {m["rank"]: m for m in summary["memory"]}
    assert set(memory) == {0, 1, 2, 3}
    for m in memory.values():
        assert m["saved_bytes"] > 0
        assert m["inflight"] == m["inflight_bound"] == 2 - m["pp_rank"]  # 1F1B: p - r
    assert summary["sample"]["text"] and "after 9 steps" in summary["sample"]["caption"]
    txt = Path(summary["summary_txt"]).read_text()
    assert "bubble     measured" in txt and "schedule   1f1b" in txt and "sample" in txt

    # Both pictures, well-formed and not trivial
    for key, path in (("loss", summary["loss_curve"]), ("timeline", summary["timeline"]["png"])):
        path = Path(path)
        assert path.is_file(), f"{key}: {path}"
        width, height = png_size(path)
        assert width >= 400 and height >= 200, (key, width, height)
        assert path.stat().st_size > 10_000, f"{key} PNG of {path.stat().st_size} bytes"
    assert str(summary["loss_curve"]) in out and str(summary["timeline"]["png"]) in out


@pytest.mark.timeout(background.WAIT)
def test_sample_merges_both_stages_on_rank_0():
    demo_run = _demo_run()
    # the sample is produced by merging both stages' weights on rank 0
    head = "[lightning-pp] sample (prompt 'import'):\n"
    assert head in demo_run.out, demo_run.out[-3000:]
    text = demo_run.out.split(head)[1][: 6 + 30]
    assert text.startswith("import") and len(text) == 36, repr(text)
    assert all(c in "\t\n" or " " <= c <= "~" for c in text), repr(text)


@pytest.mark.timeout(background.WAIT)
def test_torchrun_two_nodes_script_gives_the_single_launchers_losses():
    """README's ``examples/torchrun_two_nodes.sh loopback CONFIG`` trains the demo to the same
    per-step losses (1e-6) as Lightning's launcher with devices=4."""
    demo_run = _demo_run()
    nodes = _demo_run("demo-torchrun")
    assert "launched by torchrun (WORLD_SIZE=4 LOCAL_WORLD_SIZE=2): devices=2 num_nodes=2" in (
        nodes.out
    )

    ref = read_losses(demo_run.losses)
    got = read_losses(nodes.losses)  # written by global rank 0 only
    assert [s for s, _ in ref] == list(range(1, 10))
    assert [s for s, _ in got] == [s for s, _ in ref]
    for (step, a), (_, b) in zip(ref, got):
        assert abs(a - b) <= 1e-6 * abs(a), f"step {step}: single launcher {a} vs torchrun {b}"
    assert ref[-1][1] < ref[0][1], f"loss did not drop: {ref}"


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_plans(config, capsys, monkeypatch):
    from lightning_pp.commands.cli import main

    # configs/finetune_hf_cpu.yaml names a module of examples/ (run with PYTHONPATH=examples)
    monkeypatch.syspath_prepend(str(REPO / "examples"))

    assert main(["plan", str(REPO / "configs" / config)]) == 0, capsys.readouterr().err
    assert "is valid (nothing was trained or allocated)" in capsys.readouterr().out
