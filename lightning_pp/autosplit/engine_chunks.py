"""Feed a :class:`~lightning_pp.autosplit.split.StagedModel` to today's ``PipelineEngine``.

The engine hands a chunk only the received activation, while a split stage also needs the
microbatch (its prologue recomputes masks and positions from it; the last stage's step reads the
labels). Until the engine can pass the microbatch to a chunk, the microbatch's tensors travel
with the activation: :meth:`EngineStages.prepare` flattens the batch into a tuple of tensors (the
engine splits it into microbatches as usual), stage 0 receives that tuple, and every stage sends
``(hidden, *microbatch tensors)``. Integer tensors (token ids, labels, masks) cost a small
fraction of the hidden state and carry no gradient.

Example::

    stages = EngineStages(staged, step=lambda m, mb: m(input_ids=mb[0], labels=mb[1]).loss)
    engine = PipelineEngine(stages.chunks, schedule, topo, groups, **stages.engine_kwargs())
    result = engine.train_step(stages.prepare(batch))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from .split import StagedModel

__all__ = ["EngineStages", "StageChunk"]


class StageChunk(nn.Module):
    """One local stage as an engine chunk; its parameters are the stage's own modules."""

    def __init__(self, stages: EngineStages, chunk: int) -> None:
        super().__init__()
        self._stages = [stages]  # a list: not registered as a submodule
        self.chunk = chunk
        self.stage = stages.staged.stages[chunk]
        self.owned = nn.ModuleList(stages.staged.stage_modules(chunk))

    def forward(self, x: Any) -> Any:
        stages = self._stages[0]
        staged = stages.staged
        x = tuple(x) if isinstance(x, (tuple, list)) else (x,)
        activation, leaves = (None, x) if self.stage == 0 else (x[0], x[1:])
        out = staged.run(self.chunk, activation, stages.unflatten(leaves), stages.step)
        if self.stage == staged.layout.num_stages - 1:
            return out
        return (out, *leaves)


class EngineStages:
    """Engine chunks, input/loss functions and batch flattening for a staged model."""

    def __init__(self, staged: StagedModel, step: Callable[[nn.Module, Any], Any]) -> None:
        self.staged = staged
        self.step = step
        self.chunks = [StageChunk(self, c) for c in range(len(staged.stages))]
        self._spec: TreeSpec | None = None
        self._constants: list[Any] = []
        self._where: list[int] = []

    def prepare(self, batch: Any) -> tuple[Tensor, ...]:
        """The batch as the engine should get it: its tensors, in a flat tuple."""
        leaves, spec = tree_flatten(batch)
        self._spec, self._constants = spec, leaves
        self._where = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]
        return tuple(leaves[i] for i in self._where)

    def unflatten(self, tensors: tuple[Tensor, ...]) -> Any:
        if self._spec is None:
            raise RuntimeError("call EngineStages.prepare(batch) before the engine step")
        leaves = list(self._constants)
        for i, t in zip(self._where, tensors):
            leaves[i] = t
        return tree_unflatten(leaves, self._spec)

    def engine_kwargs(self) -> dict[str, Any]:
        """``input_fn``/``loss_fn`` for ``PipelineEngine``: the last chunk returns the loss."""
        return {"input_fn": lambda mb: tuple(mb), "loss_fn": lambda out, mb: out}
