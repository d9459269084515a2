"""The version-1 checkpoint format: its reader, kept for one release, and its writer.

Saves now write the DCP format (:mod:`.dcp_format`); this module still reads directories
written before it (:mod:`.strategy_io` and :mod:`.consolidate` dispatch here when a directory
holds ``index.json`` and no ``complete.json``). Its writer lives with the tests of the reader
(``tests/v1_writer.py``). To be removed one release after the switch.

A version-1 checkpoint is a **directory** (``epoch=0-step=5.ckpt`` is a folder)::

    step=5.ckpt/
      model.pp0.pt   ...  model.pp{P-1}.pt   parameters/buffers of one stage, by original name
      optim.pp0.pt   ...  optim.pp{P-1}.pt   that stage's optimizer state, keyed by parameter name
      meta.pt                                Lightning's metadata (loops, callbacks, schedulers...)
      index.json                             layout + which file holds which name; written last

Names are the LightningModule's own ``state_dict`` keys (``layers.3.qkv.weight``), which do not
depend on the pipeline shape (:class:`~lightning_pp.strategy.model.PipelineLayers` keys layers by
their
original index). So a rank of *any* later shape finds its parameters, and the optimizer state for
them, by name alone. Tied groups are stored once, under the group's first (canonical) name; data-
parallel replicas are identical, so only ``dp_rank == 0`` of each stage writes.

Atomicity: all ranks write into a hidden sibling directory ``.NAME.partial-TOKEN``; after every rank
reported success, rank 0 writes ``index.json`` (the completion marker) and renames the directory to
its final name. A crash at any point leaves either the previous checkpoint or a ``.partial``
directory, never a complete-looking one; :func:`read_index` refuses a directory without the marker.

Example::

    from lightning_pp.checkpoint import consolidate_checkpoint
    state_dict = consolidate_checkpoint("ckpts/step=5.ckpt", "gpt.pt")  # plain, single file
    model = GPT(**hparams); model.configure_model(); model.load_state_dict(state_dict)
"""

from __future__ import annotations

import json
import os
import pickle
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from .._lightning_compat import configure_optimizers_and_schedulers, load_file
from ..runtime.dtensor_state import module_state_like
from .agree import check_all_claimed
from .by_name import (
    adapt_scheduler_state,  # noqa: F401  (re-exported)
    adapt_scheduler_states,
    describe_layout,
    fit_scheduler_states,
    optimizer_state_by_name,
    tied_canonical_names,
)
from .by_name import canonical_names as _canonical
from .by_name import natural_key as _natural_key
from .by_name import param_names as _param_names
from .by_name import positional_optimizer_state as _optimizer_state_for
from .directory import PARTIAL, remove_checkpoint_dir
from .errors import CheckpointError  # re-exported: older code imports it from here

__all__ = [
    "CheckpointError",
    "FORMAT",
    "INDEX_FILE",
    "META_FILE",
    "consolidate_checkpoint",
    "is_pipeline_checkpoint",
    "META_SAFE_GLOBALS",
    "load_metadata",
    "load_model_shard",
    "load_optimizer_shard",
    "load_pipeline_checkpoint",
    "optimizer_state_by_name",
    "read_index",
    "remove_checkpoint_dir",
    "tied_canonical_names",
]

FORMAT = "lightning_pp.sharded_checkpoint"
VERSION = 1
INDEX_FILE = "index.json"
META_FILE = "meta.pt"
_PARTIAL = PARTIAL


# ---------------------------------------------------------------------------------- files
def _save_file(obj: Any, path: Path) -> None:
    """``torch.save`` + fsync (tests replace this function to inject a crash mid-save)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def is_pipeline_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding a complete sharded checkpoint."""
    try:
        read_index(path)
    except CheckpointError:
        return False
    return True


