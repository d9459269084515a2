"""Checkpoints from untrusted or damaged sources: no pickled code runs, nothing partial is written.

Single process, no Trainer: a two-stage checkpoint of the tiny GPT is written with the real
writer (one ``save_sharded_checkpoint`` per stage, merged the way rank 0 merges the reports), then
tampered with. Issue 13 items 9 (``consolidate --lightning`` unpickled ``meta.pt`` with
``weights_only=False``) and 10 (plain ``consolidate`` trusted the index and wrote a partial file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from pp_common import MODEL_KW  # noqa: E402
from v1_writer import save_sharded_checkpoint  # noqa: E402

from lightning_pp.checkpoint.sharded import (  # noqa: E402
    CheckpointError,
    consolidate_checkpoint,
    load_metadata,
    load_pipeline_checkpoint,
    optimizer_state_by_name,
    tied_canonical_names,
)
from lightning_pp.commands.cli import main as cli_main  # noqa: E402
from lightning_pp.models import GPT  # noqa: E402

N_LAYERS = MODEL_KW["n_layer"] + 2  # embedding, blocks, head
SPLIT = N_LAYERS // 2  # stage 0 holds layers 0..SPLIT-1, stage 1 the rest


def _stage_of(name: str) -> int:
    return 0 if int(name.split(".")[1]) < SPLIT else 1


def _gpt() -> GPT:
    model = GPT(**MODEL_KW)
    model.configure_model()
    return model


def _two_stage_checkpoint(path: Path, meta: dict[str, Any] | None = None) -> Path:
    """A pp=2 checkpoint of a briefly trained tiny GPT, written as two pipeline ranks would."""
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, MODEL_KW["vocab_size"], (2, MODEL_KW["block_size"]))
    model.layers(x).square().mean().backward()
    opt.step()
    canonical = tied_canonical_names(model, model.layers)
    by_name = optimizer_state_by_name(opt, model, canonical)
    layout = {"pp": 2, "vpp": 1, "dp": 1, "world_size": 2, "num_layers": N_LAYERS}
    parts = []
    for stage in (0, 1):
        state = {k: v for k, v in model.state_dict().items() if _stage_of(k) == stage}
        optim = {
            "state": {n: s for n, s in by_name["state"].items() if _stage_of(n) == stage},
            "param_groups": by_name["param_groups"],
            "group_of": {n: g for n, g in by_name["group_of"].items() if _stage_of(n) == stage},
        }
        ckpt = {
            "state_dict": state,
            "optimizer_states": [optim],
            "global_step": 1,
            "hyper_parameters": dict(model.hparams),
            "lightning_pp": {"module_class": "lightning_pp.models.gpt:GPT"},
            **(meta or {}),
        }
        parts.append(
            save_sharded_checkpoint(
                ckpt,
                path.parent / f"{path.name}.s{stage}",
                tag=f"pp{stage}",
                canonical=canonical,
                layout=layout,
            )
        )
    # rank 0's directory receives stage 1's files and its index entries
    for name in ("model.pp1.pt", "optim.pp1.pt"):
        shutil.move(parts[1] / name, parts[0] / name)
    index = json.loads((parts[0] / "index.json").read_text())
    other = json.loads((parts[1] / "index.json").read_text())
    index["model_files"].update(other["model_files"])
    index["optim_files"].update(other["optim_files"])
    (parts[0] / "index.json").write_text(json.dumps(index))
    shutil.rmtree(parts[1])
    parts[0].rename(path)
    return path


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return _two_stage_checkpoint(tmp_path / "step=1.ckpt")


def _n_tensors() -> int:
    return len(_gpt().state_dict())


def test_the_two_stage_checkpoint_consolidates(ckpt, tmp_path):
    state = consolidate_checkpoint(ckpt, tmp_path / "gpt.pt")
    assert len(state) == _n_tensors()
    _gpt().load_state_dict(torch.load(tmp_path / "gpt.pt", weights_only=True), strict=True)
    assert cli_main(["consolidate", str(ckpt), str(tmp_path / "full.ckpt"), "--lightning"]) == 0


# ------------------------------------------------------------------ item 9: pickled code
class _WritesMarker:
    """Unpickling this runs ``os.system``: what a malicious ``meta.pt`` would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _poison_meta(ckpt: Path, marker: Path) -> None:
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    meta["callbacks"] = {"Innocent{}": {"state": _WritesMarker(marker)}}
    torch.save(meta, ckpt / "meta.pt")


