"""LightningCLI with PipelineStrategy, as a user whose runs already use LightningCLI would write it.

    python tests/scripts/cli_run.py fit --trainer.strategy=lightning_pp.PipelineStrategy \
        --trainer.strategy.pp=2 --trainer.devices=2 ...

``Trainer(devices=2)`` re-runs this command line for rank 1 (Lightning's launcher), and each
rank writes ``$CLI_RUN_OUT/rank<r>.json``: its strategy, pipeline rank and logged losses.
tests/test_lightning_cli.py runs ``main()`` on each rank of a 2-rank Trainer world instead
(tests/worlds.py, as torchrun would run it: no launcher, no fresh interpreters).
"""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from pp_common import Data, dump  # noqa: E402

from lightning_pp.models import GPT  # noqa: E402


class Report(Callback):
    def __init__(self) -> None:
        self.train_loss: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train_loss.append(float(trainer.callback_metrics["train_loss"]))

    def on_fit_end(self, trainer, pl_module) -> None:
        s = trainer.strategy
        dump(
            os.path.join(os.environ["CLI_RUN_OUT"], f"rank{trainer.global_rank}.json"),
            {
                "strategy": type(s).__module__ + "." + type(s).__name__,
                "pp": s.pp,
                "pp_rank": s.topology.pp_rank,
                "layers": pl_module.layers.built_indices,
                "train_loss": self.train_loss,
            },
        )


def main() -> None:
    LightningCLI(GPT, Data, trainer_defaults={"callbacks": [Report()]})


if __name__ == "__main__":
    main()
