"""``lightning-pp fit`` / ``plan`` end to end: real processes, real Trainer, real gloo groups.

* plan prints the partition and schedule for the demo and the 1B GPU template, and builds the
  1B model without allocating it (meta device; the process's peak RSS stays far below 4 GB);
* the same run started by Lightning's own launcher (devices=4) and by two torchrun "nodes" of two
  processes on loopback writes the same per-step losses.

Every subprocess tree is killed on timeout (``jobs.kill_job``: torchrun puts its workers in their
own sessions, so it kills the leader's descendants found in /proc as well as its process group).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import free_port, kill_job, start_job

REPO = Path(__file__).resolve().parents[1]
DEMO = "configs/demo_cpu.yaml"
GPU_TEMPLATE = "configs/gpt_1b_pp4_vpp2.yaml"

# A small, quick version of the demo: same shape (pp=2 x dp=2, 4 processes), tiny model.
TINY = [
    "model.init_args.n_embd=32",
    "model.init_args.n_layer=2",
    "model.init_args.n_head=2",
    "data.init_args.batch_size=8",
    "data.init_args.block_size=32",
    "data.init_args.max_chars=200000",
    "trainer.max_steps=6",
    "trainer.limit_val_batches=0",
    "trainer.enable_progress_bar=false",
    "logger=false",
]


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


def run_all(cmds: list[list[str]], timeout: float, logs: list[Path]) -> list[int]:
    """Run commands concurrently; on timeout kill every process tree and fail with the logs."""
    procs = []
    for cmd, log in zip(cmds, logs):
        with open(log, "w") as out:
            procs.append(start_job(cmd, cwd=REPO, env=_env(), stdout=out))
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


@pytest.mark.timeout(600)
def test_fit_single_launcher_and_torchrun_two_nodes_give_same_losses(tmp_path):
    single_csv = tmp_path / "single.csv"
    single_log = tmp_path / "single.log"
    sample = ["sample.enabled=true", "sample.max_new_tokens=24", "sample.prompt=import"]
    cmd = [*CLI, "fit", DEMO, *TINY, *sample, "--losses-out", str(single_csv)]
    assert run_all([cmd], timeout=240, logs=[single_log]) == [0], single_log.read_text()[-3000:]
    single_out = single_log.read_text()
    assert "world=4 (num_nodes=1 x devices=4), pp=2" in single_out
    # the sample is produced by merging both stages' weights on rank 0
    assert "[lightning-pp] sample (prompt 'import'):" in single_out
    text = single_out.split("[lightning-pp] sample (prompt 'import'):\n")[1][: 6 + 24]
    assert text.startswith("import") and len(text) == 30, repr(text)
    assert all(c in "\t\n" or " " <= c <= "~" for c in text), repr(text)

    port = free_port()
    cmds, logs = [], []
    for node_rank in (0, 1):
        cmds.append(
            [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--node_rank", str(node_rank), "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(port),
                "-m", "lightning_pp", "fit", DEMO, *TINY,
                "sample.enabled=false", "--losses-out", str(tmp_path / f"node{node_rank}.csv"),
            ]
        )  # fmt: skip
        logs.append(tmp_path / f"node{node_rank}.log")
    codes = run_all(cmds, timeout=240, logs=logs)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    node0 = logs[0].read_text()
    assert "launched by torchrun (WORLD_SIZE=4 LOCAL_WORLD_SIZE=2): devices=2 num_nodes=2" in node0
    assert not (tmp_path / "node1.csv").exists()  # only global rank 0 writes

    ref = read_losses(single_csv)
    got = read_losses(tmp_path / "node0.csv")
    assert [s for s, _ in ref] == list(range(1, 7))
    assert [s for s, _ in got] == [s for s, _ in ref]
    for (step, a), (_, b) in zip(ref, got):
        assert abs(a - b) <= 1e-6 * abs(a), f"step {step}: single launcher {a} vs torchrun {b}"
    assert ref[-1][1] < ref[0][1], f"loss did not drop: {ref}"
    json.dumps(ref)  # plain numbers


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_plans(config, capsys, monkeypatch):
    from lightning_pp.commands.cli import main

    # configs/finetune_hf_cpu.yaml names a module of examples/ (run with PYTHONPATH=examples)
    monkeypatch.syspath_prepend(str(REPO / "examples"))

    assert main(["plan", str(REPO / "configs" / config)]) == 0, capsys.readouterr().err
    assert "is valid (nothing was trained or allocated)" in capsys.readouterr().out
