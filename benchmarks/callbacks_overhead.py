"""What the pipeline callbacks cost per training step.

Runs the same short ``Trainer.fit`` (PipelineStrategy, pp=4, sleep-layer "virtual devices") twice,
without and with all three callbacks measuring EVERY step (the worst case: by default they
measure every ``log_every_n_steps``), and compares the median step time (batch start to next
batch start, so the callbacks' own hooks are inside). Usage::

    python benchmarks/callbacks_overhead.py [--steps 30] [--t-f 0.01] [--t-b 0.02]

Prints one JSON line per run and the relative overhead. Each run is a subprocess (Lightning's
launcher re-executes it per rank) with a timeout that kills its process tree.

Figure measured on the 2-core shared CPU box (load average ~5-7 from other jobs), pp=4, m=8,
t_f=10 ms / t_b=20 ms per stage, ``--steps 15 --repeats 1``: median step 383 ms without, 456 ms
with all three callbacks measuring every step (+19 %, ~73 ms per measured step: barrier +
all-gather of 4 records, simulator run, saved-tensor hooks, ~40 ``pl_module.log`` calls). At
the default cadence (every ``log_every_n_steps`` = 50 steps) that is ~0.4 % amortized.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PP, M, MB_SIZE, WIDTH = 4, 8, 2, 16


def run_one(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp import PipelineLayers, PipelineMixin, PipelineStrategy
    from lightning_pp.callbacks import (
        ActivationMemoryMonitor,
        PipelineBubbleMonitor,
        PipelineTimeline,
    )
    from lightning_pp.models.virtual_device import sleep_layers

    torch.set_num_threads(1)

    class SleepNet(PipelineMixin, L.LightningModule):
        def configure_model(self) -> None:
            if getattr(self, "layers", None) is None:
                self.layers = PipelineLayers(
                    sleep_layers(2 * PP, WIDTH, args.t_f / 2, args.t_b / 2), seed=0
                )

        def pipeline_input(self, batch):
            return batch[0]

        def pipeline_loss(self, output, batch):
            return F.mse_loss(output, batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *a) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, *a) -> None:
            self.starts.append(time.perf_counter())

    timer = StepTimer()
    callbacks: list[Callback] = [timer]
    if args.callbacks:
        callbacks += [
            PipelineBubbleMonitor(every_n_steps=1),
            ActivationMemoryMonitor(every_n_steps=1),
            PipelineTimeline(every_n_steps=args.steps, dirpath=args.out / "timeline"),
        ]
    g = torch.Generator().manual_seed(0)
    n = M * MB_SIZE * args.steps
    data = TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=PP,
        strategy=PipelineStrategy(pp=PP, microbatches=M),
        max_steps=args.steps,
        logger=False,
        callbacks=callbacks,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(SleepNet(), DataLoader(data, batch_size=M * MB_SIZE))
    if trainer.is_global_zero:
        steps = [b - a for a, b in zip(timer.starts, timer.starts[1:])][2:]  # skip warm-up
        (args.out / "result.json").write_text(json.dumps({"steps": steps}))


def launch(callbacks: bool, args: argparse.Namespace) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--out",
            tmp,
            "--steps",
            str(args.steps),
            "--t-f",
            str(args.t_f),
            "--t-b",
            str(args.t_b),
        ]
        if callbacks:
            cmd.append("--callbacks")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(
            cmd,
            env=env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            log, _ = proc.communicate(timeout=args.timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.returncode != 0:
            raise SystemExit(f"run failed (callbacks={callbacks}):\n{log[-4000:]}")
        return json.loads((Path(tmp) / "result.json").read_text())["steps"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--t-f", type=float, default=0.010, help="forward seconds per stage")
    p.add_argument("--t-b", type=float, default=0.020, help="backward seconds per stage")
    p.add_argument("--repeats", type=int, default=2, help="off/on pairs, interleaved")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--callbacks", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        run_one(args)
        return
    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):  # interleave so machine load drifts hit both alike
        for on in (False, True):
            runs[on] += launch(on, args)
    off, on = statistics.median(runs[False]), statistics.median(runs[True])
    for name, steps in (("without callbacks", runs[False]), ("with callbacks", runs[True])):
        print(
            json.dumps(
                {
                    "run": name,
                    "steps": len(steps),
                    "median_step_s": round(statistics.median(steps), 5),
                    "mean_step_s": round(statistics.fmean(steps), 5),
                }
            )
        )
    print(
        f"overhead: {100 * (on - off) / off:+.2f} % of a {off * 1e3:.1f} ms step "
        f"(median; all three callbacks measuring every step)"
    )


if __name__ == "__main__":
    main()
