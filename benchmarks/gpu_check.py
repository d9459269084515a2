"""The checks to run the moment a GPU is lent (within 10 minutes), as one prepared script.

Every step runs in its own subprocess with a time limit; the script prints ONE table (step,
verdict, seconds, figures) and exits non-zero if any step that ran failed or mismatched.

On one GPU:
  memory      PipelineStrategy(pp=1, vpp=2) (in-process hand-over) with bf16-mixed on CUDA and
              the ActivationMemoryMonitor: cuda_max_allocated reported, loss finite and falling
  overhead    benchmarks/bench_strategy.py --device cuda --quick: transformer (GPT) at pp=1
              against a plain Trainer
  vdev-pp1    benchmarks/bench_pipeline.py --workload sleep --pp 1 --device cuda: the virtual
              device at pp=1 (ours and torch's single-stage schedule)
  split-cost  benchmarks/split_backward_cost.py --device cuda: (t_i + t_w) / t_b of a split
              backward (ours, torch's) against a fused one, GPT blocks at dim 1024
On two or more GPUs:
  nccl-grid   the equivalence grid of tests/test_nccl_emulation.py on REAL NCCL (pp=2, and pp=4
              with 4 GPUs), every case within 1e-6 of unpipelined training
  bench       benchmarks/run_all.py --quick --device cuda: ours against torch's schedules
  torchrun    examples/two_nodes_loopback.sh: two torchrun "nodes" on this machine, NCCL

Usage:
    python benchmarks/gpu_check.py             # everything the visible GPUs allow
    python benchmarks/gpu_check.py --dry-run   # list every step and command (CPU, no GPU)
    python benchmarks/gpu_check.py --only memory nccl-grid
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@dataclass(frozen=True)
class Step:
    name: str
    gpus: int  # GPUs it needs
    argv: tuple[str, ...]
    timeout: float
    what: str


def _self(step: str) -> tuple[str, ...]:
    return (sys.executable, os.path.join("benchmarks", "gpu_check.py"), "--step", step)


STEPS = [
    Step("memory", 1, _self("memory"), 150, "pp=1 vpp=2 bf16-mixed on CUDA, cuda_max_allocated"),
    Step(
        "overhead",
        1,
        (sys.executable, "benchmarks/bench_strategy.py", "--device", "cuda", "--quick"),
        150,
        "transformer at pp=1 vs a plain Trainer",
    ),
    Step(
        "vdev-pp1",
        1,
        (
            *(sys.executable, "benchmarks/bench_pipeline.py", "--workload", "sleep", "--pp", "1"),
            *("--microbatches", "4", "--rounds", "1", "--steps", "2", "--device", "cuda"),
            *("--out", "/tmp/lpp_gpu_check_vdev.jsonl"),
        ),
        120,
        "virtual device at pp=1",
    ),
    Step(
        "split-cost",
        1,
        (
            *(sys.executable, "benchmarks/split_backward_cost.py", "--device", "cuda"),
            *("--iters", "60", "--dim", "1024", "--heads", "16", "--seq", "512", "--mb", "4"),
        ),
        120,
        "split backward (I + W) against a fused B, 2 GPT blocks on the GPU (issue 14: <= 1.10)",
    ),
    Step("nccl-grid", 2, _self("nccl-grid"), 180, "equivalence grid on real NCCL"),
    Step(
        "bench",
        2,
        (
            *(sys.executable, "benchmarks/run_all.py", "--out", "/tmp/lpp_gpu_check_bench"),
            *("--quick", "--device", "cuda", "--workloads", "sleep", "transformer", "--pp", "2"),
        ),
        240,
        "--device cuda benchmarks against torch's schedules",
    ),
    Step(
        "torchrun",
        2,
        (
            *("bash", "examples/two_nodes_loopback.sh", "--pp", "2", "--steps", "10"),
            *("--accelerator", "gpu"),
        ),
        150,
        "2-node-style torchrun (loopback), NCCL",
    ),
]


def _result(payload: dict) -> None:
    print("RESULT " + json.dumps(payload), flush=True)


# ---- in-process steps -----------------------------------------------------------------------
def step_memory() -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_pp import PipelineStrategy
    from lightning_pp.callbacks import ActivationMemoryMonitor
    from lightning_pp.models.gpt import GPT

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from train_gpt import Progressions

    torch.manual_seed(0)
    model = GPT(vocab_size=64, n_layer=4, n_head=4, n_embd=64, block_size=32, max_steps=12)
    trainer = L.Trainer(
        # GPU_CHECK_ACCELERATOR=cpu runs the same code path without a GPU (its own test)
        accelerator=os.environ.get("GPU_CHECK_ACCELERATOR", "gpu"),
        devices=1,
        strategy=PipelineStrategy(pp=1, vpp=2, microbatches=4, schedule="gpipe"),
        precision="bf16-mixed",
        max_steps=12,
        callbacks=[ActivationMemoryMonitor()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        log_every_n_steps=1,
    )
    trainer.fit(model, DataLoader(Progressions(512, 64, 32, seed=1), batch_size=16))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    cuda = [v for k, v in metrics.items() if "cuda_max_allocated" in k]
    loss = metrics.get("train_loss", float("nan"))
    on_cuda = os.environ.get("GPU_CHECK_ACCELERATOR", "gpu") == "gpu"
    ok = (bool(cuda) or not on_cuda) and all(v > 0 for v in cuda) and math.isfinite(loss)
    _result({"ok": ok, "cuda_max_allocated_MiB": [round(v / 2**20, 1) for v in cuda],
             "train_loss": round(loss, 4)})  # fmt: skip


def _nccl_grid_worker(rank: int, world_size: int, cases: list) -> dict:
    import torch

    torch.cuda.set_device(rank)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_nccl_emulation as grid

    out = {}
    for index, case in enumerate(cases):
        try:
            out[case["id"]] = grid._run_case(rank, dict(case, device=f"cuda:{rank}"), index)
        except Exception as e:
            out[case["id"]] = {"error": f"{type(e).__name__}: {e}"}
    return out


def step_nccl_grid() -> None:
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_nccl_emulation as grid
    from distributed import run_distributed

    world = 4 if torch.cuda.device_count() >= 4 else 2
    cases = [c for c in grid.GRID if world % c["pp"] == 0]
    results = run_distributed(_nccl_grid_worker, world, cases, timeout=170, backend="nccl")
    failed = []
    for case in cases:
        for rank, res in enumerate(results):
            problem = grid.case_problem(res[case["id"]])
            if problem:
                failed.append(f"{case['id']} rank {rank}: {problem}")
    _result({"ok": not failed, "world": world, "cases": len(cases), "failed": failed[:5]})


IN_PROCESS = {"memory": step_memory, "nccl-grid": step_nccl_grid}


# ---- the driver -----------------------------------------------------------------------------
def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _run(step: Step) -> tuple[str, float, str]:
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(
            step.argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=step.timeout
        )
    except subprocess.TimeoutExpired:
        return "TIMEOUT", time.monotonic() - t0, f"no result within {step.timeout:.0f} s"
    seconds = time.monotonic() - t0
    text = proc.stdout + proc.stderr
    result = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0:
        tail = " | ".join(text.strip().splitlines()[-3:])
        return "FAIL", seconds, f"exit {proc.returncode}: {tail[-300:]}"
    if result:
        payload = json.loads(result[-1])
        verdict = "ok" if payload.pop("ok", True) else "MISMATCH"
        return verdict, seconds, json.dumps(payload)[:300]
    last = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [""]
    return "ok", seconds, last[0][:300]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="list the steps, run nothing")
    ap.add_argument("--only", nargs="+", choices=[s.name for s in STEPS], default=None)
    ap.add_argument("--step", choices=sorted(IN_PROCESS), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.step:
        IN_PROCESS[a.step]()
        # The result is printed; do not let a slow teardown (worker threads, process groups)
        # turn a finished check into a timeout.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    gpus = 0 if a.dry_run else _gpus()
    steps = [s for s in STEPS if a.only is None or s.name in a.only]
    rows = []
    failed = False
    for step in steps:
        if a.dry_run:
            rows.append((step.name, "dry-run", 0.0, f"[{step.gpus}+ GPU] " + " ".join(step.argv)))
            continue
        if gpus < step.gpus:
            rows.append((step.name, "skipped", 0.0, f"needs {step.gpus} GPU(s), {gpus} visible"))
            continue
        verdict, seconds, figures = _run(step)
        failed |= verdict != "ok"
        rows.append((step.name, verdict, seconds, figures))
        print(f"{step.name}: {verdict} ({seconds:.0f} s)", file=sys.stderr, flush=True)
    print(f"gpu_check: {gpus} GPU(s) visible" + (" (dry run)" if a.dry_run else ""))
    print("| step | verdict | s | figures / command |\n| --- | --- | --- | --- |")
    for name, verdict, seconds, figures in rows:
        print(f"| {name} | {verdict} | {seconds:.0f} | {figures} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
