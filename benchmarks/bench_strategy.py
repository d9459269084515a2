"""The strategy's own overhead: ``PipelineStrategy(pp=1)`` vs a plain Lightning ``Trainer``.

Same GPT (lightning_pp.models.GPT), same data, same optimizer, one process, one device. Each
run is a fresh subprocess (no state shared between the two), the two kinds alternate
(plain, pipeline, plain, pipeline, ...) so machine noise hits both alike, and each run's step
time is the median of ``on_train_batch_start -> on_train_batch_end`` over its steps after
warmup (forward, backward and optimizer step: everything a user pays per step).

Usage:
    python benchmarks/bench_strategy.py --out benchmarks/results/strategy_overhead.md [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(kind: str, steps: int, warmup: int, microbatches: int, device: str, size: str) -> dict:
    """Train ``warmup + steps`` steps in this process; return the per-step times."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp.models.gpt import GPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dims = {"small": (4, 4, 64, 64, 16), "tiny": (2, 2, 32, 32, 8)}[size]
    n_layer, n_head, n_embd, block, batch = dims
    n = (steps + warmup) * batch
    tokens = torch.randint(0, 256, (n, block + 1))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = DataLoader(data, batch_size=batch, shuffle=False)
    times: list[float] = []
    losses: list[float] = []

    class StepTimer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if device == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None:
                losses.append(float(loss))

    model = GPT(
        vocab_size=256,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        block_size=block,
        max_steps=steps + warmup,
    )
    kwargs: dict = {}
    if kind == "pipeline":
        from lightning_pp import PipelineStrategy

        kwargs["strategy"] = PipelineStrategy(pp=1, microbatches=microbatches)
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        max_steps=steps + warmup,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepTimer()],
        use_distributed_sampler=False,
        **kwargs,
    )
    trainer.fit(model, loader)
    measured = times[warmup:]
    return {
        "kind": kind,
        "step_s": measured,
        "median_s": statistics.median(measured),
        # 10th percentile: interference from other processes only ever adds time, so the low
        # tail estimates the intrinsic cost on a shared machine
        "p10_s": statistics.quantiles(measured, n=10)[0] if len(measured) > 1 else measured[0],
        "final_loss": losses[-1] if losses else None,
    }


def run(
    rounds: int, steps: int, warmup: int, microbatches: int, device: str, size: str, timeout=600
) -> list[dict]:
    results = []
    for rnd in range(rounds):
        kinds = ("plain", "pipeline") if rnd % 2 == 0 else ("pipeline", "plain")
        for kind in kinds:
            cmd = [
                sys.executable, os.path.abspath(__file__), "--child", kind, "--steps", str(steps),
                "--warmup", str(warmup), "--microbatches", str(microbatches), "--device", device,
                "--size", size,
            ]  # fmt: skip
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            if proc.returncode != 0:
                raise RuntimeError(f"{kind} run {rnd} failed:\n{proc.stderr[-3000:]}")
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
            results.append(json.loads(line[len("RESULT ") :]))
    return results


def to_markdown(results: list[dict], meta: dict) -> str:
    plain = [r["median_s"] for r in results if r["kind"] == "plain"]
    pipe = [r["median_s"] for r in results if r["kind"] == "pipeline"]
    plain10 = [r["p10_s"] for r in results if r["kind"] == "plain"]
    pipe10 = [r["p10_s"] for r in results if r["kind"] == "pipeline"]
    mp, mq = statistics.median(plain), statistics.median(pipe)
    overhead = mq / mp - 1
    overhead10 = statistics.median(pipe10) / statistics.median(plain10) - 1
    verdict = "PASS" if overhead <= 0.05 else "MISS"
    lines = [
        "## Strategy overhead: PipelineStrategy(pp=1) vs plain Trainer\n",
        f"- model: GPT size={meta['size']}, microbatches={meta['microbatches']}, "
        f"{meta['steps']} measured steps per run after {meta['warmup']} warmup, "
        f"{meta['rounds']} alternating rounds (fresh process per run)",
        f"- machine: {meta['machine'].get('nproc')} x {meta['machine'].get('cpu')}, torch "
        f"{meta['machine'].get('torch')}, lightning {meta['machine'].get('lightning')}, "
        f"date {meta['machine'].get('date')}, load {meta['machine'].get('loadavg')}",
        f"- command: `{meta['command']}`\n",
        "| run | plain Trainer ms (median / p10) | PipelineStrategy(pp=1) ms (median / p10) |",
        "|---|---|---|",
    ]
    for i in range(min(len(plain), len(pipe))):
        lines.append(
            f"| {i} | {plain[i] * 1e3:.2f} / {plain10[i] * 1e3:.2f} | "
            f"{pipe[i] * 1e3:.2f} / {pipe10[i] * 1e3:.2f} |"
        )
    lines.append(
        f"| **median over runs** | **{mp * 1e3:.2f}** / {statistics.median(plain10) * 1e3:.2f} | "
        f"**{mq * 1e3:.2f}** / {statistics.median(pipe10) * 1e3:.2f} |\n"
    )
    fl = {r["kind"]: r.get("final_loss") for r in results}
    lines.append(
        f"Final training loss after {meta['steps'] + meta['warmup']} steps (same data, same "
        f"init): plain {fl.get('plain')}, pipeline {fl.get('pipeline')}.\n"
    )
    lines.append(
        f"Target 5 (pp=1 overhead <= 5 %): overhead of the medians = {overhead * 100:+.1f} % -> "
        f"**{verdict}** (overhead of the 10th percentiles: {overhead10 * 100:+.1f} %)\n"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--child", choices=["plain", "pipeline"], help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="markdown file to write")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--size", choices=["small", "tiny"], default=None)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a = ap.parse_args(argv)
    size = a.size or ("tiny" if a.quick else "small")
    steps = a.steps or (10 if a.quick else 60)
    rounds = a.rounds or (2 if a.quick else 6)
    if a.child:
        res = _child(a.child, steps, a.warmup, a.microbatches, a.device, size)
        print("RESULT " + json.dumps(res), flush=True)
        return
    from benchmarks.harness import machine_info

    meta = {
        "size": size, "microbatches": a.microbatches, "steps": steps, "warmup": a.warmup,
        "rounds": rounds, "machine": machine_info(),
        "command": " ".join(["python", "benchmarks/bench_strategy.py"] + (argv or sys.argv[1:])),
    }  # fmt: skip
    results = run(rounds, steps, a.warmup, a.microbatches, a.device, size)
    md = to_markdown(results, meta)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f)
    print(md)


if __name__ == "__main__":
    main()
