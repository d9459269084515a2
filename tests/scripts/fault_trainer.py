"""A real Trainer + PipelineStrategy job in which one rank raises; used by tests/test_faults.py.

Usage: ``python fault_trainer.py <fail_rank> <where>`` with ``where`` in ``callback`` (a
callback's ``on_train_batch_end`` raises on that rank at step 1) or ``layer`` (a layer's forward
raises on that rank at step 1). Launched by Lightning's own launcher (``devices=3``). The job
must exit non-zero with every process gone; each rank prints when and how it ended.
"""

from __future__ import annotations

import os
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from pp_common import MODEL_KW, Data, make_trainer

from lightning_pp.models import GPT
from lightning_pp.strategy.pipeline_strategy import PipelineStrategy


class Injected(RuntimeError):
    pass


class RaiseInCallback(Callback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and batch_idx == 1:
            raise Injected(f"injected failure on rank {self.rank} in on_train_batch_end")


class RaisingGPT(GPT):
    """Raises inside the pipelined forward of the given rank at its second training batch."""

    def __init__(self, fail_rank: int, **kw) -> None:
        super().__init__(**kw)
        self.fail_rank, self.calls = fail_rank, 0

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.trainer.global_rank == self.fail_rank and batch_idx == 1:
            layer = self.layers[self.layers.built_indices[0]]

            def boom(module, args):
                raise Injected(f"injected failure on rank {self.fail_rank} in a layer forward")

            layer.register_forward_pre_hook(boom)


def main() -> None:
    fail_rank, where = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    callbacks = [RaiseInCallback(fail_rank)] if where == "callback" else []
    strategy = PipelineStrategy(pp=3, microbatches=4, watchdog_timeout=60.0)
    trainer = make_trainer(strategy, 3, 1, os.environ["FAULT_CKPT_DIR"], callbacks)
    model = RaisingGPT(fail_rank, **MODEL_KW) if where == "layer" else GPT(**MODEL_KW)
    try:
        trainer.fit(model, Data(dp=1, accumulate=1))
    except BaseException as e:
        print(f"RANK-END {trainer.global_rank} {type(e).__name__} {time.time():.2f}", flush=True)
        raise
    print(f"RANK-END {trainer.global_rank} finished {time.time():.2f}", flush=True)


if __name__ == "__main__":
    main()
