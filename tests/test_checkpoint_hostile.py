"""A hostile checkpoint given to each command that reads one: refused with exit code 2, and the
payload it carries never runs.

The checkpoint directory is a real one (a one-process save of the very model the run files
build), then every file a pickle could hide in is replaced by a pickled ``os.system`` call:
``.metadata`` and each ``.distcp`` data file, with a manifest rewritten to match, so that the
marker and the manifest checks pass and the readers reach the pickles. A hostile plain file
(``torch.save`` zip whose ``hyper_parameters`` unpickle as the call) covers the single-file path.
That the files are live is shown here too: DCP's stock reader runs the payload.

- ``lightning-pp consolidate`` (in this process: the command's own code, its return code);
- ``lightning-pp fit RUN.yaml --ckpt-path DIR``: a pipelined run resuming, and a plain Trainer
  run (no ``PipelineStrategy``: the CLI reads a directory through ``PipelineCheckpointIO``);
- ``lightning-pp fit RUN.yaml --ckpt-path FILE``: a pipelined run resuming from a plain file.

The three launched runs are background jobs (tests/background.py).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

import background
import pytest
import torch
import torch.distributed.checkpoint as dcp
from jobs import run_job

from lightning_pp.checkpoint.by_name import optimizer_state_by_name, tied_canonical_names
from lightning_pp.checkpoint.manifest import MANIFEST, write_manifest
from lightning_pp.checkpoint.strategy_io import save_pipeline_checkpoint
from lightning_pp.commands.cli import main as cli_main
from lightning_pp.models import GPT

REPO = Path(__file__).resolve().parents[1]

MODEL = {"vocab_size": 128, "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16}

RUN = """\
seed: 1
model:
  class_path: lightning_pp.models.GPT
  init_args: {{vocab_size: 128, n_layer: 2, n_head: 2, n_embd: 16, block_size: 16}}
data:
  class_path: lightning_pp.models.data.StdlibCharDataModule
  init_args: {{block_size: 16, batch_size: 4, max_chars: 20000}}
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  enable_checkpointing: false
  enable_progress_bar: false
  default_root_dir: {root}
logger: false
{strategy}"""
PIPELINED = "strategy: {pp: 1, microbatches: 2}\n"


class _Payload:
    """Unpickles as ``os.system(cmd)``: what a hostile checkpoint carries."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.cmd,))


def _touch(marker: Path) -> _Payload:
    return _Payload(f"touch {marker}")


def _real_checkpoint(path: Path) -> None:
    """A one-process save of the run file's model, with Lightning-like metadata."""
    torch.manual_seed(0)
    model = GPT(**MODEL)
    model.configure_model()
    optimizer = model.configure_optimizers()["optimizer"]
    canonical = tied_canonical_names(model, model.layers)
    ckpt = {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer_state_by_name(optimizer, model, canonical)],
        "global_step": 1,
        "epoch": 0,
        "loops": {},
        "hyper_parameters": dict(model.hparams),
    }
    layout = {"pp": 1, "vpp": 1, "dp": 1, "world_size": 1}
    save_pipeline_checkpoint(ckpt, path, module=model, layout=layout, canonical=canonical)


def hostile_directory(path: Path, marker: Path) -> Path:
    """A real checkpoint whose ``.metadata`` and data files are pickled ``os.system`` calls,
    with a manifest that matches them (what an attacker who rewrites the whole directory
    writes): only the readers stand between the payload and the loading process."""
    _real_checkpoint(path)
    for f in [path / ".metadata", *sorted(path.glob("*.distcp"))]:
        f.write_bytes(pickle.dumps(_touch(marker)))
    (path / MANIFEST).unlink()
    write_manifest(path)
    return path


def hostile_plain_file(path: Path, marker: Path) -> Path:
    """A plain Lightning checkpoint file whose hyperparameters unpickle as the call."""
    torch.save({"state_dict": {}, "hyper_parameters": {"x": _touch(marker)}}, path)
    return path


