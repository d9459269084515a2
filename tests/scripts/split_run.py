"""Train unmodified models under ``PipelineStrategy(split=...)``, several configs in one process
group (start-up paid once); write per-rank JSON and a sharded checkpoint per config.

    torchrun --nproc_per_node 4 tests/scripts/split_run.py --out DIR --configs '[{...}, ...]'

Each config: {"name", "model", "split", "pp", "vpp", "microbatches", optional "schedule",
"accumulate", "precision", "clip", "zero", "fsdp", "tp", "tp_plan", "build" ("configure_model" |
"init"),
"resume" (name of an earlier config whose checkpoint this one loads, at its own shape, and only
validates), "eval" (also run trainer.test and trainer.predict)}.
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
from split_common import CausalLM, Data, Losses, make_trainer  # noqa: E402

from lightning_pp import PipelineStrategy  # noqa: E402
from lightning_pp.autosplit import meta_build  # noqa: E402


def run(cfg: dict, devices: int, out: str) -> None:
    name = cfg["name"]
    strategy = PipelineStrategy(
        pp=cfg["pp"],
        vpp=cfg.get("vpp"),
        microbatches=cfg.get("microbatches"),
        schedule=cfg.get("schedule"),
        split=cfg["split"],
        zero=cfg.get("zero", 0),
        fsdp=cfg.get("fsdp", False),
        tp=cfg.get("tp", 1),
        tp_plan=cfg.get("tp_plan"),
    )
    world = int(os.environ.get("WORLD_SIZE", devices))
    dp = world // (cfg["pp"] * cfg.get("tp", 1))
    L.seed_everything(cfg.get("seed", 0), verbose=False)
    losses = Losses()
    trainer = make_trainer(strategy, devices, cfg, [losses])
    module = CausalLM(cfg["model"], cfg.get("build", "configure_model"))
    data = Data(dp=dp, accumulate=cfg.get("accumulate", 1))
    ckpt = os.path.join(out, f"ckpt_{name}")
    result: dict = {}
    if "resume" in cfg:  # another shape's checkpoint, resharded on load
        got = trainer.validate(module, data, ckpt_path=os.path.join(out, f"ckpt_{cfg['resume']}"))
        result["val_resumed"] = got[0]["val_loss"]
    else:
        trainer.fit(module, data)
        trainer.save_checkpoint(ckpt)
        if cfg.get("eval"):  # test and predict too (once: each costs a Trainer run)
            result["test"] = trainer.test(module, data, verbose=False)[0]["test_loss"]
            preds = trainer.predict(module, data)
            result["predict"] = [p.tolist() for p in preds] if preds else None
    staged = strategy.split_pipeline.staged
    stages = set(staged.stages)
    plain = meta_build(lambda: CausalLM(cfg["model"], "init")).model  # every name and tie
    share = {
        id(p): p.numel()
        for n, p in plain.named_parameters(remove_duplicate=False)
        if staged.layout.stage_of(n) in stages
    }
    rank = trainer.global_rank
    result.update(
        rank=rank,
        pp_rank=strategy.topology.pp_rank,
        dp_rank=strategy.topology.dp_rank,
        train=losses.train,
        val=losses.val,
        keys=list(module.state_dict()),
        numel=sum(p.numel() for p in module.parameters()),
        meta=sum(p.is_meta for p in module.parameters()),
        share=sum(share.values()),
        stages=sorted(stages),
        # tensor parallel: the parameters cut into DTensor shards on this rank
        sharded=[n for n, p in module.named_parameters() if hasattr(p, "placements")],
    )
    with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    strategy.barrier()


def main() -> None:
    configs_main(run)


if __name__ == "__main__":
    main()
