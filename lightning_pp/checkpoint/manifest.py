"""The completion marker of a checkpoint directory: every file's size and sha256, written last.

A save is complete only when its marker exists (DESIGN, "checkpoints hold no code"): the writer
calls :func:`write_manifest` after every other file is written, and the marker appears by an
atomic rename, so a save killed at any point has no marker. :func:`verify_manifest` is the
reader's gate, before any rank changes its state: it refuses a directory without the marker,
and one whose files differ from the list (missing, truncated, swapped or altered, or extra),
naming the file.

The marker is JSON::

    {"format": "lightning_pp.manifest", "version": 1, "hash": "sha256",
     "files": {"__0_0.distcp": {"size": 1577, "sha256": "9f..."}, ...},
     "extra": {...}}      # the writer's layout information, returned as given

Example::

    write_manifest(tmp_dir, extra={"pp": 2, "dp": 2})   # last step of a save
    manifest = verify_manifest(path)                     # first step of a load
    layout = manifest["extra"]
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import CheckpointError

__all__ = ["MANIFEST", "file_sha256", "verify_manifest", "write_manifest"]

MANIFEST = "complete.json"
FORMAT = "lightning_pp.manifest"
VERSION = 1
_BLOCK = 4 << 20  # 4 MiB reads: past ~1 MiB the hash, not the syscalls, sets the speed
_TMP = ".tmp-"


def file_sha256(path: str | os.PathLike, *, fsync: bool = False) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in 4 MiB blocks into one reused buffer (no copies);
    ``fsync`` also flushes the file to disk (the writer's: data durable before the marker)."""
    digest = hashlib.sha256()
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])  # hashlib drops the GIL for large updates
            size += n
        if fsync:
            os.fsync(f.fileno())
    return size, digest.hexdigest()


def _files(directory: Path, name: str) -> list[str]:
    """Every regular file under ``directory`` as a POSIX relative path, sorted; the marker and
    its temporary files excluded. A symlink or other special file is refused: a checkpoint
    lists bytes it holds, not pointers elsewhere."""
    out = []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for entry in [*dirs, *files]:
            full = Path(root) / entry
            if full.is_symlink() or not (full.is_dir() or full.is_file()):
                raise CheckpointError(f"{full}: a link or special file inside a checkpoint")
        for fname in files:
            rel = (Path(root) / fname).relative_to(directory).as_posix()
            if rel != name and not rel.startswith(name + _TMP):
                out.append(rel)
    return sorted(out)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(
    directory: str | os.PathLike, extra: dict[str, Any] | None = None, name: str = MANIFEST
) -> Path:
    """List every file of ``directory`` (recursively) with its size and sha256, plus ``extra``
    (JSON-serialisable layout information), into ``directory/name``; returns its path.

    Call it last: each file is fsynced as it is hashed, the marker is written to a temporary
    file, fsynced, renamed into place and the directory fsynced, so the marker is never seen
    before the data it vouches for, nor half-written.
    """
    directory = Path(directory)
    files = {}
    for rel in _files(directory, name):
        size, digest = file_sha256(directory / rel, fsync=True)
        files[rel] = {"size": size, "sha256": digest}
    for sub in {str(PurePosixPath(rel).parent) for rel in files} - {"."}:
        _fsync_dir(directory / sub)  # a file's directory entry is durable only once its dir is
    manifest = {"format": FORMAT, "version": VERSION, "hash": "sha256", "files": files}
    manifest["extra"] = extra if extra is not None else {}
    try:
        text = json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{directory / name}: extra is not plain JSON ({exc})") from None
    target = directory / name
    tmp = directory / f"{name}{_TMP}{secrets.token_hex(4)}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    _fsync_dir(directory)
    return target


def _read(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing: the save did not finish (interrupted, or still being written), "
            f"or this is not a lightning_pp checkpoint"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read as JSON ({exc})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    ok = (
        isinstance(files, dict)
        and manifest.get("format") == FORMAT
        and manifest.get("version") == VERSION
        and manifest.get("hash") == "sha256"
        and all(
            isinstance(v, dict)
            and type(v.get("size")) is int
            and isinstance(v.get("sha256"), str)
            and _plain_relative(k)
            for k, v in files.items()
        )
    )
    if not ok:
        raise CheckpointError(f"{path} is not a {FORMAT} version {VERSION} marker")
    return manifest


def _plain_relative(rel: Any) -> bool:
    """A relative POSIX path that stays inside the directory."""
    if not isinstance(rel, str) or not rel:
        return False
    p = PurePosixPath(rel)
    return not p.is_absolute() and ".." not in p.parts and "\\" not in rel


def verify_manifest(
    directory: str | os.PathLike, name: str = MANIFEST, *, hashes: bool = True
) -> dict[str, Any]:
    """Check ``directory`` against its marker and return the marker's contents.

    Raises :class:`CheckpointError` naming the file when the marker is missing (an incomplete
    save), a listed file is missing, has another size (truncated, or swapped for a
    different-sized one) or another sha256 (swapped or altered), or a file is present that the
    marker does not list. Sizes and the file list are checked before any file is hashed, so the
    common faults are found without reading gigabytes; ``hashes=False`` skips the hashing.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {str(directory)!r} is not a directory")
    marker = directory / name
    manifest = _read(marker)
    listed: dict[str, dict[str, Any]] = manifest["files"]
    present = set(_files(directory, name))
    for rel, entry in sorted(listed.items()):
        path = directory / rel
        if rel not in present:
            raise CheckpointError(f"{path} is missing (listed in {marker})")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"{path} has {size} bytes where {marker} lists {entry['size']}: the file is "
                f"truncated or was replaced"
            )
    unlisted = sorted(present - listed.keys())
    if unlisted:
        raise CheckpointError(
            f"{directory / unlisted[0]} is not listed in {marker}"
            + (f" (nor are {len(unlisted) - 1} more)" if len(unlisted) > 1 else "")
            + ": a file added after the save, or copied in from another checkpoint"
        )
    if hashes:
        for rel, entry in sorted(listed.items()):
            _, digest = file_sha256(directory / rel)
            if digest != entry["sha256"]:
                raise CheckpointError(
                    f"{directory / rel}: its sha256 differs from the one {marker} lists: the file "
                    f"was altered or swapped with another of the same size"
                )
    return manifest
