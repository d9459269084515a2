"""World -> (pp, dp, tp) grid, pipeline neighbours, the job's DeviceMesh and its process groups.

Layout: pipeline-parallel is the OUTERMOST dimension, tensor-parallel the innermost (Megatron and
torchtitan order)::

    global_rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so the ``tp`` ranks of one stage are neighbouring global ranks (one node's devices: the tensor-
parallel collectives run in every layer, forward and backward, and need the fastest links), then
the ``dp`` replicas of one stage (the gradient reduction: every parameter, once a step), while
only the pipeline's point-to-point traffic (one activation per microbatch) crosses nodes. A rank
exchanges activations with the rank of the SAME ``(dp_rank, tp_rank)`` on the neighbouring stage.

Example:
    >>> topo = PipelineTopology.from_world(world_size=8, rank=5, pp=4)
    >>> (topo.dp, topo.pp_rank, topo.dp_rank)
    (2, 2, 1)
    >>> topo.pipeline_ranks, topo.dp_ranks
    ([1, 3, 5, 7], [4, 5])
    >>> topo.prev_rank, topo.next_rank
    (3, 7)
    >>> tp = PipelineTopology.from_world(world_size=8, rank=5, pp=2, tp=2)
    >>> (tp.pp_rank, tp.dp_rank, tp.tp_rank, tp.tp_ranks, tp.next_rank)
    (1, 0, 1, [4, 5], 1)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from ..schedules import check_positive

T = TypeVar("T")

__all__ = [
    "DP_DIM",
    "MESH_DIMS",
    "PP_DIM",
    "TP_DIM",
    "PipelineTopology",
    "ProcessGroups",
    "build_process_groups",
    "once_per_default_group",
]

#: mesh dim names: Lightning's ``ModelParallelStrategy`` names (``"data_parallel"``,
#: ``"tensor_parallel"`` innermost), plus ``"pipeline_parallel"`` outermost
PP_DIM, DP_DIM, TP_DIM = "pipeline_parallel", "data_parallel", "tensor_parallel"
MESH_DIMS = (PP_DIM, DP_DIM, TP_DIM)


@dataclass(frozen=True)
class PipelineTopology:
    """Where one rank sits in the ``pp x dp x tp`` grid. Validates the numbers on
    construction."""

    world_size: int
    pp: int
    dp: int
    rank: int
    tp: int = 1

    def __post_init__(self) -> None:
        check_positive(world_size=self.world_size, pp=self.pp, dp=self.dp, tp=self.tp)
        if self.pp * self.dp * self.tp != self.world_size:
            raise ValueError(
                f"pp({self.pp}) * dp({self.dp}) * tp({self.tp}) != world_size({self.world_size}):"
                f" the pipeline, data- and tensor-parallel sizes must multiply to the number of "
                f"processes"
            )
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank({self.rank}) must lie in [0, world_size({self.world_size}))")

    @classmethod
    def from_world(
        cls, world_size: int, rank: int, pp: int, dp: int | None = None, tp: int = 1
    ) -> PipelineTopology:
        """Build the topology, inferring ``dp = world_size // (pp * tp)`` when not given."""
        if dp is None:
            check_positive(pp=pp, tp=tp)
            if world_size % (pp * tp) != 0:
                raise ValueError(
                    f"world_size({world_size}) is not divisible by pp({pp}) * tp({tp}) = "
                    f"{pp * tp}: cannot infer dp (world_size % {pp * tp} = "
                    f"{world_size % (pp * tp)})"
                )
            dp = world_size // (pp * tp)
        return cls(world_size=world_size, pp=pp, dp=dp, rank=rank, tp=tp)

    @property
    def pp_rank(self) -> int:
        """Pipeline stage index of this rank (0 = first stage)."""
        return self.rank // (self.dp * self.tp)

    @property
    def dp_rank(self) -> int:
        """Index of this rank among its stage's data-parallel replicas."""
        return (self.rank // self.tp) % self.dp

    @property
    def tp_rank(self) -> int:
        """Index of this rank in its stage's tensor-parallel group."""
        return self.rank % self.tp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def global_rank(
        self, pp_rank: int, dp_rank: int | None = None, tp_rank: int | None = None
    ) -> int:
        """Global rank of stage ``pp_rank`` in replica ``dp_rank`` at tensor-parallel index
        ``tp_rank`` (``None``: this rank's)."""
        d = self.dp_rank if dp_rank is None else dp_rank
        t = self.tp_rank if tp_rank is None else tp_rank
        if not (0 <= pp_rank < self.pp and 0 <= d < self.dp and 0 <= t < self.tp):
            raise ValueError(
                f"(pp_rank={pp_rank}, dp_rank={d}, tp_rank={t}) outside grid pp={self.pp}, "
                f"dp={self.dp}, tp={self.tp}"
            )
        return (pp_rank * self.dp + d) * self.tp + t

    @property
    def pipeline_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, in stage order."""
        return [self.global_rank(p) for p in range(self.pp)]

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks holding the same stage as this rank (its data-parallel replicas)."""
        return [self.global_rank(self.pp_rank, d) for d in range(self.dp)]

    @property
    def tp_ranks(self) -> list[int]:
        """Global ranks sharing this rank's stage and replica (its tensor-parallel group)."""
        return [self.global_rank(self.pp_rank, self.dp_rank, t) for t in range(self.tp)]

    def stage_lists(self, pp_ranks: list[int]) -> tuple[list[list[int]], int]:
        """The global ranks of stages ``pp_ranks`` in every ``(dp, tp)`` coordinate, one list
        each (every rank must create a group for every list, in the same order), and the index
        of this rank's coordinate among them: the groups of a weight whose copies live on
        several stages (tied embedding and head)."""
        lists = [
            [self.global_rank(r, d, t) for r in pp_ranks]
            for d in range(self.dp)
            for t in range(self.tp)
        ]
        return lists, self.dp_rank * self.tp + self.tp_rank

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous stage; wraps (stage 0's previous is stage pp-1)."""
        return self.global_rank((self.pp_rank - 1) % self.pp)

    @property
    def next_rank(self) -> int:
        """Global rank of the next stage; wraps (stage pp-1's next is stage 0, for interleaving)."""
        return self.global_rank((self.pp_rank + 1) % self.pp)

    def all_pipelines(self) -> list[list[int]]:
        """Every pipeline's global ranks (one list per ``(dp, tp)`` coordinate)."""
        return self.stage_lists(list(range(self.pp)))[0]

    def all_dp_groups(self) -> list[list[int]]:
        """Every stage's replica ranks (one list per ``(pp, tp)`` coordinate)."""
        return [
            [self.global_rank(p, d, t) for d in range(self.dp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]


@dataclass
class ProcessGroups:
    """The process groups this rank takes part in.

    ``pp_group`` links this rank's pipeline (point-to-point traffic and the loss broadcast);
    ``dp_group`` links the replicas of this rank's stage (gradient all-reduce); ``tp_group``
    the tensor-parallel ranks of this rank's stage and replica. All are the groups of
    :attr:`mesh`, the job's ``DeviceMesh`` (dims ``"pipeline_parallel"`` outermost, then
    ``"data_parallel"``, then ``"tensor_parallel"``), when it was built with one.
    """

    topology: PipelineTopology
    pp_group: Any
    dp_group: Any
    timeout: timedelta | None = None
    #: the job's ``torch.distributed.device_mesh.DeviceMesh`` (``None`` for hand-made groups)
    mesh: Any = None
    tp_group: Any = None
    _extra: dict[tuple[tuple[int, ...], ...], Any] = field(default_factory=dict, repr=False)

    def own_groups(self) -> list[Any]:
        """Every group here that this rank belongs to (each once): pp, dp, tp and those of
        :meth:`new_groups`."""
        found: dict[int, Any] = {}
        for g in (self.pp_group, self.dp_group, self.tp_group, *self._extra.values()):
            if g is not None:
                found.setdefault(id(g), g)
        return list(found.values())

    def new_groups(self, rank_lists: list[list[int]]) -> Any:
        """Create one group per rank list (on EVERY rank, same order) and return this rank's.

        torch requires every process to call ``new_group`` for every group, in the same order,
        even for groups it is not part of. Results are cached, so calling this again with the
        same lists on every rank is free. Returns ``None`` when this rank is in none of them.
        """
        import torch.distributed as dist

        key = tuple(tuple(r) for r in rank_lists)
        if key in self._extra:
            return self._extra[key]
        mine = None
        for ranks in rank_lists:
            g = dist.new_group(ranks=list(ranks), timeout=self.timeout)
            if self.topology.rank in ranks:
                mine = g
        self._extra[key] = mine
        return mine


#: What :func:`once_per_default_group` built in this process, by key, with the default group
#: it was built in.
_BUILT: dict[tuple[object, ...], tuple[Any, Any]] = {}


def once_per_default_group(key: tuple[object, ...], make: Callable[[], T]) -> T:
    """``make()`` once per ``key`` and default process group in this process; later calls
    return the same object. A collective ``make`` stays matched: every rank calls this at the
    same points with the same key, so every rank builds or reuses alike. Entries of an earlier
    default group (before ``destroy_process_group``) are dropped, never handed out again.

    Why: a process group made on every ``Trainer`` run stays alive with its communicator (on
    gloo a network thread that wakes every few milliseconds: 106 of them took 0.3 of a core in
    an idle process; on NCCL device memory).

    Example::

        group = once_per_default_group(("checkpoint",), lambda: dist.new_group(backend="gloo"))
    """
    import torch.distributed as dist

    world = dist.group.WORLD
    for stale in [k for k, (w, _) in _BUILT.items() if w is not world]:
        del _BUILT[stale]
    if key not in _BUILT:
        _BUILT[key] = (world, make())
    return _BUILT[key][1]


def set_group_timeout(timeout: timedelta, group: Any = None) -> bool:
    """Give an existing process group (``None``: the default one) a new collective timeout
    (torch private: ``torch.distributed.distributed_c10d._set_pg_timeout``, torch 2.x);
    ``False`` where this torch has no such function.

    Why: a group made once and reused (the default group of an earlier ``Trainer`` in the same
    process, which Lightning leaves as it is; the mesh's groups, built once per process and
    shape; ``DeviceMesh`` takes no timeout at all) kept the timeout it was made with, and a
    later ``PipelineStrategy(timeout=)`` was silently ignored.
    """
    import torch.distributed as dist

    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        return False
    setter(timeout, group)
    return True


def build_process_groups(
    topo: PipelineTopology, timeout: timedelta | None = None, device_type: str = "cpu"
) -> ProcessGroups:
    """Create the job's ``DeviceMesh`` (``pp`` x ``dp`` x ``tp``, named :data:`MESH_DIMS`) and
    take the pp, dp and tp groups from it; every rank must call this, in the same order.

    Requires ``torch.distributed`` to be initialized with ``world_size == topo.world_size``.
    A dim that spans the whole world reuses the default group (no new communicator).
    ``device_type``: the mesh's (``"cpu"``, ``"cuda"``), for the DTensors built on it.

    The mesh's rank order is the topology's: ``global_rank = (pp_rank * dp + dp_rank) * tp +
    tp_rank`` is the row-major index of ``(pp_rank, dp_rank, tp_rank)`` in a ``(pp, dp, tp)``
    array. The ``tensor_parallel`` dim is there at ``tp=1`` too (size 1), so model hooks read
    ``self.device_mesh["tensor_parallel"]`` whatever the shape.

    Built once per process and shape (:func:`once_per_default_group`): a second call with the
    same default process group and the same ``(pp, dp, tp)`` returns the same mesh and groups
    (and the groups made later with :meth:`ProcessGroups.new_groups`), with ``timeout`` for
    groups made from then on. Several ``Trainer`` runs in one process (a notebook, a sweep,
    ``fit`` then ``test``) would otherwise leave a communicator per group per run behind. A new
    default group (after ``destroy_process_group``) builds afresh.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_process_groups needs torch.distributed to be initialized first")
    if dist.get_world_size() != topo.world_size or dist.get_rank() != topo.rank:
        raise ValueError(
            f"topology (world_size={topo.world_size}, rank={topo.rank}) does not match the "
            f"process group (world_size={dist.get_world_size()}, rank={dist.get_rank()})"
        )
    import torch

    def build() -> ProcessGroups:
        ranks = torch.arange(topo.world_size).reshape(topo.pp, topo.dp, topo.tp)
        mesh = DeviceMesh(device_type, ranks, mesh_dim_names=MESH_DIMS)
        return ProcessGroups(
            topology=topo,
            pp_group=mesh.get_group(PP_DIM),
            dp_group=mesh.get_group(DP_DIM),
            timeout=timeout,
            mesh=mesh,
            tp_group=mesh.get_group(TP_DIM),
        )

    key = ("mesh", topo.world_size, topo.rank, topo.pp, topo.dp, topo.tp, device_type)
    groups = once_per_default_group(key, build)
    groups.timeout = timeout  # for the groups made from now on (new_groups)
    if timeout is not None:  # and for those made before, by DeviceMesh or an earlier run
        for group in groups.own_groups():
            set_group_timeout(timeout, group)
    return groups
