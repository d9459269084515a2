"""Checkpoints across placements: one written under zbv (V placement: rank r holds stages r
and 2p-1-r) resumes under interleaved (loop placement) and, consolidated, under a plain Trainer;
one written under interleaved resumes under zbv. Each continues the original run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_checkpoint import RESHARD_TOL, _check_launch, _losses, _phase, _read, _rel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from ckpt_launch import launch  # noqa: E402

from lightning_pp.checkpoint.sharded import read_index  # noqa: E402
from lightning_pp.commands.cli import main as cli_main  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ZBV = {"pp": 4, "microbatches": 8, "schedule": "zbv"}  # vpp unset: zbv's own 2
IL = {"pp": 4, "vpp": 2, "microbatches": 4}  # interleaved


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ckpt_zb")
    zbv_ckpt, il_ckpt = out / "zbv_ckpt", out / "il_ckpt"
    a = launch(
        4,
        [
            _phase("zbv_full", ZBV, max_steps=10),
            _phase("zbv_save", ZBV, max_steps=5, every=5, ckpt_dir=str(zbv_ckpt)),
            _phase("il_full", IL, max_steps=10),
            _phase("il_save", IL, max_steps=5, every=5, ckpt_dir=str(il_ckpt)),
        ],
        out / "a",
    )
    _check_launch(a, "group A (train + save)")
    zbv5, il5 = str(zbv_ckpt / "step=5.ckpt"), str(il_ckpt / "step=5.ckpt")
    b = launch(
        4,
        [
            _phase("zbv_to_il", IL, max_steps=10, resume=zbv5),
            _phase("il_to_zbv", ZBV, max_steps=10, resume=il5),
        ],
        out / "b",
    )
    _check_launch(b, "group B (new processes: across placements)")
    return {"out": out, "zbv5": zbv5, "il5": il5}


@pytest.mark.parametrize(
    "name,source", [("zbv_to_il", "zbv"), ("il_to_zbv", "il")], ids=["zbv->il", "il->zbv"]
)
def test_resume_across_placements_continues_the_run(runs, name, source):
    out = runs["out"]
    full = _losses(out, "a", f"{source}_full", 4)
    assert _losses(out, "a", f"{source}_save", 4) == full[:5]
    errs = _rel(_losses(out, "b", name, 4), full[5:])
    assert max(errs) <= RESHARD_TOL, errs
    assert _read(out / "b", name, 4)[0]["lr"] == _read(out / "a", f"{source}_full", 4)[0]["lr"][5:]


def test_zbv_checkpoint_records_its_shape(runs):
    index = read_index(runs["zbv5"])
    assert index["layout"]["pp"] == 4 and index["layout"]["vpp"] == 2


def test_plain_trainer_resumes_from_consolidated_zbv_checkpoint(runs, tmp_path):
    from ckpt_run import run_phase

    full_ckpt = tmp_path / "full.ckpt"
    assert cli_main(["consolidate", runs["zbv5"], str(full_ckpt), "--lightning"]) == 0
    torch.set_num_threads(1)
    result = run_phase(
        {"name": "plain", "pp": 0, "max_steps": 10, "resume": str(full_ckpt)}, str(tmp_path), 1
    )
    full = _losses(runs["out"], "a", "zbv_full", 4)
    errs = _rel(result["train_loss"], full[5:])
    assert max(errs) <= RESHARD_TOL, errs
