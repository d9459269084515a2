"""Reading a pipeline checkpoint in one process, whichever format wrote it.

Two formats are read: the DCP format every save now writes (:mod:`.dcp_format`, marker
``complete.json``) and, for one release, version 1 (``index.json`` + ``torch.save`` files,
:mod:`.sharded`). :func:`checkpoint_format` tells them apart; every function here dispatches, so
``lightning-pp consolidate``, :class:`~.plain_io.PipelineCheckpointIO` and the Hugging Face
export read both.

- :func:`consolidated_state_dict` / :func:`consolidate_checkpoint`: the unpipelined
  ``state_dict`` (every tied name present), or with ``module`` a full Lightning checkpoint whose
  optimizer state is in ``module.configure_optimizers()``'s positional order;
- :func:`checkpoint_meta`: Lightning's metadata (loops, callbacks, hyperparameters...);
- :func:`module_from_checkpoint`: the unpipelined LightningModule, from the recorded class.

Example::

    from lightning_pp.checkpoint import consolidate_checkpoint
    state_dict = consolidate_checkpoint("ckpts/step=5.ckpt", "gpt.pt")   # plain, single file
    model = GPT(**hparams); model.configure_model(); model.load_state_dict(state_dict)
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from torch import Tensor

from .._lightning_compat import configure_optimizers_and_schedulers
from .dcp_format import (
    consolidated_dcp_state_dict,
    is_dcp_checkpoint,
    load_dcp_checkpoint,
    read_dcp_checkpoint_meta,
)
from .directory import save_file_atomically
from .errors import CheckpointError
from .manifest import MANIFEST
from .meta_codec import read_meta

__all__ = [
    "checkpoint_format",
    "checkpoint_layout",
    "checkpoint_meta",
    "consolidate_checkpoint",
    "consolidated_state_dict",
    "is_pipeline_checkpoint",
    "module_from_checkpoint",
]

V1_INDEX = "index.json"


def checkpoint_format(path: str | os.PathLike) -> str:
    """``"v1"`` for a version-1 directory (``index.json``, no DCP marker), else ``"dcp"``
    (which is also what an incomplete or foreign path is refused as, naming the marker)."""
    path = Path(path)
    if (path / V1_INDEX).is_file() and not (path / MANIFEST).is_file():
        return "v1"
    return "dcp"


def is_pipeline_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete checkpoint directory of either format (cheap: the marker;
    loading verifies every file)."""
    if checkpoint_format(path) == "dcp":
        return is_dcp_checkpoint(path)
    from .sharded import is_pipeline_checkpoint as is_v1

    return is_v1(path)


def checkpoint_layout(path: str | os.PathLike) -> dict[str, Any]:
    """The shape that wrote the checkpoint (``pp``, ``vpp``, ``dp``...), for messages. Read
    without verifying the files (whatever then reads the tensors verifies them)."""
    if checkpoint_format(path) == "v1":
        from .sharded import read_index

        return dict(read_index(path)["layout"])
    if not is_dcp_checkpoint(path):
        read_dcp_checkpoint_meta(path)  # raises, naming what is missing
    return dict(read_meta(path).get("layout", {}))


def checkpoint_meta(path: str | os.PathLike, *, weights_only: bool = True) -> dict[str, Any]:
    """Lightning's metadata dict of a checkpoint (no pickled code runs: see ``weights_only`` for
    a version-1 ``meta.pt``, :func:`~.sharded.load_metadata`)."""
    path = Path(path)
    if checkpoint_format(path) == "v1":
        from .sharded import load_metadata, read_index

        return load_metadata(path / read_index(path)["meta_file"], weights_only=weights_only)
    return dict(read_dcp_checkpoint_meta(path)["lightning"])


def consolidated_state_dict(
    path: str | os.PathLike, submodule: str | None = None
) -> dict[str, Tensor]:
    """All stored tensors in one dict, tied members expanded (same tensor under each name).

    ``submodule``: keep only the keys under that LightningModule attribute, without its prefix
    (``"model"``: the state dict of the Hugging Face model a ``split=`` module holds).
    """
    if checkpoint_format(path) == "v1":
        from .sharded import consolidated_state_dict as v1_state_dict

        return v1_state_dict(path, submodule)
    return consolidated_dcp_state_dict(path, submodule)


