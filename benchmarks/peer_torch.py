"""The peer: the same layers, split the same way, run by ``torch.distributed.pipelining``.

Each rank builds the virtual stages ``chunk * pp + rank`` (loop placement, as lightning_pp
does), wraps each in :class:`~benchmarks.harness.Instrumented`, and drives torch's own schedule:
``ScheduleGPipe`` / ``Schedule1F1B`` (one stage per rank) or ``ScheduleInterleaved1F1B``
(``vpp`` stages per rank), ``ScheduleInterleavedZeroBubble`` (``"zb-h1"`` with one stage per
rank, ``"izb"`` with ``vpp``) and ``ScheduleZBVZeroBubble`` (``"zbv"``: V placement, rank r
holds stages r and 2p-1-r, as lightning_pp's zbv) and ``ScheduleDualPipeV`` (``"dualpipev"``,
the same V placement). Shapes are given up front (static
metadata), torch's fastest path.

Example (inside an initialised process group of ``pp`` ranks):
    >>> step = build_torch_step(workload, "1f1b", pp, 1, m, rank, device, stats)  # doctest: +SKIP
    >>> loss = step(x, y)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.utils.checkpoint import checkpoint

from .harness import Instrumented, RankStats
from .workloads import Workload


def stage_layers(layers: list[nn.Module], stage: int, num_stages: int) -> list[nn.Module]:
    """Layers of virtual stage ``stage`` when ``layers`` are cut into ``num_stages`` equal runs."""
    if len(layers) % num_stages:
        raise ValueError(f"{len(layers)} layers do not split evenly into {num_stages} stages")
    k = len(layers) // num_stages
    return layers[stage * k : (stage + 1) * k]


#: schedules in V placement (rank r holds stages r and 2p-1-r)
V_SCHEDULES = ("zbv", "dualpipev", "zb-auto", "zb-auto-2p")


def torch_stage(schedule: str, chunk: int, pp: int, rank: int) -> int:
    """The virtual stage of local chunk ``chunk``: V placement for zbv, dualpipev and ours
    zb-auto (two chunks per rank), loop otherwise."""
    if schedule in V_SCHEDULES:
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


class Checkpointed(nn.Module):
    """A layer run under ``torch.utils.checkpoint`` (non-reentrant): how a torch user adds
    activation recompute to a pipeline stage. Parameter names gain an ``inner.`` prefix."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def build_torch_step(
    workload: Workload,
    schedule: str,
    pp: int,
    vpp: int,
    microbatches: int,
    rank: int,
    device: torch.device,
    stats: RankStats,
    *,
    checkpoint_layers: frozenset[int] = frozenset(),
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None], list[nn.Parameter]]:
    """Return ``(step(x, y) -> loss or None, local parameters)`` for this rank.

    ``step`` runs one full training step (forward + backward of all ``microbatches``) and returns
    the mean microbatch loss on the rank holding the last stage, ``None`` elsewhere.
    ``checkpoint_layers``: indices (in the whole model) of layers wrapped in
    :class:`Checkpointed`.
    """
    num_stages = pp * vpp
    layers = [
        Checkpointed(layer) if i in checkpoint_layers else layer
        for i, layer in enumerate(workload.build_layers(pp))
    ]
    mb_shape = workload.sample_shape()
    # Static metadata: an input that requires grad tells torch to send its gradient back.
    first_in = torch.zeros(mb_shape, device=device)
    mid_in = torch.zeros(mb_shape, device=device, requires_grad=True)
    out_meta = torch.zeros(mb_shape, device=device, requires_grad=True)
    stages, params = [], []
    split = schedule in ("zb-h1", "izb", "zbv", "dualpipev")
    for chunk in range(vpp):
        s = torch_stage(schedule, chunk, pp, rank)
        module = Instrumented(
            nn.Sequential(*stage_layers(layers, s, num_stages)), stats, weight_hook=not split
        )
        module.to(device)
        params += list(module.parameters())
        stages.append(
            PipelineStage(
                module,
                s,
                num_stages,
                device,
                input_args=(first_in if s == 0 else mid_in,),
                output_args=(out_meta,),
            )
        )
    loss_fn = Workload.loss_fn
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn)
    elif schedule in ("zb-h1", "izb"):
        sched = ScheduleInterleavedZeroBubble(stages, microbatches, loss_fn=loss_fn)
    elif schedule == "zbv":
        sched = ScheduleZBVZeroBubble(stages, microbatches, loss_fn=loss_fn)
    elif schedule == "dualpipev":
        sched = ScheduleDualPipeV(stages, microbatches, loss_fn=loss_fn)
    elif schedule == "1f1b":
        sched = Schedule1F1B(stages[0], microbatches, loss_fn=loss_fn)
    elif schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], microbatches, loss_fn=loss_fn)
    else:
        raise ValueError(f"torch peer has no schedule {schedule!r}")
    has_first = rank == 0
    # the last virtual stage lives on rank pp-1 (loop placement) or rank 0 (V placement)
    has_last = rank == (0 if schedule in V_SCHEDULES else pp - 1)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (x,) if has_first else ()
        if has_last:
            sched.step(*args, target=y, losses=losses, return_outputs=False)
            return torch.stack(losses).mean().detach()
        sched.step(*args, return_outputs=False)
        return None

    return step, params
