"""FSDP2 (``fully_shard``) per pipeline chunk over the data-parallel mesh dim, driven by the engine.

Each local chunk is one FSDP2 root; each of its blocks (:func:`default_blocks`) is an FSDP2 unit
of its own (:func:`shard_chunks`). Between steps a rank holds ``1/dp`` of every parameter, its
gradient and its optimizer state (ZeRO-3).

Inside a step the pipeline runs many forwards and backwards per chunk, and FSDP2's own hooks
would all-gather and reduce-scatter around each. :class:`FsdpGradSync` drives it instead, as
:class:`~lightning_pp.runtime.grad_sync.DeferredGradSync` drives the all-reduce:

- the chunk's first forward of the step all-gathers its blocks, and they stay gathered
  (``reshard_after_forward=False``, as torchtitan does under a pipeline: one all-gather per step,
  not per microbatch) until the chunk's LAST backward of the step (its last ``B``, or its last
  ``W`` under a zero-bubble schedule);
- every backward accumulates into the gathered parameters' ``.grad`` with gradient sync off
  (``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``);
- at the chunk's last backward the engine calls :meth:`FsdpGradSync.on_chunk_grads_ready`, which
  STARTS the reduce-scatter of each of the chunk's units there (asynchronous on gloo), so it
  overlaps the rank's remaining backward work, then frees the gathered parameters;
- :meth:`FsdpGradSync.wait` finishes them before the optimizer step: each parameter's ``.grad``
  is then a ``DTensor`` shard holding the MEAN over the ``dp`` replicas.

Why not FSDP2's own post-backward: it runs from ``RegisterPostBackwardFunction``, an autograd node
at each unit's forward INPUTS, and from a callback at the end of each autograd call. A
zero-bubble ``I`` (``autograd`` w.r.t. the stage inputs, :mod:`.split_backward`) runs that node,
so with sync on FSDP2 would reduce-scatter before ``W`` had added a single weight gradient (the
same hazard pytorch#144530 reports for DDP's hooks, which ``I`` skips instead); and a direct
``W`` (:mod:`.weight_grad_direct`) makes no autograd call at all. torch.distributed.pipelining
(``stage.py``: ``backward_maybe_with_nosync`` / ``perform_reduce_grad``) turns sync off the same
way but reduces every stage at the END of the step; here each chunk starts at its own last
backward.

Two traps, both handled:

- FSDP2's reduce-scatter asks for ``ReduceOp.AVG``, which gloo builds affected by
  pytorch#162338 silently SUM: gradients ``dp`` times too large. (The gloo of torch 2.13
  averages; ``tests/test_fsdp_chunks.py`` emulates a summing one.) So the mean never depends
  on the backend's ``AVG``: each unit's reduce-scatter is replaced
  (``set_custom_reduce_scatter``) by one that divides by ``dp`` and SUMS (DDP's pre-divide),
  with FSDP2's own division off (``set_force_sum_reduction_for_comms`` and
  ``set_gradient_divide_factor(1.0)``). That one also runs asynchronously on gloo, which
  FSDP2's own (a blocking call on CPU) does not.
- Gradient accumulation: with ``enabled = False`` nothing is reduced and the gathered
  parameters keep accumulating; the last micro-step reduces the sum once. Nothing rescales
  gradients afterwards (the engine scales each microbatch's loss instead), so the compounding
  ``scale_grads`` of torchtitan#1733 cannot happen.

Example (every rank; ``mesh`` the job's ``("pipeline_parallel", "data_parallel")`` mesh)::

    chunks = shard_chunks(chunks, mesh["data_parallel"], schedule=schedule)
    sync = FsdpGradSync(chunks)
    engine = PipelineEngine(chunks, schedule, topo, groups, loss_fn=loss_fn,
                            on_chunk_grads_ready=sync.on_chunk_grads_ready)
    optimizer = torch.optim.AdamW([p for c in chunks for p in c.parameters()])
    sync.enabled = is_last_micro_step
    engine.train_step(batch)        # each chunk's reduce-scatter starts at its last backward
    sync.wait()                     # .grad: this rank's shard of the mean over dp
    norm_sq = sharded_grad_norm_sq(params)   # then summed over pp x dp for clipping
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# ``set_custom_reduce_scatter`` is public; the interface it takes is not exported yet (its
# docstring points to this class).
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor

from ..schedules import Schedule
from .dtensor_state import local_part
from .failure import monitored_wait
from .grad_sync import LaunchEvent, local_grad_square_sum

__all__ = [
    "FsdpGradSync",
    "check_fsdp_supported",
    "default_blocks",
    "local_param_bytes",
    "reshard_chunks",
    "shard_chunks",
    "shared_parameters",
    "sharded_grad_norm_sq",
    "unmix_foreach",
]

BlocksFn = Callable[[nn.Module], Iterable[nn.Module]]


# -- which sub-modules are units ----------------------------------------------------------------


def default_blocks(chunk: nn.Module) -> list[nn.Module]:
    """The chunk's blocks: its direct children that hold parameters, looking through containers
    without a forward of their own (``nn.ModuleList``, ``nn.ModuleDict``), so that
    ``PipelineChunk(layers)`` gives each layer.

    Example:
        >>> from lightning_pp.layout.partition import PipelineChunk
        >>> chunk = PipelineChunk([nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)])
        >>> [type(b).__name__ for b in default_blocks(chunk)]
        ['Linear', 'Linear']
    """
    out: list[nn.Module] = []
    for child in chunk.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out.extend(default_blocks(child))
        elif any(True for _ in child.parameters()):
            out.append(child)
    return out


def _shares_parameters(block: nn.Module, chunk: nn.Module) -> bool:
    """Whether a parameter of ``block`` is also used outside it in ``chunk`` (a tied weight):
    FSDP2 manages each parameter in ONE unit, so such a block is left to the chunk's root."""
    inside = {id(p) for p in block.parameters()}
    own = {id(m) for m in block.modules()}
    return any(
        id(p) in inside
        for m in chunk.modules()
        if id(m) not in own
        for p in m.parameters(recurse=False)
    )


