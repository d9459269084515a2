"""The DCP format's metadata: what it records of the tensors, and reading it back verified.

DCP stores the tensors; ``meta.json`` + ``meta.safetensors`` (:mod:`.meta_codec`, no pickle)
store the rest, with one entry per stored name so a loader can check and allocate everything
before DCP reads a byte::

    {"format": "lightning_pp.dcp_checkpoint", "version": 2,
     "layout": {"pp": 2, "vpp": 1, "dp": 2, ...},          # the run that wrote it
     "tied": [["layers.0.wte.weight", "layers.7.head.weight"]],   # [canonical, member]
     "model": {"layers.0.wte.weight": ["float32", [50, 16]], ...},  # dtype, shape
     "optimizers": [{"tensors": {name: {"exp_avg": ["float32", [50, 16]], "step": [...]}},
                     "values": {name: {non-tensor state}},
                     "group_of": {name: group index}, "param_groups": [hyperparameters...]}],
     "lightning": {Lightning's checkpoint dict less state_dict and optimizer_states}}

Example::

    state, desc = split_rank_state(checkpoint, canonical)   # each rank: what DCP writes
    meta = {**merge_descriptions(all_descs), "lightning": checkpoint, ...}
    meta = read_dcp_checkpoint_meta(path)                    # loaders: marker + manifest checked
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .by_name import natural_key, same_hyper
from .errors import CheckpointError
from .manifest import MANIFEST, verify_manifest
from .meta_codec import META_JSON, read_meta

__all__ = [
    "FORMAT",
    "VERSION",
    "empty_from_spec",
    "is_dcp_checkpoint",
    "merge_descriptions",
    "read_dcp_checkpoint_meta",
    "split_rank_state",
    "tensor_spec",
]

FORMAT = "lightning_pp.dcp_checkpoint"
VERSION = 2


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory with this format's completion marker (cheap: a loader
    still verifies everything; a ``.partial`` directory of an interrupted save has none)."""
    return (Path(path) / MANIFEST).is_file()


def tensor_spec(t: Tensor) -> list[Any]:
    """A tensor's dtype and shape, as JSON: what a loader allocates before DCP reads."""
    return [str(t.dtype).removeprefix("torch."), list(t.shape)]


def spec_dtype(spec: Sequence[Any]) -> torch.dtype:
    """The dtype of a :func:`tensor_spec`; a name that is not one of torch's dtypes is refused."""
    name = spec[0]
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint's metadata")
    return dtype


def empty_from_spec(spec: Sequence[Any], device: Any = "cpu") -> Tensor:
    """An uninitialised tensor of a :func:`tensor_spec` (``["float32", [4, 8]]``), for DCP to
    read into; a dtype that is not one of torch's is refused."""
    return torch.empty([int(n) for n in spec[1]], dtype=spec_dtype(spec), device=device)


def _is_spec(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], list)
        and all(type(n) is int and n >= 0 for n in value[1])
    )


def _check_structure(meta: Mapping[str, Any], where: Path) -> None:
    """What the loaders index into is there and of its type (an edited meta.json is refused
    here, naming the file, not met later as a KeyError)."""
    problems = []
    if not (isinstance(meta.get("model"), dict) and all(map(_is_spec, meta["model"].values()))):
        problems.append("'model' is not {name: [dtype, shape]}")
    tied = meta.get("tied")
    if not (isinstance(tied, list) and all(isinstance(t, list) and len(t) == 2 for t in tied)):
        problems.append("'tied' is not a list of [canonical, member] pairs")
    for key in ("layout", "lightning"):
        if not isinstance(meta.get(key), dict):
            problems.append(f"{key!r} is not a dict")
    for i, opt in enumerate(meta.get("optimizers", [])):
        groups = opt.get("param_groups") if isinstance(opt, dict) else None
        ok = (
            isinstance(groups, list)
            and all(isinstance(g, dict) for g in groups)
            and isinstance(opt.get("values"), dict)
            and isinstance(opt.get("group_of"), dict)
            and all(type(g) is int and 0 <= g < len(groups) for g in opt["group_of"].values())
            and isinstance(opt.get("tensors"), dict)
            and all(
                isinstance(t, dict) and all(map(_is_spec, t.values()))
                for t in opt["tensors"].values()
            )
        )
        if not ok:
            problems.append(f"optimizer {i}'s entry is malformed")
    if problems:
        raise CheckpointError(f"{where}: {'; '.join(problems)}; the file was edited or is foreign")


