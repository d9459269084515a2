"""Checkpoints: each stage saves what it holds, any pipeline shape loads it back.

- :mod:`.sharded`: the sharded directory format (save, load by name, reshard, consolidate);
- :mod:`.plain_io`: :class:`PipelineCheckpointIO`, a plain ``Trainer`` resuming from one.

May import: :mod:`lightning_pp.schedules`, :mod:`lightning_pp.layout`,
:mod:`lightning_pp.runtime` and :mod:`lightning_pp._lightning_compat`. It is handed the objects
it saves (module, optimizers, placement); the strategy's hooks that call it live in
:mod:`lightning_pp.strategy.checkpointing`.

Example::

    from lightning_pp.checkpoint import consolidate_checkpoint

    consolidate_checkpoint("runs/epoch=0-step=100.ckpt", out="model.pt")
"""

from .plain_io import PipelineCheckpointIO
from .sharded import (
    CheckpointError,
    consolidate_checkpoint,
    consolidated_state_dict,
    is_pipeline_checkpoint,
    load_metadata,
    load_pipeline_checkpoint,
    module_from_checkpoint,
    read_index,
    save_pipeline_checkpoint,
)

__all__ = [
    "CheckpointError",
    "PipelineCheckpointIO",
    "consolidate_checkpoint",
    "consolidated_state_dict",
    "is_pipeline_checkpoint",
    "load_metadata",
    "load_pipeline_checkpoint",
    "module_from_checkpoint",
    "read_index",
    "save_pipeline_checkpoint",
]
