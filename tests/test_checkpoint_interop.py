"""Other tools reading a lightning_pp checkpoint directory: the commands of docs/checkpoints.md,
"Reading it with other tools", run as a user runs them, on a real checkpoint.

The checkpoint: the tiny GPT (tests/scripts/pp_common.py), one AdamW step, saved by
``save_pipeline_checkpoint`` in one process without a process group (the unpipelined module:
pp=1). Its embedding and head are tied, so one name is stored for both.

- torch's ``python -m torch.distributed.checkpoint.format_utils dcp_to_torch DIR OUT``: every
  stored tensor and optimizer moment, by name; the file loads into the module with only the
  tied member missing;
- ``torch.distributed.checkpoint.load`` into a module's own ``state_dict`` (no process group);
- Lightning's ``python -m lightning.fabric.utilities.consolidate_checkpoint DIR``: refuses the
  directory (it wants Lightning's ``meta.pt``); the reader behind it gives ``dcp_to_torch``'s dict;
- Lightning Fabric's ``ModelParallelStrategy``: cannot read the directory (the errors are
  pinned), reads the file ``lightning-pp consolidate`` writes (tests/scripts/interop_fabric.py);
- the trust warning: the stock reader runs a pickled call in ``.metadata``.

The Hugging Face export (``consolidate --hf``) is tested in tests/test_hf_export.py. The three
commands (each a fresh interpreter importing torch, Lightning) run as background jobs
(tests/background.py) on a checkpoint written when the session starts.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any, NamedTuple

import background
import pytest
import torch
from jobs import run_job
from torch.distributed.checkpoint.api import CheckpointException

from lightning_pp.checkpoint import consolidate_checkpoint
from lightning_pp.checkpoint.by_name import optimizer_state_by_name, tied_canonical_names
from lightning_pp.checkpoint.dcp_format import read_dcp_checkpoint_meta
from lightning_pp.checkpoint.manifest import MANIFEST, write_manifest
from lightning_pp.checkpoint.strategy_io import save_pipeline_checkpoint
from lightning_pp.commands.cli import main as cli_main
from lightning_pp.models import GPT

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))
from pp_common import BLOCK, MODEL_KW, VOCAB  # noqa: E402

# the GPT's tie: the head (layer n_layer + 1) uses the token embedding's weight
CANONICAL = "layers.0.wte.weight"
MEMBER = f"layers.{MODEL_KW['n_layer'] + 1}.head.weight"
TIMEOUT = 240  # one command: a fresh interpreter importing torch (+ Lightning) on a busy CPU


class Saved(NamedTuple):
    path: Path
    moments: dict[str, dict[str, torch.Tensor]]  # the live optimizer's state, by name


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(SCRIPTS)])}


def _run(*args: str, cwd: Path) -> Any:
    """``python ARGS`` in a fresh process, as a user types it."""
    return run_job([sys.executable, *args], env=_env(), cwd=cwd, timeout=TIMEOUT)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ, or that one side lacks (bitwise)."""
    return sorted(
        k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k])
    )


def _save(root: Path) -> Saved:
    """A real checkpoint: one AdamW step of the tiny GPT (so every moment is non-zero)."""
    torch.manual_seed(0)
    model = GPT(**MODEL_KW)
    model.configure_model()
    optimizer = model.configure_optimizers()["optimizer"]
    x = torch.randint(0, VOCAB, (4, BLOCK + 1))
    batch = (x[:, :-1], x[:, 1:])
    model.pipeline_loss(model.layers(batch[0]), batch).backward()
    optimizer.step()
    canonical = tied_canonical_names(model, model.layers)
    by_name = optimizer_state_by_name(optimizer, model, canonical)
    ckpt = {
        "state_dict": model.state_dict(),
        "optimizer_states": [by_name],
        "global_step": 1,
        "epoch": 0,
        "loops": {},
        "hyper_parameters": dict(model.hparams),
    }
    path = root / "step=1.ckpt"
    layout = {"pp": 1, "vpp": 1, "dp": 1, "world_size": 1}
    save_pipeline_checkpoint(ckpt, path, module=model, layout=layout, canonical=canonical)
    moments = {n: {k: v.clone() for k, v in s.items()} for n, s in by_name["state"].items()}
    return Saved(path, moments)


