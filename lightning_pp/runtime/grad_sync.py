"""Gradient synchronisation around the pipeline: data-parallel replicas and tied parameters.

Data parallel (:class:`DeferredGradSync`): a pipeline rank runs many backward steps per optimizer
step (one per microbatch and chunk). All-reducing after each would move the gradients ``m``
times; instead nothing is reduced until a chunk's *last* backward of the step. The engine reports
that moment (``on_chunk_grads_ready(chunk)``) and the chunk's gradients go out at once, in
flattened buckets, asynchronously, so the reduction overlaps the backward work of the rank's other
chunks. :meth:`DeferredGradSync.wait` finishes them before the optimizer step. With gradient
accumulation only the last micro-step of the window reduces (gradients are linear).

Tied parameters (:class:`TiedParameterSync`): a weight shared by two layers on different ranks
(input embedding and output head) exists once per rank. The copies start equal (broadcast from
the owner) and stay equal because each receives the SUM of all copies' gradients, exactly the
gradient of the single shared tensor in the unpipelined model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from .dtensor_state import local_part, match_grad_placements
from .failure import monitored_wait

__all__ = [
    "DeferredGradSync",
    "LaunchEvent",
    "TiedGroup",
    "TiedParameterSync",
    "global_grad_norm",
    "local_grad_square_sum",
    "tied_parameter_sync",
]


@dataclass(frozen=True)
class LaunchEvent:
    """One asynchronous all-reduce launched by :class:`DeferredGradSync` (for tests and tools)."""

    chunk: int
    bucket: int
    numel: int
    time: float


def _buckets(params: Sequence[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters (same dtype and device per bucket) into buckets of at most ``cap_bytes``
    (a single larger parameter gets a bucket of its own)."""
    out: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = local_part(p).numel() * p.element_size()
        compatible = not current or (current[0].dtype == p.dtype and current[0].device == p.device)
        if current and (size + nbytes > cap_bytes or not compatible):
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        out.append(current)
    return out


