"""The distributed optimizer (ZeRO-1/2, Megatron-style) inside the deferred gradient sync.

:class:`~lightning_pp.runtime.grad_sync.DeferredGradSync` starts each chunk's bucketed
all-reduce at the chunk's last backward (its last W under zero-bubble). :class:`ShardedGradSync`
starts a **reduce-scatter** there instead: each data-parallel rank receives the average of its
own rows of every parameter of the bucket (:mod:`~lightning_pp.runtime.shard_layout`), and the
optimizer steps only those rows. After the step the updated rows are all-gathered back into
every replica's parameters. Optimizer state is 1/dp per rank; with ``zero=2`` the full-size
gradients are freed as soon as their bucket's reduce-scatter is started, so between steps a rank
holds 1/dp of them.

The optimizer the module configured is kept (its class, hyperparameters, param groups,
learning-rate schedulers); :meth:`ShardedGradSync.shard_optimizer` swaps each parameter in its
groups for the parameter's local rows (the *main* parameter: a view of the rows for fp32
parameters, an fp32 copy, the master weight, for lower-precision ones). That is exact for
optimizers whose update of an element depends only on that element's own history (Adam,
AdamW, SGD, RMSprop, ...), which is what Megatron's distributed optimizer assumes too.

Tensor-parallel parameters (``DTensor`` s, ``PipelineStrategy(tp=N, zero=1)``) are sharded by
their local part: the replicas of one tp rank split that rank's shard into rows
(:mod:`~lightning_pp.runtime.shard_layout`), as Megatron's distributed optimizer does under
tensor parallelism; the main parameters are plain tensors of those rows, and a checkpoint sees
each state tensor as a ``DTensor`` over the ``(data_parallel, tensor_parallel)`` mesh.

Tied weights held by several pipeline ranks (embedding and head) get a bucket of their own on
each rank, so every copy is cut into the same rows; after the data-parallel reduce-scatter the
copies' row gradients are summed over the tied group, as :class:`TiedParameterSync` sums whole
gradients without sharding.

Example (the strategy does this at setup)::

    sync = ShardedGradSync(chunk_params, dp_group, dp_size=2, dp_rank=r, zero=1, tied=tied)
    sync.shard_optimizer(optimizer)     # its groups now hold this rank's rows
    sync.enabled = is_last_micro_step
    engine.train_step(batch)            # the engine calls sync.on_chunk_grads_ready(c)
    sync.wait()                         # main parameters hold averaged row gradients
    optimizer.step()                    # steps the rows; a post-step hook all-gathers them
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from .dtensor_state import counted_once, local_part, match_grad_placements
from .failure import monitored_wait
from .grad_sync import DeferredGradSync, LaunchEvent, TiedParameterSync, _ranks
from .shard_layout import BucketLayout, ShardMember

__all__ = ["NOT_ELEMENTWISE", "ShardedGradSync", "UnshardedOptimizerView"]

#: torch optimizers whose update of an element reads other elements (a row or column
#: statistic, a line search): stepping a shard would not equal stepping the whole tensor
NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "SparseAdam", "Muon")


@dataclass
class _Bucket:
    chunk: int
    index: int
    layout: BucketLayout
    tied_group: Any = None  # the tied weight's group when this bucket holds one


class ShardedGradSync(DeferredGradSync):
    """Reduce-scatter per bucket at each chunk's last backward; the optimizer steps this rank's
    rows; :meth:`gather_params` all-gathers them after the step (see the module docstring).

    Args:
        chunk_params, group, dp_size, bucket_cap_mb: as :class:`DeferredGradSync`.
        dp_rank: this rank's index among its stage's replicas.
        zero: 1 keeps the full-size gradients allocated (zeroed once packed, reused next
            step); 2 frees them once packed.
        tied: the rank's tied weights; their row gradients are summed over each tied group in
            :meth:`wait`, so the caller must not all-reduce them again.
        mesh: the 1-D ``DeviceMesh`` of ``group``; checkpoints then save each rank's rows as a
            ``DTensor`` (``Shard(0)``) instead of gathering them. With tensor-parallel
            (``DTensor``) parameters: the 2-D ``(data_parallel, tensor_parallel)`` mesh, which
            checkpoints need (the rows are then a piece of a tp shard).
        overlap_param_gather: leave the parameter all-gathers running after the optimizer
            step; each bucket is finished at the first forward that reads it
            (:meth:`install_gather_hooks`) or by :meth:`finish_gather`.
    """

    def __init__(
        self,
        chunk_params: Sequence[Sequence[nn.Parameter]],
        group: Any,
        dp_size: int,
        dp_rank: int,
        zero: int = 1,
        bucket_cap_mb: float = 25.0,
        tied: TiedParameterSync | None = None,
        mesh: Any = None,
        overlap_param_gather: bool = False,
    ) -> None:
        if zero not in (1, 2):
            raise ValueError(f"ShardedGradSync needs zero=1 or 2, got {zero!r}")
        if dp_size < 2:
            raise ValueError(f"zero={zero} shards over data-parallel replicas, but dp={dp_size}")
        super().__init__(chunk_params, group, dp_size, bucket_cap_mb)
        self.zero, self.dp_rank = zero, dp_rank
        #: the 1-D data-parallel DeviceMesh (``None``: checkpoints gather the rows instead of
        #: saving them as DTensors)
        self.mesh = mesh
        tied_groups = {id(g.param): g.group for g in (tied.groups if tied else [])}
        #: ids of parameters whose tied-copy sum happens here, on their rows
        self.tied_handled: set[int] = set(tied_groups)
        self.buckets: list[_Bucket] = []
        for c, chunk_buckets in enumerate(self.chunk_buckets):
            regrouped: list[tuple[list[nn.Parameter], Any]] = []
            for bucket in chunk_buckets:
                plain = [p for p in bucket if id(p) not in tied_groups]
                if plain:
                    regrouped.append((plain, None))
                # a tied copy alone in its bucket: the same rows on every holder
                regrouped += [([p], tied_groups[id(p)]) for p in bucket if id(p) in tied_groups]
            for i, (params, tied_group) in enumerate(regrouped):
                layout = BucketLayout.build(params, dp_size, dp_rank)
                self.buckets.append(_Bucket(c, i, layout, tied_group))
        #: each sharded parameter's layout entry, by ``id(param)``
        self._members = {id(m.param): m for b in self.buckets for m in b.layout.members}
        #: this rank's rows of each parameter it shards: what the optimizer steps
        self.main: dict[int, nn.Parameter] = {
            i: _main_parameter(m) for i, m in self._members.items() if m.local_numel
        }
        self._pending_rs: list[tuple[Any, Tensor, _Bucket]] = []
        self._gloo = dist.get_backend(group) == "gloo"
        #: finish the parameter all-gathers at the next forwards instead of after the step
        self.overlap_param_gather = overlap_param_gather
        self._gathering: dict[int, tuple[Any, Tensor, _Bucket]] = {}
        self._original_params: dict[int, list[list[nn.Parameter]]] = {}

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    # ---------------------------------------------------------------- gradients
    def on_chunk_grads_ready(self, chunk: int) -> None:
        """Engine hook: chunk ``chunk`` has run its last backward of the step; its buckets'
        reduce-scatters start now."""
        if self._tensor_parallel and chunk not in self._launched:
            # the rows are cut from each gradient's local part, which must be the parameter's
            # shard (a vocabulary-parallel embedding's gradient comes back Replicate)
            match_grad_placements(self._chunk_params[chunk])
        if not self.enabled or chunk in self._launched:
            return
        if not self._launched:
            self.events.clear()
        self._launched.add(chunk)
        for b in self.buckets:
            if b.chunk != chunk:
                continue
            members = b.layout.members
            # Pre-divided (as DDP does): the SUM over replicas is then the average. gloo's
            # reduce-scatter has no AVG, and FSDP2 on gloo is caught summing (pytorch#162338).
            flat = b.layout.pack([m.param.grad for m in members], divide_by=self.dp_size)
            self._release_grads(members)
            self.events.append(LaunchEvent(chunk, b.index, flat.numel(), time.perf_counter()))
            if self._gloo:
                # gloo's reduce-scatter is an all-reduce of a copy of its input, started on the
                # calling thread (measured: 45-49 ms for 25 MB against 27-30 ms, blocking the
                # pipeline 3-115 ms at its start; benchmarks/results/sharded.md). The
                # all-reduce it runs, issued directly on the buffer, gives each rank the same
                # rows, asynchronously; NCCL's reduce-scatter moves half the bytes and is used.
                handle = dist.all_reduce(flat, group=self.group, async_op=True)
                out = flat.view(self.dp_size, -1)[self.dp_rank]
            else:
                out = torch.empty(b.layout.shard_numel, dtype=flat.dtype, device=flat.device)
                handle = dist.reduce_scatter_single(out, flat, group=self.group, async_op=True)
            self._pending_rs.append((handle, out, b))

    def _release_grads(self, members: Sequence[ShardMember]) -> None:
        for m in members:
            if m.param.grad is None:
                continue
            if self.zero == 2:
                m.param.grad = None  # freed: only the rows survive the step
            else:
                m.param.grad.zero_()  # kept for the next step's accumulation

    def wait(self) -> None:
        """Finish every reduce-scatter; each main parameter's ``.grad`` is its rows' average
        over the replicas (tied copies: summed over the copies too)."""
        self.finish_gather()  # a chunk without a forward this step still gets its rows
        if self.enabled:
            for c in range(len(self.chunk_buckets)):
                self.on_chunk_grads_ready(c)
        for handle, out, b in self._pending_rs:
            monitored_wait(
                [handle],
                f"in the data-parallel gradient reduce_scatter (chunk {b.chunk} bucket "
                f"{b.index}, {b.layout.numel} values)",
                _ranks(self.group),
            )
            if b.tied_group is not None:
                work = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=b.tied_group, async_op=True)
                name = b.layout.members[0].param.shape
                monitored_wait(
                    [work],
                    f"in the tied-gradient all_reduce (rows, shape {tuple(name)})",
                    _ranks(b.tied_group),
                )
            for m in b.layout.members:
                main = self.main.get(id(m.param))
                if main is not None:
                    grad = b.layout.local_view(out, m)
                    main.grad = grad if grad.dtype == main.dtype else grad.to(main.dtype)
        self._pending_rs.clear()
        self._launched.clear()

    # ---------------------------------------------------------------- parameters
    def gather_params(self) -> None:
        """After the optimizer step: every replica's parameters get every rank's updated rows,
        one all-gather per bucket, started in the order the forwards use them (the chunks'
        first layers first). Without ``overlap_param_gather`` they are finished here; with it,
        each bucket is finished by the forward pre-hook of the first module that reads one of
        its parameters (:meth:`finish_gather`, Megatron's overlapped parameter gather), so
        the gathers run under the next step's forwards."""
        order = sorted(self.buckets, key=lambda b: (b.chunk, b.index))  # parameters' order
        rows = {i: p.detach() for i, p in self.main.items()}
        for b in order:
            self._gathering[id(b)] = (*self._start_gather(b.layout, rows), b)
        if not self.overlap_param_gather:
            self.finish_gather()

    def _start_gather(self, layout: BucketLayout, rows: dict[int, Tensor]) -> tuple[Any, Tensor]:
        """Start the all-gather of one bucket from this rank's ``rows`` (``id(param) ->
        rows``; absent: none here); returns the work and the flat buffer it fills."""
        local = layout.pack_local([rows.get(id(m.param)) for m in layout.members])
        flat = torch.empty(layout.numel, dtype=local.dtype, device=local.device)
        return dist.all_gather_single(flat, local, group=self.group, async_op=True), flat

    def finish_gather(self, buckets: Sequence[_Bucket] | None = None) -> None:
        """Wait for the all-gathers of ``buckets`` (default: every one in flight) and write
        the rows into the parameters. Anything that reads parameter values between an
        optimizer step and the next forward must call it first (checkpoints do)."""
        keys = list(self._gathering) if buckets is None else [id(b) for b in buckets]
        with torch.no_grad():
            for key in keys:
                got = self._gathering.pop(key, None)
                if got is None:
                    continue
                work, flat, b = got
                monitored_wait(
                    [work],
                    f"in the parameter all_gather after the optimizer step (chunk {b.chunk} "
                    f"bucket {b.index}, {b.layout.numel} values)",
                    _ranks(self.group),
                )
                for m in b.layout.members:
                    m.rows_view(m.param.data).copy_(b.layout.unpack_full(flat, m))

    def install_gather_hooks(self, chunks: Sequence[nn.Module]) -> None:
        """``overlap_param_gather``: a forward pre-hook on every module of ``chunks`` that
        holds parameters finishes the gathers of its parameters' buckets before it runs."""
        bucket_of = {id(m.param): b for b in self.buckets for m in b.layout.members}
        for chunk in chunks:
            for module in chunk.modules():
                mine = {
                    id(bucket_of[id(p)]): bucket_of[id(p)]
                    for p in module.parameters(recurse=False)
                    if id(p) in bucket_of
                }
                if mine:
                    needed = list(mine.values())
                    module.register_forward_pre_hook(
                        lambda _m, _a, needed=needed: self._before_forward(needed)
                    )

    def _before_forward(self, needed: Sequence[_Bucket]) -> None:
        if self._gathering:  # nothing in flight: one dict test per module forward
            self.finish_gather(needed)

    def shard_optimizer(self, optimizer: Optimizer) -> None:
        """Swap every sharded parameter in ``optimizer``'s groups for this rank's rows (a
        parameter whose rows here are empty leaves the group) and all-gather the parameters
        after each ``optimizer.step()``. Call before the optimizer has any state."""
        name = type(optimizer).__name__
        if name in NOT_ELEMENTWISE:
            raise ValueError(
                f"zero={self.zero} cannot shard {name}: its update of an element reads other "
                f"elements, so stepping 1/{self.dp_size} of a tensor is not stepping the "
                f"tensor; use zero=0 (or fsdp=True, whose shards are DTensors) with {name}"
            )
        if not type(optimizer).__module__.startswith("torch.optim"):
            warnings.warn(
                f"zero={self.zero} shards {name} elementwise: each rank steps its rows of every "
                f"parameter. That equals the unsharded step only if the optimizer's update of "
                f"an element depends on that element alone (true of Adam, AdamW, SGD, Lion).",
                stacklevel=2,
            )
        if optimizer.state:
            raise ValueError(
                f"zero={self.zero}: the optimizer already has state for {len(optimizer.state)} "
                f"parameters; shard it before its first step"
            )
        self._original_params[id(optimizer)] = [list(g["params"]) for g in optimizer.param_groups]
        for group in optimizer.param_groups:
            swapped = []
            for p in group["params"]:
                if id(p) in self.main:
                    swapped.append(self.main[id(p)])
                elif id(p) not in self._members:
                    swapped.append(p)  # not synchronised here (frozen): stepped as it is
            group["params"] = swapped
        optimizer.register_step_post_hook(lambda *_: self.gather_params())

    def unsharded_view(self, optimizer: Optimizer) -> UnshardedOptimizerView:
        """``optimizer`` as if it were not sharded, for checkpoints (see the class)."""
        return UnshardedOptimizerView(self, optimizer, self._original_params[id(optimizer)])

    def gather_full(self, pieces: dict[int, Tensor]) -> dict[int, Tensor]:
        """Every sharded parameter's whole tensor from each rank's rows in ``pieces``
        (``id(param) -> rows``; absent: this rank holds none): the rows as a ``DTensor`` when
        there is a mesh (nothing moves: DCP writes each rank's own), else gathered over the dp
        group (collective). Returns ``id(param) -> tensor`` of the parameter's shape."""
        if self.mesh is not None:
            return {
                id(m.param): self.as_dtensor(id(m.param), pieces.get(id(m.param)))
                for b in self.buckets
                for m in b.layout.members
            }
        full: dict[int, Tensor] = {}
        for b in self.buckets:
            layout = b.layout
            work, flat = self._start_gather(layout, pieces)
            monitored_wait(
                [work], "in the optimizer-state all_gather of a checkpoint save", _ranks(self.group)
            )
            for m in layout.members:
                full[id(m.param)] = layout.unpack_full(flat, m).reshape(m.shape).clone()
        return full

    def as_dtensor(self, param_id: int, rows: Tensor | None) -> Tensor:
        """This rank's ``rows`` of the parameter ``param_id`` (``None``: it holds none) as the
        ``DTensor`` they are a shard of: ``Shard(0)`` over the data-parallel mesh, the
        parameter's global shape. DCP writes each rank's rows under the parameter's name.
        A tensor-parallel parameter's rows are a piece of its tp shard: see
        :func:`_rows_placements`."""
        from torch.distributed.tensor import DTensor

        member = self._members[param_id]
        p = member.param
        if rows is None:
            rows = torch.empty(member.local_shape, dtype=torch.float32, device=p.device)
        full = torch.Size(p.shape) if p.dim() > 0 else torch.Size([1])
        local_rows = rows.reshape((rows.shape[0] if rows.dim() else 1, *member.shape[1:]))
        mesh, placements = _rows_placements(p, self.mesh)
        return DTensor.from_local(
            local_rows,
            mesh,
            placements,
            run_check=False,
            shape=full,
            stride=_contiguous_stride(full),
        )

    def grad_norm_skip(self, tied: TiedParameterSync) -> set[int]:
        """ids of main parameters a global norm must not count: rows of tied copies not held
        by the tied weight's owner (the owner's rows are the same rows), and rows of a
        tensor-parallel parameter that its tp ranks replicate (a norm's weight), except on the
        first of them (torchtitan#596 counted such a weight tp times)."""
        skip = {id(self.main[i]) for i in tied.non_owner_params() if i in self.main}
        mesh = self.mesh
        if mesh is not None and mesh.ndim == 2:  # (dp, tp): rows differ over dp, not over tp
            here = {mesh.mesh_dim_names[1]: mesh.get_local_rank(1)}
            skip.update(
                id(self.main[i])
                for i, m in self._members.items()
                if i in self.main and not counted_once(m.param, here)
            )
        return skip


def _rows_kept(member: ShardMember, value: Any) -> Any:
    """This replica's rows of a loaded state value: the local part of the ``DTensor`` a loader
    read them into (:meth:`UnshardedOptimizerView.state_request`), or cut from a whole tensor
    of the parameter's shape (a tensor-parallel parameter's: its tp shard first); anything else
    (a step count) as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(value, DTensor):
        return value.to_local().reshape(member.local_shape)
    if isinstance(value, Tensor) and value.shape == member.param.shape:
        p = member.param
        if isinstance(p, DTensor):  # each rank slices its own shard: no communication
            value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
        return member.local_piece(value).clone()
    return value


def _rows_placements(param: Tensor, mesh: Any) -> tuple[Any, list[Any]]:
    """The mesh and placements under which this rank's rows of ``param`` are a shard of the
    whole tensor. ``mesh``: 1-D ``(data_parallel,)``, or 2-D ``(data_parallel,
    tensor_parallel)`` for a tensor-parallel parameter, whose rows cut its tp shard: along a
    dim the tp shard does not cut, the two cuts are independent (``Shard(0)`` over dp, the
    parameter's own placement over tp); along dim 0 when tp cuts it too (a column-wise or
    vocabulary-parallel weight) the dp pieces lie inside each tp piece, which is
    ``_StridedShard(0, split_factor=tp)`` over dp (what FSDP2 gives a tp shard, the same
    layout)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(param, DTensor):  # under tp: the same rows on every tp rank
        return mesh, [Shard(0)] if mesh is None or mesh.ndim == 1 else [Shard(0), Replicate()]
    if mesh is None or mesh.ndim != 2:
        raise ValueError(
            f"a tensor-parallel parameter of shape {tuple(param.shape)} (placements "
            f"{param.placements}) needs the 2-D (data_parallel, tensor_parallel) mesh for its "
            f"rows, got {None if mesh is None else tuple(mesh.shape)}"
        )
    (tp_placement,) = param.placements
    if isinstance(tp_placement, Replicate) or (
        isinstance(tp_placement, Shard) and tp_placement.dim != 0
    ):
        return mesh, [Shard(0), tp_placement]
    if isinstance(tp_placement, Shard):
        return mesh, [_StridedShard(0, split_factor=mesh.size(1)), tp_placement]
    raise ValueError(
        f"zero cannot place rows of a tensor-parallel parameter of shape {tuple(param.shape)} "
        f"with placements {param.placements}: only Shard or Replicate over tp"
    )


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= n
    return tuple(reversed(out))


def _main_parameter(member: ShardMember) -> nn.Parameter:
    """This rank's rows of ``member``'s parameter (of its tp shard, for a ``DTensor``) as a
    parameter of their own: a view of the rows for fp32 (the step writes the model's tensor
    directly), an fp32 copy for lower precision (the master weight; the all-gather casts it
    back)."""
    data = local_part(member.param.data)
    if data.dtype == torch.float32 and data.is_contiguous():
        return nn.Parameter(member.local_piece(data))
    return nn.Parameter(member.local_piece(data).to(torch.float32).clone())


class UnshardedOptimizerView:
    """A sharded optimizer seen whole, by checkpoints: ``param_groups`` list the module's own
    parameters (as the optimizer held them before :meth:`ShardedGradSync.shard_optimizer`),
    ``state_dict()`` presents every state tensor whole: each rank's rows as a ``DTensor``
    (``Shard(0)`` over the data-parallel mesh; DCP writes every rank's rows where they belong
    in the parameter's tensor, nothing is gathered) or, without a mesh, all-gathered over the
    replicas (collective: every dp rank calls it, in the same order). ``load_state_dict()``
    keeps this rank's rows of each whole tensor it is given. On disk the state is then the
    unsharded optimizer's, by name and shape, so a checkpoint loads into any ``zero``/``dp``
    (and into a plain Trainer).

    Example::

        view = sync.unsharded_view(optimizer)
        saved = view.state_dict()           # whole tensors, module parameters' positions
        view.load_state_dict(saved)         # each rank keeps its rows
    """

    def __init__(
        self, sync: ShardedGradSync, optimizer: Optimizer, original: list[list[nn.Parameter]]
    ) -> None:
        self.sync, self.optimizer = sync, optimizer
        self.param_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": params}
            for g, params in zip(optimizer.param_groups, original)
        ]

    def _positions(self) -> list[nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        sync, inner = self.sync, self.optimizer.state
        rows: dict[str, dict[int, Tensor]] = {}  # state key -> id(param) -> this rank's rows
        others: dict[int, dict[str, Any]] = {}  # id(param) -> step counts and other values
        for p in self._positions():
            main = sync.main.get(id(p))
            for k, v in inner.get(main if main is not None else p, {}).items():
                if main is not None and isinstance(v, Tensor) and v.shape == main.shape:
                    rows.setdefault(k, {})[id(p)] = v
                else:
                    others.setdefault(id(p), {})[k] = v
        # The keys are the optimizer's (Adam: exp_avg, exp_avg_sq), the same on every rank
        # once it has stepped; sorted, so that every rank gathers in the same order.
        full = {k: sync.gather_full(rows[k]) for k in sorted(rows)}
        # A parameter with no rows here takes its step count from one that has (all step
        # together).
        shared = next((others[i] for i in sync.main if i in others), {})
        state: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(self._positions()):
            if id(p) in sync._members and full:
                state[i] = {**others.get(id(p), shared), **{k: f[id(p)] for k, f in full.items()}}
            elif id(p) in others:
                state[i] = others[id(p)]
        groups, index = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            hyper = {k: v for k, v in g.items() if k != "params"}
            groups.append({**hyper, "params": list(range(index, index + n))})
            index += n
        return {"state": state, "param_groups": groups}

    def state_request(
        self, param: Tensor, shape: tuple[int, ...], dtype: torch.dtype
    ) -> Tensor | None:
        """What a checkpoint loader reads a saved state of ``param`` into: with a mesh, a
        moment (the parameter's shape) as the ``DTensor`` of this replica's rows (the form it
        was saved in), so only those rows are read from the files; ``None`` for anything else
        (read whole: a step count, a parameter not sharded here, no mesh)."""
        member = self.sync._members.get(id(param))
        if self.sync.mesh is None or member is None or param.dim() == 0:
            return None
        if tuple(shape) != tuple(param.shape):
            return None
        return self.sync.as_dtensor(id(param), None)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sync, positions = self.sync, self._positions()
        inner = self.optimizer
        mine: dict[int, int] = {}
        index = 0
        for g in inner.param_groups:
            for q in g["params"]:
                mine[id(q)] = index
                index += 1
        state: dict[int, dict[str, Any]] = {}
        for i, entry in state_dict["state"].items():
            p = positions[i]
            main = sync.main.get(id(p))
            target = main if main is not None else (p if id(p) in mine else None)
            if target is None:
                continue  # no rows of this parameter here
            if main is None:
                state[mine[id(p)]] = entry
                continue
            member = sync._members[id(p)]
            state[mine[id(main)]] = {k: _rows_kept(member, v) for k, v in entry.items()}
        groups = []
        for g, saved in zip(inner.param_groups, state_dict["param_groups"]):
            hyper = {k: v for k, v in saved.items() if k != "params"}
            groups.append({**hyper, "params": [mine[id(q)] for q in g["params"]]})
        inner.load_state_dict({"state": state, "param_groups": groups})