# -- what cannot run ----------------------------------------------------------------------------


def check_fsdp_supported(
    chunks: Sequence[nn.Module],
    schedule: Schedule | None = None,
    *,
    reshard_after_forward: bool = False,
    rank: int | None = None,
    ignored: set[int] | None = None,
) -> None:
    """Raise ``ValueError`` (naming the setting, the numbers and the rank) for what FSDP2 per
    chunk cannot run correctly here:

    - a parameter shared by two local chunks (a tied weight both V-placement chunks hold): each
      chunk is its own FSDP2 root and would shard, gather and reduce it twice;
    - ``reshard_after_forward=True`` under a split backward (``zb-h1``, ``zbv``): a later
      microbatch's forward frees the gathered parameters while an earlier one's ``W`` is still
      due. FSDP2 gathers them for a backward in its pre-backward hook, on the unit's outputs,
      which fires in ``I``; ``W`` starts below it, so a ``W`` that reads a parameter (the other
      factor of a LoRA product ``A @ B``, a weight norm) would read freed memory.

    ``ignored``: ids of parameters left out of FSDP2 (kept whole, synchronised by an
    all-reduce, :func:`shared_parameters`): they may be shared.

    Everything else runs, ``W`` without the graph (:mod:`.weight_grad_direct`) included: the
    gathered parameters are plain tensors that stay put until the chunk's last ``W``, which
    accumulates into them as the autograd engine would.
    """
    who = f"rank {rank}: " if rank is not None else ""
    owners: dict[int, int] = {}
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if ignored and id(p) in ignored:
                continue
            first = owners.setdefault(id(p), c)
            if first != c:
                raise ValueError(
                    f"{who}fsdp: parameter {name!r} ({tuple(p.shape)}) is shared by local chunks "
                    f"{first} and {c}; each chunk is one FSDP2 root and would shard and reduce "
                    f"it twice. Untie it, or use the deferred all-reduce (fsdp=False)"
                )
    if reshard_after_forward and schedule is not None and schedule.split_backward:
        raise ValueError(
            f"{who}fsdp: reshard_after_forward=True with schedule {schedule.name!r} "
            f"(pp={schedule.pp}, vpp={schedule.vpp}, microbatches={schedule.microbatches}): its "
            f"split backward runs a microbatch's W after later forwards freed the gathered "
            f"parameters, and FSDP2 gathers them again only in its pre-backward hook, which "
            f"fires in I, not W; use reshard_after_forward=False, or a schedule without W "
            f"(gpipe, 1f1b, interleaved)"
        )


