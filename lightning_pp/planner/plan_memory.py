"""A plan's predicted memory per pipeline rank, under each data-parallel sharding.

What ``lightning-pp plan`` (the dry run) prints: for the plan's split of the layers, each
pipeline rank's training states (:mod:`lightning_pp.planner.sharding`) and, when the layers'
bytes were measured (on the meta device, :mod:`lightning_pp.planner.meta_profile`), its peak
saved activations and message buffers (:mod:`lightning_pp.planner.memory`). One activation
analysis serves every sharding: sharding moves the training states only.

Example:
    >>> from lightning_pp.layout.plan import PipelinePlan
    >>> plan = PipelinePlan.build(pp=2, microbatches=4, world_size=8, num_layers=4)
    >>> rows = compare_shardings(plan, [[1000]] * 4, None, StateBytes.for_precision("bf16-true"))
    >>> [(r.label, r.heaviest.total) for r in rows]   # 2000 params: 16 bytes each unsharded
    [('none', 32000), ('zero=1', 16000), ('zero=2', 14000), ('fsdp', 15000)]

    (No activations here: ``zero=1`` peaks at the optimizer step, where the rows' fp32
    gradients join the full bf16 ones; ``zero=2`` freed those.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .memory import RankMemory, _buffer_bytes, peak_activation_bytes, with_states
from .profile import LayerCost
from .sharding import (
    DEFAULT_BUCKET_CAP_MB,
    SHARDINGS,
    LayerTensors,
    Sharding,
    StateBytes,
    allowed_shardings,
    rank_state_bytes,
)

if TYPE_CHECKING:
    from ..layout.plan import PipelinePlan

__all__ = ["ShardingMemory", "compare_shardings", "plan_memory"]


@dataclass(frozen=True)
class ShardingMemory:
    """Every pipeline rank's predicted memory under one sharding."""

    sharding: Sharding
    ranks: tuple[RankMemory, ...]

    @property
    def label(self) -> str:
        return self.sharding.label

    @property
    def heaviest(self) -> RankMemory:
        """The rank with the largest peak (the lowest rank on a tie)."""
        return max(self.ranks, key=lambda m: (m.total, -m.rank))

    def fits(self, limit: int | None) -> bool | None:
        """Whether the heaviest rank's peak is within ``limit`` bytes (``None``: no limit)."""
        return None if limit is None else self.heaviest.total <= limit


def _unsharded(
    plan: PipelinePlan,
    layer_tensors: Sequence[LayerTensors],
    layer_costs: Sequence[LayerCost] | None,
    state_bytes: StateBytes,
    recompute: str | None,
) -> list[RankMemory]:
    """Every rank's memory with nothing sharded; activations and buffers 0 without costs."""
    out = []
    for r in range(plan.pp):
        ranges = plan.stage_layers(r)
        state = rank_state_bytes(
            [[layer_tensors[i] for i in rng] for rng in ranges], Sharding(), state_bytes
        )
        activations = buffers = 0
        if layer_costs is not None:
            chunks = [[layer_costs[i] for i in rng] for rng in ranges]
            activations = peak_activation_bytes(plan.schedule, r, chunks, recompute)
            buffers = _buffer_bytes(plan.schedule, r, chunks)
        base = RankMemory(r, 0, 0, 0, activations, buffers)
        out.append(with_states(base, state))
    return out


def plan_memory(
    plan: PipelinePlan,
    layer_tensors: Sequence[LayerTensors],
    layer_costs: Sequence[LayerCost] | None,
    state_bytes: StateBytes,
    sharding: Sharding,
    *,
    recompute: str | None = None,
) -> ShardingMemory:
    """Every pipeline rank's memory for ``plan`` under ``sharding``.

    ``layer_tensors[i]``: layer ``i``'s parameter count or its tensors' element counts;
    ``layer_costs[i]``: its bytes at the plan's microbatch size (``None``: not measured, the
    activations and buffers count 0); ``recompute``: ``None`` or ``"full"``."""
    return compare_shardings(
        plan, layer_tensors, layer_costs, state_bytes, recompute=recompute, shardings=[sharding]
    )[0]


def compare_shardings(
    plan: PipelinePlan,
    layer_tensors: Sequence[LayerTensors],
    layer_costs: Sequence[LayerCost] | None,
    state_bytes: StateBytes,
    *,
    recompute: str | None = None,
    shardings: Sequence[Sharding] | None = None,
    bucket_cap_mb: float | None = None,
    reshard_after_forward: bool = False,
) -> list[ShardingMemory]:
    """:func:`plan_memory` under each of ``shardings`` (default: every one of
    :data:`~lightning_pp.planner.sharding.SHARDINGS` over the plan's ``dp``; only none when
    ``dp = 1``), the activations analysed once."""
    if shardings is None:
        dp = plan.dp or 1
        cap = bucket_cap_mb or plan.bucket_cap_mb or DEFAULT_BUCKET_CAP_MB
        labels = allowed_shardings(SHARDINGS, dp)
        shardings = [
            dataclasses.replace(
                Sharding.parse(label, dp=dp, bucket_cap_mb=cap),
                reshard_after_forward=reshard_after_forward and label == "fsdp",
            )
            for label in labels
        ]
    base = _unsharded(plan, layer_tensors, layer_costs, state_bytes, recompute)
    out = []
    for sharding in shardings:
        ranks = tuple(
            with_states(
                m,
                rank_state_bytes(
                    [[layer_tensors[i] for i in rng] for rng in plan.stage_layers(m.rank)],
                    sharding,
                    state_bytes,
                ),
            )
            for m in base
        )
        out.append(ShardingMemory(sharding, ranks))
    return out
