"""A plain Lightning checkpoint (one ``torch.save`` file) read by name, for a pipelined run.

A plain ``Trainer`` saves the model under the LightningModule's own ``state_dict`` keys, which
are the names a pipelined rank looks up, but it saves the optimizer state by **position**:
entry ``i`` of ``optimizer_states[k]["state"]`` belongs to the ``i``-th parameter of that
optimizer's groups, in group order. A pipeline rank holds only some parameters, so positions
are turned back into names here.

The names of each saved param group are found from the run's own groups: every rank builds its
optimizers with the same rules (e.g. decay / no-decay), but a stage may hold only one kind and
skip the other group, so groups are matched by their hyperparameters, not by their index. The
keys an LR or momentum schedule changes while training (:data:`SCHEDULED_KEYS`) are left out of
that comparison; the rest must identify exactly one saved group. Within a group the order is the
checkpoint's ``state_dict`` order (the module's registration order, which ``self.parameters()``
and ``named_parameters()`` follow; a tied parameter counts once, at its canonical name). Each
state's tensors must match its parameter's shape, so an optimizer built in another order is
refused rather than mis-assigned (a permutation of equally shaped parameters cannot be detected:
build param groups in ``named_parameters()`` order).

Example::

    ckpt = read_plain_checkpoint("last.ckpt")                     # weights_only, no code runs
    mine = local_param_groups(optimizers, names)        # this rank: [(hyperparameters, names)]
    everyone = [sum(per_opt, []) for per_opt in zip(*all_gather_object(mine))]
    merged = optimizer_states_by_name(ckpt, everyone, "last.ckpt")
    merged[0]["state"]["layers.0.wte.weight"]["exp_avg"]
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from .errors import CheckpointError

__all__ = [
    "SCHEDULED_KEYS",
    "is_plain_checkpoint",
    "local_param_groups",
    "optimizer_states_by_name",
    "read_plain_checkpoint",
]


def is_plain_checkpoint(path: str | os.PathLike) -> bool:
    """A regular file (Lightning's single-file checkpoint), not a checkpoint directory."""
    return Path(path).is_file()


def read_plain_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a plain Lightning checkpoint with torch's restricted unpickler (tensors, containers
    and the plain data types Lightning's metadata holds; anything else is refused by name)."""
    from .sharded import load_metadata

    ckpt = load_metadata(path, weights_only=True)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise CheckpointError(f"{path}: not a Lightning checkpoint (no 'state_dict' dict)")
    return ckpt


SCHEDULED_KEYS = frozenset(
    {"lr", "initial_lr", "betas", "momentum", "max_lr", "min_lr", "base_momentum", "max_momentum"}
)


def _signature(hyper: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(
        sorted((k, repr(v)) for k, v in hyper.items() if k != "params" and k not in SCHEDULED_KEYS)
    )


def local_param_groups(
    optimizers: Sequence[Optimizer], name_of: Mapping[int, str]
) -> list[list[tuple[dict[str, Any], list[str]]]]:
    """Per optimizer, per param group of THIS rank: (its hyperparameters, its parameters'
    names). ``name_of``: ``id(param) -> canonical name``."""
    return [
        [
            ({k: v for k, v in g.items() if k != "params"}, [name_of[id(p)] for p in g["params"]])
            for g in opt.param_groups
        ]
        for opt in optimizers
    ]


def _match_groups(
    saved_groups: Sequence[Mapping[str, Any]],
    groups: Sequence[tuple[Mapping[str, Any], Sequence[str]]],
    state_keys: Sequence[str],
    what: str,
) -> list[list[str]]:
    """The names of each saved group, in the checkpoint's state_dict order."""
    by_sig: dict[tuple[tuple[str, str], ...], set[str]] = {}
    for hyper, names in groups:
        by_sig.setdefault(_signature(hyper), set()).update(names)
    saved_sigs = [_signature(g) for g in saved_groups]
    for sig in by_sig:
        hits = saved_sigs.count(sig)
        if hits != 1:
            raise CheckpointError(
                f"{what}: this run's param group {dict(sig)} matches {hits} of the "
                f"{len(saved_sigs)} saved group(s) {[dict(s) for s in saved_sigs]} (groups are "
                f"matched by their hyperparameters, less {sorted(SCHEDULED_KEYS)})"
            )
    position: dict[str, int] = {}
    for i, k in enumerate(state_keys):
        position.setdefault(k, i)
    out = []
    for sig in saved_sigs:
        names = by_sig.get(sig, set())
        unknown = sorted(n for n in names if n not in position)
        if unknown:
            raise CheckpointError(
                f"{what}: {len(unknown)} parameter(s) of this model are not in its state_dict: "
                f"{unknown[:5]}"
            )
        out.append(sorted(names, key=position.__getitem__))
    return out


def optimizer_states_by_name(
    ckpt: dict[str, Any],
    groups: Sequence[Sequence[tuple[Mapping[str, Any], Sequence[str]]]],
    what: str,
) -> list[dict[str, Any]]:
    """Per optimizer: ``{"state": {name: {...}}, "group_of": {name: group hyperparameters}}``
    (the by-name form the pipeline loaders restore from).

    ``groups[k]``: optimizer ``k``'s param groups of EVERY rank, as (hyperparameters, canonical
    names) pairs (:func:`local_param_groups` gathered). ``what`` names the file in errors.
    """
    saved = ckpt.get("optimizer_states")
    if not saved:
        raise CheckpointError(f"{what}: holds no optimizer state (saved with weights_only=True?)")
    if len(saved) != len(groups):
        raise CheckpointError(
            f"{what}: holds {len(saved)} optimizer(s), this run configures {len(groups)}"
        )
    keys = list(ckpt["state_dict"])
    merged = []
    for k, (osd, opt_groups) in enumerate(zip(saved, groups)):
        ordered = _match_groups(osd["param_groups"], opt_groups, keys, f"{what} optimizer {k}")
        state: dict[str, Any] = {}
        group_of: dict[str, Any] = {}
        for g, (saved_group, names) in enumerate(zip(osd["param_groups"], ordered)):
            params = saved_group["params"]
            if len(params) != len(names):
                raise CheckpointError(
                    f"{what}: optimizer {k} group {g} was saved with {len(params)} "
                    f"parameter(s), this model's matching group has {len(names)}"
                )
            hyper = {h: v for h, v in saved_group.items() if h != "params"}
            for idx, name in zip(params, names):
                group_of[name] = hyper
                if idx in osd["state"]:
                    state[name] = osd["state"][idx]
                    _check_shapes(ckpt["state_dict"].get(name), state[name], name, what, k)
        merged.append({"state": state, "group_of": group_of})
    return merged


def _check_shapes(param: Any, state: dict[str, Any], name: str, what: str, k: int) -> None:
    """A moment tensor has its parameter's shape (scalars such as Adam's ``step`` excepted)."""
    if not isinstance(param, Tensor):
        return
    for key, value in state.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape != param.shape:
            raise CheckpointError(
                f"{what}: optimizer {k} state {key!r} for {name!r} has shape "
                f"{tuple(value.shape)}, the parameter {tuple(param.shape)}: the optimizer's "
                f"parameters were not in the module's order (build param groups in "
                f"named_parameters() order)"
            )
