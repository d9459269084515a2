"""A long Trainer + PipelineStrategy job for process-level fault tests (tests/test_fault_jobs.py).

Usage: ``python fault_job.py PP WATCHDOG [sigterm] [sigterm_rank=R] [schedule=NAME]
[fault=ckpt-stop|ckpt-kill]``.
Every rank writes ``ready.<rank>`` (its pid) into ``$FAULT_DIR`` once its second training batch
ended, then trains on (up to 100000 steps) until the test signals one of them. Launched by
Lightning's launcher (``devices=PP``), by torchrun (the world from its environment) or as SLURM
tasks (``SLURM_*`` variables). ``schedule=zbv`` runs ZB-V (two chunks per rank).

With ``sigterm``, global rank 0 (``sigterm_rank=R``: rank R) sends SIGTERM to its own process
at batch 3 (a scheduler's preemption), or every rank does when ``FAULT_ALL_SIGTERM=1`` (SLURM
signals every task).

With ``fault=ckpt-stop`` (``ckpt-kill``) a checkpoint is saved every 3 steps, and in the first
one after ``$FAULT_DIR/go`` exists global rank 0 stops (kills) itself in the middle of the save:
while it writes the metadata, after every rank passed its tensors to DCP, when the others wait
for it in the save's closing collective. It writes ``fault.0`` just before.
"""

from __future__ import annotations

import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from pp_common import MODEL_KW, Data

from lightning_pp.models import GPT
from lightning_pp.strategy.pipeline_strategy import PipelineStrategy


class FaultInSave(Callback):
    """In the first checkpoint saved after the test said ``go``, rank 0 signals itself while it
    writes the checkpoint's metadata (``meta.json``): after every rank passed its tensors to
    DCP, while the others wait for rank 0 in the save's closing collective. (Checkpoints hold no
    pickle, so the fault is a wrapper around rank 0's metadata write, not an object in the
    metadata.)"""

    def __init__(self, out: str, sig: signal.Signals) -> None:
        self.out, self.sig = out, sig

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_rank != 0 or not os.path.exists(os.path.join(self.out, "go")):
            return
        from lightning_pp.checkpoint import dcp_save

        write_meta = dcp_save.write_meta

        def write_meta_then_signal(directory, meta):
            with open(os.path.join(self.out, "fault.0"), "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), self.sig)
            return write_meta(directory, meta)

        dcp_save.write_meta = write_meta_then_signal


class Ready(Callback):
    def __init__(self, out: str, sigterm: bool, sigterm_rank: int = 0) -> None:
        self.out, self.sigterm, self.sigterm_rank = out, sigterm, sigterm_rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rank = trainer.global_rank
        if batch_idx == 1:
            path = os.path.join(self.out, f"ready.{rank}")
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
        everyone = os.environ.get("FAULT_ALL_SIGTERM") == "1"
        if self.sigterm and batch_idx == 3 and (rank == self.sigterm_rank or everyone):
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    pp, watchdog = int(sys.argv[1]), float(sys.argv[2])
    sigterm = "sigterm" in sys.argv[3:]
    options = dict(a.split("=", 1) for a in sys.argv[3:] if "=" in a)
    schedule = options.get("schedule", "1f1b")
    fault = options.get("fault")
    out = os.environ["FAULT_DIR"]
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_NTASKS" in os.environ
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", pp)))
    nodes = int(os.environ.get("FAULT_NODES", "1"))
    vpp = 2 if schedule == "zbv" else 1
    microbatches = 2 * pp if schedule == "zbv" else pp  # ZB-V warns below 2 * pp
    strategy = PipelineStrategy(
        pp=pp, vpp=vpp, microbatches=microbatches, schedule=schedule, watchdog_timeout=watchdog
    )
    callbacks: list[Callback] = [Ready(out, sigterm, int(options.get("sigterm_rank", 0)))]
    if sigterm:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=0))
    if fault is not None:
        sig = {"ckpt-stop": signal.SIGSTOP, "ckpt-kill": signal.SIGKILL}[fault]
        ckpt = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=3)
        callbacks += [ckpt, FaultInSave(out, sig)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world // nodes if launched else pp,
        num_nodes=nodes,
        strategy=strategy,
        max_steps=100000,
        max_epochs=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=sigterm or fault is not None,
        default_root_dir=out,
        callbacks=callbacks,
    )
    trainer.fit(GPT(**MODEL_KW), Data(dp=world // pp, accumulate=1, train_samples=8 * 4000))
    print(f"RANK-END {trainer.global_rank} finished", flush=True)


if __name__ == "__main__":
    main()
