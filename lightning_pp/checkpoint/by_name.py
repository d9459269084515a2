"""Names instead of positions: the helpers both checkpoint formats share.

A pipeline rank holds some of the model's parameters, each under the LightningModule's own
``state_dict`` name, and an optimizer whose positions (0, 1, ...) change with the pipeline shape.
So every format stores parameters and optimizer state **by name**; these helpers translate:

- :func:`tied_canonical_names` / :func:`canonical_names`: a tied member's stored (canonical) name;
- :func:`param_names`: ``id(param) -> (stored name, whether this process holds that copy)``;
- :func:`optimizer_state_by_name`: an optimizer's positional state dict keyed by name;
- :func:`positional_optimizer_state`: the reverse, for THIS rank's optimizer, checking that each
  of its param groups was saved with one set of hyperparameters;
- :func:`adapt_scheduler_state`: an LR scheduler's per-group lists fitted to this rank's groups.

Example::

    canonical = tied_canonical_names(module, module.layers)  # {"layers.7.w": "layers.0.w", ...}
    saved = optimizer_state_by_name(opt, module, canonical)  # {"state": {name: ...}, ...}
    groups = saved["param_groups"]
    merged = {"state": saved["state"],
              "group_of": {n: groups[g] for n, g in saved["group_of"].items()}}
    names = param_names(module2, canonical)
    opt2.load_state_dict(positional_optimizer_state(opt2, names, merged, "ckpt optimizer 0"))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .errors import CheckpointError

__all__ = [
    "adapt_scheduler_state",
    "adapt_scheduler_states",
    "describe_layout",
    "fit_scheduler_states",
    "canonical_names",
    "natural_key",
    "optimizer_state_by_name",
    "param_names",
    "positional_optimizer_state",
    "same_hyper",
    "tied_canonical_names",
]


def tied_canonical_names(module: nn.Module, layers: nn.Module) -> dict[str, str]:
    """Map every tied member's full name to its group's canonical (first) full name.

    ``layers.tied`` holds names relative to the container (``"0.wte.weight"``); the module's
    ``state_dict`` keys carry the container's prefix (``"layers.0.wte.weight"``).
    """
    prefix = next((n for n, m in module.named_modules() if m is layers), None)
    if prefix is None:
        raise ValueError("the PipelineLayers container is not a submodule of the module")
    full = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
    mapping: dict[str, str] = {}
    for group in getattr(layers, "tied", ()):
        canonical = full(group[0])
        for name in group:
            mapping[full(name)] = canonical
    return mapping


def param_names(module: nn.Module, canonical: Mapping[str, str]) -> dict[int, tuple[str, bool]]:
    """``id(param) -> (canonical name, whether this process holds the canonical copy)``."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out = {}
    for pid, ns in names.items():
        cname = canonical.get(ns[0], ns[0])
        out[pid] = (cname, cname in ns)
    return out