def split_rank_state(
    checkpoint: dict[str, Any], canonical: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's DCP state (tensors only) and its description for the metadata.

    ``checkpoint["optimizer_states"]`` holds :func:`~.by_name.optimizer_state_by_name` dicts.
    """
    model = {
        k: v.detach()
        for k, v in checkpoint.pop("state_dict", {}).items()
        if isinstance(v, Tensor) and canonical.get(k, k) == k  # a tied copy: its owner stores it
    }
    state: dict[str, Any] = {"state_dict": model}
    desc: dict[str, Any] = {"model": {k: tensor_spec(v) for k, v in model.items()}}
    optims = checkpoint.pop("optimizer_states", None)
    if optims is not None:
        desc["optimizers"] = []
        for i, saved in enumerate(optims):
            tensors: dict[str, dict[str, Tensor]] = {}
            opt_desc: dict[str, Any] = {"tensors": {}, "values": {}, "group_of": {}}
            for name, entry in saved["state"].items():
                tensors[name] = {k: v.detach() for k, v in entry.items() if isinstance(v, Tensor)}
                opt_desc["tensors"][name] = {k: tensor_spec(v) for k, v in tensors[name].items()}
                values = {k: v for k, v in entry.items() if not isinstance(v, Tensor)}
                if values:  # e.g. an int step count: JSON, not DCP
                    opt_desc["values"][name] = values
            for name, gi in saved["group_of"].items():
                opt_desc["group_of"][name] = saved["param_groups"][gi]
            state[f"optimizer_{i}"] = {"state": tensors}
            desc["optimizers"].append(opt_desc)
    return state, desc


def merge_descriptions(descs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every rank's description in one: names once (dp replicas describe the same ones), each
    optimizer's param groups listed once and referred to by index (``group_of``)."""
    model: dict[str, Any] = {}
    for d in descs:
        model.update(d["model"])
    out: dict[str, Any] = {"model": dict(sorted(model.items(), key=lambda kv: natural_key(kv[0])))}
    if any("optimizers" in d for d in descs):
        count = max(len(d.get("optimizers", ())) for d in descs)
        out["optimizers"] = []
        for i in range(count):
            merged: dict[str, Any] = {"tensors": {}, "values": {}, "group_of": {}}
            groups: list[dict[str, Any]] = []
            for d in descs:
                if i >= len(d.get("optimizers", ())):
                    continue
                o = d["optimizers"][i]
                merged["tensors"].update(o["tensors"])
                merged["values"].update(o["values"])
                for name, hyper in o["group_of"].items():
                    gi = next((j for j, g in enumerate(groups) if same_hyper(g, hyper)), None)
                    if gi is None:
                        gi = len(groups)
                        groups.append(hyper)
                    merged["group_of"][name] = gi
            merged["param_groups"] = groups
            out["optimizers"].append(merged)
    return out


def read_dcp_checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Verify ``path`` (marker, manifest: every file present and unaltered) and return its
    metadata; raise :class:`CheckpointError` naming what is wrong. One process, no collective.
    """
    path = Path(path)
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is a file, not a checkpoint directory"
        raise CheckpointError(f"checkpoint {str(path)!r} {what}")
    verify_manifest(path)
    meta = read_meta(path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: its metadata is not {FORMAT}'s")
    if not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
        raise CheckpointError(
            f"{path} has format version {meta.get('version')!r}; this lightning_pp reads "
            f"<= {VERSION}"
        )
    _check_structure(meta, path / META_JSON)
    return meta
