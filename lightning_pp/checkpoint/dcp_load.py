"""Loading the DCP format at any shape, and reading it whole in one process.

Order, so that a refusal leaves every rank as it was:

1. rank 0 verifies the marker and manifest and reads the metadata; every rank gets it, or
   every rank raises (:func:`_agreed_meta`);
2. each rank checks what it will ask for (its names stored, shapes equal, its optimizers'
   groups matching the saved hyperparameters) and allocates fresh tensors for it; the ranks
   agree (and, with ``strict``, that every stored tensor is claimed by some rank);
3. DCP reads into those tensors (:func:`~.dcp_safe.safe_dcp_load`: no pickle);
4. only then are the module's tensors and the optimizers' states replaced.

Example::

    meta = load_dcp_checkpoint(path, module, canonical=canonical, optimizers=[opt])
    state = consolidated_dcp_state_dict(path)   # one process: a plain state_dict
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ..runtime.dtensor_state import module_state_like
from .agree import (
    broadcast_first,
    check_all_claimed,
    error_text,
    gather_all,
    group_rank,
    report_errors,
)
from .by_name import (
    describe_layout,
    fit_scheduler_states,
    natural_key,
    param_names,
    positional_optimizer_state,
)
from .dcp_meta import empty_from_spec, read_dcp_checkpoint_meta, spec_dtype
from .dcp_safe import safe_dcp_load
from .errors import CheckpointError

__all__ = ["consolidated_dcp_state_dict", "load_dcp_checkpoint"]

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the default group


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
        shape = describe_layout(meta.get("layout", {}))
        raise CheckpointError(
            f"the checkpoint (saved at {shape}) has no tensors for {len(missing)} "
            f"name(s) of this rank: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    return request, wanted


def _check_state_sizes(specs: Mapping[str, Any], param: Tensor, name: str, i: int) -> None:
    """A saved state tensor is no larger than its parameter (moments have its shape, step
    counts none, factored states less): a larger one is another model's, or an edited file,
    and is refused before memory is allocated for it."""
    for key, (_, shape) in specs.items():
        if math.prod(shape) > max(1, param.numel()):
            raise CheckpointError(
                f"optimizer {i} state {key!r} of {name!r} was saved with shape {tuple(shape)}, "
                f"larger than the parameter here {tuple(param.shape)}"
            )


def _optimizer_request(
    optimizers: Sequence[Optimizer],
    names: Mapping[int, tuple[str, bool]],
    meta: Mapping[str, Any],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Fresh tensors for each optimizer's state of this rank's parameters, and per optimizer
    the by-name form :func:`~.by_name.positional_optimizer_state` reads (holding those tensors).

    An optimizer that holds only part of a parameter's state (a ``zero`` replica's rows, an FSDP2
    or tensor-parallel shard) says so through ``state_request(param, shape, dtype)``: the
    tensor to read a saved state of that shape into, a ``DTensor`` whose local part is what the rank
    keeps, so that DCP reads only that part (``None``: the whole tensor, on the CPU). Without
    it, every replica of a stage read each moment whole and then kept its ``1/dp``.

    Each optimizer's grouping is checked here, before anything is read."""
    saved = meta.get("optimizers")
    if saved is None:
        raise CheckpointError("it holds no optimizer state (saved with weights_only=True?)")
    request: dict[str, Any] = {}
    merged: list[dict[str, Any]] = []
    for i, optimizer in enumerate(optimizers):
        state_request = getattr(optimizer, "state_request", None)
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
                    specs = theirs["tensors"][name]
                    _check_state_sizes(specs, p, name, i)
                    tensors[name] = {k: _requested(state_request, p, s) for k, s in specs.items()}
                    by_name["state"][name] = {**theirs["values"].get(name, {}), **tensors[name]}
        # groups and missing names checked now (no state: nothing is copied)
        positional_optimizer_state(
            optimizer, names, {"state": {}, "group_of": by_name["group_of"]}, f"optimizer {i}"
        )
        request[f"optimizer_{i}"] = {"state": tensors}
        merged.append(by_name)
    return request, merged


def _requested(state_request: Any, param: Tensor, spec: Any) -> Tensor:
    """What DCP reads a saved state of ``param`` (its ``spec``) into: the optimizer's own
    request (part of the tensor), or the whole tensor."""
    if state_request is not None:
        part = state_request(param, tuple(int(n) for n in spec[1]), spec_dtype(spec))
        if part is not None:
            return part
    return empty_from_spec(spec)


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
        error = error_text(exc)
    used = gather_all((sorted(set(wanted.values())), error), process_group)
    report_errors([e for _, e in used], what)
    if strict:
        claimed = [n for names, _ in used for n in names]
        check_all_claimed(meta["model"], claimed, f"checkpoint {str(path)!r}")
    safe_dcp_load(request, path, process_group)  # collective; raises on every rank alike
    # every rank read everything: now change the module and the optimizers
    loaded = request["state_dict"]
    state = module_state_like(module, {k: loaded[n] for k, n in wanted.items()})
    module.load_state_dict(state, strict=strict)  # FSDP2's DTensor parameters take their shard
    names = param_names(module, canonical)
    for i, optimizer in enumerate(optimizers or ()):
        optimizer.load_state_dict(
            positional_optimizer_state(optimizer, names, merged[i], f"{path} optimizer {i}")
        )
    lightning = dict(meta["lightning"])
    return lightning if optimizers is None else fit_scheduler_states(lightning, scheduler_configs)


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
    state = {name: empty_from_spec(spec) for name, spec in meta["model"].items()}
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
