"""The checkpoint format on ``torch.distributed.checkpoint`` (format version 2).

A checkpoint is a **directory**, as in Lightning's ``ModelParallelStrategy``::

    step=5.ckpt/
      __0_0.distcp ... .metadata   DCP: {"state_dict": {name: tensor},
                                         "optimizer_0": {"state": {name: {"exp_avg": t, ...}}}, ...}
      meta.json, meta.safetensors  everything else, no pickle (:mod:`.meta_codec`): Lightning's
                                   loops/callbacks/schedulers/hparams, per name the optimizer's
                                   param-group hyperparameters and non-tensor state, every stored
                                   tensor's dtype and shape, the layout that wrote it, tied groups
      complete.json                written LAST by rank 0 (:mod:`.manifest`): the marker

**Names** are the LightningModule's own ``state_dict`` keys (``layers.3.qkv.weight``, a
``split=`` model's ``model.transformer.h.0...``), which no pipeline shape changes, so a rank of
any later shape asks DCP for the names it holds. A tied group is stored once, under its first
(canonical) name, with its optimizer state, by the rank holding that copy.

**Each rank passes what it holds**; ``dp`` replicas pass the same names and DCP's save planner
keeps one writer per name (torch 2.13 ``dedup_save_plans``: the least loaded rank), so replicas
share the writing. Only tensors go through DCP: a non-tensor DCP item is read back with
``torch.load(weights_only=False)``, so the loader (:mod:`.dcp_safe`) refuses any.

**Loading** verifies the marker and the manifest on rank 0 and reads the metadata there; every
rank then checks what it will ask for (names, shapes, optimizer groups), the ranks agree, and
only then does DCP read, into freshly allocated tensors: the module and optimizers are changed
after every rank's read succeeded. Why fresh tensors: DCP copies into the tensors it is given,
so a read failing half-way must not leave the live weights half old, half new.

Example::

    save_dcp_checkpoint(ckpt, "ckpts/step=5.ckpt", canonical=canonical, layout={"pp": 2})
    meta = load_dcp_checkpoint("ckpts/step=5.ckpt", module, canonical=canonical,
                               optimizers=[opt])           # any pp/vpp/dp/placement
    state = consolidated_dcp_state_dict("ckpts/step=5.ckpt")   # one process: a plain state_dict
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.optim import Optimizer

from .agree import broadcast_first, gather_all, group_rank, raise_together
from .by_name import (
    adapt_scheduler_state,
    natural_key,
    param_names,
    positional_optimizer_state,
    same_hyper,
)
from .dcp_safe import safe_dcp_load
from .directory import new_partial_dir, publish
from .errors import CheckpointError
from .manifest import verify_manifest, write_manifest
from .meta_codec import read_meta, write_meta

__all__ = [
    "COMPLETE_FILE",
    "FORMAT",
    "VERSION",
    "consolidated_dcp_state_dict",
    "is_dcp_checkpoint",
    "load_dcp_checkpoint",
    "read_dcp_checkpoint_meta",
    "save_dcp_checkpoint",
]

FORMAT = "lightning_pp.dcp_checkpoint"
VERSION = 2
COMPLETE_FILE = "complete.json"  # what manifest.write_manifest writes, last

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the default group


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory with this format's completion marker (cheap: a loader
    still verifies everything; a ``.partial`` directory of an interrupted save has none)."""
    return (Path(path) / COMPLETE_FILE).is_file()


# ---------------------------------------------------------------------------------- describe
def _spec(t: Tensor) -> list[Any]:
    """A tensor's dtype and shape, as JSON: what a loader allocates before DCP reads."""
    return [str(t.dtype).removeprefix("torch."), list(t.shape)]


