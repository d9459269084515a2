"""Checkpoints: each rank saves what it holds, any pipeline shape loads it back.

- :mod:`.dcp_format`: the format (``torch.distributed.checkpoint`` tensors, metadata without
  pickle, a completion marker written last): save, load at any shape, one-process reading;
- :mod:`.strategy_io`: one rank's save/load as ``PipelineStrategy``'s hooks call them;
- :mod:`.consolidate`: one-process readers of either format (consolidate, metadata, module);
- :mod:`.sharded`: the version-1 format, read for one release;
- :mod:`.plain_io`: :class:`PipelineCheckpointIO`, a plain ``Trainer`` resuming from one.

May import: :mod:`lightning_pp.schedules`, :mod:`lightning_pp.layout`,
:mod:`lightning_pp.runtime` and :mod:`lightning_pp._lightning_compat`. It is handed the objects
it saves (module, optimizers, layout); the strategy's hooks that call it live in
:mod:`lightning_pp.strategy.pipeline_strategy`.

Example::

    from lightning_pp.checkpoint import consolidate_checkpoint

    consolidate_checkpoint("runs/epoch=0-step=100.ckpt", out="model.pt")
"""

from .consolidate import (
    checkpoint_format,
    checkpoint_meta,
    consolidate_checkpoint,
    consolidated_state_dict,
    is_pipeline_checkpoint,
    module_from_checkpoint,
)
from .errors import CheckpointError
from .plain_io import PipelineCheckpointIO
from .sharded import load_metadata, read_index
from .strategy_io import load_pipeline_checkpoint, save_pipeline_checkpoint

__all__ = [
    "CheckpointError",
    "PipelineCheckpointIO",
    "checkpoint_format",
    "checkpoint_meta",
    "consolidate_checkpoint",
    "consolidated_state_dict",
    "is_pipeline_checkpoint",
    "load_metadata",
    "load_pipeline_checkpoint",
    "module_from_checkpoint",
    "read_index",
    "save_pipeline_checkpoint",
]
