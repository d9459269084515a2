"""A checkpoint directory's life: written hidden, published by one rename, removed whole.

Both formats write every file of a checkpoint into a hidden sibling ``.NAME.partial-TOKEN`` and,
once the completion marker is written there, rename it to ``NAME``. A process killed at any
point therefore leaves the previous checkpoint of that name intact and at most a ``.partial``
directory, which no loader accepts (it has no marker, and its name says what it is).

Example::

    tmp = new_partial_dir(Path("ckpts/step=5.ckpt"))   # rank 0, then broadcast the path
    ...                                                 # every rank writes into tmp
    publish(tmp, Path("ckpts/step=5.ckpt"))             # rank 0, after the marker is written
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "PARTIAL",
    "fsync_dir",
    "new_partial_dir",
    "publish",
    "remove_checkpoint_dir",
    "save_file_atomically",
]

#: what the hidden directory of a save in progress (or an interrupted one) has in its name
PARTIAL = ".partial-"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (best effort: not every OS allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def new_partial_dir(path: Path) -> Path:
    """Create the hidden directory a save of ``path`` writes into, after removing what earlier
    interrupted saves of the same name left (``.NAME.partial-*``). One rank calls it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}{PARTIAL}*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = path.parent / f".{path.name}{PARTIAL}{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def publish(tmp: Path, path: Path) -> None:
    """Rename the finished directory into place (replacing an older checkpoint of that name)."""
    old = None
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        # os.replace cannot overwrite a non-empty directory: move the old one aside first
        old = path.parent / f".{path.name}.old-{secrets.token_hex(4)}"
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_checkpoint_dir(path: str | os.PathLike) -> None:
    """Delete a checkpoint directory (or a file, or a dangling link) if it exists."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def save_file_atomically(obj: Any, out: Path) -> None:
    """``torch.save`` ``obj`` to ``out`` through a temporary sibling and a rename, so ``out``
    is either the old file or the whole new one (``consolidate``'s output)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
