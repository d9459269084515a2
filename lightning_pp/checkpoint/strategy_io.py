"""One rank's checkpoint save and load, as :class:`~lightning_pp.PipelineStrategy`'s hooks call
them: plain values in (the module, its optimizers, the run's layout), nothing of the strategy.

Saves write the DCP format (:mod:`.dcp_format`). Loads read it, and still read the version-1
format (``index.json`` directories, :mod:`.sharded`) for one release, so a run saved before the
switch resumes. Which one a directory is: :func:`~.consolidate.checkpoint_format`.

Example::

    save_pipeline_checkpoint(ckpt, path, module=module, layout={"pp": 2, "vpp": 1, "dp": 2})
    meta = load_pipeline_checkpoint(path, module, rank=rank, optimizers=[opt])
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.optim import Optimizer

from .by_name import canonical_names, optimizer_state_by_name
from .consolidate import checkpoint_format
from .dcp_format import load_dcp_checkpoint, save_dcp_checkpoint

__all__ = ["load_pipeline_checkpoint", "module_optimizer_state", "save_pipeline_checkpoint"]


def save_pipeline_checkpoint(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    *,
    module: Any,
    layout: Mapping[str, Any],
    canonical: Mapping[str, str] | None = None,
    process_group: Any = None,
) -> Path:
    """Collective: write this rank's part of a Lightning ``checkpoint`` into directory ``path``.

    The module's class (and, for a module holding a Hugging Face model, its config) is recorded
    so ``lightning-pp consolidate --lightning`` / ``--hf`` can rebuild the unpipelined model.
    ``canonical``: a ``split=`` model's tied names; default: from the module's
    ``pipeline_layers()``.
    """
    from .hf_record import hf_config_of

    cls = type(module)
    record: dict[str, Any] = {"module_class": f"{cls.__module__}:{cls.__qualname__}"}
    hf = hf_config_of(module)
    if hf is not None:  # what ``consolidate --hf`` needs to write a save_pretrained directory
        record["hf"] = hf
    checkpoint["lightning_pp"] = record
    return save_dcp_checkpoint(
        checkpoint,
        path,
        canonical=canonical_names(module, canonical),
        layout=layout,
        process_group=process_group,
    )


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
    """Collective: load this rank's tensors (and, given ``optimizers``, their optimizer state)
    by name, whatever shape wrote the checkpoint; return Lightning's metadata dict.

    ``weights_only`` matters for a version-1 directory only (its ``meta.pt`` is a pickle; see
    :func:`~.sharded.load_metadata`); the DCP format holds no pickle to trust or not.
    """
    if checkpoint_format(path) == "v1":
        from .sharded import load_pipeline_checkpoint as load_v1

        return load_v1(
            path,
            module,
            rank=rank,
            optimizers=optimizers,
            scheduler_configs=scheduler_configs,
            weights_only=weights_only,
            canonical=canonical,
        )
    return load_dcp_checkpoint(
        path,
        module,
        canonical=canonical_names(module, canonical),
        optimizers=optimizers,
        scheduler_configs=scheduler_configs,
        strict=bool(getattr(module, "strict_loading", True)),
    )


def module_optimizer_state(
    optimizer: Optimizer, module: Any, canonical: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """:func:`~.by_name.optimizer_state_by_name` for a module with pipeline layers (tied names
    resolved), what the strategy's ``optimizer_state`` hook returns."""
    return optimizer_state_by_name(optimizer, module, canonical_names(module, canonical))