def read_index(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check ``index.json``; raise :class:`CheckpointError` for anything incomplete.

    Checks what the index alone can show: it parses, every listed file exists, every stage of
    the recorded layout (``pp``) has its model (and, if any, optimizer) file, every tensor name is
    stored in exactly one file, and every tied group's canonical tensor is stored. Whether the
    files hold what the index says is checked when they are read (:func:`_load_shard`).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is a file, not a lightning_pp sharded checkpoint directory"
        )
    index_path = path / INDEX_FILE
    if not index_path.is_file():
        hint = " (an interrupted save)" if _PARTIAL in path.name else ""
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} has no {INDEX_FILE}: it is incomplete{hint} or "
            f"not a lightning_pp checkpoint; refusing to load it"
        )
    try:
        index = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index_path}: cannot be read as JSON ({exc})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not index.get("complete"):
        raise CheckpointError(f"{index_path} is not a complete {FORMAT} index")
    if index.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{index_path} has format version {index['version']}; this lightning_pp reads <= "
            f"{VERSION}"
        )
    _check_index(index_path, index)
    for name in [*index["model_files"], *index["optim_files"], index["meta_file"]]:
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} lacks {name} listed in its index")
    return index


_STAGE_FILE = re.compile(r"(model|optim)\.pp(\d+)\.pt")


def _check_index(index_path: Path, index: dict[str, Any]) -> None:
    """The index's own consistency (see :func:`read_index`); raise naming what is wrong."""
    kinds = {"layout": dict, "meta_file": str, "model_files": dict, "optim_files": dict}
    for key, kind in kinds.items():
        if not isinstance(index.get(key), kind):
            raise CheckpointError(
                f"{index_path}: the {key!r} entry is missing or not a {kind.__name__}; the index "
                f"is damaged or was edited"
            )
    pp = index["layout"].get("pp")
    for kind in ("model", "optim"):
        files = index[f"{kind}_files"]
        stages = [_STAGE_FILE.fullmatch(f) for f in files]
        if not isinstance(pp, int) or not all(stages) or (kind == "optim" and not files):
            continue  # not written by PipelineStrategy (no per-stage naming), or weights only
        missing = sorted(set(range(pp)) - {int(m.group(2)) for m in stages if m})
        if missing:
            names = [f"{kind}.pp{r}.pt" for r in missing]
            raise CheckpointError(
                f"{index_path}: the checkpoint was written at pp={pp} but its index lists no "
                f"{kind} file for stage(s) {missing} ({', '.join(names)}); the index is "
                f"incomplete or was edited, refusing to use a checkpoint that lacks stages"
            )
    where: dict[str, str] = {}
    twice: dict[str, list[str]] = {}
    for fname, names in index["model_files"].items():
        for n in names:
            if n in where:
                twice.setdefault(n, [where[n]]).append(fname)
            where[n] = fname
    if twice:
        shown = "; ".join(f"{n} in {', '.join(fs)}" for n, fs in list(twice.items())[:5])
        raise CheckpointError(
            f"{index_path}: {len(twice)} tensor name(s) are listed in more than one file "
            f"({shown}); each is stored exactly once"
        )
    lost = sorted({c for c, _ in index.get("tied", []) if c not in where})
    if lost:
        raise CheckpointError(
            f"{index_path}: tied group(s) {lost} are not stored in any file listed in the index"
        )


def _load(path: Path, *, weights_only: bool, mmap: bool) -> Any:
    """Lightning's loader (local paths and fsspec URLs), or, with ``mmap`` and a local file in
    torch's zip format, ``torch.load(mmap=True)``."""
    if mmap and "://" not in str(path) and path.is_file():
        try:
            return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):  # only the legacy format is read the plain way below
                raise
    return load_file(str(path), map_location="cpu", weights_only=weights_only)


def _load_file(path: Path) -> Any:
    """A tensor file of the checkpoint (weights_only: tensors, numbers, strings, containers)."""
    try:
        # mmap: a rank pages in only the tensors it takes, not whole stage files
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        found = _DISALLOWED.search(str(exc))
        if found is None:
            raise _unpickling_error(path, exc) from None
        raise CheckpointError(  # never legitimate here: the writer saves tensors and names only
            f"{path}: refusing to unpickle {found.group(1)!r}: a lightning_pp tensor file holds "
            f"only tensors, numbers and strings; the file was tampered with or is foreign"
        ) from None
    except Exception as exc:  # a truncated zip, a directory, permissions: name the file
        raise CheckpointError(
            f"{path}: cannot be read as a torch.save file ({type(exc).__name__}: "
            f"{_first_line(exc)}); the file is damaged or not part of this checkpoint"
        ) from exc