# -- sharding -----------------------------------------------------------------------------------


def shard_chunks(
    chunks: Sequence[nn.Module],
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    blocks: BlocksFn | None = None,
    schedule: Schedule | None = None,
    ignored: Iterable[nn.Parameter] = (),
) -> list[nn.Module]:
    """Apply ``fully_shard`` over the 1-D ``dp_mesh`` to each block of each chunk, then to the
    chunk itself (the root: it takes whatever parameters no block holds). Returns the chunks
    (the same objects, now :class:`~torch.distributed.fsdp.FSDPModule`); their parameters are
    ``DTensor`` shards from here on, so build the optimizer afterwards.

    ``blocks``: ``chunk -> sub-modules`` to shard one by one (default :func:`default_blocks`);
    a block that shares a parameter with the rest of the chunk stays with the root.
    ``ignored``: parameters FSDP2 leaves whole (``fully_shard(ignored_params=...)``), e.g. a
    weight two local chunks share (:func:`shared_parameters`); synchronise them yourself.
    ``reshard_after_forward``: ``False`` (default) keeps each chunk gathered for the whole step:
    one all-gather per step instead of one per microbatch and block. ``schedule``: checked with
    :func:`check_fsdp_supported` first.

    Use with :class:`FsdpGradSync`, which turns FSDP2's per-backward sync off: without it every
    microbatch's backward would reduce-scatter (and a zero-bubble ``I`` before its ``W``).
    """
    if dp_mesh.ndim != 1:
        raise ValueError(
            f"rank {dist.get_rank()}: shard_chunks needs the 1-D data-parallel mesh "
            f"(mesh['data_parallel']), got a {dp_mesh.ndim}-D mesh of shape {tuple(dp_mesh.shape)}"
        )
    left = set(ignored)
    check_fsdp_supported(
        chunks,
        schedule,
        reshard_after_forward=reshard_after_forward,
        rank=dist.get_rank(),
        ignored={id(p) for p in left},
    )
    pick = blocks or default_blocks
    kw: dict[str, Any] = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    if left:
        kw["ignored_params"] = left
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for chunk in chunks:
        for block in pick(chunk):
            if not isinstance(block, FSDPModule) and not _shares_parameters(block, chunk):
                fully_shard(block, **kw)
        fully_shard(chunk, **kw)
    return list(chunks)


