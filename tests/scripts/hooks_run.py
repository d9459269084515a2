"""What a Lightning user does with their own module, under PipelineStrategy(pp=2) on 2 processes.

Run by tests/test_lightning_hooks.py in a 2-rank Trainer world of its own (tests/worlds.py:
``main()`` on each rank, as torchrun would run it); by hand, ``python tests/scripts/hooks_run.py
--out DIR`` (``Trainer(devices=2)`` re-runs it for rank 1, Lightning's launcher). One process
group serves every scenario, in order, each writing ``DIR/<scenario>.rank<r>.json``:

``fit_validate``: a module that logs from ``pipeline_eval_step`` (with and without
``sync_dist``, ``log_dict``), overrides ``validation_step`` (never called under the strategy) and
builds its layers in ``configure_model`` without an "already built" guard. It trains 4 steps
(validating at the end), then ``trainer.validate()`` runs on the same trainer. Recorded: the
logged values on every rank, the warnings, the model summary rank 0 printed.

``train_log``: a module that calls ``self.log`` inside ``pipeline_loss`` during training (which
runs on the last stage only): the error each rank ends with.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelSummary  # noqa: E402
from lightning.pytorch.utilities.model_summary import get_human_readable_count  # noqa: E402
from pp_common import MODEL_KW, Data, dump  # noqa: E402

from lightning_pp import PipelineStrategy  # noqa: E402
from lightning_pp.models import GPT  # noqa: E402

STEPS = 4


class EvalLoggingGPT(GPT):
    """The GPT, as a user might extend it (see the module docstring)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.user_validation_steps = 0

    def configure_model(self) -> None:  # no "already built" guard: rebuilds on every call
        self.layers = None
        super().configure_model()

    def validation_step(self, batch, batch_idx):  # not called under the strategy
        self.user_validation_steps += 1
        return super().validation_step(batch, batch_idx)

    def pipeline_eval_step(self, output, batch, split):
        values = super().pipeline_eval_step(output, batch, split)
        loss = values[f"{split}_loss"]
        self.log(f"{split}_plain", loss * 2)  # without sync_dist
        self.log(f"{split}_synced", loss * 3, sync_dist=True)
        # one per batch, summed: syncing over the pipeline ranks too would count each twice
        self.log(f"{split}_batches", 1.0, sync_dist=True, reduce_fx="sum")
        self.log_dict({f"{split}_acc_copy": values[f"{split}_acc"]})
        return values


class TrainLoggingGPT(GPT):
    def pipeline_loss(self, output, batch):
        loss = super().pipeline_loss(output, batch)
        self.log("train_ppl", loss.exp())  # runs on the last stage only, per microbatch
        return loss


def _trainer(max_steps: int, summary: bool) -> L.Trainer:
    # the plain ModelSummary logs its table (RichModelSummary, the default when rich is
    # installed, prints it to the console instead)
    callbacks = [ModelSummary(max_depth=2)] if summary else []
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=PipelineStrategy(pp=2, microbatches=2, watchdog_timeout=60),
        max_steps=max_steps,
        val_check_interval=max_steps,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=summary,
        callbacks=callbacks,
    )


def _floats(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def fit_validate(out: str) -> None:
    summary = _Lines()
    logging.getLogger("lightning.pytorch.callbacks.model_summary").addHandler(summary)
    trainer = _trainer(STEPS, summary=True)
    model = EvalLoggingGPT(**MODEL_KW)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, Data(dp=1, accumulate=1))
        after_fit = _floats(trainer.callback_metrics)
        validated = _floats(trainer.validate(model, Data(dp=1, accumulate=1), verbose=False)[0])
    full = GPT(**MODEL_KW)
    full.configure_model()
    dump(
        os.path.join(out, f"fit_validate.rank{trainer.global_rank}.json"),
        {
            "after_fit": after_fit,
            "validated": validated,
            "user_validation_steps": model.user_validation_steps,
            "warnings": [str(w.message) for w in caught],
            "summary": "\n".join(summary.lines),
            "full_params": get_human_readable_count(sum(p.numel() for p in full.parameters())),
        },
    )
    trainer.strategy.barrier()


def train_log(out: str) -> None:
    trainer = _trainer(2, summary=False)
    try:
        trainer.fit(TrainLoggingGPT(**MODEL_KW), Data(dp=1, accumulate=1))
        error = None
    except Exception as e:  # what each rank ends with
        error = f"{type(e).__name__}: {e}"
    rank = trainer.global_rank
    dump(os.path.join(out, f"train_log.rank{rank}.json"), {"error": error})
    # The run was aborted: a normal interpreter exit would tear down a process group with
    # abandoned transfers, which can block. Rank 0 (the launcher of rank 1) waits for rank 1's
    # result; run as a script, both then leave at once (os._exit below); in a test world of
    # its own (tests/test_lightning_hooks.py), the world is closed, killing both.
    if rank == 0:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, "train_log.rank1.json")):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    sys.stdout.flush()
    sys.stderr.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    fit_validate(args.out)
    train_log(args.out)


if __name__ == "__main__":
    main()
    os._exit(0)
