"""Pipeline a model you did not write for it: cut it between its repeated blocks.

- :class:`StagedModel`: this rank's stages of ``model_fn()``, under the model's own names,
  materialised alone, initialised exactly as a plain build of the same seed.
- :class:`EngineStages`: its stages as ``PipelineEngine`` chunks.

See docs/bring_your_own_model.md for the mechanism, why it was chosen and its limits.
"""

from .engine_chunks import EngineStages, StageChunk
from .materialize import ReplayError, meta_build, replay_build
from .phantom import Phantom, PhantomValueError
from .split import SplitError, SplitLayout, StagedModel, TiedParameter

__all__ = [
    "EngineStages",
    "Phantom",
    "PhantomValueError",
    "ReplayError",
    "SplitError",
    "SplitLayout",
    "StageChunk",
    "StagedModel",
    "TiedParameter",
    "meta_build",
    "replay_build",
]