def _load_shard(directory: Path, fname: str, names: Iterable[str]) -> Any:
    """Load a model or optimizer file and check that it holds exactly the names the index lists
    for it (a file swapped with another stage's, or an edited index, is refused)."""
    data = _load_file(directory / fname)
    if fname.startswith("optim."):
        ok = isinstance(data, list) and all(
            isinstance(s, dict) and {"state", "param_groups", "group_of"} <= s.keys() for s in data
        )
        held = {n for s in data for n in s["group_of"]} if ok else set()
    else:
        ok = isinstance(data, dict)
        held = set(data) if ok else set()
    if not ok:
        raise CheckpointError(
            f"{directory / fname}: holds a {type(data).__name__}, not a lightning_pp "
            f"{fname.split('.')[0]} shard"
        )
    listed = set(names)
    if held != listed:
        missing, extra = sorted(listed - held), sorted(held - listed)
        raise CheckpointError(
            f"{directory / fname}: its contents do not match {INDEX_FILE}: "
            + "; ".join(
                f"{what} {len(ns)} name(s) {_some(ns)}"
                for what, ns in (("lacks", missing), ("holds unlisted", extra))
                if ns
            )
            + " (a file swapped or copied from another checkpoint, or an edited index)"
        )
    return data


def _some(names: Sequence[str], k: int = 5) -> str:
    return f"{list(names[:k])}{' ...' if len(names) > k else ''}"


def _first_line(exc: BaseException) -> str:
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")


_DISALLOWED = re.compile(r"GLOBAL ([\w.]+)")


def _unpickling_error(path: Path, exc: Exception) -> CheckpointError:
    """torch's weights_only refusal, reworded: which file, which global, what to do."""
    found = _DISALLOWED.search(str(exc))
    if found is None:
        reason = [
            ln.strip()
            for ln in str(exc).splitlines()[1:]
            if ln.strip() and not ln.startswith(("Check the documentation", "Please file"))
        ]
        return CheckpointError(
            f"{path}: cannot be read with weights_only=True ({'; '.join(reason) or exc}): the "
            f"file is damaged, or holds an object torch's restricted unpickler cannot rebuild "
            f"(if you wrote this checkpoint and trust it: `lightning-pp consolidate ... "
            f"--trust-checkpoint`, Trainer.fit(..., weights_only=False))"
        )
    return CheckpointError(
        f"{path}: refusing to unpickle {found.group(1)!r}: a checkpoint's files are loaded with "
        f"weights_only=True, which allows tensors, containers and the types Lightning's metadata "
        f"holds (lightning_pp.checkpoint.META_SAFE_GLOBALS), because unpickling any other global "
        f"can run code. If you wrote this checkpoint and trust it, register the type with "
        f"torch.serialization.add_safe_globals([...]), or load with code execution allowed: "
        f"`lightning-pp consolidate ... --trust-checkpoint`, Trainer.fit(..., "
        f"weights_only=False)"
    )


def _meta_safe_globals() -> list[Any]:
    """Types found in Lightning's checkpoint metadata besides tensors and plain containers.

    What Lightning 2.6 writes (``_CheckpointConnector.dump_checkpoint``): loops' and callbacks'
    state (ints, floats, strings, tensors, dicts of them: ``ModelCheckpoint`` stores paths as
    strings and scores as tensors), optimizer and LR-scheduler state dicts (numbers, lists,
    tensors), the precision plugin's state (a GradScaler's numbers), ``hyper_parameters``
    (``dict(module.hparams)``, or an OmegaConf container with its type under ``hparams_type``).
    The hyperparameter values are whatever the module's ``__init__`` received: the common
    harmless ones (paths, namespaces, dates, OmegaConf containers) are allowed here; anything else
    is refused by name (see :func:`_unpickling_error`). Every entry is a plain data type whose
    unpickling calls no user code. (dict subclasses with items, e.g. a nested ``AttributeDict``
    or a filled ``defaultdict``, cannot be rebuilt by torch's restricted unpickler at all: such
    hyperparameters need the trusted load.)
    """
    import argparse
    import collections
    import datetime
    import pathlib
    import typing

    allowed: list[Any] = [
        argparse.Namespace,
        collections.defaultdict,
        datetime.date,
        datetime.datetime,
        datetime.time,
        datetime.timedelta,
        datetime.timezone,
        pathlib.Path,
        pathlib.PosixPath,
        pathlib.PurePath,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
        pathlib.WindowsPath,
        frozenset,
        range,
        slice,
    ]
    try:
        from omegaconf import DictConfig, ListConfig, nodes
        from omegaconf.base import ContainerMetadata, Metadata
    except ImportError:  # optional: only a module whose hparams are OmegaConf containers needs it
        return allowed
    # an OmegaConf container records its nodes' reference types, builtin classes included
    builtin_types = [bool, bytes, dict, float, int, list, str, tuple]
    node_types = [
        getattr(nodes, n) for n in dir(nodes) if n.endswith("Node") and n != "EnumNode"
    ]  # an EnumNode names its enum class, which is user code and refused unless registered
    return [
        *allowed,
        *builtin_types,
        DictConfig,
        ListConfig,
        ContainerMetadata,
        Metadata,
        typing.Any,
        *node_types,
    ]


