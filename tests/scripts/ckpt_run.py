"""Checkpoint test phases: train / save / resume the tiny GPT; write per-rank JSON.

Launched by tests/test_checkpoint.py once per process group, one rank per process (the test
starts the processes itself with LOCAL_RANK/RANK/WORLD_SIZE set, so it can kill the whole group
the moment one rank dies)::

    LOCAL_RANK=r WORLD_SIZE=4 ... python tests/scripts/ckpt_run.py --out DIR --phases '[...]'

A phase: {"name", "pp", "vpp", "microbatches", "max_steps", "every" (save every N steps into
"ckpt_dir"), "resume" (ckpt_path for fit), "best_dir" (ModelCheckpoint on val_loss, top-1),
"fail_rank"/"fail_save" (that rank dies inside its Nth checkpoint data write), "async" (save in
the background: ``PipelineStrategy(async_checkpoint=True)``), "zero" (the distributed
optimizer), "fsdp" (FSDP2 per chunk), "tp" (tensor parallel), "model" (pp_common.MODELS)}.
``"pp": 0`` runs the plain single-process Trainer (no strategy); with ``"pipeline_io": true``
it gets ``plugins=[PipelineCheckpointIO()]`` (resume from a pipeline checkpoint directory).
Output: DIR/<name>.rank<r>.json.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from pp_common import GLOBAL_BATCH, Data, Recorder, configs_main, dump, make_model  # noqa: E402

from lightning_pp import PipelineStrategy  # noqa: E402

EPOCH_BATCHES = 5  # checkpoints at step 5 fall on an epoch boundary: plain loaders resume exactly


class EpochData(Data):
    """Same global batches for any dp; 5 batches per epoch, no shuffling."""

    def __init__(self, dp: int) -> None:
        super().__init__(dp, accumulate=1, train_samples=GLOBAL_BATCH * EPOCH_BATCHES)


class LRProbe(Callback):
    def __init__(self) -> None:
        self.lr: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lr.append(trainer.optimizers[0].param_groups[0]["lr"])


def _inject_failure(rank: int, fail_rank: int, fail_save: int) -> None:
    """Make ``fail_rank`` die (os._exit) inside its ``fail_save``-th DCP data write, after
    writing half of its file: the other ranks' data may be complete, the marker is not."""
    real = dcp.FileSystemWriter.write_data
    count = {"n": 0}

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        if rank == fail_rank:
            count["n"] += 1
            if count["n"] == fail_save:
                with open(os.path.join(str(self.path), f"__{rank}_0.distcp"), "wb") as f:
                    f.write(b"half a file")
                    f.flush()
                os._exit(17)
        return real(self, plan, planner)

    dcp.FileSystemWriter.write_data = write_data


class ReadCounter:
    """Elements each checkpoint tensor had read from the files by this rank's loads (DCP's read
    items of the reader every DCP load goes through), by DCP key: what a sharded load asks
    for, measured where the reading happens."""

    def __init__(self) -> None:
        from lightning_pp.checkpoint.dcp_safe import SafeFileSystemReader

        self.elements: dict[str, int] = {}
        self._cls, self._read = SafeFileSystemReader, SafeFileSystemReader.read_data
        counter = self

        def read_data(reader: Any, plan: Any, planner: Any) -> Any:
            for item in plan.items:
                key = item.storage_index.fqn
                n = 1
                for size in item.lengths:
                    n *= int(size)
                counter.elements[key] = counter.elements.get(key, 0) + n
            return counter._read(reader, plan, planner)

        SafeFileSystemReader.read_data = read_data  # type: ignore[method-assign]

    def close(self) -> None:
        self._cls.read_data = self._read  # type: ignore[method-assign]


def _pipeline_io() -> Any:
    from lightning_pp import PipelineCheckpointIO

    return PipelineCheckpointIO()


def run_phase(spec: dict, out: str, devices: int) -> dict:
    plain = spec["pp"] == 0
    world = 1 if plain else int(os.environ.get("WORLD_SIZE", devices))
    if plain:
        strategy: Any = "auto"
        dp = 1
    else:
        strategy = PipelineStrategy(
            pp=spec["pp"],
            vpp=spec.get("vpp"),  # unset: the schedule's own (zbv: 2)
            microbatches=spec.get("microbatches"),
            schedule=spec.get("schedule"),
            timeout=timedelta(seconds=90),
            async_checkpoint=bool(spec.get("async")),
            zero=spec.get("zero", 0),
            fsdp=spec.get("fsdp", False),
            tp=spec.get("tp", 1),
        )
        dp = world // (spec["pp"] * spec.get("tp", 1))
    rec, lrs = Recorder(), LRProbe()
    callbacks: list[Callback] = [rec, lrs]
    every = None
    if spec.get("every"):
        every = ModelCheckpoint(
            dirpath=spec["ckpt_dir"],
            filename="{step}",
            every_n_train_steps=spec["every"],
            save_top_k=-1,
        )
        callbacks.append(every)
    best = None
    if spec.get("best_dir"):
        best = ModelCheckpoint(
            dirpath=spec["best_dir"], monitor="val_loss", mode="min", save_top_k=1
        )
        callbacks.append(best)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1 if plain else devices,
        strategy=strategy,
        max_steps=spec.get("max_steps", 10),
        gradient_clip_val=0.5,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=[_pipeline_io()] if spec.get("pipeline_io") else None,
        enable_checkpointing=bool(every or best),
        default_root_dir=out,
    )
    if "fail_save" in spec:
        _inject_failure(trainer.global_rank, spec["fail_rank"], spec["fail_save"])
    model = make_model(spec.get("model", "gpt"))
    reads = ReadCounter() if spec.get("resume") else None
    try:
        trainer.fit(model, EpochData(dp), ckpt_path=spec.get("resume"))
    finally:
        if reads is not None:
            reads.close()
    result = {
        "rank": trainer.global_rank,
        "train_loss": rec.train_loss,
        "lr": lrs.lr,
        "val": rec.val,
        "global_step": trainer.global_step,
        "best": best.best_model_path if best else None,
        "best_k": sorted(best.best_k_models) if best else None,
        "read_elements": reads.elements if reads is not None else None,
    }
    dump(os.path.join(out, f"{spec['name']}.rank{trainer.global_rank}.json"), result)
    if not plain:
        trainer.strategy.barrier()  # the next phase reuses nothing, but keep ranks in step
    return result


def _run_phase(spec: dict, devices: int, out: str) -> None:
    run_phase(spec, out, devices)


def main() -> None:
    configs_main(_run_phase, key="phases")


if __name__ == "__main__":
    main()