def shared_parameters(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Parameters held by two or more local chunks (V placement puts a tied embedding and head
    on one rank): FSDP2 manages a parameter in one root only, so these stay whole and are
    all-reduced (:class:`FsdpGradSync`'s ``replicated``)."""
    count: dict[int, int] = {}
    first: dict[int, nn.Parameter] = {}
    for chunk in chunks:
        for p in {id(q): q for q in chunk.parameters()}.values():
            count[id(p)] = count.get(id(p), 0) + 1
            first.setdefault(id(p), p)
    return [first[i] for i, n in count.items() if n > 1]


def unmix_foreach(optimizers: Iterable[Any], whole: Sequence[nn.Parameter]) -> None:
    """Step param groups that hold both ``DTensor`` shards and a whole (ignored) parameter one
    tensor at a time: torch's multi-tensor ``foreach`` kernels (the default on GPUs) refuse a
    list mixing ``torch.Tensor`` and ``DTensor`` ("got mixed torch.Tensor and DTensor").
    A ``fused`` optimizer cannot be changed so: it is refused, naming the group."""
    ids = {id(p) for p in whole}
    for optimizer in optimizers:
        for i, group in enumerate(optimizer.param_groups):
            kinds = {id(p) in ids for p in group["params"]}
            if kinds != {True, False}:
                continue
            if group.get("fused"):
                raise ValueError(
                    f"rank {dist.get_rank()}: fsdp: param group {i} of "
                    f"{type(optimizer).__name__} is fused and mixes FSDP2's DTensor shards with "
                    f"{len(ids)} parameter(s) two local chunks share (kept whole); fused "
                    f"kernels cannot step both: use fused=False, or untie the weight"
                )
            group["foreach"] = False


def reshard_chunks(chunks: Iterable[nn.Module]) -> None:
    """Free every gathered parameter of ``chunks`` (public ``FSDPModule.reshard``). A training
    step frees them itself at each chunk's last backward; an ``eval_step`` leaves them gathered
    (``reshard_after_forward=False``), which is right before the next training step (no
    optimizer step in between) but holds the memory, and would go stale if the shards were
    changed (an optimizer step, a checkpoint load) before the next forward."""
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def local_param_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of this rank's parameters: a ``DTensor``'s local shard, a plain tensor whole."""
    seen: set[int] = set()
    total = 0
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                t = local_part(p)
                total += t.numel() * t.element_size()
    return total


# -- the private contacts with FSDP2 (torch 2.13): these three functions and the ReduceScatter
#    import above -------------------------------------------------------------------------------


def _param_groups(module: FSDPModule) -> list[Any]:
    """The module's own ``FSDPParamGroup`` s (private: torch's own
    ``pipelining/stage.py::perform_reduce_grad`` reads them the same way)."""
    return list(module._get_fsdp_state()._fsdp_param_groups)


def _reduce_now(module: FSDPModule) -> None:
    """Run the post-backward of ``module``'s own parameters NOW, with sync on: it takes the
    gradients accumulated into the gathered parameters, starts their reduce-scatter and frees the
    gathered parameters (the optimizer changes the shards; the next step gathers anew). There is
    no public call for one unit's reduce-scatter on demand; ``FSDPParamGroup.post_backward`` is
    what FSDP2's autograd hooks and ``stage.py`` call."""
    module.set_requires_gradient_sync(True, recurse=False)
    module.set_reshard_after_backward(True, recurse=False)
    try:
        for group in _param_groups(module):
            group.post_backward()
    finally:
        module.set_requires_gradient_sync(False, recurse=False)
        module.set_reshard_after_backward(False, recurse=False)


def _finish_backward(root: FSDPModule) -> None:
    """End the step for one chunk's FSDP2 tree, as the final callback of a last backward does:
    every unit back to idle, the prefetch bookkeeping (one entry per forward, so it grows with
    the microbatches) cleared. A chunk that never ran forward has nothing to end."""
    state = root._get_fsdp_state()
    if not state._is_root:
        return
    root.set_is_last_backward(True)
    try:
        state._root_post_backward_final_callback()
    finally:
        root.set_is_last_backward(False)


# -- the reduce-scatter that averages on gloo ---------------------------------------------------


@dataclass
class _Pending:
    """One started reduce-scatter, holding its buffers until it is waited for."""

    work: Any
    what: str
    buffers: tuple[Tensor, Tensor]


class _MeanReduceScatter(ReduceScatter):
    """The reduce-scatter of one unit: divide by ``dp``, then SUM.

    FSDP2 would ask for ``ReduceOp.AVG``, which some gloo builds sum (pytorch#162338), so its
    division is turned off (sum-only comms, divide factor 1: FSDP2 then scales nothing after
    the collective) and this divides first, as DDP does, on every backend. On CPU it is started
    asynchronously (:meth:`FsdpGradSync.wait` finishes it); on an accelerator FSDP2's
    reduce-scatter stream already overlaps it, so it runs there in stream order."""

    def __init__(self, dp_size: int, orig_dtype: torch.dtype, what: str, pending: list) -> None:
        self.dp_size = dp_size
        self.orig_dtype = orig_dtype
        self.what = what
        self.pending: list[_Pending] = pending

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(
                f"rank {dist.get_rank()}: fsdp: {self.what}: expected FSDP2 to ask for a SUM "
                f"reduce-scatter (force_sum_reduction_for_comms is set), got {op}"
            )
        input_tensor.div_(self.dp_size)
        # What FSDP2 does right after this call reads the output only to cast it (a reduce
        # dtype other than the parameters') or to add it to an existing gradient (which
        # FsdpGradSync moves aside first): only then must the data be there at once.
        now = input_tensor.device.type != "cpu" or input_tensor.dtype != self.orig_dtype
        work = dist.reduce_scatter_single(
            output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=not now
        )
        if not now:
            self.pending.append(_Pending(work, self.what, (input_tensor, output_tensor)))
        return work


# -- the sync -----------------------------------------------------------------------------------


@dataclass
class _Unit:
    """One FSDP2 module with parameters of its own: one reduce-scatter per step."""

    chunk: int
    index: int  # within the chunk, in launch order
    module: FSDPModule
    params: list[nn.Parameter] = field(default_factory=list)  # its DTensor shards

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.params if p.requires_grad]

    @property
    def numel(self) -> int:
        """Elements its reduce-scatter carries (every replica's, unsharded)."""
        return sum(p.numel() for p in self.trainable)