META_SAFE_GLOBALS: list[Any] = _meta_safe_globals()


def load_metadata(
    path: str | os.PathLike, *, weights_only: bool | None = None, mmap: bool = False
) -> dict[str, Any]:
    """Load a checkpoint's ``meta.pt`` (Lightning's loops, callbacks, schedulers, hparams), or a
    whole plain Lightning checkpoint file.

    By default (``weights_only`` None or True) with torch's restricted unpickler, allowing only
    tensors, containers and :data:`META_SAFE_GLOBALS` (plus what the user registered with
    ``torch.serialization.add_safe_globals``): a file that pickles anything else, e.g. a call to
    ``os.system``, is refused with a :class:`CheckpointError` naming the file and the global.
    ``weights_only=False`` unpickles anything, which runs whatever code the file names: only for
    files you trust (``Trainer.fit(..., weights_only=False)`` passes it through).

    ``mmap``: map a local file's tensors instead of reading them (``torch.load(mmap=True)``):
    a tensor's pages are read when it is used, into the page cache a node's ranks share. The
    tensors returned then read the file itself: the caller copies what it keeps before the file
    can change (Lightning rewrites ``last.ckpt`` in place). A remote file, or one in torch's
    legacy format, is read whole.
    """
    path = Path(path)
    trusted = weights_only is False
    try:
        if trusted:
            return _load(path, weights_only=False, mmap=mmap)
        with torch.serialization.safe_globals(META_SAFE_GLOBALS):
            return _load(path, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if trusted:
            raise CheckpointError(f"{path}: cannot be unpickled ({_first_line(exc)})") from exc
        raise _unpickling_error(path, exc) from None
    except Exception as exc:
        raise CheckpointError(
            f"{path}: cannot be read as a torch.save file ({type(exc).__name__}: "
            f"{_first_line(exc)}); the file is damaged or not part of this checkpoint"
        ) from exc


def _name_to_file(files: Mapping[str, Sequence[str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for fname, names in files.items():
        for n in names:
            out.setdefault(n, fname)
    return out


# ---------------------------------------------------------------------------------- collectives
def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_gather(obj: Any) -> list[Any]:
    if not _dist():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------- loading
def load_model_shard(
    path: str | os.PathLike,
    module: nn.Module,
    canonical: Mapping[str, str],
    strict: bool = True,
    index: Mapping[str, Any] | None = None,
) -> list[str]:
    """Load the checkpoint's tensors for the names ``module`` holds; return the names used.

    Each key of ``module.state_dict()`` is looked up under its canonical name; only the stage
    files that hold those names are opened (memory-mapped).
    """
    path = Path(path)
    index = index or read_index(path)
    where = _name_to_file(index["model_files"])
    wanted = {k: canonical.get(k, k) for k in module.state_dict()}
    missing = sorted(k for k, c in wanted.items() if c not in where)
    if missing and strict:
        shape = describe_layout(index.get("layout", {}))
        raise CheckpointError(
            f"checkpoint {str(path)!r} (saved at {shape}) has no tensors for "
            f"{len(missing)} name(s) of this rank: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}"
        )
    by_file: dict[str, list[str]] = {}
    for k, c in wanted.items():
        if c in where:
            by_file.setdefault(where[c], []).append(k)
    state: dict[str, Any] = {}
    for fname, keys in by_file.items():
        data = _load_shard(path, fname, index["model_files"][fname])
        for k in keys:
            state[k] = data[wanted[k]]
    module.load_state_dict(module_state_like(module, state), strict=strict)
    return sorted({wanted[k] for k in state})


def _merged_optimizer_states(
    path: Path, index: Mapping[str, Any], names: Iterable[str]
) -> list[dict[str, Any]]:
    """Per optimizer: ``{"state": {name: ...}, "group_of": {name: hyperparameters}}``."""
    names = set(names)
    files = [f for f, ns in index["optim_files"].items() if names & set(ns)]
    merged: list[dict[str, Any]] = []
    for fname in files:
        for i, saved in enumerate(_load_shard(path, fname, index["optim_files"][fname])):
            while len(merged) <= i:
                merged.append({"state": {}, "group_of": {}})
            for n, gi in saved["group_of"].items():
                if n in names:
                    if not (isinstance(gi, int) and 0 <= gi < len(saved["param_groups"])):
                        raise CheckpointError(
                            f"{path / fname}: optimizer {i} puts {n!r} in param group {gi!r}, "
                            f"but holds {len(saved['param_groups'])} group(s); the file is damaged"
                        )
                    merged[i]["group_of"][n] = saved["param_groups"][gi]
                    if n in saved["state"]:
                        merged[i]["state"][n] = saved["state"][n]
    return merged


def load_optimizer_shard(
    path: str | os.PathLike,
    optimizers: Sequence[Optimizer],
    module: nn.Module,
    canonical: Mapping[str, str],
    index: Mapping[str, Any] | None = None,
) -> None:
    """Load each optimizer's state for the parameters ``module`` holds, found by name."""
    if not optimizers:
        return
    path = Path(path)
    index = index or read_index(path)
    if not index["optim_files"]:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds no optimizer state (saved with weights_only=True?)"
        )
    names = _param_names(module, canonical)
    merged = _merged_optimizer_states(path, index, (n for n, _ in names.values()))
    if len(merged) < len(optimizers):
        merged += [{"state": {}, "group_of": {}}] * (len(optimizers) - len(merged))
    for i, optimizer in enumerate(optimizers):
        sd = _optimizer_state_for(optimizer, names, merged[i], f"{path} optimizer {i}")
        optimizer.load_state_dict(sd)


# ---------------------------------------------------------------------------------- one rank
# What PipelineStrategy.save_checkpoint / load_checkpoint / optimizer_state call: plain values in
# (this rank's place, the run's layout), nothing of the strategy.
def load_pipeline_checkpoint(
    path: str | os.PathLike,
    module: Any,
    *,
    rank: int,
    optimizers: Sequence[Optimizer] | None = None,
    scheduler_configs: Sequence[Any] = (),
    weights_only: bool | None = None,
    canonical: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Collective: load this rank's layers (and, when ``optimizers`` is given, their optimizer
    state) by name; return Lightning's metadata dict.

    Works whatever pipeline shape wrote the checkpoint: names do not depend on it. A failure on
    any rank is raised on every rank, so none is left waiting in a collective. With
    ``module.strict_loading``, a saved tensor that no rank of this model loaded is an error.
    ``scheduler_configs`` (the Trainer's ``lr_scheduler_configs``) get their saved states fitted
    to THIS rank's param groups (rank 0 saved them for its own). ``weights_only``: see
    :func:`load_metadata` (``None``, the Trainer's default, loads ``meta.pt`` safely).
    """
    path = str(path)
    index = read_index(path)
    canonical = _canonical(module, canonical)
    strict = module.strict_loading
    used: list[str] = []
    error = None
    try:
        used = load_model_shard(path, module, canonical, strict=strict, index=index)
        if optimizers is not None:
            load_optimizer_shard(path, optimizers, module, canonical, index=index)
    except Exception as exc:
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    gathered = _all_gather((used, error))
    errors = [e for _, e in gathered if e]
    if errors:
        raise CheckpointError(f"loading checkpoint {path!r} failed: " + "; ".join(errors))
    if strict:
        saved = [n for names in index["model_files"].values() for n in names]
        claimed = [n for names, _ in gathered for n in names]
        check_all_claimed(saved, claimed, f"checkpoint {path!r}")
    meta = load_metadata(Path(path) / index["meta_file"], weights_only=weights_only)
    return meta if optimizers is None else fit_scheduler_states(meta, scheduler_configs)


# ---------------------------------------------------------------------------------- consolidate
def consolidated_state_dict(
    path: str | os.PathLike, submodule: str | None = None
) -> dict[str, Tensor]:
    """All stages' tensors in one dict, tied members expanded (same tensor under each name).

    ``submodule``: keep only the keys under that LightningModule attribute, without its prefix
    (``"model"``: the state dict of the Hugging Face model a ``split=`` module holds as
    ``self.model``, for ``HFModel.load_state_dict(strict=True)`` / ``save_pretrained``).
    """
    path = Path(path)
    index = read_index(path)
    state: dict[str, Tensor] = {}
    for fname, names in index["model_files"].items():
        for k, v in _load_shard(path, fname, names).items():
            state[k] = v.clone() if isinstance(v, Tensor) else v
    for canonical, member in index["tied"]:
        if canonical in state:
            state[member] = state[canonical]
    if submodule:
        prefix = submodule.rstrip(".") + "."
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if not state:
            raise CheckpointError(f"checkpoint {str(path)!r} holds no keys under {prefix!r}")
    return dict(sorted(state.items(), key=lambda kv: _natural_key(kv[0])))


def consolidate_checkpoint(
    path: str | os.PathLike,
    out: str | os.PathLike | None = None,
    module: Any = None,
    submodule: str | None = None,
    *,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Merge a sharded checkpoint into one ordinary file.

    Without ``module``: a plain ``state_dict`` (original names, every tied name present) that
    loads with ``load_state_dict(strict=True)`` into the unpipelined LightningModule.

    With ``module`` (an unpipelined LightningModule of the same architecture; ``configure_model``
    is called if its layers are not built yet): a full Lightning checkpoint (``state_dict``,
    ``optimizer_states`` in the positional order of ``module.configure_optimizers()``,
    ``lr_schedulers``, loops, callbacks, hyperparameters), so a plain ``Trainer`` resumes with
    ``trainer.fit(module, ckpt_path=out)``. ``weights_only=False`` loads ``meta.pt`` with code
    execution allowed (see :func:`load_metadata`): only for checkpoints you trust.

    ``submodule`` (without ``module``): only that attribute's keys, unprefixed (see
    :func:`consolidated_state_dict`).

    Every stage of the recorded layout must be present and every file must hold exactly what the
    index lists (:func:`read_index`); otherwise a :class:`CheckpointError` is raised and nothing
    is written. Returns what was (or would be) written to ``out``.
    """
    path = Path(path)
    if module is not None and submodule:
        raise ValueError(
            "consolidate_checkpoint: pass module (a Lightning checkpoint) or "
            "submodule (a plain state dict of one attribute), not both"
        )
    state = consolidated_state_dict(path, None if module is not None else submodule)
    if module is None:
        result: dict[str, Any] = state
    else:
        result = _lightning_checkpoint(path, state, module, weights_only=weights_only)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
        _save_file(result, tmp)
        os.replace(tmp, out)
    return result


def _lightning_checkpoint(
    path: Path, state: dict[str, Tensor], module: Any, *, weights_only: bool = True
) -> dict[str, Any]:
    index = read_index(path)
    meta = load_metadata(path / index["meta_file"], weights_only=weights_only)
    if getattr(module, "layers", None) is None and hasattr(module, "configure_model"):
        module.configure_model()
    module.load_state_dict(state, strict=True)
    layers = module.pipeline_layers() if hasattr(module, "pipeline_layers") else None
    canonical = tied_canonical_names(module, layers) if layers is not None else {}
    optimizers, scheduler_configs = configure_optimizers_and_schedulers(module)
    ckpt = dict(meta)
    ckpt["state_dict"] = state
    if index["optim_files"] and optimizers:
        names = _param_names(module, canonical)
        merged = _merged_optimizer_states(path, index, (n for n, _ in names.values()))
        opt_states = []
        for i, optimizer in enumerate(optimizers):
            sd = _optimizer_state_for(optimizer, names, merged[i], f"{path} optimizer {i}")
            optimizer.load_state_dict(sd)  # validates, and gives the schedulers their groups
            opt_states.append(optimizer.state_dict())
        ckpt["optimizer_states"] = opt_states
        if "lr_schedulers" in meta:
            ckpt["lr_schedulers"] = adapt_scheduler_states(meta["lr_schedulers"], scheduler_configs)
    return ckpt
