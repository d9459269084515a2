"""Train the tied GPT under PipelineStrategy(pp=2, recompute=...) for several schedules and
recompute specs in one process group; write per-rank JSON. Launched by
``tests/test_recompute_trainer.py`` under torchrun::

    torchrun --nproc_per_node 2 tests/scripts/recompute_run.py --out DIR --configs '[{...}]'

Each config: {"name", "schedule", "vpp", "recompute"}; ``recompute="auto"`` first runs one
probing step with an unlimited budget, then trains with a budget halfway between the largest
"least possible" and the largest "no recompute" peak over the ranks, so some rank must recompute.
Output: DIR/<name>.rank<r>.json with the losses, the budget, the plan's layers for this rank, and
per step the ActivationMemoryMonitor's recompute stats of every rank.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from pp_common import MODEL_KW, Data, Recorder, configs_main, dump, make_trainer  # noqa: E402

from lightning_pp import PipelineStrategy  # noqa: E402
from lightning_pp.callbacks import ActivationMemoryMonitor  # noqa: E402
from lightning_pp.models import GPT  # noqa: E402

PP, MICROBATCHES = 2, 4


class RecomputeRecorder(Callback):
    """After the monitor (list it after): every measured step's recompute stats, all ranks."""

    def __init__(self, monitor: ActivationMemoryMonitor) -> None:
        self.monitor = monitor
        self.steps: list[list[dict]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(
            [
                dict(vars(r), layers=list(r.layers), ratio=r.ratio)
                for r in self.monitor.last_recompute
            ]
        )


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _strategy(cfg: dict, **kw) -> PipelineStrategy:
    return PipelineStrategy(
        pp=PP, vpp=cfg["vpp"], microbatches=MICROBATCHES, schedule=cfg["schedule"], **kw
    )


def probe_budget(cfg: dict, devices: int) -> int:
    """One step with an unlimited budget: every rank's plan knows its peak without recompute
    and its least possible peak; the budget lies halfway between the largest of each."""
    strategy = _strategy(cfg, recompute="auto", activation_budget=10**15)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=1,
        limit_val_batches=0,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(GPT(**MODEL_KW), Data(dp=1, accumulate=1))
    plan = strategy.recompute_plan
    least = max(r.min_peak for r in plan.ranks)
    most = max(r.none_peak for r in plan.ranks)
    if not least < most:
        raise RuntimeError(f"no budget forces recompute: least {least}, no recompute {most}")
    strategy.barrier()
    return (least + most) // 2


def run(cfg: dict, devices: int, out: str) -> None:
    name = cfg["name"]
    budget = probe_budget(cfg, devices) if cfg["recompute"] == "auto" else None
    strategy = _strategy(cfg, recompute=cfg["recompute"], activation_budget=budget)
    monitor = ActivationMemoryMonitor(every_n_steps=1)
    rec, recompute = Recorder(), RecomputeRecorder(monitor)
    lines = Lines()
    logging.getLogger("lightning_pp").addHandler(lines)
    logging.getLogger("lightning_pp").setLevel(logging.INFO)
    trainer = make_trainer(
        strategy, devices, 1, os.path.join(out, f"ckpt_{name}"), [monitor, recompute, rec]
    )
    try:
        trainer.fit(GPT(**MODEL_KW), Data(dp=1, accumulate=1))
    finally:
        logging.getLogger("lightning_pp").removeHandler(lines)
    rank = trainer.global_rank
    plan = strategy.recompute_plan
    dump(
        os.path.join(out, f"{name}.rank{rank}.json"),
        {
            "rank": rank,
            "train_loss": rec.train_loss,
            "budget": budget,
            "plan_layers": None if plan is None else plan.mine(rank).layers,
            "recompute_steps": recompute.steps,
            "metric_keys": sorted(k for k in trainer.callback_metrics if k.startswith("pp/")),
            "recompute_log": [ln for ln in lines.lines if ln.startswith("recomputed layers")],
        },
    )
    strategy.barrier()  # every rank wrote before the next configuration reuses the group


def main() -> None:
    configs_main(run)


if __name__ == "__main__":
    main()
