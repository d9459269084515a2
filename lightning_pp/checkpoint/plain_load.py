"""A pipelined run resuming from a plain Lightning checkpoint (one ``torch.save`` file).

A plain ``Trainer`` (no ``PipelineStrategy``) saves the LightningModule's ``state_dict`` under
the names a pipeline rank looks up, and each optimizer's state by position
(:mod:`.plain_file` turns positions back into names). Order, so that a refusal leaves every
rank as it was (as :mod:`.dcp_load` does for the DCP format):

1. every rank reads the file with torch's restricted unpickler (no code runs; the user's
   explicit ``Trainer.fit(..., weights_only=False)`` is the one way to unpickle anything),
   mapped, not read: a rank pages in only the tensors it takes, and a node's ranks share those
   pages (each read the whole file into its own memory before: a node of 8 ranks held 8 copies);
2. the ranks exchange their param groups, so that every rank can tell which saved position is
   which name, whatever subset of the model it holds;
3. each rank picks its tensors and builds its optimizers' positional states; errors (a missing
   name, another shape, a group matching no saved group) are agreed, and with ``strict`` every
   saved tensor must be claimed by some rank;
4. only then are the module's tensors and the optimizers' states replaced; everything kept
   (optimizer states, Lightning's loop and callback states) is copied out of the mapped file
   first, since Lightning may rewrite that very file in place (``last.ckpt``).

Example::

    meta = load_plain_checkpoint("plain/last.ckpt", module, canonical=canonical,
                                 optimizers=[opt])          # any pp/vpp/dp/placement
    meta["global_step"]
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from ..runtime.dtensor_state import module_state_like
from .agree import check_all_claimed, error_text, gather_all, report_errors
from .by_name import fit_scheduler_states, param_names, positional_optimizer_state
from .errors import CheckpointError
from .plain_file import local_param_groups, optimizer_states_by_name
from .sharded import load_metadata

__all__ = ["load_plain_checkpoint"]

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the default group


def _read(path: str | os.PathLike, trusted: bool) -> dict[str, Any]:
    ckpt = load_metadata(path, weights_only=not trusted, mmap=True)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise CheckpointError(f"{path}: not a Lightning checkpoint (no 'state_dict' dict)")
    return ckpt


def _model_tensors(
    module: nn.Module, canonical: Mapping[str, str], saved: Mapping[str, Any], strict: bool
) -> dict[str, Tensor]:
    """This rank's ``state_dict`` keys -> the saved tensors (a tied member may be saved under
    its own key or only under its canonical one)."""
    picked: dict[str, Tensor] = {}
    missing, wrong = [], []
    for key, tensor in module.state_dict().items():
        value = saved.get(key, saved.get(canonical.get(key, key)))
        if not isinstance(value, Tensor):
            missing.append(key)
        elif value.shape != tensor.shape:
            wrong.append(f"{key}: saved {tuple(value.shape)}, here {tuple(tensor.shape)}")
        else:
            picked[key] = value
    if wrong:
        raise CheckpointError(f"{len(wrong)} tensor(s) differ in shape: {wrong[:5]}")
    if missing and strict:
        raise CheckpointError(
            f"the plain checkpoint has no tensors for {len(missing)} name(s) of this rank: "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    return picked


def load_plain_checkpoint(
    path: str | os.PathLike,
    module: nn.Module,
    *,
    canonical: Mapping[str, str],
    optimizers: Sequence[Optimizer] | None = None,
    scheduler_configs: Sequence[Any] = (),
    strict: bool = True,
    trusted: bool = False,
    process_group: ProcessGroup = None,
) -> dict[str, Any]:
    """Collective: load this rank's tensors (and, given ``optimizers``, their state) from a
    plain Lightning checkpoint file; return Lightning's metadata (loops, callbacks, schedulers).

    Nothing of ``module`` or ``optimizers`` changes unless every rank's checks succeeded;
    otherwise every rank raises :class:`CheckpointError`. ``trusted``: unpickle anything
    (``weights_only=False``; runs whatever code the file names).
    """
    what = f"loading plain checkpoint {str(path)!r} failed"
    ckpt: dict[str, Any] = {}
    error = None
    try:
        ckpt = _read(path, trusted)
    except Exception as exc:
        error = error_text(exc)
    report_errors(gather_all(error, process_group), what)

    names = param_names(module, canonical)
    name_of = {pid: name for pid, (name, _) in names.items()}
    mine = local_param_groups(optimizers or (), name_of)
    everyone = [sum(per_opt, []) for per_opt in zip(*gather_all(mine, process_group))]
    picked: dict[str, Tensor] = {}
    states: list[dict[str, Any]] = []
    try:
        picked = _model_tensors(module, canonical, ckpt["state_dict"], strict)
        if optimizers:
            by_name = optimizer_states_by_name(ckpt, everyone, str(path))
            states = [
                positional_optimizer_state(opt, names, merged, f"{path} optimizer {i}")
                for i, (opt, merged) in enumerate(zip(optimizers, by_name))
            ]
    except Exception as exc:
        error = error_text(exc)
    used = gather_all((sorted(picked), error), process_group)
    report_errors([e for _, e in used], what)
    if strict:
        claimed = {k for keys, _ in used for k in keys}
        # a tied member saved under its own key is claimed through its canonical name
        claimed |= {k for k in ckpt["state_dict"] if canonical.get(k, k) in claimed}
        check_all_claimed(ckpt["state_dict"], claimed, f"plain checkpoint {str(path)!r}")
    # every rank's checks passed: now change the module (which copies) and the optimizers
    module.load_state_dict(module_state_like(module, picked), strict=strict)
    for optimizer, state in zip(optimizers or (), states):
        optimizer.load_state_dict(_owned(state))  # an optimizer keeps the tensors it is given
    lightning = _owned(
        {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
    )
    return lightning if optimizers is None else fit_scheduler_states(lightning, scheduler_configs)


def _owned(value: Any) -> Any:
    """``value`` with every tensor in its dicts, lists and tuples copied out of the mapped file
    (containers keep their type: an ``OrderedDict``, a ``defaultdict``, a named tuple)."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _owned(v)
        return out
    if isinstance(value, list):
        items = copy.copy(value)
        items[:] = [_owned(v) for v in value]
        return items
    if isinstance(value, tuple):
        parts = [_owned(v) for v in value]
        return type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)
    return value