# ------------------------------------------------------------------------ the commands
def _dcp_to_torch(saved: Saved) -> str:
    out = saved.path.parent / "converted.pt"
    mod = "torch.distributed.checkpoint.format_utils"
    result = _run("-m", mod, "dcp_to_torch", str(saved.path), str(out), cwd=saved.path.parent)
    assert result.returncode == 0 and out.is_file(), result.describe()
    return str(out)


def _lightning_cli(saved: Saved) -> str:
    out = saved.path.parent / "lightning.pt"
    mod = "lightning.fabric.utilities.consolidate_checkpoint"
    result = _run("-m", mod, str(saved.path), "--output_file", str(out), cwd=saved.path.parent)
    assert result.returncode == 1, result.describe()
    assert not out.exists()
    return result.output


def _fabric(saved: Saved, plain: Path) -> str:
    result = _run(str(SCRIPTS / "interop_fabric.py"), str(saved.path), str(plain), cwd=plain.parent)
    assert result.returncode == 0, result.describe()
    line = next(x for x in reversed(result.output.splitlines()) if x.startswith("{"))
    (plain.parent / "fabric.json").write_text(line)
    return "ok"


_SAVED: dict[str, Saved] = {}


def background_jobs(items, tmp_path_factory) -> dict:
    """The checkpoint, written now in the main thread (and the file ``lightning-pp
    consolidate`` makes of it), then the three commands in the background."""
    if not items:
        return {}
    saved = _SAVED["saved"] = _save(tmp_path_factory.mktemp("interop"))
    plain = saved.path.parent / "gpt.pt"
    assert cli_main(["consolidate", str(saved.path), str(plain)]) == 0  # docs: the safe path
    return {
        "interop-dcp_to_torch": lambda: _dcp_to_torch(saved),
        "interop-lightning-cli": lambda: _lightning_cli(saved),
        "interop-fabric": lambda: _fabric(saved, plain),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    if "saved" not in _SAVED:  # no background jobs were asked for this session
        _SAVED["saved"] = _save(tmp_path_factory.mktemp("interop"))
    return _SAVED["saved"]


@pytest.fixture(scope="module")
def converted() -> dict[str, Any]:
    """``dcp_to_torch``'s output file, read back with ``weights_only=True`` (which also shows
    it holds nothing but tensors in plain containers)."""
    background.check("interop-dcp_to_torch")  # exit code 0, the file written
    return torch.load(_SAVED["saved"].path.parent / "converted.pt", weights_only=True)


# ------------------------------------------------------------------------ torch's DCP
def test_the_checkpoint_has_one_tie(saved):
    """What the other tests rely on: exactly one tied pair, stored under the canonical name."""
    assert read_dcp_checkpoint_meta(saved.path)["tied"] == [[CANONICAL, MEMBER]]


@pytest.mark.timeout(background.WAIT)
def test_dcp_to_torch_gives_every_stored_tensor_by_name(saved, converted):
    assert sorted(converted) == ["optimizer_0", "state_dict"]  # Lightning's metadata is not DCP's
    full = consolidate_checkpoint(saved.path)  # every name, the tied member too
    assert MEMBER in full and MEMBER not in converted["state_dict"]  # stored once
    stored = {k: v for k, v in full.items() if k != MEMBER}
    assert _equal(converted["state_dict"], stored) == []


@pytest.mark.timeout(background.WAIT)
def test_dcp_to_torch_gives_the_optimizer_moments_by_name(saved, converted):
    optimizer = converted["optimizer_0"]
    assert sorted(optimizer) == ["state"]  # param groups' hyperparameters are in meta.json
    assert sorted(optimizer["state"]) == sorted(saved.moments)
    assert MEMBER not in optimizer["state"]  # the tie's state is the canonical name's
    for name, want in saved.moments.items():
        assert sorted(optimizer["state"][name]) == ["exp_avg", "exp_avg_sq", "step"], name
        assert _equal(optimizer["state"][name], want) == [], name


@pytest.mark.timeout(background.WAIT)
def test_the_converted_weights_load_into_the_module_with_only_the_tied_member_missing(
    saved, converted
):
    model = GPT(**MODEL_KW)
    model.configure_model()
    missing, unexpected = model.load_state_dict(converted["state_dict"], strict=False)
    assert (missing, unexpected) == ([MEMBER], [])
    # the member is the canonical tensor itself, so it has the saved values all the same
    assert _equal(model.state_dict(), consolidate_checkpoint(saved.path)) == []


def test_dcp_load_fills_a_modules_own_state_dict(saved):
    """``dcp.load`` in one process (no process group) into the module's tensors, in place:
    the tied member's key is dropped from the request (it is not stored)."""
    import torch.distributed.checkpoint as dcp

    model = GPT(**MODEL_KW)
    model.configure_model()
    request = model.state_dict()
    with pytest.raises(CheckpointException, match=f"Missing key .*: state_dict.{MEMBER}"):
        dcp.load({"state_dict": request}, checkpoint_id=saved.path)
    del request[MEMBER]
    dcp.load({"state_dict": request}, checkpoint_id=saved.path)
    assert _equal(model.state_dict(), consolidate_checkpoint(saved.path)) == []


# ------------------------------------------------------------------------ Lightning
@pytest.mark.timeout(background.WAIT)
def test_lightnings_consolidate_cli_refuses_the_directory_for_want_of_meta_pt():
    """Lightning 2.6's CLI accepts only a directory holding its pickled ``meta.pt``; this format
    keeps Lightning's metadata in meta.json/meta.safetensors instead (no pickle). Adding a
    ``meta.pt`` is no way around: the manifest check then refuses the directory."""
    output = background.check("interop-lightning-cli")  # exit code 1, no output file
    assert "Only FSDP-sharded checkpoints saved with Lightning are supported" in output


@pytest.mark.timeout(background.WAIT)
def test_lightnings_reader_behind_the_cli_gives_dcp_to_torchs_dict(saved, converted):
    """The function the CLI calls (private: ``_load_distributed_checkpoint``) reads the directory
    with DCP's ``FileSystemReader`` and merges ``meta.pt`` if there is one: here, nothing."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    got = _load_distributed_checkpoint(saved.path)
    assert sorted(got) == sorted(converted)
    assert _equal(got["state_dict"], converted["state_dict"]) == []
    for name, moments in converted["optimizer_0"]["state"].items():
        assert _equal(got["optimizer_0"]["state"][name], moments) == [], name


@pytest.mark.timeout(background.WAIT)
def test_fabric_model_parallel_reads_the_consolidated_file_not_the_directory():
    background.check("interop-fabric")
    got = json.loads((_SAVED["saved"].path.parent / "fabric.json").read_text())
    # the directory: Fabric looks for its meta.pt, then wants a single file
    assert got["load_dir"].startswith("ValueError: The path"), got
    assert "does not point to a valid checkpoint" in got["load_dir"], got
    assert got["load_raw_dir"].startswith("ValueError: Failed to load checkpoint"), got
    # the consolidated file: every tensor, the tie kept
    assert got["keys_equal"] and got["tensors_equal"] and got["tied"], got


# ------------------------------------------------------------------------ trust
class _Payload:
    """Unpickles as ``os.system(cmd)``."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.cmd,))


def test_the_stock_readers_unpickle_the_metadata(saved, tmp_path, capsys):
    """Why docs/checkpoints.md says to use them on trusted checkpoints only: ``dcp_to_torch``
    (and Lightning's reader, the same ``FileSystemReader``) runs a call pickled into
    ``.metadata``, where ``lightning-pp consolidate`` refuses it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    hostile = tmp_path / "hostile.ckpt"
    shutil.copytree(saved.path, hostile)
    marker = tmp_path / "ran"
    (hostile / ".metadata").write_bytes(pickle.dumps(_Payload(f"touch {marker}")))
    (hostile / MANIFEST).unlink()
    write_manifest(hostile)  # a matching manifest: the unpickler, not the hashes, must refuse
    assert cli_main(["consolidate", str(hostile), str(tmp_path / "safe.pt")]) == 2
    assert "refusing to unpickle" in capsys.readouterr().err
    assert not marker.exists()
    # the call runs inside pickle.load; DCP then fails on what it returned (os.system's 0)
    with pytest.raises(CheckpointException, match="'int' object has no attribute"):
        dcp_to_torch_save(hostile, tmp_path / "unsafe.pt")
    assert marker.exists()
