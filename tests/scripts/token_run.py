"""Train on padded, prompt-masked batches under ``PipelineStrategy`` (issue 34), several
configurations in one process group; write per-rank JSON.

    torchrun --nproc_per_node 4 tests/scripts/token_run.py --out DIR --configs '[{...}, ...]'

Each config: {"name", "kind" ("family" | "layers"), "family" (kind family), "pp", "schedule",
optional "vpp", "microbatches", "loss_normalization", "zero", "fsdp"}.
"""

from __future__ import annotations

import json
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
from pp_common import configs_main  # noqa: E402
from token_common import Data, Losses, make_module, make_trainer  # noqa: E402

from lightning_pp import PipelineStrategy  # noqa: E402


def run(cfg: dict, devices: int, out: str) -> None:
    split = None
    if cfg["kind"] == "family":
        from byom_families import family_fn

        split = "model." + family_fn(cfg["family"])[1]
    strategy = PipelineStrategy(
        pp=cfg["pp"],
        vpp=cfg.get("vpp"),
        microbatches=cfg.get("microbatches", 2),
        schedule=cfg.get("schedule"),
        split=split,
        # LPP_TOKEN_FORCE_NORMALIZATION=samples: the weighting removed everywhere, to see the
        # padded-batch comparisons fail (tests/test_token_loss.py)
        loss_normalization=os.environ.get(
            "LPP_TOKEN_FORCE_NORMALIZATION", cfg.get("loss_normalization", "auto")
        ),
        zero=cfg.get("zero", 0),
        fsdp=cfg.get("fsdp", False),
    )
    world = int(os.environ.get("WORLD_SIZE", devices))
    L.seed_everything(0, verbose=False)
    losses = Losses()
    trainer = make_trainer(strategy, devices, [losses])
    module = make_module(cfg)
    trainer.fit(module, Data(dp=world // cfg["pp"]))
    result = dict(
        rank=trainer.global_rank,
        dp_rank=strategy.topology.dp_rank,
        train=losses.train,
        val=losses.val,
        keys=list(module.state_dict()),
        source=strategy.loss_counts.source,
    )
    with open(os.path.join(out, f"{cfg['name']}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    strategy.barrier()


def main() -> None:
    configs_main(run)


if __name__ == "__main__":
    main()
