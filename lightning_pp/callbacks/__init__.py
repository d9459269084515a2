"""Callbacks that show the pipeline: bubble time, activation memory, measured timeline.

They read the engine's per-step record (``PipelineStrategy.last_record``), gather it from every
rank once per measured step (shared by all three), and compute their numbers with the
Lightning-free functions of :mod:`lightning_pp.callbacks.analysis`.

Example::

    from lightning_pp.callbacks import (ActivationMemoryMonitor, PipelineBubbleMonitor,
                                        PipelineTimeline)

    trainer = L.Trainer(devices=4, strategy=PipelineStrategy(pp=4, microbatches=8),
                        callbacks=[PipelineBubbleMonitor(prog_bar=True),
                                   ActivationMemoryMonitor(), PipelineTimeline(every_n_steps=100)])
"""

from .bubble import PipelineBubbleMonitor
from .memory import ActivationMemoryMonitor
from .state_memory import ModelStateMemoryMonitor
from .timeline import PipelineTimeline

__all__ = [
    "ActivationMemoryMonitor",
    "ModelStateMemoryMonitor",
    "PipelineBubbleMonitor",
    "PipelineTimeline",
]