def _empty(spec: Sequence[Any], device: Any = "cpu") -> Tensor:
    dtype = getattr(torch, str(spec[0]), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {spec[0]!r} in the checkpoint's metadata")
    return torch.empty([int(n) for n in spec[1]], dtype=dtype, device=device)


def _split_rank_state(
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
    desc: dict[str, Any] = {"model": {k: _spec(v) for k, v in model.items()}}
    optims = checkpoint.pop("optimizer_states", None)
    if optims is not None:
        desc["optimizers"] = []
        for i, saved in enumerate(optims):
            tensors: dict[str, dict[str, Tensor]] = {}
            opt_desc: dict[str, Any] = {"tensors": {}, "values": {}, "group_of": {}}
            for name, entry in saved["state"].items():
                tensors[name] = {k: v.detach() for k, v in entry.items() if isinstance(v, Tensor)}
                opt_desc["tensors"][name] = {k: _spec(v) for k, v in tensors[name].items()}
                values = {k: v for k, v in entry.items() if not isinstance(v, Tensor)}
                if values:  # e.g. an int step count: JSON, not DCP
                    opt_desc["values"][name] = values
            for name, gi in saved["group_of"].items():
                opt_desc["group_of"][name] = saved["param_groups"][gi]
            state[f"optimizer_{i}"] = {"state": tensors}
            desc["optimizers"].append(opt_desc)
    return state, desc


def _merge_descriptions(descs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------- save
def save_dcp_checkpoint(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    *,
    canonical: Mapping[str, str],
    layout: Mapping[str, Any],
    process_group: ProcessGroup = None,
) -> Path:
    """Collective: every rank calls it with its own Lightning ``checkpoint`` dict.

    Args:
        checkpoint: Lightning's dict; ``state_dict`` holds this rank's tensors and
            ``optimizer_states`` the dicts of :func:`~.by_name.optimizer_state_by_name` (absent
            for a weights-only save). Consumed. Rank 0's other entries are the metadata.
        path: the final directory (the same on every rank).
        canonical: tied member name -> canonical name (:func:`~.by_name.tied_canonical_names`).
        layout: the run's shape (pp, vpp, dp, layer ranges...), recorded in the metadata.
        process_group: the ranks that save together (default: all).

    Returns the final directory. Raises :class:`CheckpointError` on every rank if any rank
    failed; the hidden ``.NAME.partial-*`` directory is then removed and ``path`` untouched.

    Example::

        ckpt = {"state_dict": module.state_dict(), "global_step": 5,
                "optimizer_states": [optimizer_state_by_name(opt, module, canonical)]}
        save_dcp_checkpoint(ckpt, "ckpts/step=5.ckpt", canonical=canonical, layout={"pp": 2})
    """
    path = Path(path)
    rank = group_rank(process_group)
    what = f"saving checkpoint {str(path)!r} failed"
    made: tuple[str | None, str | None] = (None, None)
    if rank == 0:
        try:
            made = (str(new_partial_dir(path)), None)
        except Exception as exc:
            made = (None, f"{type(exc).__name__}: {exc}")
    tmp_name, error = broadcast_first(made, process_group)
    raise_together(error, process_group, what)
    tmp = Path(str(tmp_name))

    def fail(errors: Sequence[str]) -> None:
        if errors:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"{what}: " + "; ".join(errors))

    def agree(error: str | None) -> None:
        fail([f"rank {r}: {e}" for r, e in enumerate(gather_all(error, process_group)) if e])

    state: dict[str, Any] = {}
    desc: dict[str, Any] = {"model": {}}
    error = None
    try:
        state, desc = _split_rank_state(checkpoint, canonical)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    descs = gather_all((desc, error), process_group)
    fail([f"rank {r}: {e}" for r, (_, e) in enumerate(descs) if e])
    try:  # DCP gathers every rank's write result: a failure raises on every rank
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=process_group)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    agree(error)
    if rank == 0:
        try:
            meta = {
                "format": FORMAT,
                "version": VERSION,
                "layout": dict(layout),
                "tied": sorted([c, n] for n, c in canonical.items() if n != c),
                **_merge_descriptions([d for d, _ in descs]),
                "lightning": checkpoint,
            }
            write_meta(tmp, meta)
            write_manifest(tmp, {"format": FORMAT, "version": VERSION})  # last: the marker
            publish(tmp, path)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    agree(error)  # also the barrier: nobody returns before the directory is published
    return path


# ---------------------------------------------------------------------------------- load
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
    return meta


def _agreed_meta(path: Path, process_group: ProcessGroup) -> dict[str, Any]:
    """Rank 0 verifies and reads the metadata; every rank gets it, or every rank raises."""
    got: tuple[dict[str, Any] | None, str | None] = (None, None)
    if group_rank(process_group) == 0:
        try:
            got = (read_dcp_checkpoint_meta(path), None)
        except Exception as exc:
            got = (None, str(exc) if isinstance(exc, CheckpointError) else f"{exc!r}")
    meta, error = broadcast_first(got, process_group)
    if error is not None:
        raise CheckpointError(error)
    assert meta is not None
    return meta


def _shape_of(meta: Mapping[str, Any]) -> str:
    lay = meta.get("layout", {})
    return ", ".join(f"{k}={lay[k]}" for k in ("pp", "vpp", "dp") if k in lay) or "unknown shape"


def _model_request(
    module: nn.Module, canonical: Mapping[str, str], meta: Mapping[str, Any], strict: bool
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Fresh tensors for the stored names this rank holds, and ``local key -> stored name``."""
    stored = meta["model"]
    request: dict[str, Tensor] = {}
    wanted: dict[str, str] = {}
    missing, wrong = [], []
    for key, tensor in module.state_dict().items():
        name = canonical.get(key, key)
        if name not in stored:
            missing.append(key)
            continue
        if list(tensor.shape) != list(stored[name][1]):
            wrong.append(f"{key}: saved {tuple(stored[name][1])}, here {tuple(tensor.shape)}")
            continue
        wanted[key] = name
        if name not in request:  # DCP casts into the tensor it is given: allocate ours
            request[name] = torch.empty_like(tensor, device=tensor.device)
    if wrong:
        raise CheckpointError(f"{len(wrong)} tensor(s) differ in shape: {wrong[:5]}")
    if missing and strict:
        raise CheckpointError(
            f"the checkpoint (saved at {_shape_of(meta)}) has no tensors for {len(missing)} "
            f"name(s) of this rank: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    return request, wanted


def _optimizer_request(
    optimizers: Sequence[Optimizer],
    names: Mapping[int, tuple[str, bool]],
    meta: Mapping[str, Any],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Fresh CPU tensors for each optimizer's state of this rank's parameters, and per optimizer
    the by-name form :func:`~.by_name.positional_optimizer_state` reads (holding those tensors).

    Each optimizer's grouping is checked here, before anything is read."""
    saved = meta.get("optimizers")
    if saved is None:
        raise CheckpointError("it holds no optimizer state (saved with weights_only=True?)")
    request: dict[str, Any] = {}
    merged: list[dict[str, Any]] = []
    for i, optimizer in enumerate(optimizers):
        theirs = saved[i] if i < len(saved) else {"tensors": {}, "values": {}, "group_of": {}}
        groups = theirs.get("param_groups", [])
        by_name: dict[str, Any] = {"state": {}, "group_of": {}}
        tensors: dict[str, dict[str, Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names[id(p)][0]
                if name in theirs["group_of"]:
                    by_name["group_of"][name] = groups[theirs["group_of"][name]]
                if name in theirs["tensors"] and name not in tensors:
                    tensors[name] = {k: _empty(s) for k, s in theirs["tensors"][name].items()}
                    by_name["state"][name] = {**theirs["values"].get(name, {}), **tensors[name]}
        # groups and missing names checked now (no state: nothing is copied)
        positional_optimizer_state(
            optimizer, names, {"state": {}, "group_of": by_name["group_of"]}, f"optimizer {i}"
        )
        request[f"optimizer_{i}"] = {"state": tensors}
        merged.append(by_name)
    return request, merged


def load_dcp_checkpoint(
    path: str | os.PathLike,
    module: nn.Module,
    *,
    canonical: Mapping[str, str],
    optimizers: Sequence[Optimizer] | None = None,
    scheduler_configs: Sequence[Any] = (),
    strict: bool = True,
    process_group: ProcessGroup = None,
) -> dict[str, Any]:
    """Collective: load the tensors (and, given ``optimizers``, the optimizer state) of the
    names ``module`` holds; return Lightning's metadata dict (loops, callbacks, schedulers...).

    Works whatever pipeline shape wrote the checkpoint, and in one process without a process
    group (the unpipelined module). Nothing of ``module`` or ``optimizers`` changes unless every
    rank's checks and reads succeeded; otherwise every rank raises :class:`CheckpointError`.
    ``strict``: every local name must be stored, and every stored tensor claimed by some rank.
    ``scheduler_configs`` (the Trainer's ``lr_scheduler_configs``): their saved states are fitted
    to THIS rank's param groups (rank 0 saved them for its own).

    Example::

        meta = load_dcp_checkpoint(path, module, canonical=tied_canonical_names(module,
                                   module.layers), optimizers=[opt])
        meta["global_step"]
    """
    path = Path(path)
    what = f"loading checkpoint {str(path)!r} failed"
    meta = _agreed_meta(path, process_group)
    request: dict[str, Any] = {}
    wanted: dict[str, str] = {}
    merged: list[dict[str, Any]] = []
    error = None
    try:
        model, wanted = _model_request(module, canonical, meta, strict)
        request["state_dict"] = model
        if optimizers is not None:
            opt_request, merged = _optimizer_request(
                optimizers, param_names(module, canonical), meta
            )
            request.update(opt_request)
    except Exception as exc:
        error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    used = gather_all((sorted(set(wanted.values())), error), process_group)
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(used) if e]
    if not errors and strict:
        unused = sorted(set(meta["model"]) - {n for names, _ in used for n in names})
        if unused:
            errors.append(
                f"{len(unused)} saved tensor(s) belong to no rank of this model: {unused[:5]} "
                f"(set LightningModule.strict_loading=False to allow)"
            )
    if errors:
        raise CheckpointError(f"{what}: " + "; ".join(errors))
    safe_dcp_load(request, path, process_group)  # collective; raises on every rank alike
    # every rank read everything: now change the module and the optimizers
    loaded = request["state_dict"]
    module.load_state_dict({k: loaded[n] for k, n in wanted.items()}, strict=strict)
    names = param_names(module, canonical)
    for i, optimizer in enumerate(optimizers or ()):
        optimizer.load_state_dict(
            positional_optimizer_state(optimizer, names, merged[i], f"{path} optimizer {i}")
        )
    lightning = dict(meta["lightning"])
    if optimizers is not None and "lr_schedulers" in lightning:
        lightning["lr_schedulers"] = [
            adapt_scheduler_state(state, cfg.scheduler.optimizer)
            for state, cfg in zip(lightning["lr_schedulers"], scheduler_configs)
        ]
    return lightning


# ---------------------------------------------------------------------------------- one process
def consolidated_dcp_state_dict(
    path: str | os.PathLike, submodule: str | None = None
) -> dict[str, Tensor]:
    """Every stored tensor in one dict (one process, no process group), tied members expanded
    (the same tensor under each name): what the unpipelined module's ``load_state_dict`` takes.

    ``submodule``: keep only the keys under that attribute, without its prefix (``"model"``: the
    Hugging Face model a ``split=`` module holds as ``self.model``).

    Example::

        state = consolidated_dcp_state_dict("ckpts/step=5.ckpt")
        model = GPT(**hparams); model.configure_model(); model.load_state_dict(state)
    """
    path = Path(path)
    meta = read_dcp_checkpoint_meta(path)
    state = {name: _empty(spec) for name, spec in meta["model"].items()}
    safe_dcp_load({"state_dict": state}, path, None)
    for canonical, member in meta["tied"]:
        if canonical in state:
            state[member] = state[canonical]
    if submodule:
        prefix = submodule.rstrip(".") + "."
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if not state:
            raise CheckpointError(f"checkpoint {str(path)!r} holds no keys under {prefix!r}")
    return dict(sorted(state.items(), key=lambda kv: natural_key(kv[0])))
