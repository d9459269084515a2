"""Reading a torch.distributed.checkpoint (DCP) directory without running code from it.

Stock DCP (torch 2.13) unpickles from the directory in two places:

- ``FileSystemReader.read_metadata`` calls a plain ``pickle.load`` on ``.metadata``: a crafted
  file runs any function it names (``os.system``) the moment it is read.
- ``DefaultLoadPlanner.load_bytes`` (default_planner.py, lines 387 and 390) calls
  ``torch.load(value, weights_only=False)`` on every non-tensor ("bytes") item of a data file.

Tensor items are read with ``torch.load(..., weights_only=True)`` (filesystem.py,
``read_data``): torch's restricted unpickler, which rebuilds tensors only, so it is kept.

Here :class:`SafeFileSystemReader` reads ``.metadata`` with an unpickler that constructs only
the classes DCP's ``Metadata`` is made of, checks the storage entries it names (each a file
inside the directory), and refuses bytes items before reading any; :class:`TensorsOnlyLoadPlanner`
refuses bytes items when the load is planned, before any tensor is copied. lightning_pp's format
stores only tensors through DCP (Lightning's own metadata goes to :mod:`.meta_codec`), so a
bytes item in its checkpoint is never legitimate. :func:`safe_dcp_load` is ``dcp.load`` with both.

Example::

    state = {"model": model.state_dict()}
    verify_manifest(path)           # .manifest: every file present, whole, unaltered
    safe_dcp_load(state, path)      # tensors are copied into state's tensors in place
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .errors import CheckpointError

__all__ = [
    "METADATA_GLOBALS",
    "SafeFileSystemReader",
    "TensorsOnlyLoadPlanner",
    "read_dcp_metadata",
    "safe_dcp_load",
]

# The globals a torch 2.13 ``.metadata`` pickle names, found by recording ``find_class`` while
# unpickling real saves (every dtype, 0-d, empty, non-contiguous, channels-last tensors,
# Parameters, nested dicts/lists, python scalars as bytes items, optimizer state from
# get_state_dict, DTensors Shard/Replicate, one file per rank or per item). Every one is a plain
# data class, an enum, or a lookup by name: constructing them calls no code chosen by the file.
# torch dtypes (``torch.float32`` ...) and ``torch.Size`` are checked by value in _find_class.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),  # an Enum
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        # torch.layout pickles as _get_layout("torch.strided"): a dict lookup by name
        ("torch.serialization", "_get_layout"),
        # StorageMeta.checkpoint_id when the save was given a Path (a POSIX path: no I/O)
        ("pathlib", "PosixPath"),
    }
)

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_DISALLOWED = re.compile(r"GLOBAL ([\w.]+)")  # torch's weights_only refusal names the global


class _MetadataUnpickler(pickle.Unpickler):
    """Constructs only :data:`METADATA_GLOBALS`, torch dtypes and ``torch.Size``; any other
    global (``posix.system``, ``builtins.eval``, ``copyreg._reconstructor`` ...) is refused
    before it is even imported."""

    def __init__(self, file: IO[bytes], path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        # the lookup is done here, never by pickle's own find_class (which imports the module and
        # follows dotted names): a name outside the fixed set is never imported
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and _IDENTIFIER.match(name):
            value = getattr(torch, name, None)
            if value is torch.Size or isinstance(value, torch.dtype):
                return value
        raise CheckpointError(
            f"refusing to unpickle {module + '.' + name!r} from {self._path}: a DCP metadata file "
            f"holds only torch.distributed.checkpoint's metadata classes, sizes and dtypes; this "
            f"one names other code, so it was tampered with or is foreign (nothing was run)"
        )

    def persistent_load(self, pid: Any) -> Any:  # DCP's metadata pickle has no persistent ids
        raise CheckpointError(f"refusing a persistent id in {self._path}: not a DCP metadata file")


def _check_storage(metadata: Any, directory: Path, path: Path) -> None:
    """Refuse metadata whose storage entries point outside the directory or are malformed:
    ``read_data`` opens ``relative_path`` as given, so ``../../x`` would read any file."""
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path}: its storage_data is a {type(storage).__name__}, not a dict")
    root = directory.resolve()
    for index, info in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointError(f"{path}: a storage entry is not (MetadataIndex, _StorageInfo)")
        rel = info.relative_path
        ok = (
            isinstance(rel, str)
            and rel
            and not os.path.isabs(rel)
            and ".." not in Path(rel).parts
            and (root / rel).resolve().is_relative_to(root)
            and all(type(v) is int and v >= 0 for v in (info.offset, info.length))
        )
        if not ok:
            raise CheckpointError(
                f"{path}: the storage entry of {index.fqn!r} ({rel!r}, offset {info.offset!r}, "
                f"length {info.length!r}) is not a byte range of a file inside {directory}"
            )


def read_dcp_metadata(path: str | os.PathLike) -> dcp_metadata.Metadata:
    """Read a DCP ``.metadata`` file with the restricted unpickler and check its storage entries;
    raise :class:`CheckpointError` naming the file for anything else."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist: not a complete DCP checkpoint") from None
    except Exception as exc:  # truncated, not a pickle, a dataclass rebuilt with wrong fields
        raise CheckpointError(
            f"{path}: cannot be read as DCP metadata ({type(exc).__name__}: {exc})"
        ) from None
    _check_storage(metadata, path.parent, path)
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` that unpickles nothing but DCP's metadata classes.

    - ``.metadata`` is read by :func:`read_dcp_metadata` (restricted unpickler, storage entries
      checked), not ``pickle.load``;
    - a refused ``.metadata`` is final: there is no fall back to rank-local ``__N.metadata``
      files (stock DCP falls back when ``read_metadata`` takes ``**kwargs``, which would let a
      planted rank file replace a refused global one);
    - bytes items are refused before any byte is read (their reader is ``torch.load`` with
      ``weights_only=False`` in the planner); tensor items go through torch's ``weights_only``
      reader, and any failure names the data file.

    Example::

        reader = SafeFileSystemReader(path)
        dcp.load(state, storage_reader=reader, planner=TensorsOnlyLoadPlanner())
    """

    #: the refusal of the last :meth:`read_metadata`: dcp.load catches it and raises an
    #: AssertionError of its text instead, so :func:`safe_dcp_load` re-raises this one
    refusal: CheckpointError | None = None

    def read_metadata(self, *args: Any, rank: int | None = None) -> dcp_metadata.Metadata:
        try:
            metadata = read_dcp_metadata(Path(self._get_metadata_path(rank)))
        except CheckpointError as exc:
            self.refusal = exc
            raise
        # as FileSystemReader.read_metadata does: a fresh load id for this load
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        # check every item first, so a refusal leaves the state untouched
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            rel = self.storage_data[item.storage_index].relative_path
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointError(
                    f"refusing the non-tensor item {item.dest_index.fqn!r} of "
                    f"{Path(self.path) / rel}: reading it would unpickle arbitrary objects, and "
                    f"a lightning_pp checkpoint stores only tensors through DCP"
                )
            by_file.setdefault(rel, []).append(item)
        future = None
        for rel, items in by_file.items():  # one file at a time, so an error can name it
            try:
                future = super().read_data(dataclasses.replace(plan, items=items), planner)
                future.wait()
            except CheckpointError:
                raise
            except Exception as exc:
                raise _data_error(Path(self.path) / rel, exc) from None
        return future if future is not None else super().read_data(plan, planner)


def _data_error(path: Path, exc: Exception) -> CheckpointError:
    found = _DISALLOWED.search(str(exc)) if isinstance(exc, pickle.UnpicklingError) else None
    if found is not None:
        return CheckpointError(
            f"refusing to unpickle {found.group(1)!r} from {path}: a DCP data file holds only "
            f"tensors; it was tampered with or is foreign (nothing was run)"
        )
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return CheckpointError(
        f"{path}: a tensor cannot be read ({type(exc).__name__}: {first}); the file is "
        f"truncated, damaged or from another checkpoint"
    )


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that loads tensors only: a plan that would read a non-tensor
    (bytes) item is refused when it is made, before anything is read, and ``load_bytes`` (stock:
    ``torch.load(weights_only=False)``) refuses too.

    Example::

        dcp.load(state, storage_reader=SafeFileSystemReader(path),
                 planner=TensorsOnlyLoadPlanner(allow_partial_load=False))
    """

    def __init__(self, *args: Any, checkpoint: str | os.PathLike | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._checkpoint = checkpoint  # only to name the directory in errors

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        names = sorted({i.dest_index.fqn for i in plan.items if i.type == LoadItemType.BYTE_IO})
        if names:
            raise CheckpointError(
                f"refusing to load non-tensor item(s) {names[:5]}{' ...' if len(names) > 5 else ''}"
                f" of {self._path()}: reading one would unpickle arbitrary objects, and a "
                f"lightning_pp checkpoint stores only tensors through DCP"
            )
        return plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(
            f"refusing to unpickle the non-tensor item {read_item.dest_index.fqn!r} of "
            f"{self._path()}: a lightning_pp checkpoint stores only tensors through DCP"
        )

    def _path(self) -> str:
        return str(self._checkpoint) if self._checkpoint is not None else "the checkpoint"


class _QuietFallback(logging.Filter):
    """Drops DCP's "Global metadata is not found. Falling back to rank local metadata." (with
    its traceback) after our reader refused ``.metadata``: the refusal is raised, nothing falls
    back, and the warning would mislead. DCP logs it on the root logger (state_dict_loader.py)."""

    def __init__(self, reader: SafeFileSystemReader) -> None:
        super().__init__()
        self._reader = reader

    def filter(self, record: logging.LogRecord) -> bool:
        return self._reader.refusal is None or not str(record.msg).startswith(
            ("Global metadata is not found", "Rank local metadata is not found")
        )


def safe_dcp_load(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    process_group: dist.ProcessGroup | None = None,
    *,
    allow_partial_load: bool = False,
) -> None:
    """``dcp.load`` of the tensors of ``state_dict`` from ``path`` in place, through
    :class:`SafeFileSystemReader` and :class:`TensorsOnlyLoadPlanner` (collective over
    ``process_group``, or the default group; one process without an initialised group loads
    alone). Raises :class:`CheckpointError`: the reader's or planner's own, or one naming the
    directory for DCP's other failures (a key missing from the checkpoint, a shape mismatch).
    """
    no_dist = not (dist.is_available() and dist.is_initialized())
    reader = SafeFileSystemReader(path)
    quiet = _QuietFallback(reader)
    logging.getLogger().addFilter(quiet)
    try:
        with warnings.catch_warnings():  # one process (no group) is meant, not a slip: quiet
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(
                state_dict,
                storage_reader=reader,
                planner=TensorsOnlyLoadPlanner(
                    allow_partial_load=allow_partial_load, checkpoint=path
                ),
                process_group=process_group,
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        # DCP wraps each rank's exception; ours (which name the file) are raised as they are
        errors = [e for e, _ in exc.failures.values()]
        ours = next((e for e in errors if isinstance(e, CheckpointError)), reader.refusal)
        if ours is not None:
            raise ours from None
        detail = "; ".join(
            f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(exc.failures.items())
        )
        raise CheckpointError(f"loading DCP checkpoint {str(path)!r} failed: {detail}") from None
    finally:
        logging.getLogger().removeFilter(quiet)
