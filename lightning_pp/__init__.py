"""lightning_pp: pipeline-parallel training for PyTorch Lightning.

Public names are imported lazily so that the pure-Python parts (``lightning_pp.schedules`` and
the ``lightning-pp schedule`` command) start without importing torch or Lightning.

``Trainer(strategy="pipeline")`` needs the name in Lightning's ``StrategyRegistry``: it is
registered when ``lightning_pp.strategy`` is imported, which ``import lightning_pp`` does
whenever Lightning is already imported (``import lightning`` first), and which any use of
``lightning_pp.PipelineStrategy`` does too.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "PipelineStrategy": "lightning_pp.strategy",
    "PipelineCheckpointIO": "lightning_pp.checkpoint.plain_io",
    "PipelineLayers": "lightning_pp.strategy.model",
    "PipelineMixin": "lightning_pp.strategy.model",
    "select_layers": "lightning_pp.strategy.model",
    "GPT": "lightning_pp.models.gpt",
}

__all__ = [*sorted(_EXPORTS), "__version__", "register_strategy"]

# Decisions (shape, placement, schedule, ...) are logged at INFO under the ``lightning_pp``
# logger; module loggers are its children. As Lightning does for ``lightning.pytorch``: shown on
# stderr unless the application configured logging itself (a root handler), then left to it.
_logger = logging.getLogger(__name__)
if not logging.getLogger().hasHandlers() and not _logger.handlers:
    _logger.setLevel(logging.INFO)
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False


def register_strategy() -> None:
    """Register ``"pipeline"`` and ``"pipeline_spawn"`` in Lightning's ``StrategyRegistry``."""
    importlib.import_module("lightning_pp.strategy")


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lightning_pp' has no attribute {name!r}")


if "lightning.pytorch" in sys.modules:
    register_strategy()