def _own_params(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s parameters that it manages itself: the shards of its own FSDP2 parameter
    groups (those of nested FSDP2 modules belong to them). Not "its ``DTensor`` s": a parameter
    left out with ``ignored_params`` is a plain tensor without tensor parallelism but a
    ``DTensor`` with it, and its gradient is the ``replicated`` sync's business (taken for a
    shard, it was set aside at the reduce and added back unsynced)."""
    return [
        fsdp_param.sharded_param
        for group in _param_groups(cast(FSDPModule, module))
        for fsdp_param in group.fsdp_params
    ]


def _units(chunk: int, root: nn.Module) -> list[_Unit]:
    """The chunk's units with parameters, deepest last block first (autograd's order), the
    root last. A frozen unit is one too: its post-backward frees its gathered parameters."""
    modules = [m for m in root.modules() if isinstance(m, FSDPModule)]
    units: list[_Unit] = []
    for m in reversed(modules):
        params = _own_params(cast(nn.Module, m))
        if params:
            units.append(_Unit(chunk, len(units), m, params))
    return units


class FsdpGradSync:
    """The data-parallel gradient sync of FSDP2 chunks, for the engine (the interface of
    :class:`~lightning_pp.runtime.grad_sync.DeferredGradSync`): ``enabled``, ``events``,
    ``num_buckets``, :meth:`on_chunk_grads_ready`, :meth:`wait`. See the module docstring.

    Args:
        chunks: this rank's chunks, sharded by :func:`shard_chunks`, in local chunk order.
        divide_then_sum: ``True`` (always, in use): the mean over ``dp`` by dividing, then a
            SUM reduce-scatter, whatever the backend does with ``ReduceOp.AVG``. ``False`` leaves
            FSDP2's own ``AVG`` reduce-scatter, which gloo builds affected by pytorch#162338 sum:
            only for the test that shows what the fix prevents.

    Sets on every unit: gradient sync and reshard-after-backward off, ``is_last_backward``
    off (this class ends each step itself), zero gradients reduced for parameters a backward
    did not reach (every replica then issues the same collectives).
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        *,
        divide_then_sum: bool = True,
        replicated: Any = None,
    ) -> None:
        for c, chunk in enumerate(chunks):
            if not isinstance(chunk, FSDPModule):
                raise TypeError(
                    f"rank {dist.get_rank()}: FsdpGradSync: chunk {c} ({type(chunk).__name__}) "
                    f"is not sharded; call shard_chunks first"
                )
        self.chunks: list[FSDPModule] = [cast(FSDPModule, c) for c in chunks]
        #: the all-reduce of the parameters FSDP2 leaves whole (``shard_chunks(ignored=...)``):
        #: a :class:`~lightning_pp.runtime.grad_sync.DeferredGradSync` over them, or ``None``
        self.replicated = replicated
        #: tied copies this sync sums itself: none (:class:`TiedParameterSync` does, on shards)
        self.tied_handled: set[int] = set()
        self._enabled = True
        self.units: list[list[_Unit]] = [_units(c, root) for c, root in enumerate(chunks)]
        self.dp_size, self.dp_ranks = self._dp_group()
        #: one event per unit whose reduce-scatter started, for the step in progress (or the
        #: latest that reduced)
        self.events: list[LaunchEvent] = []
        self._pending: list[_Pending] = []
        self._prior: list[tuple[nn.Parameter, Tensor]] = []
        self._launched: set[int] = set()
        for root in self.chunks:
            root.set_requires_gradient_sync(False)
            root.set_reshard_after_backward(False)
            root.set_is_last_backward(False)
            root.set_reduce_scatter_unused_params(True)
        if divide_then_sum:
            for units in self.units:
                for u in units:
                    self._install_mean(u)

    def _dp_group(self) -> tuple[int, list[int] | None]:
        """``dp`` and the replicas' global ranks (for hang reports), from the shards' mesh."""
        for units in self.units:
            for u in units:
                # dim 0: FSDP2's own. Under tensor parallelism a shard's mesh is (dp, tp), whose
                # size() is dp * tp
                mesh = cast(DTensor, u.params[0]).device_mesh
                return mesh.size(0), dist.get_process_group_ranks(mesh.get_group(0))
        return 1, None

    def _install_mean(self, unit: _Unit) -> None:
        what = f"reduce-scatter of chunk {unit.chunk} unit {unit.index} ({unit.numel} values)"
        comm = _MeanReduceScatter(self.dp_size, unit.params[0].dtype, what, self._pending)
        unit.module.set_custom_reduce_scatter(comm)
        unit.module.set_force_sum_reduction_for_comms(True)
        unit.module.set_gradient_divide_factor(1.0)

    @property
    def enabled(self) -> bool:
        """``False`` on gradient-accumulation micro-steps: nothing is reduced."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = value
        if self.replicated is not None:
            self.replicated.enabled = value

    @property
    def num_buckets(self) -> int:
        """Reduce-scatters per step (one per unit with trainable parameters), and the whole
        parameters' all-reduce buckets."""
        extra = self.replicated.num_buckets if self.replicated is not None else 0
        return sum(1 for units in self.units for u in units if u.trainable) + extra

    def on_chunk_grads_ready(self, chunk: int) -> None:
        """Engine hook: ``chunk`` ran its last backward of the step; start its reduce-scatters."""
        if not self.enabled or chunk in self._launched:
            return
        if not self._launched:
            self.events.clear()  # a new step (kept per step: a run would grow it forever)
        self._launched.add(chunk)
        if self.replicated is not None:  # the whole parameters' all-reduce, same moment
            self.replicated.on_chunk_grads_ready(chunk)
            self.events += [e for e in self.replicated.events if e.chunk == chunk]
        for unit in self.units[chunk]:
            self._set_aside_grads(unit)
            if unit.trainable:
                now = time.perf_counter()
                self.events.append(LaunchEvent(chunk, unit.index, unit.numel, now))
            _reduce_now(unit.module)

    def _set_aside_grads(self, unit: _Unit) -> None:
        """Move gradients the shards already hold (``zero_grad(set_to_none=False)``) aside: FSDP2
        would add the new shard to them right after starting the reduce-scatter, before its
        data arrived. :meth:`wait` adds them back."""
        for p in unit.params:
            if p.grad is not None:
                self._prior.append((p, p.grad))
                p.grad = None

    def wait(self) -> None:
        """Finish every started reduce-scatter (chunks the engine did not report start here, so
        every replica issues the same collectives), then end the step for FSDP2."""
        if not self.enabled:
            return
        for c in range(len(self.chunks)):
            self.on_chunk_grads_ready(c)
        if self.replicated is not None:
            self.replicated.wait()
        for p in self._pending:
            # Watched: a replica that died or hangs ends this wait (abort channel, watchdog).
            monitored_wait([p.work], f"in the data-parallel {p.what}", self.dp_ranks)
        self._pending.clear()
        with torch.no_grad():
            for param, prior in self._prior:
                if param.grad is None:
                    param.grad = prior
                else:
                    param.grad.add_(prior)
        self._prior.clear()
        for root in self.chunks:
            _finish_backward(root)
        self._launched.clear()


# -- gradient-norm clipping ---------------------------------------------------------------------


def sharded_grad_norm_sq(params: Iterable[nn.Parameter], skip: set[int] | None = None) -> Tensor:
    """This rank's sum of squares (fp32) of its LOCAL gradient shards: a ``DTensor`` gradient
    counts its shard, a plain one whole. Sum it over pp x dp (every rank holds distinct shards)
    and take the square root for the global norm; ``skip``: ids of parameters counted elsewhere
    (a tied copy counted on its owner).

    Example (the caller, clipping)::

        sq = sharded_grad_norm_sq(params)
        dist.all_reduce(sq)                 # over every rank of pp x dp
        clip_coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    """
    return local_grad_square_sum(list(params), skip)