# ---------------------------------------------------------------------------------- optimizer
def optimizer_state_by_name(
    optimizer: Optimizer, module: nn.Module, canonical: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter NAME instead of position.

    Returns ``{"state": {name: {...}}, "param_groups": [hyperparameters, ...], "group_of":
    {name: group index}}``. Only parameters whose canonical copy this process holds are included
    (a tied copy held elsewhere is saved by its owner; the copies' states are identical).
    Positions differ between pipeline shapes (each stage has its own optimizer); names do not.
    """
    ids = param_names(module, canonical or {})
    sd = optimizer.state_dict()
    index_to_param = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[str, Any] = {}
    group_of: dict[str, int] = {}
    groups = []
    for gi, group in enumerate(sd["param_groups"]):
        groups.append({k: v for k, v in group.items() if k != "params"})
        for idx in group["params"]:
            p = index_to_param[idx]
            if id(p) not in ids:
                raise CheckpointError(
                    f"optimizer parameter #{idx} (shape {tuple(p.shape)}) is not a parameter of "
                    f"{type(module).__name__}; cannot name its state"
                )
            name, owner = ids[id(p)]
            if not owner:
                continue
            group_of[name] = gi
            if idx in sd["state"]:
                state[name] = sd["state"][idx]
    return {"state": state, "param_groups": groups, "group_of": group_of}


def positional_optimizer_state(
    optimizer: Optimizer,
    names: Mapping[int, tuple[str, bool]],
    saved: Mapping[str, Any],
    what: str,
) -> dict[str, Any]:
    """Positional ``optimizer.state_dict()`` form built from name-keyed ``saved`` entries.

    ``saved``: merged ``{"state": {...}, "group_of": {name: (file, group hyperparameters)}}``.
    """
    state: dict[int, Any] = {}
    groups = []
    idx = 0
    missing = []
    for group in optimizer.param_groups:
        hyper: dict[str, Any] | None = None
        params = []
        for p in group["params"]:
            name = names[id(p)][0]
            if name not in saved["group_of"]:
                missing.append(name)
            else:
                theirs = saved["group_of"][name]
                if hyper is None:
                    hyper, first = theirs, name
                elif not same_hyper(hyper, theirs):
                    raise CheckpointError(
                        f"{what}: param group {len(groups)} holds {first!r} and {name!r}, which "
                        f"were saved in groups with different hyperparameters "
                        f"({_hyper_diff(hyper, theirs)}); group the parameters as when saving"
                    )
                if name in saved["state"]:
                    state[idx] = {
                        k: v.clone() if isinstance(v, Tensor) else v
                        for k, v in saved["state"][name].items()
                    }
            params.append(idx)
            idx += 1
        current = {k: v for k, v in group.items() if k != "params"}
        groups.append({**current, **(hyper or {}), "params": params})
    if missing:
        raise CheckpointError(
            f"{what}: no optimizer state for {len(missing)} parameter(s): {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}"
        )
    return {"state": state, "param_groups": groups}


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a == b


def same_hyper(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)


def _hyper_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    keys = sorted(k for k in a.keys() | b.keys() if not _same_value(a.get(k), b.get(k)))
    return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys)


def adapt_scheduler_state(state: dict[str, Any], optimizer: Optimizer) -> dict[str, Any]:
    """Fit a saved LR-scheduler state to THIS optimizer's param groups.

    Schedulers keep per-group lists (``base_lrs``, ``_last_lr``) whose length is the number of
    groups of the optimizer that saved them; another pipeline stage (or the unpipelined module) may
    have a different number. They are rebuilt from the restored groups, which carry
    ``initial_lr`` (what ``base_lrs`` is made from) and ``lr`` (the last computed rate).
    """
    state = dict(state)
    groups = optimizer.param_groups
    if "base_lrs" in state and all("initial_lr" in g for g in groups):
        state["base_lrs"] = [g["initial_lr"] for g in groups]
    if "_last_lr" in state:
        state["_last_lr"] = [g["lr"] for g in groups]
    return state


def adapt_scheduler_states(states: Sequence[dict[str, Any]], configs: Sequence[Any]) -> list:
    """:func:`adapt_scheduler_state` for each saved scheduler state, fitted to the optimizer of
    the matching Lightning scheduler config (``config.scheduler.optimizer``)."""
    return [adapt_scheduler_state(s, cfg.scheduler.optimizer) for s, cfg in zip(states, configs)]


def fit_scheduler_states(meta: dict[str, Any], configs: Sequence[Any]) -> dict[str, Any]:
    """Lightning's loaded metadata with its ``lr_schedulers`` fitted to THIS rank's optimizers
    (:func:`adapt_scheduler_states`); as it is when it holds none."""
    if "lr_schedulers" not in meta:
        return meta
    return {**meta, "lr_schedulers": adapt_scheduler_states(meta["lr_schedulers"], configs)}


def describe_layout(layout: Mapping[str, Any], sep: str = ", ") -> str:
    """``"pp=2, vpp=1, dp=2"``: the shape that wrote a checkpoint, for messages (the keys it
    lacks are left out; ``"unknown shape"`` when it has none)."""
    shown = [f"{k}={layout[k]}" for k in ("pp", "vpp", "dp") if k in layout]
    return sep.join(shown) or "unknown shape"


def canonical_names(module: Any, canonical: Mapping[str, str] | None) -> Mapping[str, str]:
    """Tied member -> stored name: as given (a split model's ties), else from the module's
    :class:`~lightning_pp.strategy.model.PipelineLayers` (its ``pipeline_layers()`` hook)."""
    if canonical is not None:
        return canonical
    return tied_canonical_names(module, module.pipeline_layers())


def natural_key(name: str) -> list[Any]:
    """Sort key that orders ``layers.10`` after ``layers.9``."""
    return [int(t) if t.isdigit() else t for t in name.split(".")]
