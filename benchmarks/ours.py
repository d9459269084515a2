"""lightning_pp's side of the comparison: the same layers, cut by ``partition_layers``, run by
:class:`~lightning_pp.engine.PipelineEngine` with the project's own schedules.

Example (inside an initialised process group of ``pp`` ranks):
    >>> step, params = build_ours_step(w, "1f1b", pp, 1, m, rank, dev, stats)  # doctest: +SKIP
    >>> loss = step(x, y)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_pp.engine import PipelineEngine
from lightning_pp.partition import PipelineChunk, local_layer_indices, partition_layers
from lightning_pp.schedules import build_schedule
from lightning_pp.topology import PipelineTopology, build_process_groups

from .harness import Instrumented, RankStats
from .peer_torch import stage_layers
from .workloads import Workload

# Both sides agree activation shapes once (torch's peer gets static metadata too).
STATIC_SHAPES = True


def build_ours_step(
    workload: Workload,
    schedule: str,
    pp: int,
    vpp: int,
    microbatches: int,
    rank: int,
    device: torch.device,
    stats: RankStats,
    *,
    monitor: bool = True,
    recv_lookahead: int | None = None,
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None], list[nn.Parameter]]:
    """Return ``(step(x, y) -> loss or None, local parameters)``, like the torch peer's builder.

    ``monitor=False`` turns the engine's failure monitor off (``abort_on_failure=False``);
    ``recv_lookahead`` overrides the engine's default.
    """
    layers = workload.build_layers(pp)
    ranges = partition_layers(len(layers), pp, vpp)
    chunks = []
    for c, r in enumerate(local_layer_indices(ranges, rank, pp, vpp)):
        mine = [layers[i] for i in r]
        # Same cut as the peer, layer for layer: the comparison is only fair if it holds.
        peer = stage_layers(layers, c * pp + rank, pp * vpp)
        assert all(a is b for a, b in zip(mine, peer)) and len(mine) == len(peer)
        chunks.append(Instrumented(PipelineChunk(mine, r), stats).to(device))
    topo = PipelineTopology.from_world(dist.get_world_size(), rank, pp=pp)
    groups = build_process_groups(topo)
    engine = PipelineEngine(
        chunks,
        build_schedule(schedule, pp=pp, microbatches=microbatches, vpp=vpp),
        topo,
        groups,
        loss_fn=lambda out, mb: Workload.loss_fn(out, mb[1]),
        device=device,
        static_shapes=STATIC_SHAPES,
        abort_on_failure=monitor,
        recv_lookahead=recv_lookahead,
    )
    params = [p for c in chunks for p in c.parameters()]
    is_last = rank == pp - 1

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        loss = engine.train_step((x, y)).loss
        return loss if is_last else None

    step.engine = engine  # type: ignore[attr-defined]  # for profiling scripts
    return step, params
