"""Resume a plain ``Trainer`` (no ``PipelineStrategy``) from a sharded pipeline checkpoint.

A pipeline checkpoint is a directory of per-stage files keyed by parameter name
(:mod:`lightning_pp.checkpoint`); a plain Trainer reads one ``torch.save`` file whose optimizer
state is positional. :class:`PipelineCheckpointIO` bridges the two at load time: given a
directory, it consolidates it in memory into the full Lightning checkpoint that ``lightning-pp
consolidate DIR out.ckpt --lightning`` would write, and hands that to the Trainer. Anything else
(an ordinary ``.ckpt`` file, every save) goes to Lightning's ``TorchCheckpointIO`` unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from .consolidate import consolidate_checkpoint, module_from_checkpoint

__all__ = ["PipelineCheckpointIO"]


class PipelineCheckpointIO(TorchCheckpointIO):
    """A ``CheckpointIO`` that lets a plain Trainer resume from a ``PipelineStrategy`` checkpoint.

    Example::

        from lightning_pp import PipelineCheckpointIO

        trainer = L.Trainer(max_steps=1000, plugins=[PipelineCheckpointIO()])
        trainer.fit(GPT(**hparams), data, ckpt_path="ckpts/step=500.ckpt")  # a pipeline directory

    The optimizer state in a pipeline checkpoint is keyed by parameter name; a plain Trainer
    restores it by position, in the order of ``configure_optimizers()``. To find that order the
    plugin builds a second, throwaway instance of the module on CPU (the class recorded in the
    checkpoint, or ``module_class``, with the saved hyperparameters), calls its
    ``configure_model()`` and ``configure_optimizers()`` outside the Trainer, and loads the
    state by name into it, exactly as ``lightning-pp consolidate --lightning`` does. So it needs
    host memory for one more copy of the model and its optimizer state, and a
    ``configure_optimizers`` that does not need ``self.trainer``; otherwise consolidate once with
    the CLI and pass the file.

    Args:
        module_class: the LightningModule class (or ``"package.module:Class"``) to rebuild;
            default: the class recorded at save time (a class defined in the running script,
            ``__main__:Class``, is accepted here).

    Trust: nothing in the directory is unpickled (DCP format). A version-1 directory's
    ``meta.pt`` is read with ``weights_only=True`` and lightning_pp's allow-list unless
    ``trainer.fit(..., weights_only=False)`` is passed (see docs/checkpoints.md, "Trust").
    """

    def __init__(self, module_class: type | str | None = None) -> None:
        super().__init__()
        self.module_class = module_class

    @override
    def load_checkpoint(
        self,
        path: str | os.PathLike,
        map_location: Any | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Consolidate a pipeline checkpoint directory in memory; load any other path as usual."""
        if not (isinstance(path, (str, Path)) and Path(path).is_dir()):
            return super().load_checkpoint(path, map_location, weights_only)
        trusted = weights_only is False
        module = module_from_checkpoint(
            path, self.module_class, weights_only=not trusted, allow_main=True
        )
        # Tensors come back on CPU; the Trainer moves the state to the module's device itself.
        return consolidate_checkpoint(path, module=module, weights_only=not trusted)
