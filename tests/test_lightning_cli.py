"""LightningCLI drives PipelineStrategy (issue 13, item 15): the `cli` extra, and a real run.

The run is ``LightningCLI(GPT, Data)`` (tests/scripts/cli_run.py) on the 2 ranks of a Trainer
world of its own (tests/worlds.py: forked ranks, as torchrun would run them), with the strategy
chosen on the command line by class path. Lightning's launcher has tests of its own
(test_strategy, test_cli_fit).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))

from worlds import World, script_main  # noqa: E402

# Lightning's own requirement for LightningCLI (lightning.pytorch.cli)
REQUIREMENT = "jsonargparse[signatures]>=4.27.7"


def test_cli_extra_installs_lightning_cli_requirement():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["cli"] == [REQUIREMENT]  # pip install lightning-pp[cli]
    assert REQUIREMENT in extras["dev"]  # so CI runs the test below
    readme = (ROOT / "README.md").read_text()
    assert "lightning-pp[cli]" in readme and "--trainer.strategy=lightning_pp.PipelineStrategy" in (
        readme
    )


def _cli_case(rank: int, size: int, out: str, argv: list[str]) -> None:
    """On each rank of the world: LightningCLI's command line, as torchrun would run it."""
    os.environ["CLI_RUN_OUT"] = out
    script_main(rank, size, "cli_run", argv)


def test_lightning_cli_trains_with_pipeline_strategy(tmp_path):
    pytest.importorskip("jsonargparse", reason="pip install -e '.[cli]'")
    out = tmp_path / "out"
    out.mkdir()
    argv = [
        "fit",
        "--trainer.strategy=lightning_pp.PipelineStrategy",
        "--trainer.strategy.pp=2",
        "--trainer.strategy.microbatches=2",
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.max_steps=3",
        "--trainer.limit_val_batches=0",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--model.vocab_size=32",
        "--model.block_size=8",
        "--model.n_layer=2",
        "--model.n_head=2",
        "--model.n_embd=16",
        "--data.dp=1",
        "--data.accumulate=1",
    ]
    own = World("trainer", 2)  # a Trainer world of its own: LightningCLI starts its own run
    try:
        own.run(_cli_case, str(out), argv, timeout=300)
    finally:
        own.close()
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [d["strategy"] for d in ranks] == [
        "lightning_pp.strategy.pipeline_strategy.PipelineStrategy"
    ] * 2
    assert [(d["pp"], d["pp_rank"]) for d in ranks] == [(2, 0), (2, 1)]
    assert ranks[0]["layers"] == [0, 1] and ranks[1]["layers"] == [2, 3]  # 4 layers, cut in two
    losses = ranks[0]["train_loss"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert ranks[1]["train_loss"] == losses
    # LightningCLI saved the run's config, strategy included
    config = (tmp_path / "config.yaml").read_text()
    assert "lightning_pp.PipelineStrategy" in config or "PipelineStrategy" in config
