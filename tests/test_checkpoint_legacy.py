"""Today's format (``index.json`` directories, format version 1) still loads, for one release.

The fixture ``tests/data/legacy_v1_pp2/step=5.ckpt`` was written by the version-1 writer itself
(main 0856f40: a pp=2 1F1B run of the tiny GPT, saved at step 5 of 10); ``expected.json`` holds the
losses and learning rates of that uninterrupted 10-step run. Resuming from the fixture must
continue that run: at its own shape in the shared 2-rank Trainer world, and in a plain
single-process Trainer through ``PipelineCheckpointIO``. ``lightning-pp consolidate`` reads it too.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from worlds import script_main, world  # noqa: E402

from lightning_pp.commands.cli import main as cli_main  # noqa: E402
from lightning_pp.models import GPT  # noqa: E402

pytestmark = pytest.mark.timeout(600)

FIXTURE = ROOT / "tests" / "data" / "legacy_v1_pp2"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())["uninterrupted"]["rank0"]
TOL = 1e-6  # the same shape continues bitwise in practice; the plain Trainer within 1e-6


def _copy(tmp_path: Path) -> Path:
    """The fixture copied (a load must not need to write, but never risk the checked-in one)."""
    dst = tmp_path / "step=5.ckpt"
    shutil.copytree(FIXTURE / "step=5.ckpt", dst)
    return dst


def _rel(got: list[float], want: list[float]) -> list[float]:
    assert len(got) == len(want), (len(got), len(want))
    return [abs(g - w) / abs(w) for g, w in zip(got, want)]


def test_the_fixture_is_a_version_1_directory():
    index = json.loads((FIXTURE / "step=5.ckpt" / "index.json").read_text())
    assert index["version"] == 1 and index["layout"]["pp"] == 2
    assert len(EXPECTED["train_loss"]) == 10


def test_legacy_checkpoint_resumes_at_its_shape(tmp_path):
    ckpt = _copy(tmp_path)
    phase = {"name": "legacy", "pp": 2, "microbatches": 2, "max_steps": 10, "resume": str(ckpt)}
    argv = ["--out", str(tmp_path / "out"), "--phases", json.dumps([phase])]
    world("trainer", 2).run(script_main, "ckpt_run", argv, timeout=400)
    ranks = [json.loads((tmp_path / "out" / f"legacy.rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["train_loss"] == ranks[1]["train_loss"]
    errs = _rel(ranks[0]["train_loss"], EXPECTED["train_loss"][5:])
    assert max(errs) <= TOL, errs
    assert ranks[0]["lr"] == EXPECTED["lr"][5:]
    assert ranks[0]["global_step"] == 10


def test_plain_trainer_resumes_from_a_legacy_directory(tmp_path):
    from ckpt_run import run_phase

    ckpt = _copy(tmp_path)
    torch.set_num_threads(1)
    spec = {"name": "plain", "pp": 0, "max_steps": 10, "resume": str(ckpt), "pipeline_io": True}
    result = run_phase(spec, str(tmp_path), 1)
    errs = _rel(result["train_loss"], EXPECTED["train_loss"][5:])
    assert max(errs) <= TOL, errs


def test_consolidate_reads_a_legacy_directory(tmp_path, capsys):
    from pp_common import MODEL_KW

    ckpt = _copy(tmp_path)
    out = tmp_path / "model.pt"
    assert cli_main(["consolidate", str(ckpt), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    model = GPT(**MODEL_KW)
    model.configure_model()
    model.load_state_dict(state, strict=True)  # every name, tied members included
    assert state["layers.0.wte.weight"].shape == (MODEL_KW["vocab_size"], MODEL_KW["n_embd"])
