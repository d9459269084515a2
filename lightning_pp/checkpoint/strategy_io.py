"""One rank's checkpoint save and load, as :class:`~lightning_pp.PipelineStrategy`'s hooks call
them: plain values in (the module, its optimizers, the run's layout), nothing of the strategy.

Saves write the DCP format (:mod:`.dcp_format`). Loads read it, and still read the version-1
format (``index.json`` directories, :mod:`.sharded`) for one release, so a run saved before the
switch resumes. Which one a directory is: :func:`~.consolidate.checkpoint_format`.

Loads also take a plain Lightning checkpoint (one ``torch.save`` file of an unpipelined run,
:mod:`.plain_load`): its optimizer state is positional and is turned into names first.

Example::

    save_pipeline_checkpoint(ckpt, path, module=module, layout={"pp": 2, "vpp": 1, "dp": 2})
    meta = load_pipeline_checkpoint(path, module, rank=rank, optimizers=[opt])
    saver = CheckpointSaver(asynchronous=True)       # the strategy's: one per fit
    saver.save(ckpt, path, module=module, layout=layout)  # returns once tensors are copied
    saver.wait()                                     # before a load, at teardown
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.optim import Optimizer

from .agree import raise_together
from .async_save import PendingSave, checkpoint_group
from .by_name import canonical_names, optimizer_state_by_name
from .consolidate import checkpoint_format
from .dcp_format import load_dcp_checkpoint, save_dcp_checkpoint
from .dcp_save import start_async_dcp_checkpoint
from .errors import CheckpointError
from .plain_file import is_plain_checkpoint

__all__ = [
    "CheckpointSaver",
    "load_pipeline_checkpoint",
    "module_optimizer_state",
    "save_pipeline_checkpoint",
]


def _record(checkpoint: dict[str, Any], module: Any) -> None:
    """Record the module's class (and a Hugging Face model's config) in ``checkpoint``, so
    ``lightning-pp consolidate --lightning`` / ``--hf`` can rebuild the unpipelined model."""
    from .hf_record import hf_config_of

    cls = type(module)
    record: dict[str, Any] = {"module_class": f"{cls.__module__}:{cls.__qualname__}"}
    hf = hf_config_of(module)
    if hf is not None:  # what ``consolidate --hf`` needs to write a save_pretrained directory
        record["hf"] = hf
    checkpoint["lightning_pp"] = record


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
    _record(checkpoint, module)
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
    by_name: dict[str, Any] = {
        "canonical": canonical_names(module, canonical),
        "optimizers": optimizers,
        "scheduler_configs": scheduler_configs,
        "strict": bool(getattr(module, "strict_loading", True)),
    }
    if is_plain_checkpoint(path):  # a plain Trainer's single file
        from .plain_load import load_plain_checkpoint

        return load_plain_checkpoint(path, module, trusted=weights_only is False, **by_name)
    return load_dcp_checkpoint(path, module, **by_name)


def module_optimizer_state(
    optimizer: Optimizer, module: Any, canonical: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """:func:`~.by_name.optimizer_state_by_name` for a module with pipeline layers (tied names
    resolved), what the strategy's ``optimizer_state`` hook returns."""
    return optimizer_state_by_name(optimizer, module, canonical_names(module, canonical))


class CheckpointSaver:
    """Writes one rank's checkpoints, synchronously or in the background (``dcp.async_save``).

    Asynchronous: :meth:`save` returns once this rank's tensors are copied; the write, the
    marker and the rename (rank 0) go on in DCP's writer thread, whose collectives run on a
    gloo group of their own (:func:`~.async_save.checkpoint_group`, made at the first save).
    At most one save is in flight: the next :meth:`save` waits for the previous one first, and
    :meth:`wait` (collective) must be called before anything reads a checkpoint and at
    teardown. Until the
    marker is written the directory stays hidden (``.NAME.partial-*``), so a kill at any point
    leaves the previous checkpoint as the newest complete one.

    Example::

        saver = CheckpointSaver(asynchronous=True)
        saver.save(ckpt, "ckpts/step=5.ckpt", module=module, layout=layout)
        ...                 # training steps overlap the write
        saver.wait()        # raises CheckpointError naming the path if the write failed
    """

    def __init__(self, asynchronous: bool = False) -> None:
        self.asynchronous = asynchronous
        self._group: Any = None
        self._pending: PendingSave | None = None

    @property
    def pending_path(self) -> Path | None:
        """The final directory of the save in flight, if any (not yet waited for)."""
        return self._pending.path if self._pending is not None else None

    def save(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike,
        *,
        module: Any,
        layout: Mapping[str, Any],
        canonical: Mapping[str, str] | None = None,
    ) -> None:
        """Collective: :func:`save_pipeline_checkpoint`, or its background form."""
        if not self.asynchronous:
            save_pipeline_checkpoint(
                checkpoint, path, module=module, layout=layout, canonical=canonical
            )
            return
        self.wait()
        if self._group is None:  # collective, and every rank saves: made on every rank alike
            self._group = checkpoint_group()
        _record(checkpoint, module)
        self._pending = start_async_dcp_checkpoint(
            checkpoint,
            path,
            canonical=canonical_names(module, canonical),
            layout=layout,
            writer_group=self._group,
        )

    def wait(self) -> None:
        """Collective: block until the save in flight (if any) is written and published; raise
        its error on every rank.

        Rank 0 publishes (marker, rename) in its writer thread after DCP's save returned, which
        the other ranks do not see: so the ranks agree on the checkpoint group, which is also
        the barrier after which every rank may read the directory."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error = None
        try:
            pending.wait()
        except CheckpointError as exc:
            error = str(exc)
        raise_together(error, self._group, f"checkpoint {str(pending.path)!r}")