def consolidate_checkpoint(
    path: str | os.PathLike,
    out: str | os.PathLike | None = None,
    module: Any = None,
    submodule: str | None = None,
    *,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Merge a checkpoint directory into one ordinary ``torch.save`` file.

    Without ``module``: a plain ``state_dict`` (original names, every tied name present) that
    loads with ``load_state_dict(strict=True)`` into the unpipelined LightningModule.

    With ``module`` (an unpipelined LightningModule of the same architecture; ``configure_model``
    is called if its layers are not built yet): a full Lightning checkpoint (``state_dict``,
    ``optimizer_states`` in the positional order of ``module.configure_optimizers()``,
    ``lr_schedulers``, loops, callbacks, hyperparameters), so a plain ``Trainer`` resumes with
    ``trainer.fit(module, ckpt_path=out)``. ``weights_only=False`` matters for a version-1
    ``meta.pt`` only (code execution allowed: for checkpoints you trust).

    ``submodule`` (without ``module``): only that attribute's keys, unprefixed.

    The checkpoint is verified first (every file present and unaltered); otherwise a
    :class:`CheckpointError` is raised and nothing is written. Returns what was (or would be)
    written to ``out``.
    """
    if checkpoint_format(path) == "v1":
        from .sharded import consolidate_checkpoint as consolidate_v1

        return consolidate_v1(path, out, module, submodule, weights_only=weights_only)
    if module is not None and submodule:
        raise ValueError(
            "consolidate_checkpoint: pass module (a Lightning checkpoint) or "
            "submodule (a plain state dict of one attribute), not both"
        )
    if module is None:
        result: dict[str, Any] = consolidated_dcp_state_dict(path, submodule)
    else:
        result = _lightning_checkpoint(Path(path), module)
    if out is not None:
        save_file_atomically(result, Path(out))
    return result


def _lightning_checkpoint(path: Path, module: Any) -> dict[str, Any]:
    """Load a DCP checkpoint into the unpipelined ``module`` and its own optimizers (one
    process), and return it as a plain Lightning checkpoint dict."""
    if getattr(module, "layers", None) is None and hasattr(module, "configure_model"):
        module.configure_model()
    # the tied names the checkpoint was written with (a split= model's, or PipelineLayers'):
    # a peek, no pickle either; load_dcp_checkpoint verifies every file before using any
    stored = read_meta(path)
    canonical = {member: name for name, member in stored["tied"]}
    optimizers, scheduler_configs = configure_optimizers_and_schedulers(module)
    with_optim = bool(optimizers) and "optimizers" in stored
    meta = load_dcp_checkpoint(
        path,
        module,
        canonical=canonical,
        optimizers=optimizers if with_optim else None,
        scheduler_configs=scheduler_configs,
    )
    meta["state_dict"] = {k: v.detach() for k, v in module.state_dict().items()}
    if with_optim:
        meta["optimizer_states"] = [opt.state_dict() for opt in optimizers]
    return meta


def module_from_checkpoint(
    path: str | os.PathLike,
    class_path: str | type | None = None,
    *,
    weights_only: bool = True,
    allow_main: bool = False,
) -> Any:
    """Instantiate the unpipelined LightningModule a checkpoint was written from.

    The class is ``class_path`` (a class, or ``"package.module:Class"``), else the one recorded at
    save time; it is called with the saved hyperparameters. Trust: importing a module runs its
    top-level code, so only a class that is a ``LightningModule`` subclass is called, and a
    recorded class is imported only when its module is importable here (installed or on the
    path). ``allow_main``: accept a class recorded from a script (``__main__:Class``), which
    resolves only inside that same script (the CLI refuses it).
    """
    from lightning.pytorch import LightningModule

    path = Path(path)
    meta = checkpoint_meta(path, weights_only=weights_only)
    if class_path is None:
        class_path = meta.get("lightning_pp", {}).get("module_class")
        if class_path is None:
            raise CheckpointError(f"checkpoint {str(path)!r} does not record its module class")
    if isinstance(class_path, str):
        module_name, _, qualname = class_path.partition(":")
        if not qualname:
            raise ValueError(
                f"a module class must look like 'package.module:Class', got {class_path!r}"
            )
        if module_name == "__main__" and not allow_main:
            raise ValueError(
                f"the module class was defined in a script ({class_path}); name an importable "
                "class instead (pkg.mod:Class)"
            )
        cls: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    else:
        cls = class_path
    if not (isinstance(cls, type) and issubclass(cls, LightningModule)):
        raise CheckpointError(
            f"{class_path!r} (from checkpoint {str(path)!r}) is not a LightningModule class; "
            "refusing to call it with the checkpoint's hyperparameters"
        )
    return cls(**dict(meta.get("hyper_parameters", {})))