# ---------------------------------------------------------------- the launched runs
def _fit(tmp: Path, *, pipelined: bool, ckpt: Path, marker: Path) -> str:
    run = tmp / "run.yaml"
    strategy = PIPELINED if pipelined else ""
    run.write_text(textwrap.dedent(RUN.format(root=tmp / "root", strategy=strategy)))
    result = run_job(
        [sys.executable, "-m", "lightning_pp", "fit", str(run), "--ckpt-path", str(ckpt)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=tmp,
        timeout=300,
    )
    assert result.returncode == 2, result.describe()
    assert not marker.exists(), f"the payload RAN: {result.describe()}"
    line = next(x for x in result.output.splitlines() if x.startswith("lightning-pp fit: error"))
    assert str(ckpt) in line and "Traceback" not in result.output, result.describe()
    return line


CASES = {
    # name: (pipelined run?, a hostile directory (else a plain file))
    "resume-directory": (True, True),
    "plain-trainer-directory": (False, True),
    "resume-plain-file": (True, False),
}


def background_jobs(items, tmp_path_factory) -> dict:
    """Each launched ``lightning-pp fit`` in the background (tests/background.py); the hostile
    files are written here, in the main thread, before any job starts."""
    wanted = {
        item.callspec.params["case"]
        for item in items
        if getattr(item, "originalname", "") == "test_a_launched_run_refuses_a_hostile_checkpoint"
    }
    jobs = {}
    for name in sorted(wanted):
        tmp = tmp_path_factory.mktemp(name)
        pipelined, directory = CASES[name]
        marker = tmp / "PWNED"
        maker = hostile_directory if directory else hostile_plain_file
        ckpt = maker(tmp / "hostile.ckpt", marker)
        jobs[f"hostile-{name}"] = lambda t=tmp, p=pipelined, c=ckpt, m=marker: _fit(
            t, pipelined=p, ckpt=c, marker=m
        )
    return jobs


@pytest.mark.timeout(background.WAIT)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_launched_run_refuses_a_hostile_checkpoint(case):
    line = background.check(f"hostile-{case}")
    # the refusal names what it refused: the unpickler's verdict on a file of the checkpoint
    assert "os.system" in line or "posix.system" in line, line


# ---------------------------------------------------------------- in this process
def test_the_hostile_files_are_live(tmp_path):
    """DCP's own reader runs the payload of this very directory: the refusals above mean it."""
    marker = tmp_path / "RAN"
    path = hostile_directory(tmp_path / "hostile.ckpt", marker)
    with contextlib.suppress(Exception):  # it runs the payload, then fails on its result
        dcp.FileSystemReader(str(path)).read_metadata()
    assert marker.exists()
    marker2 = tmp_path / "RAN2"
    plain = hostile_plain_file(tmp_path / "plain.ckpt", marker2)
    with contextlib.suppress(Exception):
        torch.load(plain, weights_only=False)
    assert marker2.exists()


@pytest.mark.parametrize("extra", [[], ["--lightning"]], ids=["state_dict", "lightning"])
def test_consolidate_refuses_a_hostile_directory(tmp_path, capsys, extra):
    marker = tmp_path / "PWNED"
    path = hostile_directory(tmp_path / "hostile.ckpt", marker)
    out = tmp_path / "out.pt"
    assert cli_main(["consolidate", str(path), str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert ".metadata" in err and ("os.system" in err or "posix.system" in err), err
    assert not marker.exists() and not out.exists()


def test_consolidate_refuses_a_directory_hostile_in_every_file(tmp_path, capsys):
    """Every file a payload, the marker and the JSON files included: refused at the first."""
    marker = tmp_path / "PWNED"
    path = hostile_directory(tmp_path / "hostile.ckpt", marker)
    for f in path.iterdir():
        f.write_bytes(pickle.dumps(_touch(marker)))
    assert cli_main(["consolidate", str(path), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert f"{path}/" in err, err  # names the file it refused
    assert not marker.exists()
    shutil.rmtree(path)
