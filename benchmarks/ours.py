"""lightning_pp's side of the comparison: the same layers, cut by ``partition_layers``, run by
:class:`~lightning_pp.runtime.engine.PipelineEngine` with the project's own schedules.

Example (inside an initialised process group of ``pp`` ranks):
    >>> step, params = build_ours_step(w, "1f1b", pp, 1, m, rank, dev, stats)  # doctest: +SKIP
    >>> loss = step(x, y)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pp.layout.partition import PipelineChunk, partition_layers
from lightning_pp.layout.topology import PipelineTopology, build_process_groups
from lightning_pp.runtime.engine import PipelineEngine
from lightning_pp.schedules import Costs, Schedule, build_schedule

from .harness import Instrumented, RankStats
from .peer_torch import stage_layers, torch_stage
from .workloads import Workload

# Both sides agree activation shapes once (torch's peer gets static metadata too).
STATIC_SHAPES = True


def build_chunks(
    workload: Workload,
    schedule: str,
    pp: int,
    vpp: int,
    microbatches: int,
    rank: int,
    device: torch.device,
    wrap: Callable[[Schedule, int, PipelineChunk], nn.Module] | None = None,
) -> tuple[Schedule, list[nn.Module]]:
    """The schedule and this rank's chunks of the workload's layers, in local chunk order,
    following the schedule's placement (V for zbv); each chunk passed through
    ``wrap(schedule, local chunk index, chunk)`` if given (a meter), then moved to ``device``."""
    layers = workload.build_layers(pp)
    # zb-auto: the order computed from the workload's cost model (same on every rank);
    # "zb-auto-2p": the same under twice 1F1B's activation memory (ZB-2p)
    costs = memory = None
    if schedule.startswith("zb-auto"):
        if workload.schedule_costs:
            costs = Costs(**dict(workload.schedule_costs))
        memory = "2p" if schedule == "zb-auto-2p" else "1p"
        schedule = "zb-auto"
    sched = build_schedule(
        schedule, pp=pp, microbatches=microbatches, vpp=vpp, costs=costs, memory=memory
    )
    ranges = partition_layers(len(layers), pp, sched.vpp)
    chunks = []
    for c, s in enumerate(sched.stages_of(rank)):
        chunk = PipelineChunk([layers[i] for i in ranges[s]], ranges[s])
        chunks.append((wrap(sched, c, chunk) if wrap is not None else chunk).to(device))
    return sched, chunks


def build_ours_engine(
    workload: Workload,
    schedule: str,
    pp: int,
    vpp: int,
    microbatches: int,
    rank: int,
    device: torch.device,
    *,
    groups: Any = None,
    wrap: Callable[[Schedule, int, PipelineChunk], nn.Module] | None = None,
    **engine_kw: Any,
) -> tuple[PipelineEngine, list[nn.Parameter], bool]:
    """This rank's :class:`PipelineEngine` over the workload's layers: ``(engine, local
    parameters, holds the last stage)``. Chunks from :func:`build_chunks` (``wrap``: a meter);
    ``groups``: process groups to share (built for this topology when ``None``); ``engine_kw``
    go to the engine.
    """
    sched, chunks = build_chunks(workload, schedule, pp, vpp, microbatches, rank, device, wrap)
    topo = PipelineTopology.from_world(dist.get_world_size(), rank, pp=pp)
    engine = PipelineEngine(
        chunks,
        sched,
        topo,
        groups if groups is not None else build_process_groups(topo),
        loss_fn=lambda out, mb: Workload.loss_fn(out, mb[1]),
        device=device,
        static_shapes=STATIC_SHAPES,
        **engine_kw,
    )
    params = [p for c in chunks for p in c.parameters()]
    return engine, params, rank == sched.locate(sched.num_stages - 1)[0]


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
    release_outputs: bool = True,
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None], list[nn.Parameter]]:
    """Return ``(step(x, y) -> loss or None, local parameters)``, like the torch peer's builder.

    ``monitor=False`` turns the engine's failure monitor off (``abort_on_failure=False``);
    ``recv_lookahead`` overrides the engine's default; ``release_outputs=False`` keeps sent
    outputs whole (the engine's option of that name).
    """

    def metered(sched: Schedule, c: int, chunk: PipelineChunk) -> nn.Module:
        # Same cut as the peer, layer for layer: the comparison is only fair if it holds.
        every = list(range(workload.layers_per_rank * pp))
        peer = stage_layers(every, torch_stage(schedule, c, pp, rank), pp * vpp)
        assert chunk.layer_indices == peer, (c, chunk.layer_indices, peer)
        # the same meter as the peer's (no weight hook under a split backward, see Instrumented)
        return Instrumented(chunk, stats, weight_hook=not sched.split_backward)

    engine, params, is_last = build_ours_engine(
        workload, schedule, pp, vpp, microbatches, rank, device,
        wrap=metered, abort_on_failure=monitor, recv_lookahead=recv_lookahead,
        release_outputs=release_outputs,
    )  # fmt: skip
    records: list = []  # the engine's step records (measured per-action compute: t_i, t_w)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        result = engine.train_step((x, y))
        records.append(result.record)
        return result.loss if is_last else None

    step.engine = engine  # type: ignore[attr-defined]  # for profiling scripts
    step.records = records  # type: ignore[attr-defined]
    return step, params