def test_consolidate_lightning_refuses_pickled_code(ckpt, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    _poison_meta(ckpt, marker)
    out = tmp_path / "full.ckpt"
    code = cli_main(["consolidate", str(ckpt), str(out), "--lightning"])
    assert not marker.exists(), "the pickled os.system call ran"
    assert code == 2
    err = capsys.readouterr().err
    assert str(ckpt / "meta.pt") in err
    assert "posix.system" in err
    assert "--trust-checkpoint" in err
    assert not out.exists()
    with pytest.raises(CheckpointError, match="posix.system"):
        consolidate_checkpoint(ckpt, module=_gpt())
    assert not marker.exists()


def test_resume_refuses_pickled_code(ckpt, tmp_path):
    marker = tmp_path / "PWNED"
    _poison_meta(ckpt, marker)
    model = _gpt()
    with pytest.raises(CheckpointError, match=r"meta\.pt.*posix\.system"):
        load_pipeline_checkpoint(ckpt, model, rank=0)
    assert not marker.exists()


def test_tensor_files_never_unpickle_code(ckpt, tmp_path):
    marker = tmp_path / "PWNED"
    shard = torch.load(ckpt / "model.pp1.pt", weights_only=True)
    shard[next(iter(shard))] = _WritesMarker(marker)
    torch.save(shard, ckpt / "model.pp1.pt")
    with pytest.raises(CheckpointError, match=r"model\.pp1\.pt: refusing to unpickle 'posix"):
        consolidate_checkpoint(ckpt)
    assert not marker.exists()


def test_trusted_load_is_explicit(ckpt, tmp_path):
    """``weights_only=False`` (``--trust-checkpoint``, ``Trainer.fit(weights_only=False)``)
    unpickles anything: only on request."""
    marker = tmp_path / "PWNED"
    _poison_meta(ckpt, marker)
    load_metadata(ckpt / "meta.pt", weights_only=False)
    assert marker.exists()


def test_metadata_types_lightning_writes_are_allowed(tmp_path):
    from omegaconf import OmegaConf

    meta = {
        "hyper_parameters": {
            "cfg": OmegaConf.create({"a": 1, "b": {"c": [1, 2.5, "x", None, True]}}),
            "root": pathlib.Path("/data"),
            "ns": argparse.Namespace(depth=3),
            "every": datetime.timedelta(minutes=5),
            "when": datetime.datetime(2024, 1, 2, 3, 4, 5),
            "frozen": frozenset({1}),
            "window": slice(1, 5),
            "dtype": torch.bfloat16,
        },
        "hparams_type": type(OmegaConf.create({})),
        "callbacks": {"ModelCheckpoint{}": {"best_model_score": torch.tensor(1.5)}},
    }
    torch.save(meta, tmp_path / "meta.pt")
    got = load_metadata(tmp_path / "meta.pt")
    assert got["hyper_parameters"]["cfg"].b.c[1] == 2.5
    assert got["hyper_parameters"]["root"] == pathlib.Path("/data")
    assert got["hyper_parameters"]["ns"].depth == 3


def test_lightning_module_class_must_be_a_lightning_module(ckpt, tmp_path, capsys):
    """The recorded class is imported and called with the saved hyperparameters: a checkpoint
    naming ``os:system`` must not get it called."""
    marker = tmp_path / "PWNED"
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    meta["lightning_pp"]["module_class"] = "os:system"
    meta["hyper_parameters"] = {"command": f"touch {marker}"}
    torch.save(meta, ckpt / "meta.pt")
    assert cli_main(["consolidate", str(ckpt), str(tmp_path / "o.ckpt"), "--lightning"]) == 2
    assert not marker.exists()
    assert "is not a LightningModule class" in capsys.readouterr().err


# ------------------------------------------------------------------ item 10: the index
def _edit_index(ckpt: Path, edit) -> None:
    index = json.loads((ckpt / "index.json").read_text())
    edit(index)
    (ckpt / "index.json").write_text(json.dumps(index))


def _refused(ckpt: Path, out: Path, capsys, *needles: str) -> str:
    assert cli_main(["consolidate", str(ckpt), str(out)]) == 2
    assert not out.exists(), "a partial consolidated file was written"
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    return err


def test_consolidate_refuses_an_index_missing_a_stage(ckpt, tmp_path, capsys):
    _edit_index(ckpt, lambda ix: ix["model_files"].pop("model.pp1.pt"))
    _refused(ckpt, tmp_path / "o.pt", capsys, "index.json", "model.pp1.pt", "pp=2")


def test_consolidate_refuses_an_index_missing_names(ckpt, tmp_path, capsys):
    removed = []

    def drop(ix):
        names = ix["model_files"]["model.pp1.pt"]
        removed.append(names.pop())

    _edit_index(ckpt, drop)
    _refused(ckpt, tmp_path / "o.pt", capsys, "model.pp1.pt", removed[0])


def test_consolidate_refuses_swapped_shards(ckpt, tmp_path, capsys):
    a, b = ckpt / "model.pp0.pt", ckpt / "model.pp1.pt"
    tmp = ckpt / "swap"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    _refused(ckpt, tmp_path / "o.pt", capsys, "model.pp0.pt", "do not match index.json")


def test_consolidate_refuses_a_name_stored_twice(ckpt, tmp_path, capsys):
    def dup(ix):
        ix["model_files"]["model.pp1.pt"].append(ix["model_files"]["model.pp0.pt"][0])

    _edit_index(ckpt, dup)
    _refused(ckpt, tmp_path / "o.pt", capsys, "index.json", "more than one file")


@pytest.mark.parametrize(
    "damage,needle",
    [
        ("index_not_json", "index.json"),
        ("index_without_model_files", "model_files"),
        ("truncated_shard", "model.pp1.pt"),
        ("optim_swapped", "optim.pp0.pt"),
    ],
)
def test_resume_errors_name_the_file(ckpt, damage, needle):
    if damage == "index_not_json":
        (ckpt / "index.json").write_text('{"format": ')
    elif damage == "index_without_model_files":
        _edit_index(ckpt, lambda ix: ix.pop("model_files"))
    elif damage == "truncated_shard":
        data = (ckpt / "model.pp1.pt").read_bytes()
        (ckpt / "model.pp1.pt").write_bytes(data[: len(data) // 2])
    elif damage == "optim_swapped":
        a, b = ckpt / "optim.pp0.pt", ckpt / "optim.pp1.pt"
        tmp = ckpt / "swap"
        a.rename(tmp)
        b.rename(a)
        tmp.rename(b)
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError) as info:
        load_pipeline_checkpoint(ckpt, model, rank=0, optimizers=[opt])
    assert needle in str(info.value)
    assert str(ckpt) in str(info.value)