class DeferredGradSync:
    """Deferred, bucketed, asynchronous data-parallel gradient all-reduce (average over ``group``).

    Args:
        chunk_params: the parameters of each local chunk, in local chunk order. A parameter
            shared by several chunks is reduced with the lowest-numbered one (whose last backward
            comes last in every schedule).
        group: the data-parallel process group.
        dp_size: number of data-parallel replicas (the average divides by it).
        bucket_cap_mb: bucket size.

    Example (inside a step)::

        sync.enabled = is_last_micro_step
        engine.train_step(batch)        # engine calls sync.on_chunk_grads_ready(c) per chunk
        sync.wait()                     # gradients are now averaged over the replicas
    """

    def __init__(
        self,
        chunk_params: Sequence[Sequence[nn.Parameter]],
        group: Any,
        dp_size: int,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        self.group = group
        self.dp_size = dp_size
        self.enabled = True
        seen: set[int] = set()
        owned: list[list[nn.Parameter]] = [[] for _ in chunk_params]
        for c in range(len(chunk_params)):
            for p in chunk_params[c]:
                if id(p) in seen or not p.requires_grad:
                    continue
                # give a shared parameter to the lowest chunk index holding it
                first = min(i for i, ps in enumerate(chunk_params) if any(q is p for q in ps))
                if first == c:
                    seen.add(id(p))
                    owned[c].append(p)
        self._chunk_params = [list(ps) for ps in chunk_params]
        #: tensor-parallel (DTensor) parameters: their gradients are laid out as they are first
        self._tensor_parallel = any(isinstance(p, DTensor) for ps in chunk_params for p in ps)
        cap = max(1, int(bucket_cap_mb * 1024 * 1024))
        self.chunk_buckets: list[list[list[nn.Parameter]]] = [_buckets(ps, cap) for ps in owned]
        self._pending: list[tuple[Any, Tensor, list[nn.Parameter]]] = []
        self._launched: set[int] = set()
        #: ids of tied parameters whose copies this sync sums itself (none here; the sharded
        #: sync sums their rows), which :meth:`TiedParameterSync.all_reduce_grads` then skips
        self.tied_handled: set[int] = set()
        #: the launches of the latest step that reduced (of the one in progress, once it
        #: launched): one event per bucket.
        self.events: list[LaunchEvent] = []

    @property
    def num_buckets(self) -> int:
        return sum(len(b) for b in self.chunk_buckets)

    def on_chunk_grads_ready(self, chunk: int) -> None:
        """Engine hook: chunk ``chunk`` has run its last backward of the step."""
        if self._tensor_parallel and chunk not in self._launched:
            match_grad_placements(self._chunk_params[chunk])
        if not self.enabled or self.dp_size == 1 or chunk in self._launched:
            return
        if not self._launched:
            # A new step's first launch: the events start over. Kept for the whole run they
            # grew by one per bucket per step, forever (issue 35: memory that never levels).
            self.events.clear()
        self._launched.add(chunk)
        for b, bucket in enumerate(self.chunk_buckets[chunk]):
            # Local parts: a tensor-parallel DTensor's shard is what its replicas share.
            flat = torch.cat(
                [
                    local_part(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    for p in bucket
                ]
            )
            # Pre-divide (as DDP does) so the SUM is the average and large sums cannot overflow.
            flat.div_(self.dp_size)
            self.events.append(LaunchEvent(chunk, b, flat.numel(), time.perf_counter()))
            handle = dist.all_reduce(flat, group=self.group, async_op=True)
            self._pending.append((handle, flat, bucket))

    def wait(self) -> None:
        """Finish every launched reduction and write the averages back into ``.grad``.

        Chunks the engine did not report (e.g. a chunk without backward work) are launched here,
        so every replica issues the same collectives in the same order.
        """
        if self.enabled and self.dp_size > 1:
            for c in range(len(self.chunk_buckets)):
                self.on_chunk_grads_ready(c)
        for b, (handle, flat, bucket) in enumerate(self._pending):
            # Watched: a replica that died or hangs ends this wait (abort channel, watchdog).
            monitored_wait(
                [handle],
                f"in the data-parallel gradient all_reduce (bucket {b}, {flat.numel()} values)",
                _ranks(self.group),
            )
            offset = 0
            for p in bucket:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grad = local_part(p.grad)
                n = grad.numel()
                grad.copy_(flat[offset : offset + n].view_as(grad))
                offset += n
        self._pending.clear()
        self._launched.clear()


@dataclass
class TiedGroup:
    """One tied weight as seen by this rank: its local parameter and the ranks sharing it."""

    names: tuple[str, ...]
    param: nn.Parameter
    owner_rank: int  # global rank whose copy initialises the weight
    ranks: list[int]  # global ranks holding a copy (this replica)
    group: Any = field(default=None, repr=False)

    @property
    def is_owner(self) -> bool:
        return dist.get_rank() == self.owner_rank


class TiedParameterSync:
    """Keep copies of tied weights on different ranks equal.

    Example::

        tied = TiedParameterSync(groups)
        tied.broadcast_weights()        # once, at setup: copies start from the owner's values
        ...                             # every step, after the data-parallel sync:
        tied.all_reduce_grads()         # each copy receives the sum of all copies' gradients
    """

    def __init__(self, groups: Sequence[TiedGroup]) -> None:
        self.groups = [g for g in groups if len(g.ranks) > 1]

    def broadcast_weights(self) -> None:
        with torch.no_grad():
            for g in self.groups:
                # A tensor-parallel copy is a DTensor: the owner's shard goes to the copy's
                # shard, so every copy must be cut the same way (DecoderLM: both Shard(0));
                # tied_parameter_sync refused copies cut differently (check_tied_cuts).
                local = local_part(g.param.data)
                work = dist.broadcast(local, src=g.owner_rank, group=g.group, async_op=True)
                monitored_wait(
                    [work],
                    f"in the tied-weight broadcast of {g.names[0]} from rank {g.owner_rank}",
                    g.ranks,
                    min_timeout=120.0,  # at set-up: ranks arrive seconds apart
                )

    def all_reduce_grads(self, skip: set[int] | None = None) -> None:
        """Sum each tied weight's gradient over its copies; ``skip``: ids of parameters summed
        elsewhere (the sharded sync sums their rows)."""
        for g in self.groups:
            if skip and id(g.param) in skip:
                continue
            if g.param.grad is None:
                g.param.grad = torch.zeros_like(g.param)
            # An FSDP2 copy's gradient is a DTensor: every copy is cut into the same shards
            # over its replicas, so summing the local shards sums the copies.
            local = local_part(g.param.grad)
            work = dist.all_reduce(local, op=dist.ReduceOp.SUM, group=g.group, async_op=True)
            monitored_wait([work], f"in the tied-gradient all_reduce of {g.names[0]}", g.ranks)

    def non_owner_params(self) -> set[int]:
        """ids of local copies that a global norm must not count again."""
        return {id(g.param) for g in self.groups if not g.is_owner}


_CUT_DIMS = 8  # dims of a weight's shape a cut descriptor holds
_CUT_PLACEMENTS = 4  # mesh dims of a DTensor's placements it holds


def _cut_of(t: Tensor | None) -> list[int]:
    """A fixed-length description of how ``t`` is cut on this rank: its dims plus one (0: this
    rank holds no copy), the global shape, the local shape, then per mesh dim its size and
    placement (``Shard(d)``: ``d``, ``Replicate``: -1, other: -2)."""
    words = [0] * (1 + 2 * _CUT_DIMS + 1 + 2 * _CUT_PLACEMENTS)
    if t is None:
        return words
    local = local_part(t)
    if t.dim() > _CUT_DIMS:
        raise ValueError(f"a tied weight of {t.dim()} dims (at most {_CUT_DIMS} are compared)")
    words[0] = t.dim() + 1
    words[1 : 1 + t.dim()] = list(t.shape)
    words[1 + _CUT_DIMS : 1 + _CUT_DIMS + local.dim()] = list(local.shape)
    if isinstance(t, DTensor):
        placements = list(t.placements)[:_CUT_PLACEMENTS]
        words[1 + 2 * _CUT_DIMS] = len(placements)
        base = 2 + 2 * _CUT_DIMS
        for i, pl in enumerate(placements):
            code = pl.dim if pl.is_shard() else (-1 if pl.is_replicate() else -2)  # type: ignore[attr-defined]
            words[base + 2 * i : base + 2 * i + 2] = [t.device_mesh.size(i), code]
    return words


def _describe_cut(words: Sequence[int]) -> str:
    """``Shard(1) over 2 ranks of (32, 16), local (32, 8)`` from :func:`_cut_of`'s words."""
    ndim = words[0] - 1
    shape = tuple(words[1 : 1 + ndim])
    local = tuple(words[1 + _CUT_DIMS : 1 + _CUT_DIMS + ndim])
    n = words[1 + 2 * _CUT_DIMS]
    base = 2 + 2 * _CUT_DIMS
    parts = []
    for i in range(n):
        size, code = words[base + 2 * i], words[base + 2 * i + 1]
        name = f"Shard({code})" if code >= 0 else ("Replicate()" if code == -1 else "other")
        parts.append(f"{name} over {size} ranks")
    how = ", ".join(parts) if parts else "whole"
    return f"{how} of {shape}, local {local}"


def check_tied_cuts(tied: Sequence[tuple[Sequence[str], Tensor | None]], group: Any = None) -> None:
    """Collective over ``group`` (every rank, the same tied weights in the same order): refuse
    tied copies cut differently (a tensor-parallel plan that shards the embedding by rows and
    the head by columns). Their gradients are summed element by element over the copies'
    local parts, so copies cut differently would add unrelated elements, silently, or abort
    inside gloo when the local sizes differ. ``tied``: per tied weight its names and this
    rank's copy (``None``: it holds none). Every rank raises the same :class:`ValueError`,
    naming the weight and each holder's cut, before any gradient is exchanged."""
    if not tied or not dist.is_initialized():
        return
    # NCCL gathers device tensors only (a rank holding no copy has no device of its own)
    on_gpu = dist.get_backend(group) == "nccl" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    mine = torch.tensor([_cut_of(t) for _, t in tied], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(everyone, mine, group=group, async_op=True)
    monitored_wait(
        [work], "in the check of how tied weights are cut", _ranks(group), min_timeout=120.0
    )
    ranks = _ranks(group) or list(range(len(everyone)))
    problems = []
    for i, (names, _) in enumerate(tied):
        held = {r: tuple(t[i].tolist()) for r, t in zip(ranks, everyone) if t[i][0].item()}
        if len(set(held.values())) > 1:
            cuts = "; ".join(f"rank {r}: {_describe_cut(w)}" for r, w in sorted(held.items()))
            problems.append(f"{' / '.join(names)} ({cuts})")
    if problems:
        raise ValueError(
            f"tied weights are cut differently on the ranks holding them: {problems}. Their "
            f"gradients are summed element by element, so every copy must be cut the same "
            f"way: give the tied modules the same tensor-parallel style (or untie them)"
        )


def tied_parameter_sync(
    layers: Any, placement: Any, topology: Any, groups: Any
) -> TiedParameterSync:
    """Collective (every rank, same order): one process group per tied weight whose copies live
    on several pipeline ranks (one per data-parallel replica), and this rank's view of each.

    ``layers``: this rank's :class:`~lightning_pp.strategy.model.PipelineLayers` (``layers.tied``
    lists
    each group's names, canonical first); ``placement``: the
    :class:`~lightning_pp.layout.placement.LayerPlacement` saying which pipeline rank holds which
    layer.
    """
    from ..layout.placement import layer_of

    # this rank's copy of each tied weight (the first of its names held here), None if none
    copies = [
        next((layers.get_parameter(n) for n in names if layer_of(n) in layers), None)
        for names in layers.tied
    ]
    check_tied_cuts([(tuple(names), copy) for names, copy in zip(layers.tied, copies)])
    tied: list[TiedGroup] = []
    for names, copy in zip(layers.tied, copies):
        pp_ranks, owner = placement.tied_ranks(layer_of(n) for n in names)
        if len(pp_ranks) < 2:
            continue
        lists, mine = topology.stage_lists(list(pp_ranks))
        group = groups.new_groups(lists)  # collective: every rank creates every group
        if copy is not None:
            tied.append(
                TiedGroup(
                    names=tuple(names),
                    param=copy,
                    owner_rank=topology.global_rank(owner),
                    ranks=lists[mine],
                    group=group,
                )
            )
    return TiedParameterSync(tied)


def local_grad_square_sum(params: Sequence[nn.Parameter], skip: set[int] | None = None) -> Tensor:
    """This rank's sum of squared gradients (fp32), skipping ``skip``; a ``DTensor`` gradient
    counts its local shard (:func:`~.dtensor_state.local_part`)."""
    skip = skip or set()
    grads = [local_part(p.grad) for p in params if p.grad is not None and id(p) not in skip]
    device = grads[0].device if grads else (params[0].device if params else torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total += g.detach().float().pow(2).sum()
    return total


def global_grad_norm(
    params: Sequence[nn.Parameter],
    group: Any,
    skip: set[int] | None = None,
    reduce: Callable[[Tensor, Any], None] | None = None,
) -> Tensor:
    """L2 norm of the gradients of the whole model (all stages), in fp32.

    Each rank sums the squares of its own gradients, skipping ``skip`` (ids of tied copies
    counted on their owner), and the sums are added over ``group`` (the pipeline group: the
    replicas of a stage hold equal gradients after the data-parallel sync, so they are not
    summed again).
    """
    total = local_grad_square_sum(params, skip)
    if reduce is not None:
        reduce(total, group)
    elif group is not None and dist.is_initialized():
        work = dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group, async_op=True)
        monitored_wait([work], "in the global gradient-norm all_reduce", _ranks(group))
    return total.sqrt()


def _ranks(group: Any) -> list[int] | None:
    """The global ranks of ``group`` for hang reports (``None`` when it cannot be told)."""
    try:
        return list(dist.get_process_group_ranks(group)) if group is not None else None
    except Exception:
        return None
